"""The emulator's model of zone append.

Zone append (`zone_append=True`, what `open_device` gives with
`zone_append=on`): an append is placed as a ZNS drive places a Zone Append
-- under the zone lock only long enough to move the write pointer past it --
and its data is written after the lock is released, so several appends to
one zone are in flight at once and complete in any order, each returning
where it landed (`info.zone_append` is true). A flush then records write
pointers that may cover appends still in flight: after a crash their blocks
hold whatever the image held there (EMU-1 holds for acknowledged appends
only), as on a drive. Without it, an append is a write at the write pointer
under the zone lock (one in flight per zone), as null_blk behaves.
"""

from __future__ import annotations

from zonefs_py.device.emu_discard import EmuDiscard
from zonefs_py.device.emu_io import Buffer

#: Slice size of `append_scattered` in zone-append mode (QEMU's NVMe with zasl=5).
SCATTER_PIECE_BYTES = 128 << 10


class EmuZoneAppend(EmuDiscard):
    """Zone appends placed under the zone lock and written outside it (module docstring)."""

    def _zone_append_write(self, zone_idx: int, data: Buffer, length: int) -> int:
        """Place the append under the zone lock, write it outside (module doc)."""
        start = zone_idx << self._zone_shift
        ok = False
        with self._zone_locks[zone_idx]:
            if self.faults.io_armed:  # where it would land: nothing moves if it fails
                self.faults.check_write(start + self._zones.wp_rel[zone_idx], length)
            with self._state_lock:
                self._check_alive()
                rel = self._zones.reserve_append(zone_idx, length)
            try:
                discards = self._claim_range_zl(zone_idx, rel, length)
            except BaseException:
                with self._state_lock:
                    self._zones.end_append(zone_idx, rel, length, False)
                raise
        try:
            self._check_alive()
            self._store(zone_idx, start + rel, data, discards)
            ok = True
        finally:
            with self._state_lock:
                self._zones.end_append(zone_idx, rel, length, ok)
                if ok:
                    self._count_write_locked()
        return start + rel
