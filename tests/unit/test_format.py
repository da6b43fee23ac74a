"""format/: records, ops, superblock and checksums (pure encode/decode, no I/O)."""

from __future__ import annotations

import dataclasses
import struct
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zonefs_py.format.checksum import block_checksums, first_bad_block
from zonefs_py.format.constants import (
    NEWEST_DISK_VERSION,
    RECORD_HEADER_SIZE,
    OpType,
    RecordType,
)
from zonefs_py.format.ops import OpDecodeError, decode_ops, encode_op, encode_ops
from zonefs_py.format.records import (
    MAX_PAYLOAD,
    RecordError,
    decode_record,
    encode_record,
    padded_size,
    peek_header,
)
from zonefs_py.format.superblock import Superblock, SuperblockError

BS = 4096
FS_ID = 0x12345678

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, (1 << 64) - 1)
i64 = st.integers(-(1 << 63), (1 << 63) - 1)
name = st.binary(min_size=1, max_size=255)


# -- records --------------------------------------------------------------------------

@given(rtype=st.sampled_from(RecordType), seq=u64, payload=st.binary(max_size=9000),
       flags=u16)
def test_record_round_trip(rtype: RecordType, seq: int, payload: bytes, flags: int) -> None:
    raw = encode_record(rtype, seq, FS_ID, payload, BS, flags)
    assert len(raw) == padded_size(len(payload), BS)
    assert len(raw) % BS == 0
    assert raw[RECORD_HEADER_SIZE + len(payload):] == bytes(len(raw) - RECORD_HEADER_SIZE
                                                            - len(payload))
    rec = decode_record(raw, 0, FS_ID, BS)
    assert (rec.type, rec.seq, rec.flags, rec.payload, rec.size_bytes) == (
        rtype, seq, flags, payload, len(raw))
    assert decode_record(raw, 0, None, BS).payload == payload  # any fs id accepted


def test_record_at_an_offset_in_a_buffer() -> None:
    a = encode_record(RecordType.JOURNAL, 1, FS_ID, b"a", BS)
    b = encode_record(RecordType.JOURNAL, 2, FS_ID, b"b" * 5000, BS)
    buf = a + b
    assert decode_record(buf, len(a), FS_ID, BS).payload == b"b" * 5000


def _good() -> bytes:
    return encode_record(RecordType.JOURNAL, 7, FS_ID, b"payload" * 10, BS)


def test_record_bad_magic_rejected() -> None:
    raw = bytearray(_good())
    raw[0] ^= 1
    assert peek_header(raw) is None
    with pytest.raises(RecordError, match="magic"):
        decode_record(raw, 0, FS_ID, BS)


@pytest.mark.parametrize("byte", [4, 8, 20, 24, RECORD_HEADER_SIZE, RECORD_HEADER_SIZE + 69])
def test_record_any_flipped_bit_rejected(byte: int) -> None:
    raw = bytearray(_good())
    raw[byte] ^= 0x10
    with pytest.raises(RecordError):
        decode_record(raw, 0, FS_ID, BS)


def test_record_checksum_mismatch_named() -> None:
    raw = bytearray(_good())
    raw[RECORD_HEADER_SIZE] ^= 0xFF
    with pytest.raises(RecordError, match="checksum"):
        decode_record(raw, 0, FS_ID, BS)


def test_record_of_a_foreign_filesystem_rejected() -> None:
    with pytest.raises(RecordError, match="another filesystem"):
        decode_record(_good(), 0, FS_ID + 1, BS)


@pytest.mark.parametrize("keep", [0, 10, RECORD_HEADER_SIZE, RECORD_HEADER_SIZE + 5])
def test_truncated_record_is_torn(keep: int) -> None:
    with pytest.raises(RecordError):
        decode_record(_good()[:keep], 0, FS_ID, BS)


