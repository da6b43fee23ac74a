"""How fast the drainer may go: it yields to user writes, passes the read-QoS
gate, and keeps to the `drain_rate=` token bucket (drainer.py uses one
`DrainPacer` for every file in flight, so the limits hold for all together).
"""

from __future__ import annotations

import math

import trio

from zonefs_py.drain.manager import DrainManager

#: The drainer reads the next part only once user writes paused this long...
WRITER_IDLE_S = 0.2
#: ...or it waited this long (a writer that never pauses does not stop the drain).
WRITER_WAIT_S = 5.0


class DrainPacer:
    """The drainer's waits before it reads file data and before it sends a part."""

    def __init__(self, manager: DrainManager) -> None:
        self.m = manager
        #: trio time the upload token bucket is free again (`drain_rate=`).
        self._next_free = 0.0
        #: trio time the drain's read-QoS bucket is free again (`drain_rate_reads=`).
        self._qos_next = 0.0

    async def before_read(self, nbytes: int) -> None:
        """Wait until user writes pause, then for the read-QoS gate."""
        await self.yield_to_writers()
        await self.admit_read(nbytes)

    async def yield_to_writers(self) -> None:
        """Wait (at most WRITER_WAIT_S) until no user write came for WRITER_IDLE_S: a
        checkpoint burst is absorbed at device speed first, drained in the gaps."""
        deadline = trio.current_time() + WRITER_WAIT_S
        while True:
            now = trio.current_time()
            quiet_at = self.m.last_write + WRITER_IDLE_S
            if quiet_at <= now or now >= deadline:
                return
            await trio.sleep(min(quiet_at, deadline) - now)

    async def admit_read(self, nbytes: int) -> None:
        """The read-QoS rule (fs/data/qos.py) with a bucket of the drainer's own: while
        training reads are served, drain reads pass at `drain_rate_reads=` (MB/s,
        all files together), or at the read-latency controller's current write
        allowance when it limits writers and that is lower. Sharing the appends'
        bucket halved a checkpoint writer's speed (measured); without a rate of
        its own while reads ran, a drain that keeps up doubled the reader's p99
        (DESIGN 6.5: the controller's allowance stays unlimited without appends)."""
        qos = self.m.host.qos
        now = trio.current_time()
        rate = min(qos.allowance, self.m.rate_reads_bytes_s or math.inf)
        if not qos.enabled or rate == math.inf or not qos.reads_active(now):
            self._qos_next = now
            return
        self._qos_next = max(self._qos_next, now - 0.05) + nbytes / rate
        wait = self._qos_next - now
        if wait > 0:
            await trio.sleep(wait)

    async def before_upload(self, nbytes: int) -> None:
        """Token bucket of `drain_rate` bytes/s (at most one part of burst)."""
        rate = self.m.rate_bytes_s
        if rate <= 0:
            return
        now = trio.current_time()
        self._next_free = max(self._next_free, now) + nbytes / rate
        wait = self._next_free - now - nbytes / rate
        if wait > 0:
            await trio.sleep(wait)
