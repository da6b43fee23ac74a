"""Per-block data checksums: the low 32 bits of xxh3-64 (seed 0) of each block.

Computed in C (native/, `zn_block_csums` / `zn_first_bad_block`, the GIL
released) when the extension is built, else with the `xxhash` module: the
same values (a test compares them). The Python loop holds the GIL for about
0.1 ms per MiB, long enough to stall the trio thread behind a worker thread
that checksums a 1 MiB chunk; the C loop neither holds the GIL nor pays a
Python call per block.
"""

from __future__ import annotations

import struct

import xxhash

_MASK = 0xFFFFFFFF
_hash = xxhash.xxh3_64_intdigest

try:
    from zonefs_py._native import ffi as _ffi
    from zonefs_py._native import lib as _lib
except ImportError:  # pragma: no cover - depends on the build
    _lib = None


Data = bytes | bytearray | memoryview


def py_block_checksums(data: Data, block_size: int) -> bytes:
    """The pure-Python computation (reference for the C one)."""
    mv = memoryview(data)
    n = len(mv) // block_size
    return struct.pack(f"<{n}I", *[_hash(mv[i * block_size:(i + 1) * block_size]) & _MASK
                                   for i in range(n)])


def py_first_bad_block(data: Data, block_size: int, csums: bytes) -> int | None:
    mv = memoryview(data)
    n = len(mv) // block_size
    expect = struct.unpack(f"<{n}I", csums[:n * 4])
    for i in range(n):
        if _hash(mv[i * block_size:(i + 1) * block_size]) & _MASK != expect[i]:
            return i
    return None


def block_checksums(data: Data, block_size: int) -> bytes:
    """Return one little-endian u32 checksum per block of `data` (a block multiple)."""
    if _lib is None:
        return py_block_checksums(data, block_size)
    n = len(data) // block_size
    out = _ffi.new("uint8_t[]", n * 4 or 1)
    rc = _lib.zn_block_csums(_ffi.from_buffer(data), n * block_size, block_size, out)
    if rc < 0:
        raise ValueError(f"checksums of {len(data)} bytes in {block_size}-byte blocks")
    return _ffi.buffer(out, n * 4)[:]


def first_bad_block(data: Data, block_size: int, csums: bytes) -> int | None:
    """Return the index of the first block whose checksum does not match, or None."""
    n = len(data) // block_size
    if len(csums) < n * 4:
        raise ValueError(f"{len(csums)} checksum bytes for {n} blocks")
    if _lib is None:
        return py_first_bad_block(data, block_size, csums)
    bad = _lib.zn_first_bad_block(_ffi.from_buffer(data), n * block_size, block_size,
                                  _ffi.from_buffer(csums))
    return None if bad < 0 else int(bad)
