"""The zone state machine of the emulator, after Linux null_blk (drivers/block/null_blk/zoned.c).

`ZoneStates` holds every zone's write pointer and condition plus the open /
active counters, and implements the transitions the kernel allows, with the
kernel's errors (as `OSError`):

  * EIO       -- write off the write pointer, past the zone capacity, into a
                 FULL / READONLY / OFFLINE zone; zone append or a zone
                 management command on a conventional zone; close of an EMPTY
                 or FULL zone; open of a FULL zone; any command on a READONLY
                 or OFFLINE zone.
  * ETOOMANYREFS -- BLK_STS_ZONE_OPEN_RESOURCE (max open zones reached and no
                 implicitly open zone can be closed to make room).
  * EOVERFLOW -- BLK_STS_ZONE_ACTIVE_RESOURCE (max active zones reached).

No-ops, as in null_blk: reset of EMPTY, open of EXPLICIT_OPEN, close of
CLOSED, finish of FULL.

Not thread-safe by itself: the device calls every method with its state lock
held, and never across I/O (no blocking call happens in here).

Caveats:
  * When max open is reached, null_blk closes an implicitly open zone
    round-robin; this model skips zones with a write in flight (null_blk
    does not, and can then leave an EMPTY zone with a moved write pointer).
  * READONLY / OFFLINE zones keep reporting their last write pointer; the
    kernel reports an invalid one. Reads of a READONLY zone return its data.
"""

from __future__ import annotations

import errno

from zonefs_py.device.base import OPEN_CONDS, Zone, ZoneCond, ZoneType
from zonefs_py.device.emu_format import Geometry, TableEntry

_C = ZoneCond
_BAD = (_C.READONLY, _C.OFFLINE)


def _eio(msg: str) -> OSError:
    return OSError(errno.EIO, msg)