def test_torn_multi_block_record_rejected() -> None:
    raw = encode_record(RecordType.CHECKPOINT_DATA, 3, FS_ID, bytes(range(256)) * 40, BS)
    assert len(raw) == 3 * BS
    torn = raw[:BS] + bytes(2 * BS)  # only the first block reached the media
    with pytest.raises(RecordError, match="checksum"):
        decode_record(torn, 0, FS_ID, BS)
    with pytest.raises(RecordError, match="past the end"):
        decode_record(raw[:2 * BS], 0, FS_ID, BS)


def test_record_unknown_type_and_huge_length_rejected() -> None:
    raw = bytearray(_good())
    struct.pack_into("<H", raw, 4, 99)
    with pytest.raises(RecordError, match="unknown record type"):
        decode_record(raw, 0, FS_ID, BS)
    raw = bytearray(_good())
    struct.pack_into("<I", raw, 16, MAX_PAYLOAD + 1)
    with pytest.raises(RecordError, match="implausible"):
        decode_record(raw, 0, FS_ID, BS)
    with pytest.raises(ValueError, match="exceeds"):
        encode_record(RecordType.JOURNAL, 1, FS_ID, bytes(MAX_PAYLOAD + 1), BS)


# -- ops ------------------------------------------------------------------------------

OP_STRATEGIES = {
    OpType.INODE: st.tuples(st.just(OpType.INODE), u64, u32, u32, u32, u32, u64, u64, i64, i64,
                            i64, u32),
    OpType.INODE_FREE: st.tuples(st.just(OpType.INODE_FREE), u64),
    OpType.DIRENT_ADD: st.tuples(st.just(OpType.DIRENT_ADD), u64, u64, name),
    OpType.DIRENT_DEL: st.tuples(st.just(OpType.DIRENT_DEL), u64, name),
    OpType.EXTENT: st.integers(0, 40).flatmap(lambda n: st.tuples(
        st.just(OpType.EXTENT), u64, u64, st.just(n), u64,
        st.binary(min_size=4 * n, max_size=4 * n))),
    OpType.TRUNCATE: st.tuples(st.just(OpType.TRUNCATE), u64, u64),
    OpType.SYMLINK: st.tuples(st.just(OpType.SYMLINK), u64, st.binary(min_size=1, max_size=4095)),
    OpType.XATTR_SET: st.tuples(st.just(OpType.XATTR_SET), u64, name, st.binary(max_size=3000)),
    OpType.XATTR_DEL: st.tuples(st.just(OpType.XATTR_DEL), u64, name),
    OpType.ZONE_STATE: st.tuples(st.just(OpType.ZONE_STATE), u32, u8, u8, u32),
    # An EXTENT of a sealed zone: no checksums (decoded back to EXTENT with None).
    OpType.EXTENT_SEALED: st.tuples(st.just(OpType.EXTENT), u64, u64, u32, u64, st.none()),
    OpType.ZONE_SEAL: st.tuples(st.just(OpType.ZONE_SEAL), u32, u32, u64),
    OpType.COUNTERS: st.tuples(st.just(OpType.COUNTERS), st.dictionaries(u16, u64, max_size=20)),
    OpType.NEXT_INO: st.tuples(st.just(OpType.NEXT_INO), u64),
    OpType.TENANT_BYTES: st.tuples(st.just(OpType.TENANT_BYTES), u64, u64),
    OpType.PREALLOC: st.tuples(st.just(OpType.PREALLOC), u64, u64, u64),
    OpType.PUNCH: st.tuples(st.just(OpType.PUNCH), u64, u64, u64),
    OpType.SHARE: st.tuples(st.just(OpType.SHARE), u64, u64, u32),
    OpType.PARENT: st.tuples(st.just(OpType.PARENT), u64, u64),
    OpType.ZONE_LIVE: st.tuples(st.just(OpType.ZONE_LIVE), u32, u64),
    OpType.INODE_COUNT: st.tuples(st.just(OpType.INODE_COUNT), u64),
    OpType.INO_GENERATION: st.tuples(st.just(OpType.INO_GENERATION), u64, u32),
    # Two layouts: without a bandwidth policy (24 bytes) and with one (32 bytes).
    OpType.TENANT: st.one_of(
        st.tuples(st.just(OpType.TENANT), u16, u16, u64, u32, u32, u32),
        st.tuples(st.just(OpType.TENANT), u16, u16, u64, u32, u32, u32, u32, u8, u8)),
    OpType.TENANT_DEL: st.tuples(st.just(OpType.TENANT_DEL), u16),
    OpType.ZONE_TENANT: st.tuples(st.just(OpType.ZONE_TENANT), u32, u16),
    OpType.RESIDENT: st.tuples(st.just(OpType.RESIDENT),
                               st.lists(u64, max_size=64).map(tuple)),
    OpType.INLINE: st.tuples(st.just(OpType.INLINE), u64, u64, i64, i64,
                             st.binary(max_size=2048)),
    OpType.DRAIN: st.tuples(st.just(OpType.DRAIN), u64, u8, u64, u64,
                            st.binary(max_size=1024), st.binary(max_size=1024)),
}
OPS = st.one_of(*OP_STRATEGIES.values())


