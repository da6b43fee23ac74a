"""Appends at a zone's write pointer enter the device in the order they were reserved.

Without zone append a device places an append at the zone's write pointer,
under the zone's lock, in whatever order the worker threads reach that lock.
A file has up to `MAX_INFLIGHT` chunks in flight, each in its own thread,
and which thread finishes its checksums first is the scheduler's choice: a
file's 1 MiB chunks landed in a shuffled order, so consecutive file blocks
were not consecutive on the device and never merged into one extent. Five
2 GiB files written in 1 MiB writes through the engine left 7,603-8,414
extents over the runs measured (of 10,240 chunks) where 40 would do (one
per file per 256 MiB zone), each ~200 bytes of memory plus its own checksum
object, and an EXTENT op per extent in every checkpoint.

`AppendOrder` hands out a ticket per zone when a piece is reserved (on the
trio thread, in carve order), and a worker waits, after its checksums and
before the device call, until the tickets before its own are done. The wait
is bounded (`WAIT_S`): order is only a preference, never a dependency, so a
ticket whose thread never runs (its task was cancelled) or a slow thread
costs the next ones at most that long, and nothing can deadlock on it (a
waiting thread holds a slot of the append limiter; the ticket it waits for
may still be queued for one). Appends to one zone were already serialised
by the zone lock, so waiting costs no device concurrency. Devices with zone
append place slices themselves (scattered on purpose by the emulator) and
take no tickets.
"""

from __future__ import annotations

import threading
import time

#: Longest a worker waits for the appends reserved before its own.
WAIT_S = 0.05


class AppendOrder:
    """Per-zone tickets: `ticket` on the trio thread, `wait` and `done` anywhere."""

    def __init__(self, wait_s: float = WAIT_S) -> None:
        self._cond = threading.Condition()
        #: zone -> next ticket to hand out; zone -> first ticket not yet done
        #: (absent when every ticket of the zone is done).
        self._next: dict[int, int] = {}
        self._serving: dict[int, int] = {}
        self.wait_s = wait_s
        #: Waits that ran out (the order was given up once): a figure for tests.
        self.timeouts = 0

    def ticket(self, zone: int) -> int:
        with self._cond:
            # Tickets only grow (one int per zone ever written): a late `done` of
            # an old ticket can never be taken for one handed out since.
            t = self._next.get(zone, 0)
            self._next[zone] = t + 1
            self._serving.setdefault(zone, t)
            return t

    def wait(self, zone: int, ticket: int) -> None:
        """Block until every earlier ticket of `zone` is done, or `wait_s` passed."""
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            while self._serving.get(zone, ticket) < ticket:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.timeouts += 1
                    return
                self._cond.wait(left)

    def done(self, zone: int, ticket: int) -> None:
        """Mark `ticket` done (idempotent, and a no-op once a later one is done)."""
        with self._cond:
            serving = self._serving.get(zone)
            if serving is None or serving > ticket:
                return
            serving = ticket + 1
            if serving >= self._next[zone]:
                del self._serving[zone]
            else:
                self._serving[zone] = serving
            self._cond.notify_all()

    def pending_zones(self) -> int:
        """Zones with tickets handed out and not all done."""
        with self._cond:
            return len(self._serving)
