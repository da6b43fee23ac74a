"""The rolling superblock in two zones (blocking; call from worker threads).

Each superblock write appends one SUPERBLOCK record to the current superblock
zone. When that zone is full, the other zone is reset and the record goes
there; until the new zone has a valid record the old zone still holds the
previous one, so there is always a valid superblock (INV-1). On read, the
valid record with the highest sequence number in either zone wins; torn or
foreign records are skipped.
"""

from __future__ import annotations

import threading

from zonefs_py.device.base import ZoneCond, ZonedDevice
from zonefs_py.format.constants import RecordType
from zonefs_py.format.records import RecordError, decode_record, encode_record, padded_size
from zonefs_py.format.superblock import Superblock, SuperblockError

#: Read the superblock zones in pieces of this size.
_READ_CHUNK = 1 << 20


class SuperblockStore:
    """Write and find superblocks in zones `sb_zone_a` and `sb_zone_b`."""

    def __init__(self, dev: ZonedDevice, zone_a: int, zone_b: int) -> None:
        #: Why read_latest() refused a well-formed superblock record (None: it did not).
        self.refusal: str | None = None
        self.dev = dev
        self.zones = (zone_a, zone_b)
        self.seq = 0
        self.current_zone = zone_a
        self.bytes_written = 0
        self._lock = threading.Lock()

    def read_latest(self) -> Superblock | None:
        """Return the newest valid superblock, or None if there is none (then
        `refusal` says why a well-formed record was refused, e.g. another format
        version, if one was met)."""
        self.refusal = None
        best: tuple[int, int, Superblock] | None = None
        bs = self.dev.info.block_size
        for zone in self.dev.report_zones(self.zones[0], 1) + self.dev.report_zones(
                self.zones[1], 1):
            if zone.cond in (ZoneCond.EMPTY, ZoneCond.OFFLINE):
                continue
            end = zone.start_bytes + zone.written_bytes
            pos = zone.start_bytes
            while pos < end:
                length = min(_READ_CHUNK, end - pos)
                buf = self.dev.read(pos, length)
                off = 0
                while off < len(buf):
                    try:
                        rec = decode_record(buf, off, None, bs)
                    except RecordError:
                        off += bs
                        continue
                    if rec.type == RecordType.SUPERBLOCK:
                        try:
                            sb = Superblock.decode(rec.payload)
                        except SuperblockError as exc:
                            sb = None
                            self.refusal = str(exc)
                        if sb is not None and (best is None or rec.seq > best[0]):
                            best = (rec.seq, zone.index, sb)
                    off += rec.size_bytes
                pos += length
        if best is None:
            return None
        self.seq, self.current_zone, sb = best
        return sb

    def write(self, sb: Superblock) -> None:
        """Append a new superblock record (durable when this returns)."""
        with self._lock:
            bs = self.dev.info.block_size
            payload = sb.encode()
            need = padded_size(len(payload), bs)
            zone = self.dev.report_zones(self.current_zone, 1)[0]
            if zone.remaining_bytes < need:
                other = self.zones[1] if self.current_zone == self.zones[0] else self.zones[0]
                self.dev.reset_zone(other)
                self.current_zone = other
            self.seq += 1
            rec = encode_record(RecordType.SUPERBLOCK, self.seq, sb.fs_id, payload, bs)
            self.dev.append(self.current_zone, rec)
            self.dev.flush()
            self.bytes_written += len(rec)
