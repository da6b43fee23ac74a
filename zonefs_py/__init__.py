"""zonefs-py: a FUSE log-structured filesystem for zoned SSDs."""

import ctypes as _ctypes
import os as _os

__version__ = "0.1.0"


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