def test_every_op_type_has_a_strategy() -> None:
    assert set(OP_STRATEGIES) == set(OpType)


@pytest.mark.parametrize("kind", list(OpType))
@settings(max_examples=30)
@given(data=st.data())
def test_op_codec_round_trip_per_type(kind: OpType, data: st.DataObject) -> None:
    op = data.draw(OP_STRATEGIES[kind])
    assert decode_ops(encode_op(op)) == [op]


@settings(max_examples=300)
@given(ops=st.lists(OPS, max_size=12))
def test_op_codec_round_trip(ops: list[tuple[object, ...]]) -> None:
    decoded = decode_ops(encode_ops(ops))
    assert decoded == ops
    assert all(isinstance(op[0], OpType) for op in decoded)


@given(op=OPS, cut=st.integers(1, 40))
def test_truncated_op_payload_raises(op: tuple[object, ...], cut: int) -> None:
    raw = encode_op(op)
    with pytest.raises(OpDecodeError):
        decode_ops(raw[:max(0, len(raw) - cut)] or raw[:1])


def test_unknown_op_type_raises() -> None:
    with pytest.raises(OpDecodeError, match="unknown op type"):
        decode_ops(struct.pack("<BI", 200, 0))
    with pytest.raises(ValueError, match="unknown op type"):
        encode_op((200, 1))


def test_inconsistent_lengths_raise() -> None:
    raw = bytearray(encode_op((OpType.DIRENT_ADD, 1, 2, b"abc")))
    struct.pack_into("<H", raw, 5 + 16, 7)  # name length past the body
    with pytest.raises(OpDecodeError, match="DIRENT_ADD"):
        decode_ops(bytes(raw))
    raw = bytearray(encode_op((OpType.INODE, *range(1, 12))))
    struct.pack_into("<I", raw, 1, 10)
    with pytest.raises(OpDecodeError):
        decode_ops(bytes(raw))


# -- superblock -----------------------------------------------------------------------

def _sb() -> Superblock:
    return Superblock(fs_uuid=uuid.uuid4().bytes, block_size=4096, zone_size=1 << 23,
                      nr_zones=64, sb_zone_a=0, sb_zone_b=1, meta_first_zone=2,
                      meta_zone_count=4, data_first_zone=6, data_zone_count=58,
                      reserve_bytes=1 << 20, label=b"lbl", checkpoint_zone=2,
                      checkpoint_offset=(2 << 23) + 4096, checkpoint_seq=2, created_ns=123)


def test_superblock_round_trip() -> None:
    sb = _sb()
    assert Superblock.decode(sb.encode()) == sb
    moved = sb.with_checkpoint(3, 3 << 23, 99)
    assert Superblock.decode(moved.encode()) == moved
    assert sb.fs_id == int.from_bytes(sb.fs_uuid[:4], "little")
    assert str(uuid.UUID(sb.uuid_str)) == sb.uuid_str


