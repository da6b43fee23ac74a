"""Metadata records: encode and decode, no I/O.

Every metadata write (superblock, zone headers, journal batches, checkpoint
pieces) is one *record*: a 32-byte header, a payload (JOURNAL and
CHECKPOINT_DATA ones maybe zlib-compressed: `compress_payload`, flag
FLAG_ZLIB), zero padding up to the device block size. Layout in docs/SPEC.md
("Record").

The checksum is xxh3-64 (seed 0) over the header with its checksum field zeroed,
followed by the payload; the padding is not covered but must be zero for fsck.
A record is valid only if magic, fs_id, type, length and checksum all agree:
anything else is a torn or foreign block, and the reader decides from context
(see journal.log) whether that is a normal torn tail or corruption.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import xxhash

from zonefs_py.format.constants import RECORD_HEADER_SIZE, RECORD_MAGIC, RecordType

_HEADER = struct.Struct("<IHHQIIQ")
assert _HEADER.size == RECORD_HEADER_SIZE

#: Largest payload one record may carry (bounds memory on read of a bad length).
MAX_PAYLOAD = 64 << 20

#: Record flag (format 3): the payload is a zlib stream of the ops (JOURNAL and
#: CHECKPOINT_DATA records only). No other flag exists; a record with any other
#: bit set is corruption.
FLAG_ZLIB = 0x1
#: zlib level 1, the fastest (what it saves on small files: docs/DESIGN.md 3.3).
ZLIB_LEVEL = 1


def compress_payload(payload: bytes, block_size: int) -> tuple[bytes, int]:
    """Return (payload, flags) to store: compressed when that saves at least
    one device block (a payload that fits a block as it is stays as it is)."""
    if RECORD_HEADER_SIZE + len(payload) <= block_size:
        return payload, 0
    packed = zlib.compress(payload, ZLIB_LEVEL)
    if padded_size(len(packed), block_size) < padded_size(len(payload), block_size):
        return packed, FLAG_ZLIB
    return payload, 0


class RecordError(Exception):
    """The bytes at this position are not a valid record (torn, foreign or corrupt)."""


@dataclass(frozen=True, slots=True)
class Record:
    """One decoded metadata log record: type, sequence number, flags and payload."""

    type: RecordType
    seq: int
    flags: int
    payload: bytes
    #: Total bytes the record occupies on the device (header + payload + padding).
    size_bytes: int


def padded_size(payload_len: int, block_size: int) -> int:
    """Return the on-device size of a record with this payload length."""
    raw = RECORD_HEADER_SIZE + payload_len
    return (raw + block_size - 1) // block_size * block_size


def encode_record(rtype: RecordType, seq: int, fs_id: int, payload: bytes,
                  block_size: int, flags: int = 0) -> bytes:
    """Return the padded bytes of one record."""
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"record payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    head = _HEADER.pack(RECORD_MAGIC, int(rtype), flags, seq, len(payload), fs_id, 0)
    digest = xxhash.xxh3_64_intdigest(head[:24] + payload)
    head = head[:24] + struct.pack("<Q", digest)
    total = padded_size(len(payload), block_size)
    return head + payload + bytes(total - RECORD_HEADER_SIZE - len(payload))


def peek_header(buf: bytes | memoryview, offset: int = 0) -> tuple[int, int, int, int, int] | None:
    """Return (type, flags, seq, payload_len, fs_id) if the magic matches, else None."""
    if len(buf) - offset < RECORD_HEADER_SIZE:
        return None
    magic, rtype, flags, seq, plen, fs_id, _ = _HEADER.unpack_from(buf, offset)
    if magic != RECORD_MAGIC:
        return None
    return rtype, flags, seq, plen, fs_id


def decode_record(buf: bytes | memoryview, offset: int, fs_id: int | None,
                  block_size: int) -> Record:
    """Decode the record that starts at buf[offset].

    `fs_id` None accepts any filesystem id (used by mkfs/probe). Raises
    RecordError when the bytes are not a complete valid record, including when
    the record's length runs past the end of `buf` (a torn tail).
    """
    head = peek_header(buf, offset)
    if head is None:
        raise RecordError("no record magic")
    rtype, flags, seq, plen, rec_fs_id = head
    if fs_id is not None and rec_fs_id != fs_id:
        raise RecordError(f"record of another filesystem (id {rec_fs_id:#x})")
    if plen > MAX_PAYLOAD:
        raise RecordError(f"implausible payload length {plen}")
    try:
        rt = RecordType(rtype)
    except ValueError:
        raise RecordError(f"unknown record type {rtype}") from None
    end = offset + RECORD_HEADER_SIZE + plen
    if end > len(buf):
        raise RecordError("record runs past the end of the written data")
    (stored,) = struct.unpack_from("<Q", buf, offset + 24)
    view = memoryview(buf)
    digest = xxhash.xxh3_64()
    digest.update(view[offset:offset + 24])
    digest.update(view[offset + RECORD_HEADER_SIZE:end])
    if digest.intdigest() != stored:
        raise RecordError("record checksum mismatch")
    payload = bytes(view[offset + RECORD_HEADER_SIZE:end])
    return Record(rt, seq, flags, payload, padded_size(plen, block_size))
