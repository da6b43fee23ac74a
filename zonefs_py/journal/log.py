"""The metadata log: a chain of meta zones holding checkpoints and journal records.

Blocking code, called from worker threads by `journal.journal.Journal` (and
directly by mkfs and fsck). Layout and reading rules (docs/DESIGN.md, "Metadata
log"):

* Every meta zone in use starts with a ZONE_HEADER record. Record sequence
  numbers increase by exactly one along the whole chain, across zones, so the
  zone that continues the log is the one whose header has seq = last + 1.
  The device is flushed before a new zone's header is written, so a power cut
  never keeps records of a zone while losing some of the zone before it.
* A checkpoint is CHECKPOINT_BEGIN, CHECKPOINT_DATA..., CHECKPOINT_END, always
  starting in a fresh zone. The superblock points at the BEGIN of the newest
  checkpoint known to be complete; zones before it are obsolete and reset.
* Reading stops at the first invalid record of a zone. If a later valid record
  of the same chain exists in that zone, or a zone's header skips a number,
  the log is corrupt in the middle (`LogCorrupt`); otherwise an invalid record
  is a torn tail, normal after a power cut.

Zone accounting without the device: `MetaLog` is the only writer of the meta
zones (it starts, finishes and resets them), so it keeps which of them are
EMPTY and how much room the zone it appends to has left, learnt from one zone
report when it is built and at `scan`. `free_zones`, `free_zone_count` and
`room_in_current_zone` read only that, so the journal may ask them on the trio
thread (a zone report is an ioctl on a real device). The figures err on the
safe side: a zone counts as EMPTY only once its reset returned, and stops
counting before anything is appended to it; after a failed append the room
left is taken as 0. Writes still check the device itself (worker threads).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from zonefs_py.device.base import Zone, ZoneCond, ZonedDevice
from zonefs_py.format.constants import RECORD_HEADER_SIZE, RecordType
from zonefs_py.format.records import (
    Record,
    RecordError,
    compress_payload,
    decode_record,
    encode_record,
)

_ZONE_HEADER = struct.Struct("<16sI")
#: Record types whose payload (ops) is stored zlib-compressed when that saves a
#: block (format 3; `compress_payload`).
_COMPRESSED = (RecordType.JOURNAL, RecordType.CHECKPOINT_DATA)
_READ_CHUNK = 4 << 20


class LogCorrupt(Exception):
    """The metadata log is damaged somewhere other than its tail."""


class LogFull(Exception):
    """No empty meta zone is left for the next record."""


@dataclass(slots=True)
class LogPosition:
    """Where a record sits in the metadata log: meta zone, absolute byte offset, sequence number."""

    zone: int
    offset: int  # absolute byte offset of the record
    seq: int


@dataclass(slots=True)
class ScanResult:
    """What a scan of the chain found (records are yielded separately)."""

    last_seq: int = 0
    #: Where the next record can go, or None if the last zone has a torn tail.
    append_zone: int | None = None
    torn_tail: bool = False
    chain_zones: list[int] = field(default_factory=list)
    obsolete_zones: list[int] = field(default_factory=list)
    garbage_zones: list[int] = field(default_factory=list)


class MetaLog:
    """Append records to, and read them back from, the meta zones."""

    def __init__(self, dev: ZonedDevice, first_zone: int, zone_count: int, fs_uuid: bytes,
                 fs_id: int) -> None:
        self.dev = dev
        self.block_size = dev.info.block_size
        self.zones = list(range(first_zone, first_zone + zone_count))
        self.fs_uuid = fs_uuid
        self.fs_id = fs_id
        self.next_seq = 1
        self.cur_zone: int | None = None
        self.zone_first_seq: dict[int, int] = {}
        self.bytes_written = 0
        #: `bytes_written` plus the unused tail of every zone finished because a
        #: record did not fit in it: what appends took of the meta area.
        self.bytes_consumed = 0
        self._lock = threading.Lock()
        #: Meta zones known EMPTY on the device (see the module docstring).
        self._empty: set[int] = set()
        #: Bytes the zone the log appends to can still take, as of our last write
        #: to it (0 when unknown: a record would then be taken to need a new zone).
        self._cur_room = 0
        report = self.dev.report_zones(first_zone, zone_count)
        self._learn_zones(report)
        self._capacity = {z.index: z.capacity_bytes for z in report}
        usable = [z.capacity_bytes for z in report
                  if z.cond not in (ZoneCond.OFFLINE, ZoneCond.READONLY)]
        #: What the smallest meta zone holds (capacity may be below the zone size):
        #: the unit in which the journal counts meta zones.
        self.zone_capacity_bytes = min(usable, default=dev.info.zone_size_bytes)
        #: The largest JOURNAL / CHECKPOINT_DATA payload that fits in an empty meta
        #: zone after its header, whether compression helps or not.
        self.max_payload_bytes = max(
            self.block_size, self.zone_capacity_bytes - self.block_size - RECORD_HEADER_SIZE)

    def _learn_zones(self, report: list[Zone]) -> None:
        """Take the meta zones' conditions (and the room of the current one) from a report."""
        self._empty = {z.index for z in report if z.cond == ZoneCond.EMPTY}
        cur = self.cur_zone
        self._cur_room = next((z.remaining_bytes for z in report if z.index == cur), 0)

    def capacity_bytes(self, zone: int) -> int:
        """Bytes meta zone `zone` can hold (its capacity, as reported at open); a
        data zone lent to the namespace index (format 6) is asked of the device
        once."""
        cap = self._capacity.get(zone)
        if cap is None:
            cap = self._capacity[zone] = self.dev.report_zones(zone, 1)[0].capacity_bytes
        return cap

    # -- writing ------------------------------------------------------------------
    def _zone(self, idx: int) -> Zone:
        return self.dev.report_zones(idx, 1)[0]

    def free_zones(self) -> list[int]:
        """Meta zones that hold nothing (EMPTY), in order. Memory only: safe on the
        trio thread (membership tests only, as a worker thread may change the
        sets meanwhile)."""
        return [z for z in self.zones if z in self._empty and z not in self.zone_first_seq]

    def free_zone_count(self) -> int:
        """How many meta zones hold nothing (`free_zones`), from memory."""
        return len(self.free_zones())

    def room_in_current_zone(self) -> int:
        """Bytes the zone the log appends to can still take (0 when a record
        would start a new zone). Memory only, as `free_zones`."""
        return 0 if self.cur_zone is None else self._cur_room

    def _start_zone_locked(self) -> int:
        try:
            return self._start_zone_inner_locked()
        except BaseException:
            self._cur_room = 0  # whatever the device holds now: take the zone as full
            raise

    def _start_zone_inner_locked(self) -> int:
        while True:
            free = self.free_zones()
            if not free:
                raise LogFull("no empty meta zone left for the metadata log")
            zone = self._zone(free[0])
            if zone.cond == ZoneCond.EMPTY:
                break
            # Not what we knew (an OFFLINE zone): as the device says, not free.
            self._empty.discard(zone.index)
        if self.cur_zone is not None:
            # What went to the zone we leave must be durable before the next one
            # gets anything: zones persist independently, and a power cut that
            # kept the new zone's header but not the old zone's tail would leave
            # a gap in the chain, which reads as damage in the middle.
            self.dev.flush()
            cur = self._zone(self.cur_zone)
            if cur.cond not in (ZoneCond.FULL, ZoneCond.EMPTY):
                self.dev.finish_zone(self.cur_zone)
        payload = _ZONE_HEADER.pack(self.fs_uuid, zone.index)
        rec = encode_record(RecordType.ZONE_HEADER, self.next_seq, self.fs_id, payload,
                            self.block_size)
        # Not EMPTY any more from the first byte sent, whether the append returns.
        self._empty.discard(zone.index)
        self.dev.append(zone.index, rec)
        self.bytes_written += len(rec)
        self.bytes_consumed += len(rec)
        self.zone_first_seq[zone.index] = self.next_seq
        self.next_seq += 1
        self.cur_zone = zone.index
        self._cur_room = zone.remaining_bytes - len(rec)
        return zone.index

    def append(self, records: list[tuple[RecordType, bytes]], *,
               new_zone: bool = False) -> list[LogPosition]:
        """Append records (not flushed); return where each landed.

        `new_zone` starts a fresh zone first (checkpoints begin in one).
        JOURNAL and CHECKPOINT_DATA payloads are compressed on the way when
        that saves a block (in the caller's thread: a worker's).
        Several records that fit in the current zone go out in one device write.
        """
        with self._lock:
            if new_zone or self.cur_zone is None:
                self._start_zone_locked()
            positions: list[LogPosition] = []
            pending: list[bytes] = []
            pending_len = 0
            assert self.cur_zone is not None
            remaining = self._zone(self.cur_zone).remaining_bytes
            self._cur_room = remaining
            for rtype, payload in records:
                flags = 0
                if rtype in _COMPRESSED:
                    payload, flags = compress_payload(payload, self.block_size)
                rec = encode_record(rtype, self.next_seq, self.fs_id, payload, self.block_size,
                                    flags)
                if len(rec) > remaining - pending_len:
                    self._write_pending_locked(pending, positions)
                    pending, pending_len = [], 0
                    # The zone's tail is given up: part of what this append takes.
                    self.bytes_consumed += self._cur_room
                    self._start_zone_locked()
                    # The zone header took this sequence number: encode again.
                    rec = encode_record(rtype, self.next_seq, self.fs_id, payload,
                                        self.block_size, flags)
                    remaining = self._zone(self.cur_zone).remaining_bytes
                    if len(rec) > remaining:
                        raise LogFull(f"a {len(rec)}-byte record does not fit in a meta zone")
                positions.append(LogPosition(self.cur_zone, -1, self.next_seq))
                self.next_seq += 1
                pending.append(rec)
                pending_len += len(rec)
            self._write_pending_locked(pending, positions)
            return positions

    def _write_pending_locked(self, pending: list[bytes], positions: list[LogPosition]) -> None:
        if not pending:
            return
        data = b"".join(pending)
        assert self.cur_zone is not None
        # What is left once it landed, from now on (the trio thread may ask while
        # it is in flight); unknown after a failed append: as if the zone were full.
        self._cur_room -= len(data)
        try:
            off = self.dev.append(self.cur_zone, data)
        except BaseException:
            self._cur_room = 0
            raise
        self.bytes_written += len(data)
        self.bytes_consumed += len(data)
        # Fill in the offsets of the records written by this call.
        todo = [p for p in positions if p.offset == -1]
        for p, rec in zip(todo, pending, strict=True):
            p.offset = off
            off += len(rec)

    def take_zone(self) -> int:
        """Take an empty meta zone out of the log's pool for another writer (the
        namespace index's pages, format 5); it comes back by `reset_zones`.
        Raises LogFull when none is empty."""
        with self._lock:
            while True:
                free = self.free_zones()
                if not free:
                    raise LogFull("no empty meta zone left for the namespace index")
                zone = self._zone(free[0])
                self._empty.discard(zone.index)
                if zone.cond == ZoneCond.EMPTY:
                    return zone.index

    def reset_zones(self, zones: list[int]) -> None:
        """Reset obsolete meta zones (after the checkpoint that made them so is durable)."""
        with self._lock:
            for z in zones:
                if z == self.cur_zone:
                    continue
                self.dev.reset_zone(z)
                self.zone_first_seq.pop(z, None)
                # Only now: a reset that raised leaves the zone counted as used.
                self._empty.add(z)

    def zones_before(self, seq: int) -> list[int]:
        """Chain zones whose every record precedes `seq` (a checkpoint's first zone seq)."""
        # A copy first (atomic): a commit's worker thread may start a zone meanwhile.
        first_seq = self.zone_first_seq.copy()
        return [z for z, s in first_seq.items() if s < seq and z != self.cur_zone]

    # -- reading ------------------------------------------------------------------
    def _read_zone_header(self, zone: Zone) -> int | None:
        """Return the header seq of a written meta zone, or None if it has no valid header."""
        buf = self.dev.read(zone.start_bytes, self.block_size)
        try:
            rec = decode_record(buf, 0, self.fs_id, self.block_size)
        except RecordError:
            return None
        if rec.type != RecordType.ZONE_HEADER or len(rec.payload) < _ZONE_HEADER.size:
            return None
        fs_uuid, idx = _ZONE_HEADER.unpack_from(rec.payload)
        if fs_uuid != self.fs_uuid or idx != zone.index:
            return None
        return rec.seq

    def scan(self, start: LogPosition, result: ScanResult) -> Iterator[tuple[Record, int]]:
        """Yield (record, absolute offset) from `start` to the end of the chain.

        Fills `result` as it goes (complete once the iterator is exhausted).
        Raises LogCorrupt for damage in the middle of the log.
        """
        report = {z.index: z for z in self.dev.report_zones(self.zones[0], len(self.zones))}
        headers: dict[int, int] = {}
        for idx, z in report.items():
            if z.cond == ZoneCond.OFFLINE:
                raise LogCorrupt(f"meta zone {idx} is OFFLINE")
            if z.written_bytes == 0:
                continue
            seq = self._read_zone_header(z)
            if seq is None:
                result.garbage_zones.append(idx)
            else:
                headers[idx] = seq
        if start.zone not in headers or headers[start.zone] > start.seq:
            raise LogCorrupt(f"the checkpoint zone {start.zone} does not hold seq {start.seq}")
        by_seq = {s: z for z, s in headers.items()}
        zone_idx = start.zone
        pos = start.offset
        expect = start.seq
        self.zone_first_seq = {}
        while True:
            zone = report[zone_idx]
            result.chain_zones.append(zone_idx)
            self.zone_first_seq[zone_idx] = headers[zone_idx]
            end = zone.start_bytes + zone.written_bytes
            torn_at: int | None = None
            if pos == zone.start_bytes:
                expect = headers[zone_idx]
            for rec, off in self._iter_zone(pos, end):
                if rec is None:
                    torn_at = off
                    break
                if rec.seq != expect:
                    raise LogCorrupt(
                        f"meta zone {zone_idx} offset {off}: record seq {rec.seq}, "
                        f"expected {expect}")
                expect += 1
                if rec.type != RecordType.ZONE_HEADER:
                    yield rec, off
            if torn_at is not None:
                self._check_no_valid_after(torn_at, end, expect)
            nxt = by_seq.get(expect)
            if nxt is None:
                result.last_seq = expect - 1
                result.torn_tail = torn_at is not None
                result.append_zone = None if torn_at is not None or zone.remaining_bytes == 0 \
                    else zone_idx
                self.cur_zone = result.append_zone
                self.next_seq = expect
                self._learn_zones(list(report.values()))
                break
            zone_idx = nxt
            pos = report[nxt].start_bytes
        chain = set(result.chain_zones)
        for idx, seq in headers.items():
            if idx in chain:
                continue
            if seq > result.last_seq:
                raise LogCorrupt(
                    f"meta zone {idx} starts at seq {seq}, past the end of the log "
                    f"({result.last_seq}): a record in between is damaged")
            result.obsolete_zones.append(idx)

    def _iter_zone(self, pos: int, end: int) -> Iterator[tuple[Record | None, int]]:
        """Yield (record, offset) from pos to end; (None, offset) at the first bad record."""
        bs = self.block_size
        while pos < end:
            length = min(_READ_CHUNK, end - pos)
            buf = self.dev.read(pos, length)
            off = 0
            while off < len(buf):
                try:
                    rec = decode_record(buf, off, self.fs_id, bs)
                except RecordError:
                    head_len = _record_len_hint(buf, off, bs)
                    if head_len is not None and off + head_len > len(buf) \
                            and pos + off + head_len <= end:
                        # The record spans our read window: read it whole.
                        big = self.dev.read(pos + off, head_len)
                        try:
                            rec = decode_record(big, 0, self.fs_id, bs)
                        except RecordError:
                            yield None, pos + off
                            return
                        yield rec, pos + off
                        off += rec.size_bytes
                        continue
                    yield None, pos + off
                    return
                yield rec, pos + off
                off += rec.size_bytes
            pos += off if off else length

    def _check_no_valid_after(self, torn_at: int, end: int, expect: int) -> None:
        """Raise LogCorrupt if a valid record of this chain lies after a bad one."""
        bs = self.block_size
        pos = torn_at + bs
        while pos < end:
            length = min(_READ_CHUNK, end - pos)
            buf = self.dev.read(pos, length)
            for off in range(0, len(buf), bs):
                try:
                    rec = decode_record(buf, off, self.fs_id, bs)
                except RecordError:
                    continue
                if rec.seq >= expect:
                    raise LogCorrupt(
                        f"damaged metadata record at byte {torn_at} with valid records "
                        f"after it (seq {rec.seq})")
            pos += length


def _record_len_hint(buf: bytes, off: int, bs: int) -> int | None:
    from zonefs_py.format.records import padded_size, peek_header

    head = peek_header(buf, off)
    if head is None:
        return None
    plen = head[3]
    if plen > (64 << 20):
        return None
    return padded_size(plen, bs)