class ZoneStates:
    """Per-zone write pointers and conditions with null_blk's transition rules."""

    def __init__(self, geo: Geometry, entries: list[TableEntry]) -> None:
        """Load persisted entries as a device does at power-on.

        Open zones come back CLOSED (or EMPTY when nothing was written), as
        open zones of an NVMe ZNS drive do after a power cycle.
        """
        self.geo = geo
        self.cap = geo.zone_capacity_bytes
        self.wp_rel: list[int] = []
        self.data_end: list[int] = []
        self.cond: list[ZoneCond] = []
        self.resets: list[int] = []
        self.inflight = [False] * geo.nr_zones
        #: Zone appends reserved (write pointer advanced) but not yet completed.
        self.appends_inflight = [0] * geo.nr_zones
        self.nr_imp_open = self.nr_exp_open = self.nr_closed = 0
        self.imp_close_zone_no = geo.nr_conventional
        for idx, entry in enumerate(entries):
            cond = entry.cond
            if idx < geo.nr_conventional:
                cond = _C.NOT_WP
            elif cond not in (_C.FULL, *_BAD):
                if entry.wp_rel_bytes == 0:
                    cond = _C.EMPTY
                elif entry.wp_rel_bytes >= self.cap:
                    cond = _C.FULL
                else:
                    cond = _C.CLOSED
                    self.nr_closed += 1
            self.wp_rel.append(entry.wp_rel_bytes)
            self.data_end.append(entry.data_end_rel_bytes)
            self.cond.append(cond)
            self.resets.append(entry.reset_count)

    @staticmethod
    def fresh_entries(geo: Geometry) -> list[TableEntry]:
        """Return the table of a newly created device (all sequential zones EMPTY)."""
        conv = TableEntry(geo.zone_size_bytes, geo.zone_size_bytes, _C.NOT_WP)
        seq = TableEntry(0, 0, _C.EMPTY)
        return [conv if i < geo.nr_conventional else seq for i in range(geo.nr_zones)]

    # -- reporting -------------------------------------------------------------

    def entry(self, idx: int) -> TableEntry:
        return TableEntry(self.wp_rel[idx], self.data_end[idx], self.cond[idx], self.resets[idx])

    def zone(self, idx: int) -> Zone:
        geo = self.geo
        start = idx * geo.zone_size_bytes
        conventional = idx < geo.nr_conventional
        return Zone(
            index=idx,
            start_bytes=start,
            size_bytes=geo.zone_size_bytes,
            capacity_bytes=geo.zone_size_bytes if conventional else self.cap,
            wp_bytes=start + self.wp_rel[idx],
            type=ZoneType.CONVENTIONAL if conventional else ZoneType.SEQ_WRITE_REQUIRED,
            cond=self.cond[idx],
        )

    # -- resources (null_check_active / null_check_open) ------------------------

    def _check_active(self) -> bool:
        limit = self.geo.max_active
        return not limit or self.nr_exp_open + self.nr_imp_open + self.nr_closed < limit

    def _check_open(self) -> None:
        limit = self.geo.max_open
        if not limit or self.nr_exp_open + self.nr_imp_open < limit:
            return
        if self.nr_imp_open and self._check_active() and self._close_imp_open_zone():
            return
        raise OSError(errno.ETOOMANYREFS, "max open zones reached")

    def _check_resources(self, idx: int) -> None:
        if self.cond[idx] is _C.EMPTY and not self._check_active():
            raise OSError(errno.EOVERFLOW, "max active zones reached")
        self._check_open()

    def _close_imp_open_zone(self) -> bool:
        first, nr = self.geo.nr_conventional, self.geo.nr_zones
        zno = self.imp_close_zone_no if self.imp_close_zone_no < nr else first
        for _ in range(first, nr):
            idx = zno
            zno = zno + 1 if zno + 1 < nr else first
            if (self.cond[idx] is _C.IMPLICIT_OPEN and not self.inflight[idx]
                    and not self.appends_inflight[idx]):
                self._close(idx)
                self.imp_close_zone_no = zno
                return True
        return False

    def _drop_counts(self, idx: int) -> None:
        cond = self.cond[idx]
        if cond is _C.IMPLICIT_OPEN:
            self.nr_imp_open -= 1
        elif cond is _C.EXPLICIT_OPEN:
            self.nr_exp_open -= 1
        elif cond is _C.CLOSED:
            self.nr_closed -= 1

    def _close(self, idx: int) -> None:
        self._drop_counts(idx)
        if self.wp_rel[idx] == 0:
            self.cond[idx] = _C.EMPTY
        else:
            self.cond[idx] = _C.CLOSED
            self.nr_closed += 1

    # -- writes (null_zone_write) -------------------------------------------------

    def begin_write(self, idx: int, expected_rel: int | None, length_bytes: int) -> int:
        """Check a write of `length_bytes` and open the zone; return the relative offset.

        `expected_rel=None` is a zone append (lands at the write pointer).
        The caller must hold the zone's write lock until `end_write` or
        `abort_write`. Raises OSError (EIO, ETOOMANYREFS, EOVERFLOW).
        """
        cond = self.cond[idx]
        if cond in (_C.FULL, *_BAD):
            raise _eio(f"zone {idx} is {cond.name}")
        wp = self.wp_rel[idx]
        if expected_rel is not None and expected_rel != wp:
            raise _eio(f"write at {expected_rel} of zone {idx} is not at its write pointer {wp}")
        if wp + length_bytes > self.cap:
            raise _eio(f"write of {length_bytes} bytes at {wp} overflows zone {idx} capacity")
        if cond in (_C.EMPTY, _C.CLOSED):
            self._check_resources(idx)
            if cond is _C.CLOSED:
                self.nr_closed -= 1
            self.nr_imp_open += 1
            self.cond[idx] = _C.IMPLICIT_OPEN
        self.inflight[idx] = True
        return wp

    def end_write(self, idx: int, length_bytes: int) -> None:
        """Advance the write pointer after the data reached the image."""
        self.inflight[idx] = False
        self.wp_rel[idx] += length_bytes
        self.data_end[idx] = self.wp_rel[idx]
        if self.wp_rel[idx] == self.cap and self.cond[idx] not in _BAD:
            self._drop_counts(idx)
            self.cond[idx] = _C.FULL

    def abort_write(self, idx: int) -> None:
        """Forget an in-flight write whose data I/O failed (the zone stays open)."""
        self.inflight[idx] = False

    def reserve_append(self, idx: int, length_bytes: int) -> int:
        """Place a zone append as a ZNS drive does: check it, move the write pointer
        past it now (FULL at capacity), return its relative offset. The data is
        written afterwards, concurrently with other appends; `end_append` records
        it. Raises OSError like `begin_write`."""
        rel = self.begin_write(idx, None, length_bytes)
        self.inflight[idx] = False
        self.appends_inflight[idx] += 1
        self.wp_rel[idx] += length_bytes
        if self.wp_rel[idx] == self.cap and self.cond[idx] not in _BAD:
            self._drop_counts(idx)
            self.cond[idx] = _C.FULL
        return rel

    def end_append(self, idx: int, rel: int, length_bytes: int, ok: bool) -> None:
        """Record a reserved append as done (ok: its data reached the image)."""
        self.appends_inflight[idx] -= 1
        if ok:
            self.data_end[idx] = max(self.data_end[idx], rel + length_bytes)

    # -- zone management (null_zone_mgmt) ----------------------------------------

    def _mgmt_target(self, idx: int, what: str) -> ZoneCond:
        if idx < self.geo.nr_conventional:
            raise _eio(f"{what} of conventional zone {idx}")
        cond = self.cond[idx]
        if cond in _BAD:
            raise _eio(f"{what} of {cond.name} zone {idx}")
        return cond

    def reset(self, idx: int) -> bool:
        """Reset the zone to EMPTY; return False for the no-op on an EMPTY zone."""
        if self._mgmt_target(idx, "reset") is _C.EMPTY:
            return False
        self._drop_counts(idx)
        self.cond[idx] = _C.EMPTY
        self.wp_rel[idx] = self.data_end[idx] = 0
        self.resets[idx] += 1
        return True

    def open(self, idx: int) -> bool:
        """Open the zone explicitly; return False for the no-op on EXPLICIT_OPEN."""
        cond = self._mgmt_target(idx, "open")
        if cond is _C.EXPLICIT_OPEN:
            return False
        if cond is _C.FULL:
            raise _eio(f"open of FULL zone {idx}")
        if cond in (_C.EMPTY, _C.CLOSED):
            self._check_resources(idx)
        self._drop_counts(idx)
        self.cond[idx] = _C.EXPLICIT_OPEN
        self.nr_exp_open += 1
        return True

    def close(self, idx: int) -> bool:
        """Close an open zone; return False for the no-op on CLOSED."""
        cond = self._mgmt_target(idx, "close")
        if cond is _C.CLOSED:
            return False
        if cond not in OPEN_CONDS:
            raise _eio(f"close of {cond.name} zone {idx}")
        self._close(idx)
        return True

    def finish(self, idx: int) -> bool:
        """Move the zone to FULL; return False for the no-op on FULL."""
        cond = self._mgmt_target(idx, "finish")
        if cond is _C.FULL:
            return False
        if cond in (_C.EMPTY, _C.CLOSED):
            self._check_resources(idx)
        self._drop_counts(idx)
        self.cond[idx] = _C.FULL
        self.wp_rel[idx] = self.geo.zone_size_bytes
        return True

    def set_bad(self, idx: int, cond: ZoneCond) -> None:
        """Turn the zone READONLY or OFFLINE; the same condition again restores EMPTY.

        Raises ValueError for a conventional zone (null_blk refuses it too).
        """
        if idx < self.geo.nr_conventional:
            raise ValueError(f"cannot change the condition of conventional zone {idx}")
        if self.cond[idx] is cond:
            self.cond[idx] = _C.EMPTY
            self.wp_rel[idx] = self.data_end[idx] = 0
            return
        self._drop_counts(idx)
        self.cond[idx] = cond
        self.wp_rel[idx] = self.data_end[idx]
