"""Build `zonefs_py._native` with cffi in API (out-of-line) mode.

Used by setup.py (`cffi_modules=["native/build_native.py:ffibuilder"]`), so
`pip install -e .` compiles it; `python native/build_native.py` builds it in
place for development. Needs gcc, the Python headers and liburing's headers
and library, and xxhash.h (Debian 12: build-essential python3-dev liburing-dev
libxxhash-dev pkg-config).

The cdef is the part of native/zonefs_native.h between the CDEF-BEGIN and
CDEF-END markers, so the header is the single source of the C API.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from cffi import FFI

NATIVE_DIR = Path(__file__).resolve().parent
HEADER = NATIVE_DIR / "zonefs_native.h"
SOURCE = NATIVE_DIR / "zonefs_native.c"
ZAPPEND_SOURCE = NATIVE_DIR / "zonefs_zappend.c"


def _cdef_text() -> str:
    """Return the declarations between the CDEF markers of the header."""
    text = HEADER.read_text()
    begin = text.index("/* CDEF-BEGIN */") + len("/* CDEF-BEGIN */")
    end = text.index("/* CDEF-END */")
    return text[begin:end]


def _pkg_config(*args: str) -> list[str]:
    """Return pkg-config's answer for liburing, or [] if pkg-config is missing."""
    try:
        out = subprocess.run(["pkg-config", *args, "liburing"], check=True,
                             capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return shlex.split(out)


def _make_builder() -> FFI:
    builder = FFI()
    builder.cdef(_cdef_text())
    cflags = _pkg_config("--cflags")
    libs = [flag[2:] for flag in _pkg_config("--libs") if flag.startswith("-l")] or ["uring"]
    builder.set_source(
        "zonefs_py._native",
        '#include "zonefs_native.h"\n',
        # Relative to the setup.py directory, as setuptools requires.
        sources=[str(src.relative_to(NATIVE_DIR.parent)) for src in (SOURCE, ZAPPEND_SOURCE)],
        include_dirs=[str(NATIVE_DIR)],
        libraries=[*libs, "pthread"],
        extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                            *cflags],
    )
    return builder


ffibuilder = _make_builder()

if __name__ == "__main__":
    import os

    os.chdir(NATIVE_DIR.parent)
    # Writes zonefs_py/_native.c and zonefs_py/_native*.so (both git-ignored).
    print(ffibuilder.compile(tmpdir=".", verbose=False))
