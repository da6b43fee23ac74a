"""Metadata operations: encode and decode, no I/O.

An op is a plain tuple whose first element is an `OpType`; the rest are the
fields below, in order. Ops are *physical* (they set state, they do not
describe intent): an INODE op carries the full attributes including nlink, so
replaying a journal never recomputes anything. Framing on disk: u8 type,
u32 body length, body (docs/SPEC.md "Operations").

    INODE       (ino, mode, uid, gid, nlink, rdev, size, atime_ns, mtime_ns, ctime_ns, flags)
    INODE_FREE  (ino,)
    DIRENT_ADD  (parent_ino, ino, name)
    DIRENT_DEL  (parent_ino, name)
    EXTENT      (ino, file_block, nblocks, dev_offset, checksums: bytes of nblocks*u32,
                or None: the blocks lie in a sealed zone whose summary holds their
                checksums; encoded as an EXTENT_SEALED op, decoded back to this)
    TRUNCATE    (ino, first_dropped_block)
    SYMLINK     (ino, target)
    XATTR_SET   (ino, name, value)
    XATTR_DEL   (ino, name)
    ZONE_STATE  (zone_idx, stream, flags, reset_count)
    COUNTERS    (dict[int, int])   counter id -> value
    NEXT_INO    (next_ino,)
    TENANT_BYTES (dir_ino, bytes_written)   user bytes written below a top-level directory
    INLINE      (ino, size, mtime_ns, ctime_ns, data)   a small file's bytes in the metadata
                (fs/inline.py), with the size and times they give it
    DRAIN       (ino, state, size, xxh3, url, token)   drain state of a file (zonefs_py/drain)
    ZONE_SEAL   (zone_idx, reset_count, data_blocks)   the zone's summary blocks are written
                after its first data_blocks blocks (format/zonesum.py)
    PREALLOC    (ino, first_block, nblocks)   reserves file blocks (fallocate, model/prealloc.py)
    PUNCH       (ino, first_block, nblocks)   drops the mappings and reservations of file blocks
    SHARE       (dev_offset, nblocks, count)   device blocks gain `count` references
                (copy_file_range sharing extents, model/shared.py)
    INO_GENERATION (first_ino, generation)   inodes numbered first_ino and up (to the
                next such op's first_ino) are of `generation` (u32, FUSE's and
                export handles'; model/state.py `generation_of`)
    TENANT      (tenant_id, flags, dir_ino, min_zones, max_zones, max_active)   a declared
                tenant's table entry (issue 45; max_zones / max_active 0: no cap;
                flags 0, reserved); or, with a bandwidth policy (the long layout,
                told apart by its length), (tenant_id, flags, dir_ino, min_zones,
                max_zones, max_active, write_cap_kbs, write_share_pct, read_share_pct)
                (0: none; fs/data/tenantqos.py)
    TENANT_DEL  (tenant_id,)   the tenant is removed; its zones are nobody's
    ZONE_TENANT (zone_idx, tenant_id)   the zone (opened by the ZONE_STATE before
                it) holds only that tenant's data until its next ZONE_STATE
    Format 5 only (issue 32, docs/DESIGN.md 3.15):
    PARENT      (ino, parent_ino)   an inode record's primary parent directory
    ZONE_LIVE   (zone_idx, live_blocks)   a checkpoint's live block count of a data zone
    INODE_COUNT (count,)   a checkpoint's number of inodes
    RESIDENT    (inos: tuple of u64)   inodes a mount loads at once
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

from zonefs_py.format.constants import INLINE_MAX_BYTES, OpType, RecordType
from zonefs_py.format.records import FLAG_ZLIB, MAX_PAYLOAD

Op = tuple[Any, ...]

_FRAME = struct.Struct("<BI")
_INODE = struct.Struct("<QIIIIQQqqqI")
_Q = struct.Struct("<Q")
_DIRENT_ADD = struct.Struct("<QQH")
_DIRENT_DEL = struct.Struct("<QH")
_EXTENT = struct.Struct("<QQIQ")
_QQ = struct.Struct("<QQ")
_XATTR_SET = struct.Struct("<QHI")
_XATTR_DEL = struct.Struct("<QH")
_ZONE_STATE = struct.Struct("<IBBHI")
_COUNTER = struct.Struct("<HQ")
_DRAIN = struct.Struct("<QBQQHH")
_INLINE = struct.Struct("<QQqqH")
_ZONE_SEAL = struct.Struct("<IIQ")
_QQQ = struct.Struct("<QQQ")
_SHARE = struct.Struct("<QQI")
_ZONE_LIVE = struct.Struct("<IQ")
_INO_GENERATION = struct.Struct("<QI")
_TENANT = struct.Struct("<HHQIII")
#: TENANT with a bandwidth policy: + u32 write cap (kB/s), u8 write share (%), u8 read
#: share (%), u16 reserved (0).
_TENANT_QOS = struct.Struct("<HHQIIIIBBH")
_TENANT_DEL = struct.Struct("<H")
_ZONE_TENANT = struct.Struct("<IH")
#: Inodes one RESIDENT op lists at most (a checkpoint writes as many ops as needed).
RESIDENT_MAX_INODES = 4096


class OpDecodeError(Exception):
    """A payload that passed its record checksum still does not decode (a bug or
    a format mismatch): never silently skipped."""


def encode_op(op: Op) -> bytes:
    """Return the framed bytes of one op."""
    kind = op[0]
    if kind == OpType.INODE:
        body = _INODE.pack(*op[1:])
    elif kind == OpType.INODE_FREE or kind == OpType.NEXT_INO or kind == OpType.INODE_COUNT:
        body = _Q.pack(op[1])
    elif kind == OpType.DIRENT_ADD:
        body = _DIRENT_ADD.pack(op[1], op[2], len(op[3])) + op[3]
    elif kind == OpType.DIRENT_DEL:
        body = _DIRENT_DEL.pack(op[1], len(op[2])) + op[2]
    elif kind == OpType.EXTENT:
        body = _EXTENT.pack(op[1], op[2], op[3], op[4])
        if op[5] is None:
            kind = OpType.EXTENT_SEALED
        else:
            body += op[5]
    elif kind == OpType.ZONE_SEAL:
        body = _ZONE_SEAL.pack(op[1], op[2], op[3])
    elif kind == OpType.TRUNCATE or kind == OpType.TENANT_BYTES or kind == OpType.PARENT:
        body = _QQ.pack(op[1], op[2])
    elif kind == OpType.ZONE_LIVE:
        body = _ZONE_LIVE.pack(op[1], op[2])
    elif kind == OpType.INO_GENERATION:
        body = _INO_GENERATION.pack(op[1], op[2])
    elif kind == OpType.TENANT:
        if len(op) == 7:
            body = _TENANT.pack(*op[1:])
        else:
            body = _TENANT_QOS.pack(*op[1:10], 0)
    elif kind == OpType.TENANT_DEL:
        body = _TENANT_DEL.pack(op[1])
    elif kind == OpType.ZONE_TENANT:
        body = _ZONE_TENANT.pack(op[1], op[2])
    elif kind == OpType.RESIDENT:
        if len(op[1]) > RESIDENT_MAX_INODES:
            raise ValueError(f"RESIDENT op of {len(op[1])} inodes (at most {RESIDENT_MAX_INODES})")
        body = struct.pack(f"<{len(op[1])}Q", *op[1])
    elif kind == OpType.PREALLOC or kind == OpType.PUNCH:
        body = _QQQ.pack(op[1], op[2], op[3])
    elif kind == OpType.SHARE:
        body = _SHARE.pack(op[1], op[2], op[3])
    elif kind == OpType.SYMLINK:
        body = _Q.pack(op[1]) + op[2]
    elif kind == OpType.XATTR_SET:
        body = _XATTR_SET.pack(op[1], len(op[2]), len(op[3])) + op[2] + op[3]
    elif kind == OpType.XATTR_DEL:
        body = _XATTR_DEL.pack(op[1], len(op[2])) + op[2]
    elif kind == OpType.ZONE_STATE:
        body = _ZONE_STATE.pack(op[1], op[2], op[3], 0, op[4])
    elif kind == OpType.COUNTERS:
        items = sorted(op[1].items())
        body = struct.pack("<H", len(items)) + b"".join(_COUNTER.pack(k, v) for k, v in items)
    elif kind == OpType.INLINE:
        if len(op[5]) > INLINE_MAX_BYTES:
            raise ValueError(f"INLINE op of {len(op[5])} bytes (at most {INLINE_MAX_BYTES})")
        body = _INLINE.pack(op[1], op[2], op[3], op[4], len(op[5])) + op[5]
    elif kind == OpType.DRAIN:
        body = _DRAIN.pack(op[1], op[2], op[3], op[4], len(op[5]), len(op[6])) + op[5] + op[6]
    else:
        raise ValueError(f"unknown op type {kind!r}")
    return _FRAME.pack(int(kind), len(body)) + body


def encode_ops(ops: list[Op]) -> bytes:
    return b"".join(encode_op(op) for op in ops)


def record_body(rtype: int, flags: int, payload: bytes) -> bytes:
    """The ops bytes a JOURNAL or CHECKPOINT_DATA record carries (inflated when
    its FLAG_ZLIB is set). Raises OpDecodeError for any other flag, or for a
    zlib stream that does not inflate to at most MAX_PAYLOAD bytes exactly (the
    record checksum passed: a bug or corruption, never skipped)."""
    if flags == 0:
        return payload
    if flags != FLAG_ZLIB:
        raise OpDecodeError(f"record flags {flags:#x}: unknown bits")
    if rtype not in (RecordType.JOURNAL, RecordType.CHECKPOINT_DATA):
        raise OpDecodeError(f"record type {rtype} cannot be compressed")
    inflate = zlib.decompressobj()
    try:
        body = inflate.decompress(payload, MAX_PAYLOAD)
    except zlib.error as exc:
        raise OpDecodeError(f"compressed payload does not inflate: {exc}") from None
    if not inflate.eof or inflate.unconsumed_tail or inflate.unused_data:
        raise OpDecodeError("compressed payload is truncated, too long or followed by bytes")
    return body


def decode_ops(payload: bytes) -> list[Op]:
    """Decode a payload into ops. Raises OpDecodeError on any inconsistency."""
    ops: list[Op] = []
    append = ops.append
    pos = 0
    end = len(payload)
    mv = memoryview(payload)
    frame = _FRAME.unpack_from
    inode = _INODE.unpack_from
    dirent = _DIRENT_ADD.unpack_from
    inode_len = _INODE.size
    t_inode, t_dirent = OpType.INODE, OpType.DIRENT_ADD
    try:
        while pos < end:
            kind, blen = frame(payload, pos)
            pos += 5
            bend = pos + blen
            if bend > end:
                raise OpDecodeError(f"op body runs past the payload at byte {pos}")
            # Fast paths for the two ops that make up most of a checkpoint.
            if kind == 1 and blen == inode_len:
                append((t_inode, *inode(payload, pos)))
            elif kind == 3:
                parent, ino, nlen = dirent(payload, pos)
                if pos + 18 + nlen != bend:
                    raise OpDecodeError("inconsistent DIRENT_ADD name length")
                append((t_dirent, parent, ino, payload[pos + 18:bend]))
            else:
                append(_decode_body(kind, payload, mv, pos, bend))
            pos = bend
    except struct.error as exc:
        raise OpDecodeError(f"truncated op at byte {pos}: {exc}") from None
    return ops


def _decode_body(kind: int, payload: bytes, mv: memoryview, pos: int, bend: int) -> Op:
    if kind == OpType.INODE:
        if bend - pos != _INODE.size:
            raise OpDecodeError("INODE op of wrong length")
        return (OpType.INODE, *_INODE.unpack_from(payload, pos))
    if kind == OpType.INODE_FREE:
        return (OpType.INODE_FREE, _Q.unpack_from(payload, pos)[0])
    if kind == OpType.NEXT_INO:
        return (OpType.NEXT_INO, _Q.unpack_from(payload, pos)[0])
    if kind == OpType.INODE_COUNT:
        if bend - pos != 8:
            raise OpDecodeError("INODE_COUNT body is not 8 bytes")
        return (OpType.INODE_COUNT, _Q.unpack_from(payload, pos)[0])
    if kind == OpType.PARENT:
        if bend - pos != 16:
            raise OpDecodeError("PARENT body is not 16 bytes")
        return (OpType.PARENT, *_QQ.unpack_from(payload, pos))
    if kind == OpType.INO_GENERATION:
        if bend - pos != _INO_GENERATION.size:
            raise OpDecodeError("INO_GENERATION body is not 12 bytes")
        return (OpType.INO_GENERATION, *_INO_GENERATION.unpack_from(payload, pos))
    if kind == OpType.TENANT:
        # Two layouts, told apart by the length: without (24 bytes, the first) and
        # with a bandwidth policy (32 bytes); an op decodes to the tuple it was from.
        if bend - pos == _TENANT_QOS.size:
            return (OpType.TENANT, *_TENANT_QOS.unpack_from(payload, pos)[:9])
        _check(bend - pos == _TENANT.size, "TENANT length")
        return (OpType.TENANT, *_TENANT.unpack_from(payload, pos))
    if kind == OpType.TENANT_DEL:
        _check(bend - pos == _TENANT_DEL.size, "TENANT_DEL length")
        return (OpType.TENANT_DEL, *_TENANT_DEL.unpack_from(payload, pos))
    if kind == OpType.ZONE_TENANT:
        _check(bend - pos == _ZONE_TENANT.size, "ZONE_TENANT length")
        return (OpType.ZONE_TENANT, *_ZONE_TENANT.unpack_from(payload, pos))
    if kind == OpType.ZONE_LIVE:
        if bend - pos != _ZONE_LIVE.size:
            raise OpDecodeError("ZONE_LIVE body is not 12 bytes")
        return (OpType.ZONE_LIVE, *_ZONE_LIVE.unpack_from(payload, pos))
    if kind == OpType.RESIDENT:
        n, rest = divmod(bend - pos, 8)
        if rest or n > RESIDENT_MAX_INODES:
            raise OpDecodeError(f"RESIDENT body of {bend - pos} bytes")
        return (OpType.RESIDENT, struct.unpack_from(f"<{n}Q", payload, pos))
    if kind == OpType.DIRENT_ADD:
        parent, ino, nlen = _DIRENT_ADD.unpack_from(payload, pos)
        start = pos + _DIRENT_ADD.size
        _check(start + nlen == bend, "DIRENT_ADD name length")
        return (OpType.DIRENT_ADD, parent, ino, bytes(mv[start:bend]))
    if kind == OpType.DIRENT_DEL:
        parent, nlen = _DIRENT_DEL.unpack_from(payload, pos)
        start = pos + _DIRENT_DEL.size
        _check(start + nlen == bend, "DIRENT_DEL name length")
        return (OpType.DIRENT_DEL, parent, bytes(mv[start:bend]))
    if kind == OpType.EXTENT:
        ino, fblock, nblocks, dev = _EXTENT.unpack_from(payload, pos)
        start = pos + _EXTENT.size
        _check(start + nblocks * 4 == bend, "EXTENT checksum count")
        return (OpType.EXTENT, ino, fblock, nblocks, dev, bytes(mv[start:bend]))
    if kind == OpType.EXTENT_SEALED:
        _check(bend - pos == _EXTENT.size, "EXTENT_SEALED length")
        ino, fblock, nblocks, dev = _EXTENT.unpack_from(payload, pos)
        return (OpType.EXTENT, ino, fblock, nblocks, dev, None)
    if kind == OpType.ZONE_SEAL:
        _check(bend - pos == _ZONE_SEAL.size, "ZONE_SEAL length")
        return (OpType.ZONE_SEAL, *_ZONE_SEAL.unpack_from(payload, pos))
    if kind == OpType.TRUNCATE:
        return (OpType.TRUNCATE, *_QQ.unpack_from(payload, pos))
    if kind == OpType.TENANT_BYTES:
        return (OpType.TENANT_BYTES, *_QQ.unpack_from(payload, pos))
    if kind == OpType.PREALLOC or kind == OpType.PUNCH:
        _check(bend - pos == _QQQ.size, f"{OpType(kind).name} length")
        return (OpType(kind), *_QQQ.unpack_from(payload, pos))
    if kind == OpType.SHARE:
        _check(bend - pos == _SHARE.size, "SHARE length")
        return (OpType.SHARE, *_SHARE.unpack_from(payload, pos))
    if kind == OpType.SYMLINK:
        (ino,) = _Q.unpack_from(payload, pos)
        return (OpType.SYMLINK, ino, bytes(mv[pos + 8:bend]))
    if kind == OpType.XATTR_SET:
        ino, nlen, vlen = _XATTR_SET.unpack_from(payload, pos)
        start = pos + _XATTR_SET.size
        _check(start + nlen + vlen == bend, "XATTR_SET lengths")
        return (OpType.XATTR_SET, ino, bytes(mv[start:start + nlen]),
                bytes(mv[start + nlen:bend]))
    if kind == OpType.XATTR_DEL:
        ino, nlen = _XATTR_DEL.unpack_from(payload, pos)
        start = pos + _XATTR_DEL.size
        _check(start + nlen == bend, "XATTR_DEL name length")
        return (OpType.XATTR_DEL, ino, bytes(mv[start:bend]))
    if kind == OpType.ZONE_STATE:
        zone, stream, flags, _res, resets = _ZONE_STATE.unpack_from(payload, pos)
        return (OpType.ZONE_STATE, zone, stream, flags, resets)
    if kind == OpType.COUNTERS:
        (count,) = struct.unpack_from("<H", payload, pos)
        _check(pos + 2 + count * _COUNTER.size == bend, "COUNTERS length")
        values = {}
        for i in range(count):
            k, v = _COUNTER.unpack_from(payload, pos + 2 + i * _COUNTER.size)
            values[k] = v
        return (OpType.COUNTERS, values)
    if kind == OpType.INLINE:
        ino, size, mtime, ctime, dlen = _INLINE.unpack_from(payload, pos)
        start = pos + _INLINE.size
        _check(start + dlen == bend, "INLINE data length")
        _check(dlen <= INLINE_MAX_BYTES, f"INLINE data length {dlen} (at most {INLINE_MAX_BYTES})")
        return (OpType.INLINE, ino, size, mtime, ctime, bytes(mv[start:bend]))
    if kind == OpType.DRAIN:
        ino, dstate, size, xxh, ulen, tlen = _DRAIN.unpack_from(payload, pos)
        start = pos + _DRAIN.size
        _check(start + ulen + tlen == bend, "DRAIN lengths")
        return (OpType.DRAIN, ino, dstate, size, xxh, bytes(mv[start:start + ulen]),
                bytes(mv[start + ulen:bend]))
    raise OpDecodeError(f"unknown op type {kind}")


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise OpDecodeError(f"inconsistent {what}")
