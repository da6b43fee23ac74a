"""Per-block data checksums: the low 32 bits of xxh3-64 (seed 0) of each block."""

from __future__ import annotations

import struct

import xxhash

_MASK = 0xFFFFFFFF
_hash = xxhash.xxh3_64_intdigest


def block_checksums(data: bytes | bytearray | memoryview, block_size: int) -> bytes:
    """Return one little-endian u32 checksum per block of `data` (a block multiple)."""
    mv = memoryview(data)
    n = len(mv) // block_size
    return struct.pack(f"<{n}I", *[_hash(mv[i * block_size:(i + 1) * block_size]) & _MASK
                                   for i in range(n)])


def first_bad_block(data: bytes | memoryview, block_size: int, csums: bytes) -> int | None:
    """Return the index of the first block whose checksum does not match, or None."""
    mv = memoryview(data)
    n = len(mv) // block_size
    expect = struct.unpack(f"<{n}I", csums[:n * 4])
    for i in range(n):
        if _hash(mv[i * block_size:(i + 1) * block_size]) & _MASK != expect[i]:
            return i
    return None
