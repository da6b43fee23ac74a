"""Per-tenant write bandwidth (issue 45): write caps and read shares, work-conserving.

A declared tenant (model/tenants.py) may have a bandwidth policy:

* a **write cap**, absolute (`tenant set DIR --write-mbps X`: X MB/s) or a share
  of the device's write bandwidth (`--write-share PCT`), never both;
* a **read share** (`--read-share PCT`): while the tenant reads, every other
  writer together (other tenants and undeclared files) gets at most
  (100 - PCT)% of the device's write bandwidth.

Both are *work-conserving*: a cap applies only while someone else is busy on the
device (another tenant, or undeclared files, had appends or reads within
`BUSY_S`, or has appends waiting here); a read share only while its tenant
reads (a read in flight in Python, or bytes served within `BUSY_S`, in Python
or by the C data plane). A checkpoint tenant capped at 30% gets the whole
device while the dataset tenant is idle: a cap exists to protect the others,
and idle others need no protection.

Enforcement: `WritePipeline._write_chunk_now` calls `admit(tenant, nbytes)`
before a chunk's append. Each limit that applies is a token bucket kept as a
virtual finishing time (`_Bucket.next_free`; at most `BURST_S` of unused time
banked): the chunk takes its slot in every bucket that applies and waits for
the latest, re-checking every `RECHECK_S` whether the limits still apply (the
others may have gone idle: it then goes at once, and the bucket forgets its
backlog). Buckets: one per capped tenant (its own chunks), one per reading
tenant with a read share (everyone else's chunks).

Never stopped: every limit is at least `MIN_RATE` (1 MB/s), and a chunk waits
at most its size at that rate plus the backlog ahead of it. Flush, fsync and
truncate are *not* exempt (unlike the read-latency gate's `expedited`): with
the kernel's writeback cache nearly every byte of a checkpoint reaches us
through a flush, so an exemption would void the cap. They wait for their own
bytes at their tenant's rate and finish; the wait holds no lock another
tenant's request needs (the file's lock is held only by its own writers).

The device's write bandwidth (what a share is a share of): the highest rate of
file-data appends that landed over a `WINDOW_S` window since mount (all
writers together), or the mount's fixed figure when one is given
(`device_write_bps`). Until a window has been measured a share limits nothing
(there is nothing yet to take a share of; the first window runs at full speed
and measures the device). A capped tenant alone on the device runs at full
speed, so the peak is seen early; the estimate never decreases within a mount.

Figures (`report`): per tenant, its write and read rate over the last window
(bytes/s), bytes written and read, and `throttled_s` (total time its chunks
waited here), for `stat --json`, `tenant list` and Prometheus.

Runs on the trio thread; only `admit` awaits; the bookkeeping is synchronous.

Caveats: the cap paces appends to the device, not write(2): with the writeback
cache the kernel absorbs a burst into the page cache first (at memory speed)
and it reaches the device at the capped rate. The cleaner's copies and the
journal are never paced. Read activity of C-served reads is seen at the data
plane's poll (every 50 ms, dataplane/wiring.py). A file published to the C
read map before its tenant was removed counts its C reads to the old id.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from zonefs_py.model.tenants import TenantTable

#: Window of the rate figures and of the device bandwidth estimate (seconds).
WINDOW_S = 0.5
#: A tenant with appends or reads within this many seconds is busy.
BUSY_S = 0.2
#: How often a waiting chunk checks whether its limits still apply (seconds).
RECHECK_S = 0.05
#: Unused bucket time banked at most (seconds of the bucket's rate).
BURST_S = 0.05
#: No limit goes below this (bytes/s): a capped writer is slowed, never stopped.
MIN_RATE = 1e6


class _TenantSource(Protocol):
    tenants: TenantTable


@dataclass(slots=True)
class TenantFigures:
    """What one tenant did (tenant 0: files of no declared tenant)."""

    written_bytes: int = 0
    read_bytes: int = 0
    write_rate: float = 0.0
    read_rate: float = 0.0
    throttled_s: float = 0.0
    last_write: float = -math.inf
    last_read: float = -math.inf
    reads_in_flight: int = 0
    writes_waiting: int = 0
    #: Totals at the start of the current window.
    written_mark: int = 0
    read_mark: int = 0


@dataclass(slots=True)
class _Bucket:
    #: When the bucket's last slot ends (virtual time, the trio clock).
    next_free: float = -math.inf


class TenantBandwidth:
    """Per-tenant write caps and read shares (the module docstring)."""

    def __init__(self, source: _TenantSource, *, device_write_bps: float = 0.0) -> None:
        self._source = source
        #: The trio clock (a test's MockClock moves it): the buckets sleep on it.
        self._clock: Callable[[], float] = trio.current_time
        #: Fixed device write bandwidth (bytes/s), 0: measured (`device_write_bps`).
        self.fixed_device_bps = device_write_bps
        #: Highest total append rate over a window so far (bytes/s), 0 before one.
        self.peak_write_bps = 0.0
        self.figures: dict[int, TenantFigures] = {}
        self._buckets: dict[tuple[str, int], _Bucket] = {}
        self._window_start = -math.inf
        self._total_written = 0
        self._total_mark = 0
        #: C-served bytes per tenant as last polled (`add_c_reads`).
        self._c_seen: dict[int, int] = {}

    @property
    def device_write_bps(self) -> float:
        """What a share is a share of (bytes/s); 0 while unknown."""
        return self.fixed_device_bps or self.peak_write_bps

    def _fig(self, tid: int) -> TenantFigures:
        f = self.figures.get(tid)
        if f is None:
            f = self.figures[tid] = TenantFigures()
        return f

    # -- activity ----------------------------------------------------------------------
    def wrote(self, tid: int, nbytes: int) -> None:
        """File data of tenant `tid` landed on the device."""
        now = self._clock()
        self._tick(now)
        f = self._fig(tid)
        f.written_bytes += nbytes
        f.last_write = now
        self._total_written += nbytes

    def read_started(self, tid: int) -> None:
        self._fig(tid).reads_in_flight += 1

    def read_done(self, tid: int, nbytes: int) -> None:
        now = self._clock()
        self._tick(now)
        f = self._fig(tid)
        f.reads_in_flight -= 1
        f.read_bytes += nbytes
        f.last_read = now

    def add_c_reads(self, served: dict[int, int]) -> None:
        """Totals of bytes the C data plane served per tenant (since the module loaded)."""
        now = self._clock()
        self._tick(now)
        for tid, total in served.items():
            new = total - self._c_seen.get(tid, 0)
            self._c_seen[tid] = total
            if new > 0:
                f = self._fig(tid)
                f.read_bytes += new
                f.last_read = now

    def busy(self, tid: int, now: float) -> bool:
        """Whether tenant `tid` is using the device (appends or reads, now or lately)."""
        f = self.figures.get(tid)
        return f is not None and (
            f.reads_in_flight > 0 or f.writes_waiting > 0
            or now - max(f.last_write, f.last_read) < BUSY_S)

    def reading(self, tid: int, now: float) -> bool:
        f = self.figures.get(tid)
        return f is not None and (f.reads_in_flight > 0 or now - f.last_read < BUSY_S)

    def _tick(self, now: float) -> None:
        """Close the window if it is over: the rates and the device estimate (no await)."""
        if now < self._window_start + WINDOW_S:
            return
        if self._window_start > -math.inf:
            elapsed = now - self._window_start
            for f in self.figures.values():
                f.write_rate = (f.written_bytes - f.written_mark) / elapsed
                f.read_rate = (f.read_bytes - f.read_mark) / elapsed
                f.written_mark, f.read_mark = f.written_bytes, f.read_bytes
            if elapsed < 2 * WINDOW_S:  # (a longer one holds idle time: no measure)
                total = (self._total_written - self._total_mark) / elapsed
                self.peak_write_bps = max(self.peak_write_bps, total)
        self._total_mark = self._total_written
        self._window_start = now

    # -- the limits -----------------------------------------------------------------------
    def limits(self, tid: int, now: float) -> list[tuple[tuple[str, int], float]]:
        """The buckets a chunk of tenant `tid` passes now, with their rates (bytes/s)."""
        table = self._source.tenants
        if not table:
            return []
        out: list[tuple[tuple[str, int], float]] = []
        dev = self.device_write_bps
        policy = table.get(tid) if tid else None
        if policy is not None and (policy.write_cap_kbs or policy.write_share):
            rate = (policy.write_cap_kbs * 1e3 if policy.write_cap_kbs
                    else policy.write_share / 100 * dev)
            if rate and any(t != tid and self.busy(t, now) for t in self.figures):
                out.append((("cap", tid), max(MIN_RATE, rate)))
        if dev:
            for other, p in table.by_id.items():
                if other != tid and p.read_share and self.reading(other, now):
                    out.append((("read", other), max(MIN_RATE, (100 - p.read_share) / 100 * dev)))
        return out

    async def admit(self, tid: int, nbytes: int) -> None:
        """Wait until `nbytes` of tenant `tid`'s file data may be appended."""
        now = self._clock()
        self._tick(now)
        f = self._fig(tid)
        f.last_write = now
        limits = self.limits(tid, now)
        if not limits:
            return
        mine: dict[tuple[str, int], float] = {}
        for key, rate in limits:
            b = self._buckets.setdefault(key, _Bucket())
            b.next_free = mine[key] = max(b.next_free, now - BURST_S) + nbytes / rate
        slot_end = max(mine.values())
        t0 = now
        f.writes_waiting += 1
        try:
            while now < slot_end:
                await trio.sleep_until(min(slot_end, now + RECHECK_S))
                now = self._clock()
                if now >= slot_end:
                    break
                current = {key for key, _ in self.limits(tid, now)}
                lifted = [key for key in mine if key not in current]
                if lifted:
                    # Whoever this bucket protected went idle: it forgets its
                    # backlog (the others waiting in it see the same at their check).
                    for key in lifted:
                        self._buckets.pop(key, None)
                        del mine[key]
                    slot_end = max(mine.values(), default=now)
        finally:
            f.writes_waiting -= 1
            end = self._clock()
            f.throttled_s += end - t0
            f.last_write = end

    # -- figures ------------------------------------------------------------------------------
    def report(self, tid: int) -> dict[str, Any]:
        """Figures and policy of one declared tenant, for the status document (outside a
        trio run, e.g. an engine used offline: the figures as they stand)."""
        try:
            now: float | None = self._clock()
        except RuntimeError:
            now = None
        if now is not None:
            self._tick(now)
        f = self.figures.get(tid) or TenantFigures()
        policy = self._source.tenants.get(tid)
        dev = self.device_write_bps
        cap = None
        if policy is not None and policy.write_cap_kbs:
            cap = policy.write_cap_kbs * 1e3
        elif policy is not None and policy.write_share and dev:
            cap = policy.write_share / 100 * dev
        return {
            "write_bytes_per_s": round(f.write_rate),
            "read_bytes_per_s": round(f.read_rate),
            "write_cap_bytes_per_s": None if cap is None else round(cap),
            "write_cap_mb_s": None if policy is None or not policy.write_cap_kbs
            else policy.write_cap_kbs / 1e3,
            "write_share_pct": (policy.write_share or None) if policy else None,
            "read_share_pct": (policy.read_share or None) if policy else None,
            "write_capped_now": now is not None and any(
                k == ("cap", tid) for k, _ in self.limits(tid, now)),
            "throttled_seconds": round(f.throttled_s, 3),
            "bytes_read": f.read_bytes,
        }

    def status(self) -> dict[str, Any]:
        """Device-wide: the bandwidth the shares are taken of."""
        return {"device_write_bytes_per_s": round(self.device_write_bps),
                "device_write_measured": not self.fixed_device_bps}
