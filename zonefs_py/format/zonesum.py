"""Zone summaries: the checksums of a sealed data zone, stored in the zone itself.

No I/O. When a data zone stops taking data (full, or finished early) the
filesystem *seals* it: it appends, right after the zone's last data block,
summary blocks (SUM) holding one u32 checksum per data block below them, in
device order, then records the seal (ZONE_SEAL op: zone, reset count, data
blocks). From then on the zone's checksums live only on the device; the
extents of the zone keep none in memory or in checkpoints (docs/SPEC.md
"Zone summary", docs/DESIGN.md 3.11). A summary dies and is reset with the
data it describes, so cleaning and checkpoint rotation stay whole-zone.

Layout, with P = (block_size - 32) // 4 checksums per summary block and a
zone of D data blocks: summary block k (0 <= k < ceil(D / P)) sits at zone
block D + k and covers data blocks [k*P, min((k+1)*P, D)):

    u32 magic        SUM_MAGIC (b"ZSUM")
    u32 zone         zone index
    u32 resets       the zone's reset count when it was written (its generation)
    u32 index        k
    u32 data_blocks  D
    u32 count        checksums in this block
    u64 xxh3         xxh3-64 of the whole block with this field zeroed
    count x u32      checksums, then zeros to the end of the block

A block is trusted only if its xxh3, magic, zone, generation, index and D all
match what the seal recorded: a damaged summary block fails the reads of
exactly the data blocks it covers, and a summary of an earlier generation of
the zone is never taken for the current one.
"""

from __future__ import annotations

import struct

import xxhash

#: b"ZSUM" read as a little-endian u32.
SUM_MAGIC = 0x4D55535A
SUM_HEADER = struct.Struct("<IIIIIIQ")
SUM_HEADER_SIZE = SUM_HEADER.size  # 32
_XXH_AT = 24


def per_block(block_size: int) -> int:
    """Checksums one summary block holds."""
    return (block_size - SUM_HEADER_SIZE) // 4


def sum_blocks(data_blocks: int, block_size: int) -> int:
    """Summary blocks of a zone sealed after `data_blocks` data blocks."""
    p = per_block(block_size)
    return -(-data_blocks // p)


def summary_end(data_blocks: int, block_size: int) -> int:
    """Bytes from the zone's start to the end of the summary of a zone sealed
    after `data_blocks` data blocks (the write pointer the seal leaves)."""
    return (data_blocks + sum_blocks(data_blocks, block_size)) * block_size


def covering(rel: int, nblocks: int, block_size: int) -> list[tuple[int, int, int]]:
    """The summary blocks holding the checksums of zone blocks [rel, rel+nblocks):
    (summary block k, first and end entry in k), in order."""
    p = per_block(block_size)
    return [(k, max(rel, k * p) - k * p, min(rel + nblocks, (k + 1) * p) - k * p)
            for k in range(rel // p, (rel + nblocks - 1) // p + 1)]


def room_blocks(zone_blocks: int, block_size: int) -> int:
    """Blocks of a zone of `zone_blocks` kept for its summary: enough for a zone
    whose every other block is data (the most a seal can need)."""
    p = per_block(block_size)
    room = -(-zone_blocks // (p + 1))
    assert sum_blocks(zone_blocks - room, block_size) <= room
    return room


def encode(zone: int, resets: int, csums: bytes | bytearray, block_size: int) -> bytes:
    """The summary blocks of a zone whose data blocks have checksums `csums`
    (4 bytes per block, in device order; blocks no extent maps hold anything)."""
    data_blocks = len(csums) // 4
    p = per_block(block_size)
    out = bytearray()
    for k in range(sum_blocks(data_blocks, block_size)):
        body = csums[k * p * 4:(k + 1) * p * 4]
        count = len(body) // 4
        block = bytearray(block_size)
        SUM_HEADER.pack_into(block, 0, SUM_MAGIC, zone, resets, k, data_blocks, count, 0)
        block[SUM_HEADER_SIZE:SUM_HEADER_SIZE + len(body)] = body
        struct.pack_into("<Q", block, _XXH_AT, xxhash.xxh3_64_intdigest(block))
        out += block
    return bytes(out)


def decode_block(block: bytes | memoryview, zone: int, resets: int, index: int,
                 data_blocks: int) -> bytes | None:
    """The checksums of summary block `index` of a seal (zone, resets, data_blocks);
    None if the block is damaged or belongs to anything else."""
    block_size = len(block)
    if block_size < SUM_HEADER_SIZE + 4:
        return None
    magic, bzone, bresets, bindex, bdata, count, digest = SUM_HEADER.unpack_from(block, 0)
    if (magic != SUM_MAGIC or bzone != zone or bresets != resets or bindex != index
            or bdata != data_blocks):
        return None
    p = per_block(block_size)
    if count != min(p, data_blocks - index * p):
        return None
    zeroed = bytearray(block)
    zeroed[_XXH_AT:_XXH_AT + 8] = bytes(8)
    if xxhash.xxh3_64_intdigest(zeroed) != digest:
        return None
    return bytes(block[SUM_HEADER_SIZE:SUM_HEADER_SIZE + count * 4])