def test_superblock_label_is_cut_at_64_bytes() -> None:
    sb = dataclasses.replace(_sb(), label=b"x" * 80)
    assert Superblock.decode(sb.encode()).label == b"x" * 64


def test_superblock_other_version_refused() -> None:
    raw = bytearray(_sb().encode())
    struct.pack_into("<I", raw, 0, NEWEST_DISK_VERSION + 1)
    with pytest.raises(SuperblockError, match=f"version {NEWEST_DISK_VERSION + 1}"):
        Superblock.decode(bytes(raw))


def test_superblock_short_payload_refused() -> None:
    with pytest.raises(SuperblockError, match="too short"):
        Superblock.decode(_sb().encode()[:40])


# -- checksums ------------------------------------------------------------------------

@given(data=st.binary(min_size=512, max_size=8 * 512).map(lambda b: b[:len(b) // 512 * 512]),
       flip=st.integers(0, 1 << 20))
def test_block_checksums_find_the_flipped_block(data: bytes, flip: int) -> None:
    csums = block_checksums(data, 512)
    assert len(csums) == len(data) // 512 * 4
    assert first_bad_block(data, 512, csums) is None
    pos = flip % len(data)
    bad = bytearray(data)
    bad[pos] ^= 1 << (flip % 8)
    assert first_bad_block(bytes(bad), 512, csums) == pos // 512


# -- compressed payloads (record flag FLAG_ZLIB, format 3) ---------------------------------

def _ops_payload(n: int) -> bytes:
    return encode_ops([(OpType.INODE, 100 + i, 0o100644, 0, 0, 1, 0, 256, 1, 2, 3, 0)
                       for i in range(n)])


def test_compressed_payload_round_trips_and_saves_blocks() -> None:
    import zonefs_py.format.records as rec_mod
    from zonefs_py.format.ops import record_body

    small = _ops_payload(10)  # fits one block as it is: stored as it is
    assert rec_mod.compress_payload(small, 4096) == (small, 0)
    big = _ops_payload(500)
    packed, flags = rec_mod.compress_payload(big, 4096)
    assert flags == rec_mod.FLAG_ZLIB
    assert rec_mod.padded_size(len(packed), 4096) < rec_mod.padded_size(len(big), 4096)
    raw = rec_mod.encode_record(RecordType.JOURNAL, 7, 1, packed, 4096, flags)
    rec = rec_mod.decode_record(raw, 0, 1, 4096)
    assert rec.flags == rec_mod.FLAG_ZLIB
    assert decode_ops(record_body(rec.type, rec.flags, rec.payload)) == decode_ops(big)
    import random

    noise = random.Random(1).randbytes(6000)  # incompressible: stored as it is
    assert rec_mod.compress_payload(noise, 4096) == (noise, 0)


@pytest.mark.parametrize("case", ["garbage", "truncated", "trailing", "bomb", "flag", "type"])
def test_bad_compressed_payloads_are_decode_errors(case: str) -> None:
    import zlib

    from zonefs_py.format.ops import record_body
    from zonefs_py.format.records import FLAG_ZLIB, MAX_PAYLOAD

    good = zlib.compress(_ops_payload(200), 1)
    rtype, flags, payload = RecordType.JOURNAL, FLAG_ZLIB, good
    if case == "garbage":
        payload = b"\x78\x01" + bytes(100)
    elif case == "truncated":
        payload = good[:-10]
    elif case == "trailing":
        payload = good + b"x"
    elif case == "bomb":
        payload = zlib.compress(bytes(MAX_PAYLOAD + 1), 1)
    elif case == "flag":
        flags = 0x2
    else:
        rtype = RecordType.CHECKPOINT_BEGIN
    with pytest.raises(OpDecodeError):
        record_body(rtype, flags, payload)
