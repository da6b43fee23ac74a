"""zonefs-py: a FUSE log-structured filesystem for zoned SSDs."""

import ctypes as _ctypes
import os as _os
import sys as _sys

__version__ = "0.1.0"

#: Whether pyfuse3 was imported before this package: then its calls to libfuse were
#: bound before `_fuseext` could take them, and the census cannot see answers
#: (fuseext.census_arm says so and tracks no request in flight).
PYFUSE3_IMPORTED_FIRST = "pyfuse3" in _sys.modules


def _preload_fuseext() -> None:
    """Put `zonefs_py._fuseext` into the global symbol scope before anything imports
    pyfuse3 (bound at import, RTLD_NOW): zonefs_py/fuseext.py says why. Quietly
    nothing when it is not built (fuseext.install then says so)."""
    try:
        import zonefs_py._fuseext as ext

        _ctypes.CDLL(ext.__file__, mode=_os.RTLD_GLOBAL | getattr(_os, "RTLD_NOLOAD", 0))
    except (ImportError, OSError):
        pass


_preload_fuseext()
