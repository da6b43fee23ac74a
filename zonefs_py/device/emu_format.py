"""Encode and decode the emulator image's header and zone table (pure, no I/O).

Byte layout: docs/SPEC.md, "Emulator image". Everything is little-endian.

    block 0 (HEADER_BYTES)      header, xxh64-checked (version 1 or 2)
    table copy 0, table copy 1  zone table, alternating, newest valid wins
    zone data                   from `data_offset`, `nr_zones * zone_size` bytes

Caveats:
  * Only the geometry is validated here; whether the file is long enough is
    checked by the caller, which knows the file size.
  * A table entry stores the write pointer relative to the zone start, so a
    table copy is independent of `data_offset`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from zonefs_py.device.base import ZoneCond

#: Version of the emulator image layout (separate from the filesystem's DISK_VERSION).
#: Version 2 added the data-discarding mode (flags bit 0, `discard_first_zone`);
#: version 1 images (flags 0) are still opened, and written back unchanged.
EMU_IMAGE_VERSION = 2
#: Header flags bit 0: blocks written to zones >= `discard_first_zone` are not stored.
FLAG_DISCARD_DATA = 1
#: `discard_first_zone` before anyone declared where the data zones start: discard nothing.
NO_DISCARD_ZONE = 0xFFFFFFFF
HEADER_MAGIC = b"ZNSEMU1\x00"
TABLE_MAGIC = b"ZNSTBL1\x00"
#: Bytes reserved for the header, and the alignment of every metadata region.
HEADER_BYTES = 4096
META_ALIGN = 4096
#: Zone data starts on a 1 MiB boundary, so zone starts stay aligned for O_DIRECT.
DATA_ALIGN = 1 << 20

_HEADER = struct.Struct("<8sIIIIQQIIIIQQQ")  # version-1 fields, 80 bytes
_HEADER_V2 = struct.Struct("<I")  # discard_first_zone at offset 80 (version 2)
HEADER_V2_SIZE = _HEADER.size + _HEADER_V2.size
HEADER_CHECKSUM_AT = 120
_TABLE_HEAD = struct.Struct("<8sQII")  # magic, seq, nr_zones, entry_size (24 bytes)
TABLE_CHECKSUM_AT = 24
TABLE_ENTRIES_AT = 32
_ENTRY = struct.Struct("<QQIB3x")  # wp_rel, data_end_rel, reset_count, cond (24 bytes)
ENTRY_BYTES = _ENTRY.size

_VALID_CONDS = frozenset(int(c) for c in ZoneCond)


class ImageFormatError(ValueError):
    """The bytes are not a valid emulator header or table copy (message is one line)."""


def round_up(value: int, align: int) -> int:
    """Round `value` up to a multiple of `align`."""
    return (value + align - 1) // align * align


@dataclass(frozen=True, slots=True)
class Geometry:
    """Geometry and limits recorded in the header (all sizes in bytes)."""

    block_size: int
    zone_size_bytes: int
    zone_capacity_bytes: int
    nr_zones: int
    nr_conventional: int
    max_open: int
    max_active: int

    def validate(self) -> None:
        """Check the geometry is one a Linux zoned block device could have.

        Raises ImageFormatError naming the first offending field.
        """
        bs = self.block_size
        if bs < 512 or bs > 65536 or bs & (bs - 1):
            raise ImageFormatError(f"block size {bs} is not a power of two in [512, 65536]")
        zs = self.zone_size_bytes
        if zs < bs or zs & (zs - 1):
            raise ImageFormatError(f"zone size {zs} is not a power of two >= the block size")
        cap = self.zone_capacity_bytes
        if cap <= 0 or cap > zs or cap % bs:
            raise ImageFormatError(
                f"zone capacity {cap} must be a positive multiple of {bs} and <= zone size {zs}"
            )
        if self.nr_zones < 1:
            raise ImageFormatError("the device needs at least one zone")
        if not 0 <= self.nr_conventional <= self.nr_zones:
            raise ImageFormatError(
                f"{self.nr_conventional} conventional zones but only {self.nr_zones} zones"
            )
        if self.max_open < 0 or self.max_active < 0:
            raise ImageFormatError("zone limits cannot be negative")
        if self.max_active and self.max_open > self.max_active:
            raise ImageFormatError(
                f"max open zones {self.max_open} exceeds max active zones {self.max_active}"
            )

    @property
    def table_copy_bytes(self) -> int:
        """Bytes of one table copy, padded to META_ALIGN."""
        return round_up(TABLE_ENTRIES_AT + ENTRY_BYTES * self.nr_zones, META_ALIGN)

    @property
    def table_offset(self) -> int:
        return HEADER_BYTES

    @property
    def data_offset(self) -> int:
        return round_up(self.table_offset + 2 * self.table_copy_bytes, DATA_ALIGN)

    @property
    def image_bytes(self) -> int:
        """Smallest valid file size for this geometry."""
        return self.data_offset + self.nr_zones * self.zone_size_bytes


@dataclass(frozen=True, slots=True)
class DataDiscard:
    """The data-discarding mode of a version-2 header (docs/SPEC.md, "Emulator image").

    `enabled`: the image was created with `--discard-data`. `first_zone`:
    blocks written to zones at or past it are accepted (the write pointer
    moves) but not stored, so they read back as zeros; NO_DISCARD_ZONE until
    mkfs declares where its data zones start (`declare_data_zones`).
    """

    enabled: bool = False
    first_zone: int = NO_DISCARD_ZONE

    def discards(self, zone_idx: int) -> bool:
        """Return True when blocks written to `zone_idx` are dropped."""
        return self.enabled and zone_idx >= self.first_zone


def encode_header(geo: Geometry, discard: DataDiscard | None = None) -> bytes:
    """Return the HEADER_BYTES-long (version 2) header block for `geo`."""
    discard = discard or DataDiscard()
    flags = FLAG_DISCARD_DATA if discard.enabled else 0
    head = _HEADER.pack(
        HEADER_MAGIC, EMU_IMAGE_VERSION, HEADER_V2_SIZE, geo.block_size, geo.nr_conventional,
        geo.zone_size_bytes, geo.zone_capacity_bytes, geo.nr_zones, geo.max_open,
        geo.max_active, flags, geo.table_offset, geo.table_copy_bytes, geo.data_offset,
    ) + _HEADER_V2.pack(discard.first_zone)
    block = bytearray(HEADER_BYTES)
    block[: len(head)] = head
    block[HEADER_CHECKSUM_AT : HEADER_CHECKSUM_AT + 8] = xxhash.xxh64_intdigest(
        bytes(block[:HEADER_CHECKSUM_AT])
    ).to_bytes(8, "little")
    return bytes(block)


def decode_header(block: bytes) -> Geometry:
    """Parse and check a header block; return its geometry.

    Raises ImageFormatError for a wrong magic, version, checksum or geometry.
    """
    return decode_header_full(block)[0]


def decode_header_full(block: bytes) -> tuple[Geometry, DataDiscard]:
    """Parse and check a header block (version 1 or 2); return geometry and discard mode.

    Raises ImageFormatError for a wrong magic, version, checksum or geometry,
    or flags this version does not define.
    """
    if len(block) < HEADER_CHECKSUM_AT + 8 or block[:8] != HEADER_MAGIC:
        raise ImageFormatError("no emulator image magic")
    want = int.from_bytes(block[HEADER_CHECKSUM_AT : HEADER_CHECKSUM_AT + 8], "little")
    if xxhash.xxh64_intdigest(bytes(block[:HEADER_CHECKSUM_AT])) != want:
        raise ImageFormatError("header checksum mismatch")
    (_magic, version, _hsize, bs, nconv, zsize, zcap, nzones, mopen, mactive, flags,
     toff, tbytes, doff) = _HEADER.unpack_from(block, 0)
    if version not in (1, EMU_IMAGE_VERSION):
        raise ImageFormatError(f"unsupported image version {version}")
    geo = Geometry(bs, zsize, zcap, nzones, nconv, mopen, mactive)
    geo.validate()
    if (toff, tbytes, doff) != (geo.table_offset, geo.table_copy_bytes, geo.data_offset):
        raise ImageFormatError("header layout offsets disagree with its geometry")
    if version == 1:  # flags were reserved and never read in version 1
        return geo, DataDiscard()
    if flags & ~FLAG_DISCARD_DATA:
        raise ImageFormatError(f"unknown header flags {flags:#x}")
    (first_zone,) = _HEADER_V2.unpack_from(block, _HEADER.size)
    if first_zone != NO_DISCARD_ZONE and not nconv <= first_zone < nzones:
        raise ImageFormatError(f"discard_first_zone {first_zone} out of range")
    return geo, DataDiscard(bool(flags & FLAG_DISCARD_DATA), first_zone)


@dataclass(frozen=True, slots=True)
class TableEntry:
    """One zone's persisted state (positions relative to the zone start).

    `wp_rel_bytes` is the write pointer the device reports; `data_end_rel_bytes`
    is where written data ends (they differ after finish: reads between them
    return zeros, as on null_blk).
    """

    wp_rel_bytes: int
    data_end_rel_bytes: int
    cond: ZoneCond
    reset_count: int = 0


def encode_table(geo: Geometry, seq: int, entries: list[TableEntry]) -> bytes:
    """Return one table copy (geo.table_copy_bytes long) carrying sequence number `seq`."""
    buf = bytearray(geo.table_copy_bytes)
    _TABLE_HEAD.pack_into(buf, 0, TABLE_MAGIC, seq, len(entries), ENTRY_BYTES)
    pos = TABLE_ENTRIES_AT
    for entry in entries:
        _ENTRY.pack_into(buf, pos, entry.wp_rel_bytes, entry.data_end_rel_bytes,
                         entry.reset_count, int(entry.cond))
        pos += ENTRY_BYTES
    digest = _table_digest(buf, len(entries))
    buf[TABLE_CHECKSUM_AT:TABLE_ENTRIES_AT] = digest.to_bytes(8, "little")
    return bytes(buf)


def _table_digest(buf: bytes | bytearray, nr_entries: int) -> int:
    h = xxhash.xxh64()
    h.update(bytes(buf[:TABLE_CHECKSUM_AT]))
    h.update(bytes(buf[TABLE_ENTRIES_AT : TABLE_ENTRIES_AT + ENTRY_BYTES * nr_entries]))
    return h.intdigest()


def decode_table(geo: Geometry, buf: bytes) -> tuple[int, list[TableEntry]]:
    """Parse one table copy and return (seq, entries).

    Raises ImageFormatError when the copy is torn, foreign or inconsistent
    with the geometry (write pointer past the zone, bad condition, a
    conventional zone with a write pointer).
    """
    if len(buf) < TABLE_ENTRIES_AT or buf[:8] != TABLE_MAGIC:
        raise ImageFormatError("no table magic")
    _magic, seq, nr, esize = _TABLE_HEAD.unpack_from(buf, 0)
    if nr != geo.nr_zones or esize != ENTRY_BYTES:
        raise ImageFormatError("table shape disagrees with the header")
    if len(buf) < TABLE_ENTRIES_AT + ENTRY_BYTES * nr:
        raise ImageFormatError("table copy truncated")
    want = int.from_bytes(buf[TABLE_CHECKSUM_AT:TABLE_ENTRIES_AT], "little")
    if _table_digest(buf, nr) != want:
        raise ImageFormatError("table checksum mismatch")
    entries: list[TableEntry] = []
    for idx in range(nr):
        wp_rel, data_end, resets, cond = _ENTRY.unpack_from(
            buf, TABLE_ENTRIES_AT + idx * ENTRY_BYTES
        )
        if cond not in _VALID_CONDS:
            raise ImageFormatError(f"zone {idx}: invalid condition {cond:#x}")
        conventional = idx < geo.nr_conventional
        if conventional != (cond == ZoneCond.NOT_WP):
            raise ImageFormatError(f"zone {idx}: condition {cond:#x} does not match its type")
        if wp_rel > geo.zone_size_bytes or wp_rel % geo.block_size:
            raise ImageFormatError(f"zone {idx}: write pointer {wp_rel} out of range")
        if data_end > wp_rel or data_end % geo.block_size:
            raise ImageFormatError(f"zone {idx}: data end {data_end} out of range")
        entries.append(TableEntry(wp_rel, data_end, ZoneCond(cond), resets))
    return seq, entries


def pick_newest_table(
    geo: Geometry, copies: list[bytes]
) -> tuple[int, int, list[TableEntry]]:
    """Return (copy_index, seq, entries) of the valid copy with the highest sequence.

    Raises ImageFormatError when no copy is valid.
    """
    best: tuple[int, int, list[TableEntry]] | None = None
    reasons: list[str] = []
    for idx, buf in enumerate(copies):
        try:
            seq, entries = decode_table(geo, buf)
        except ImageFormatError as exc:
            reasons.append(f"copy {idx}: {exc}")
            continue
        if best is None or seq > best[1]:
            best = (idx, seq, entries)
    if best is None:
        raise ImageFormatError("no valid zone table (" + "; ".join(reasons) + ")")
    return best
