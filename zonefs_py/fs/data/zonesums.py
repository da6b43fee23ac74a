"""Zone summaries at run time: sealing full zones, and the bounded checksum cache.

`ZoneSealer` writes the summary of a data zone that takes no more data
(format/zonesum.py, docs/DESIGN.md 3.11): it builds the zone's checksums
from the extents that map into it (no await), writes them at the zone's
write pointer from a worker thread, then applies and journals a ZONE_SEAL op,
which drops the checksums of those extents from memory. The next commit
flushes the device before it writes that op (`Allocator.summary_written` tells the journal), so a
ZONE_SEAL is never durable before its summary (INV-23). A crash before the
op is durable leaves an unsealed zone whose checksums are still in the log:
the summary blocks are then dead bytes below the write pointer.

`SumCache` gives reads the checksums of blocks in sealed zones: it reads the
summary blocks they need (and a few after them, for sequential readers) and
keeps decoded blocks in an LRU bounded by `cache_mb=`. A damaged summary
block fails the reads of exactly the data blocks it covers (EIO, a log line
naming the file), never anything else.

Both run on the trio thread; device I/O goes to worker threads or the
io_uring reader. Readers pin the zones they look up (INV-8), so a zone whose
summary is being read is never reset, and a seal (zone, reset count) never
changes under a pinned read.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import trio

from zonefs_py import errors
from zonefs_py.alloc.allocator import Allocator, DataZone
from zonefs_py.device.aread import AsyncReader
from zonefs_py.device.base import ZonedDevice
from zonefs_py.format import zonesum
from zonefs_py.format.constants import OpType
from zonefs_py.fs.lazyio import warm_zone
from zonefs_py.fs.tasks import MountTasks
from zonefs_py.journal.journal import Journal
from zonefs_py.model.state import State

log = logging.getLogger(__name__)

#: Summary blocks read past the last one a read needs (sequential readers then
#: find the next ones cached: 8 blocks of 4 KiB cover ~32 MiB of data).
READ_AHEAD_BLOCKS = 8
#: Per cached block, besides its checksums: the key tuple and the dict's node.
_ENTRY_OVERHEAD = 200


class SummaryDamaged(errors.IOFailure):
    """A summary block failed its checks: the blocks it covers cannot be verified."""


def zone_checksums(state: State, zone: int, data_blocks: int) -> bytearray:
    """The checksums of the zone's first `data_blocks` blocks, in device order, from
    the extents that map them (0 for blocks no extent maps: dead data). No await."""
    bs = state.block_size
    lo = zone * state.zone_size
    out = bytearray(data_blocks * 4)
    for ino in state.zone_owners.get(zone, ()):
        inode = state.inodes.get(ino)
        if inode is None or inode.extents is None:
            continue
        for e in inode.extents:
            if not lo <= e.dev < lo + state.zone_size:
                continue
            if e.csums is None:
                raise errors.CorruptionError(
                    f"inode {ino} has no checksums in zone {zone}, which is not sealed")
            rel = (e.dev - lo) // bs
            if rel + e.nblocks > data_blocks:
                raise errors.CorruptionError(
                    f"inode {ino} maps blocks of zone {zone} past its {data_blocks} data blocks")
            out[rel * 4:(rel + e.nblocks) * 4] = e.csums
    return out


class ZoneSealer:
    """Writes the summaries of zones that take no more data (see the module doc)."""

    def __init__(self, dev: ZonedDevice, state: State, journal: Journal, alloc: Allocator,
                 limiter: trio.CapacityLimiter, tasks: MountTasks) -> None:
        self.dev = dev
        #: The mount's task group: seals and zone finishes run in it.
        self.tasks = tasks
        #: Work started while no mount runs (an engine from ZoneFS.load): run by
        #: `wait_idle`, in order.
        self._deferred: list[Callable[[], Awaitable[None]]] = []
        self.state = state
        self.journal = journal
        self.alloc = alloc
        self.limiter = limiter
        self.bs = dev.info.block_size
        self.sealed = 0
        self.summary_bytes = 0
        self._running = False
        #: Tasks of this sealer still running (`wait_idle`).
        self._tasks = 0
        self._idle = trio.Event()
        self._idle.set()
        #: False: zones are never sealed (tests of the unsealed layout only).
        self.enabled = True
        #: False: queued zones wait until a caller seals them (tests that seal by hand).
        self.automatic = True
        alloc.subscribe_seal_ready(self._kick)

    # -- zones that filled up -----------------------------------------------------
    def _kick(self) -> None:
        if self._running or not self.automatic:
            return
        self._running = True
        self._spawn(self._run_queue, "zonefs-sealer")

    def _spawn(self, fn: Callable[[], Awaitable[None]], name: str) -> None:
        if not self.tasks.is_open:
            self._deferred.append(fn)
            return
        if not self._tasks:
            self._idle = trio.Event()
        self._tasks += 1

        async def task() -> None:
            try:
                await fn()
            finally:
                self._tasks -= 1
                if not self._tasks:
                    self._idle.set()

        self.tasks.start_soon(task, name=name)

    async def _run_queue(self) -> None:
        """Task: seal the queued zones. A failed finish is logged; anything else
        (a bug, Cancelled) gives the queued seals up and propagates."""
        try:
            while self.alloc.seal_queue:
                zone = self.alloc.seal_queue.pop(0)
                try:
                    await self.seal(zone, finish=True)
                except OSError as exc:
                    log.error("finishing data zone %d failed: %s", zone, exc)
        except BaseException:
            for z in self.alloc.seal_queue:
                self.alloc.seal_written(z, ok=False)
            self.alloc.seal_queue.clear()
            raise
        finally:
            self._running = False

    async def wait_idle(self) -> None:
        """Wait until no seal or zone closing of this sealer is left (unmount, tests);
        run the work deferred while no mount ran."""
        while self._deferred:
            await self._deferred.pop(0)()
        while self._tasks:
            await self._idle.wait()

    # -- zones finished early -----------------------------------------------------
    async def close_zones(self, zones: list[int], limiter: trio.CapacityLimiter | None = None
                          ) -> None:
        """Seal (if decided) and finish zones the allocator stopped writing
        (`to_finish`). Raises OSError if a finish fails (as finishing did)."""
        for z in zones:
            if self.alloc.zones[z].seal_at is not None:
                await self.seal(z, finish=True, limiter=limiter)
            else:
                await trio.to_thread.run_sync(self.dev.finish_zone, z,
                                              limiter=limiter or self.limiter)

    def close_zones_later(self, zones: list[int]) -> None:
        """`close_zones` from a task of the mount (callers that cannot await); a failed
        finish is logged; anything else gives the seals up and propagates."""
        if not zones:
            return

        async def run() -> None:
            try:
                await self.close_zones(zones)
            except OSError as exc:
                log.error("finishing zones %s failed: %s", zones, exc)
            except BaseException:
                for z in zones:
                    if self.alloc.zones[z].seal_at is not None:
                        self.alloc.seal_written(z, ok=False)
                raise

        self._spawn(run, "zonefs-close-zones")

    # -- one seal -------------------------------------------------------------------
    async def seal(self, zone: int, finish: bool = False,
                   limiter: trio.CapacityLimiter | None = None) -> None:
        """Write the zone's summary and record the seal; then, with `finish`, finish
        the zone if the summary did not fill it (its active-zone token back),
        while the seal still holds the zone (no reset can come between).

        A failed summary write is logged, not raised (the zone stays unsealed);
        a failed finish raises OSError."""
        dz = self.alloc.zones[zone]
        data_bytes = dz.seal_at
        if data_bytes is None:
            return
        ok = False
        end = data_bytes
        try:
            ok = await self._seal(zone, dz, data_bytes)
            if ok:
                end = zonesum.summary_end(data_bytes // self.bs, self.bs)
            if finish and end < dz.zone_capacity:
                await trio.to_thread.run_sync(self.dev.finish_zone, zone,
                                              limiter=limiter or self.limiter)
        finally:
            self.alloc.seal_written(zone, ok)

    async def _seal(self, zone: int, dz: DataZone, data_bytes: int) -> bool:
        """Write the summary and apply ZONE_SEAL; False if the zone stays unsealed."""
        if not self.enabled or self.state.zone_seals.get(zone) is not None:
            return False
        data_blocks = data_bytes // self.bs
        resets = self.state.zone_info.get(zone, (0, 0, dz.resets))[2]
        await warm_zone(self.state, zone)
        try:
            csums = zone_checksums(self.state, zone, data_blocks)
        except (errors.CorruptionError, errors.IOFailure) as exc:
            # (IOFailure: format 5 reads the zone's owners from the index.)
            log.error("data zone %d not sealed: %s", zone, exc)
            return False
        blob = zonesum.encode(zone, resets, csums, self.bs)
        try:
            await trio.to_thread.run_sync(self.dev.write, dz.start + data_bytes, blob,
                                          limiter=self.limiter)
        except OSError as exc:
            log.error("writing the summary of data zone %d failed (%s); its checksums "
                      "stay in the metadata", zone, exc)
            return False
        self.alloc.summary_written(zone)  # the summary is flushed before the op
        op = (OpType.ZONE_SEAL, zone, resets, data_blocks)
        self.state.apply(op)
        self.journal.add([op])
        self.sealed += 1
        self.summary_bytes += len(blob)
        return True


class SumCache:
    """Checksums of blocks in sealed zones, read from their summaries on demand."""

    def __init__(self, dev: ZonedDevice, state: State, limiter: trio.CapacityLimiter,
                 cache_bytes: int, path_of: Callable[[int], str], *,
                 reader: AsyncReader | None = None) -> None:
        self.dev = dev
        self.state = state
        self.limiter = limiter
        self.bs = dev.info.block_size
        self.per_block = zonesum.per_block(self.bs)
        self.cache_bytes = cache_bytes
        self.path_of = path_of
        #: Thread-free reads (io_uring) when the device allows, else None.
        self.reader = reader
        #: (zone, resets, summary block) -> its checksums, least recently used first.
        self._lru: OrderedDict[tuple[int, int, int], bytes] = OrderedDict()
        #: zone -> its keys in the LRU (a reset drops them: `forget_zone`).
        self._by_zone: dict[int, set[tuple[int, int, int]]] = {}
        #: Summary blocks being read now -> set when that read ends (either way).
        self._loading: dict[tuple[int, int, int], trio.Event] = {}
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0
        self.blocks_read = 0
        self.damaged = 0

    def _put(self, key: tuple[int, int, int], csums: bytes) -> None:
        if key in self._lru:
            return
        self._lru[key] = csums
        self._by_zone.setdefault(key[0], set()).add(key)
        self.used_bytes += len(csums) + _ENTRY_OVERHEAD
        while self.used_bytes > self.cache_bytes and len(self._lru) > 1:
            old_key, old = self._lru.popitem(last=False)
            self.used_bytes -= len(old) + _ENTRY_OVERHEAD
            keys = self._by_zone[old_key[0]]
            keys.discard(old_key)
            if not keys:
                del self._by_zone[old_key[0]]

    def forget_zone(self, zone: int) -> None:
        """Drop the cached checksums of `zone`, which is being reset (INV-8: dead, unpinned).

        Its summary is gone, and its next seal has a new reset count, so they
        can never be looked up again. Left in the LRU they would only age out:
        under steady rewrites (checkpoint rotation) the cache filled with them
        up to `cache_mb=` (256 MiB by default), which the soak saw as the
        daemon's memory growing by ~25 MiB every 2 minutes.
        """
        for key in self._by_zone.pop(zone, ()):
            self.used_bytes -= len(self._lru.pop(key)) + _ENTRY_OVERHEAD

    def clear(self) -> None:
        self._lru.clear()
        self._by_zone.clear()
        self.used_bytes = 0

    async def _read(self, off: int, nbytes: int) -> bytes | memoryview:
        if self.reader is not None and self.reader.uses_ring:
            return await self.reader.read(off, nbytes)
        return await trio.to_thread.run_sync(self.dev.read, off, nbytes, limiter=self.limiter)

    def _sealed(self, dev_off: int, nblocks: int) -> tuple[int, int, int, int] | None:
        """(zone, resets, data blocks, first block in the zone) of `nblocks` blocks at
        `dev_off`, or None when no summary of their zone holds them."""
        zsize = self.state.zone_size
        zone = dev_off // zsize
        seal = self.state.zone_seals.get(zone)
        rel = (dev_off - zone * zsize) // self.bs
        if seal is None or rel + nblocks > seal[1]:
            return None
        return zone, seal[0], seal[1], rel

    def cached(self, dev_off: int, nblocks: int) -> bytes | None:
        """The checksums of `nblocks` blocks at `dev_off` in a sealed zone when every
        summary block holding them is cached, else None (no await, no log line: the
        caller then takes `checksums`, which reads, reports and counts)."""
        where = self._sealed(dev_off, nblocks)
        if where is None:
            return None
        zone, resets, _data_blocks, rel = where
        p = self.per_block
        k0 = rel // p
        if (rel + nblocks - 1) // p == k0:
            key = (zone, resets, k0)
            csums = self._lru.get(key)
            if csums is None:
                return None
            self._lru.move_to_end(key)
            self.hits += 1
            a = rel - k0 * p
            return csums[a * 4:(a + nblocks) * 4]
        parts: list[bytes] = []
        for k, a, b in zonesum.covering(rel, nblocks, self.bs):
            csums = self._lru.get((zone, resets, k))
            if csums is None:
                return None
            parts.append(csums[a * 4:b * 4])
        for k in range(k0, (rel + nblocks - 1) // p + 1):
            self._lru.move_to_end((zone, resets, k))
        self.hits += 1
        return b"".join(parts)

    async def checksums(self, ino: int, fblock: int, dev_off: int, nblocks: int) -> bytes:
        """The checksums of `nblocks` blocks at `dev_off`, in a sealed zone the caller
        has pinned. Raises SummaryDamaged (a log line names the file and offset) if
        a summary block they need is damaged, errors.IOFailure on a read error."""
        bs = self.bs
        zsize = self.state.zone_size
        where = self._sealed(dev_off, nblocks)
        if where is None:
            log.error("internal error in %s at file offset %d: no summary holds the "
                      "checksums of device offset %d", self.path_of(ino), fblock * bs, dev_off)
            raise errors.IOFailure(f"inconsistent mapping at file offset {fblock * bs}")
        zone, resets, data_blocks, rel = where
        p = self.per_block
        k0, k1 = rel // p, (rel + nblocks - 1) // p
        got: dict[int, bytes | None] = {}
        missing: list[int] = []
        while True:
            got.clear()
            missing.clear()
            for k in range(k0, k1 + 1):
                cached = self._lru.get((zone, resets, k))
                if cached is None:
                    missing.append(k)
                else:
                    self._lru.move_to_end((zone, resets, k))
                    got[k] = cached
            # Another read is loading the first block this one misses (read-ahead
            # segments of one file run concurrently): wait for it, then look again.
            pending = self._loading.get((zone, resets, missing[0])) if missing else None
            if pending is None:
                break
            await pending.wait()
        if missing:
            self.misses += 1
            first = missing[0]
            last = min(missing[-1] + READ_AHEAD_BLOCKS, zonesum.sum_blocks(data_blocks, bs) - 1)
            base = zone * zsize + data_blocks * bs
            loading = trio.Event()
            keys = [(zone, resets, k) for k in range(first, last + 1)
                    if (zone, resets, k) not in self._loading]
            for key in keys:
                self._loading[key] = loading
            try:
                raw = await self._read(base + first * bs, (last - first + 1) * bs)
            except OSError as exc:
                log.error("read error in the summary of zone %d (for %s at file offset %d): %s",
                          zone, self.path_of(ino), fblock * bs, exc)
                raise errors.IOFailure(f"device read failed: {exc}") from exc
            finally:
                for key in keys:
                    del self._loading[key]
                loading.set()
            self.blocks_read += last - first + 1
            mv = memoryview(raw)
            for k in range(first, last + 1):
                csums = zonesum.decode_block(mv[(k - first) * bs:(k - first + 1) * bs], zone,
                                             resets, k, data_blocks)
                if k0 <= k <= k1:
                    got[k] = csums
                if csums is not None:
                    self._put((zone, resets, k), csums)
        else:
            self.hits += 1
        parts: list[bytes] = []
        for k, a, b in zonesum.covering(rel, nblocks, bs):
            csums = got.get(k)
            if csums is None:
                self.damaged += 1
                file_off = (fblock + k * p + a - rel) * bs
                log.error("damaged checksum block in %s: file offsets %d to %d cannot be "
                          "verified (summary block %d of zone %d, device offset %d)",
                          self.path_of(ino), file_off, (fblock + k * p + b - rel) * bs, k,
                          zone, zone * zsize + (data_blocks + k) * bs)
                raise SummaryDamaged(f"damaged checksum block for file offset {file_off}")
            parts.append(csums[a * 4:b * 4])
        return parts[0] if len(parts) == 1 else b"".join(parts)
