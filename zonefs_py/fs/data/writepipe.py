"""The write pipeline: chunks to zones, their EXTENT ops applied in carve order.

A chunk (a carved piece of a file's buffer, `fs/data/writestate.py`) is reserved
in zones, checksummed and appended in one worker thread (C, GIL released),
then described by EXTENT ops that are applied after its predecessor's, so a
later write of the same blocks always wins. Until its ops are applied a
chunk stays readable from the file's in-flight list.

Pipelining: a full chunk carved from a streaming buffer is written by a
task of the mount (fs/tasks.py) while the writer goes on filling the next one (at most
`MAX_INFLIGHT` chunks per file). fsync, close, truncate and non-sequential
writes drain the file's in-flight chunks first (`FileWrites.drain`); a chunk
that could not be written makes the next flush/fsync of that file fail with
EIO.

Appends pass their tenant's bandwidth limits (`fs/data/tenantqos.py`: a write
cap, others' read shares; work-conserving, never bypassed, never stopping a
writer), then the read-latency controller (`fs/data/qos.py`); the appends of
a file being flushed, fsynced or truncated pass the latter at once.

Zone append: on a device with `info.zone_append`, a chunk goes out through
`append_scattered` as several appends in flight at once (NVMe Zone Append:
128 KiB each on QEMU), which land wherever the device puts them; each landed
slice gets its own EXTENT op at its returned address (device-contiguous
slices merged). docs/DESIGN.md "Zone append" has the crash argument.
Appends at the write pointer go to the device in reservation order
(`fs/data/append_order.py`), so a sequential file is one extent per zone.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import NamedTuple

import trio

from zonefs_py import errors
from zonefs_py.alloc.allocator import Allocator, NeedCleaning
from zonefs_py.alloc.streams import classify_stream
from zonefs_py.device.base import ZonedDevice, capabilities
from zonefs_py.format.checksum import block_checksums
from zonefs_py.format.constants import (
    C_DATA_BYTES,
    C_STREAM_BASE,
    C_TENANT_USER_BASE,
    FLAG_STREAM_SET,
    OpType,
    Stream,
)
from zonefs_py.format.ops import Op
from zonefs_py.fs.data.append_order import AppendOrder
from zonefs_py.fs.data.writestate import Chunk, FileWrites
from zonefs_py.fs.data.zonesums import ZoneSealer
from zonefs_py.fs.lazyio import warm_zone_owners
from zonefs_py.fs.tasks import MountTasks
from zonefs_py.journal.journal import Journal
from zonefs_py.model.state import Inode, State
from zonefs_py.model.tenants import tenant_of

log = logging.getLogger(__name__)

#: Chunks of one file in flight at once.
MAX_INFLIGHT = 4
#: Zone of a placed EXTENT op that is not its append's first slice (no in-flight mark).
NO_ZONE = -1


class _Reserved(NamedTuple):
    """A piece of a chunk reserved in a zone and not yet appended."""

    zone: int
    granted: int
    #: `AppendOrder` ticket, -1 without (zone append devices).
    ticket: int


class WritePipeline:
    """Appends file data to zones and applies what landed (module docstring)."""

    def __init__(self, dev: ZonedDevice, state: State, journal: Journal, alloc: Allocator,
                 limiter: trio.CapacityLimiter, writes: FileWrites, sealer: ZoneSealer,
                 path_of: Callable[[int], str], tasks: MountTasks, *,
                 on_need_space: Callable[[int], Awaitable[bool]] | None = None) -> None:
        self.dev = dev
        self.state = state
        self.journal = journal
        self.alloc = alloc
        self.limiter = limiter
        self.writes = writes
        self.sealer = sealer
        self.path_of = path_of
        #: The mount's task group: the chunks of streaming writes run in it.
        self.tasks = tasks
        self.bs = dev.info.block_size
        self.counters = state.counters
        #: Foreground cleaning (the engine's): returns False when nothing was freed.
        self.on_need_space = on_need_space
        self.stream_hint: Callable[[Inode], int] = lambda inode: classify_stream(
            self.state, inode)
        #: Appends at the write pointer go to the device in reservation order (None
        #: with zone append, where the device places them).
        self.append_order: AppendOrder | None = (
            None if dev.info.zone_append else AppendOrder())
        #: The device's scattered append (zone append), or None: found once here.
        self._scattered = capabilities(dev).append_scattered
        #: Test hook, set only by `chunks_held_at` (None in production).
        self._landing_hook: Callable[[], Awaitable[None]] | None = None

    @contextlib.contextmanager
    def chunks_held_at(self, hook: Callable[[], Awaitable[None]]) -> Iterator[None]:
        """TEST HOOK: within the block, every chunk awaits `hook()` after its data
        is placed and before its ops are applied, so a test can make chunks land
        before, during or after another request (tests/unit/test_chunk_landing.py).
        """
        if self._landing_hook is not None:
            raise RuntimeError("chunks are already held at a hook")
        self._landing_hook = hook
        try:
            yield
        finally:
            self._landing_hook = None

    def _count(self, key: int, n: int) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    async def queue_chunk(self, inode: Inode, fblock: int, data: bytes | bytearray,
                          logical_end: int, mtime: int, final: bool) -> None:
        """Send one chunk: written before returning if `final` (or when no mount runs:
        an engine from ZoneFS.load), else by a task of the mount (returning once at
        most MAX_INFLIGHT chunks of the file are in flight)."""
        chunk, chunks = self.writes.add_chunk(inode.ino, fblock, data, logical_end, mtime)
        if final or not self.tasks.is_open:
            try:
                await self._write_chunk(inode, chunk)
            finally:
                # The caller gets the error now (or what propagated instead of it).
                err = self.writes.write_errors.pop(inode.ino, None)
            if err is not None:
                raise err
            return
        self.tasks.start_soon(self._write_chunk, inode, chunk, name=f"zonefs-chunk-{inode.ino}")
        if len(chunks) > MAX_INFLIGHT:
            await chunks[-1 - MAX_INFLIGHT].applied.wait()

    def queue_chunk_nowait(self, inode: Inode, fblock: int, data: bytes, logical_end: int,
                           mtime: int) -> None:
        """Send one chunk by a task of the mount without waiting (no await): bytes a C
        write stream staged (fs/cstreams.py), whose own credit bounds what is in
        flight. Raises NoTaskGroup when the mount's tasks have ended."""
        chunk, _chunks = self.writes.add_chunk(inode.ino, fblock, data, logical_end, mtime)
        try:
            self.tasks.start_soon(self._write_chunk, inode, chunk,
                                  name=f"zonefs-chunk-{inode.ino}")
        except BaseException:
            self.writes.write_errors.setdefault(
                inode.ino, errors.IOFailure("staged chunk not written: the mount is closing"))
            self.writes.chunk_done(inode.ino, chunk)
            raise

    async def _write_chunk(self, inode: Inode, chunk: Chunk) -> None:
        """Write one chunk and apply its ops after its predecessor's.

        A ZoneFSError is recorded in `write_errors` (the file's next flush/fsync
        fails with it). Anything else (a bug, or Cancelled: the mount ends
        uncleanly, a clean end flushes first) is recorded as an IOFailure too and
        propagates, to the mount's nursery; the chunk always leaves the in-flight
        list.
        """
        try:
            await self._write_chunk_now(inode, chunk)
        except BaseException as exc:
            if not isinstance(exc, trio.Cancelled):
                log.exception("unexpected error writing file data of inode %d", inode.ino)
            self.writes.write_errors.setdefault(
                inode.ino, errors.IOFailure(f"chunk not written: {exc!r}"))
            self.writes.chunk_done(inode.ino, chunk)
            raise

    async def _write_chunk_now(self, inode: Inode, chunk: Chunk) -> None:
        ops: list[Op] = []
        error: errors.ZoneFSError | None = None
        try:
            tenant = tenant_of(self.state, inode)
            await self.writes.bandwidth.admit(tenant, len(chunk.data))
            await self.writes.qos.admit_write(len(chunk.data), inode.ino)
            placed = await self.place_file_data(inode, chunk.fblock, chunk.data)
            self.writes.bandwidth.wrote(tenant, len(chunk.data))
        except errors.ZoneFSError as exc:
            error = exc
            placed = []
        if self._landing_hook is not None:
            await self._landing_hook()
        if placed and self.state.lazy:
            await warm_zone_owners(self.state, {z for _op, z in placed if z != NO_ZONE})
        if chunk.prev is not None:
            await chunk.prev.applied.wait()
        try:
            # Always account the placed pieces (their zones' in-flight marks), even
            # when the file was deleted meanwhile: then they are garbage, not leaks.
            try:
                ops = self.apply_placed(inode, placed)
            except (errors.IOFailure, errors.CorruptionError) as exc:
                error = exc  # nothing was applied; the pieces were given back
            if error is None and inode.ino in self.state.inodes:
                times = {"mtime": chunk.mtime, "ctime": chunk.mtime} if chunk.mtime else {}
                op = inode.op(size=max(inode.size, chunk.logical_end), flags=inode.flags,
                              **times)
                self.state.apply(op)
                ops.append(op)
            elif error is not None:
                self.writes.write_errors[inode.ino] = error
            if ops:
                self.journal.add(ops)
        finally:
            self.writes.chunk_done(inode.ino, chunk)

    async def append_file_data(self, inode: Inode, fblock: int, data: bytes) -> list[Op]:
        """Write data for file blocks from `fblock` now; apply and return the ops."""
        return self.apply_placed(inode, await self.place_file_data(inode, fblock, data))

    async def place_file_data(self, inode: Inode, fblock: int,
                              data: bytes | bytearray) -> list[tuple[Op, int]]:
        """Append data to zones; return (EXTENT op, zone) pairs not yet applied.

        ZONE_STATE ops of newly opened zones are applied and journaled here.
        """
        if not inode.flags & FLAG_STREAM_SET:
            stream = self.stream_hint(inode)
            op = inode.op(flags=(inode.flags & ~0xFF) | stream | FLAG_STREAM_SET)
            self.state.apply(op)
        stream = inode.stream
        # Only in zones of the file's declared tenant, if any (INV-27); its heads
        # (its own, its group's, its stream's shared one) are the tenant's.
        tenant = tenant_of(self.state, inode)
        owner = 0
        if self._wants_private_head(inode, fblock, len(data)):
            # A checkpoint's files die together with their directory (the shards
            # of one step): they share their group's heads (DESIGN 3.7). A group
            # is one directory, so all its files are of one tenant.
            group = inode.parent if stream == Stream.CHECKPOINT and inode.parent else None
            owner = self.alloc.owner_for(inode.ino, group)
        placed: list[tuple[Op, int]] = []
        try:
            await self._place_pieces(inode, fblock, data, stream, (owner, tenant), placed)
        except BaseException:
            # The pieces already written are garbage now; give their zones back.
            self.discard_placed(placed)
            raise
        # The allocator told the journal of each append (`append_done`, INV-7).
        return placed

    async def _place_pieces(self, inode: Inode, fblock: int, data: bytes | bytearray,
                            stream: int, owner: tuple[int, int],
                            placed: list[tuple[Op, int]]) -> None:
        """Reserve, append and describe each piece of `data` (appended to `placed`).

        Every piece of the chunk is reserved (and ticketed, `AppendOrder`) before
        any is appended, and one worker thread appends them in order: a chunk
        that straddles the end of a zone's data room keeps its place at the start
        of the next zone, ahead of the file's later chunks, and a sequential file
        stays one extent per zone. (Reserved one after the other, the second
        piece came after later chunks' pieces: up to 3 extents per zone.) The
        byte ranges a failed append leaves are reserved again in another zone.
        """
        todo: list[tuple[int, int]] = [(0, len(data))]  # byte ranges not yet written
        failures = 0
        view = memoryview(data)
        while todo:
            try:
                jobs, todo = await self._reserve_pieces(stream, owner, todo)
            except OSError as exc:
                # Finishing a zone to free its token failed (the zones just
                # reserved were given up, as a failed append's zone is).
                failures += 1
                self._write_failed(inode, "finishing a zone for its token", exc, failures)
                continue
            try:
                results = await trio.to_thread.run_sync(
                    self._checksum_and_append,
                    [(r.zone, view[lo:lo + r.granted], r.ticket) for lo, r in jobs],
                    limiter=self.limiter)
            except BaseException:
                self._give_up([r for _, r in jobs])
                raise
            finally:
                if self.append_order is not None:
                    # A no-op when the worker marked it; else (the thread failed
                    # first) the next appends of the zone need not wait.
                    for _, r in jobs:
                        self.append_order.done(r.zone, r.ticket)
            error: OSError | None = None
            for (lo, r), result in zip(jobs, results, strict=True):
                if isinstance(result, OSError):
                    self.alloc.append_done(r.zone, ok=False)
                    failures += 1
                    error = result
                    todo.append((lo, lo + r.granted))
                    log.error("write of %d bytes to zone %d failed (%s); %s", r.granted,
                              r.zone, result, "retrying in another zone" if failures < 3
                              else "giving up")
                    continue
                landed, csums = result
                # One EXTENT op per slice, at the address the device returned for
                # it (zone append: slices land anywhere in the zone, in any order;
                # DESIGN "Zone append"). Only the first carries the zone's
                # in-flight mark.
                first = fblock + lo // self.bs
                for dev_off, b0, nb in self._slices(landed):
                    op = (OpType.EXTENT, inode.ino, first + b0, nb, dev_off,
                          csums[b0 * 4:(b0 + nb) * 4])
                    placed.append((op, r.zone if b0 == 0 else NO_ZONE))
                self._count(C_DATA_BYTES, r.granted)
                self._count(C_STREAM_BASE + stream, r.granted)
                if owner[1]:
                    self._count(C_TENANT_USER_BASE + owner[1], r.granted)
            if error is not None and failures >= 3:
                raise errors.IOFailure(
                    f"cannot write data of {self.path_of(inode.ino)}: {error}") from error
            todo.sort()

    def _write_failed(self, inode: Inode, what: str, exc: OSError, failures: int) -> None:
        """Log a failed write or finish; raise IOFailure at the third."""
        log.error("%s failed (%s); %s", what, exc,
                  "retrying in another zone" if failures < 3 else "giving up")
        if failures >= 3:
            raise errors.IOFailure(
                f"cannot write data of {self.path_of(inode.ino)}: {exc}") from exc

    def _give_up(self, pending: list[_Reserved]) -> None:
        """Account reservations that will never be appended as failed appends (their
        zones' write pointers would trail their reservations: stop using them)."""
        for r in pending:
            if r.ticket >= 0:
                assert self.append_order is not None
                self.append_order.done(r.zone, r.ticket)
            self.alloc.append_done(r.zone, ok=False)

    async def _reserve_pieces(self, stream: int, owner: tuple[int, int],
                              todo: list[tuple[int, int]]
                              ) -> tuple[list[tuple[int, _Reserved]], list[tuple[int, int]]]:
        """Reserve the byte ranges `todo` for (stream, owner) where owner is (file or
        0, tenant or 0), one piece per zone;
        then finish the zones the allocator gave up for their tokens.

        Returns the pieces as (offset in the chunk, reservation), and the ranges
        left for later. With no space for the first piece: ask for cleaning and
        try again (once more after a pass that freed nothing), then NoSpace.
        With no space for a later one: stop there; the pieces reserved are
        appended first (waiting for the cleaner while holding them could wait on
        their own zones). Raises OSError if a zone cannot be finished (the
        pieces are given up).
        """
        jobs: list[tuple[int, _Reserved]] = []
        rest = list(todo)
        to_finish: list[int] = []
        cleaned_nothing = False
        try:
            while rest:
                lo, hi = rest[0]
                zone_ops: list[Op] = []
                try:
                    zone, granted = self.alloc.reserve(stream, owner[0], hi - lo, zone_ops,
                                                       to_finish, owner[1])
                except (NeedCleaning, errors.NoSpace) as exc:
                    if jobs:
                        break
                    if (isinstance(exc, NeedCleaning) and self.on_need_space is not None
                            and not cleaned_nothing):
                        # A pass that frees nothing still earns one more try:
                        # while this waited for the cleaner's lock, another
                        # writer's pass may have made the room (a dead zone
                        # reset, then a head opened that this data may share).
                        cleaned_nothing = not await self.on_need_space(exc.tenant)
                        continue
                    self.sealer.close_zones_later(to_finish)
                    to_finish = []
                    if isinstance(exc, errors.NoSpace):
                        raise
                    raise errors.NoSpace("no space left on the device") from None
                if zone_ops:
                    self.journal.add(zone_ops)
                order = self.append_order
                ticket = order.ticket(zone) if order is not None else -1
                jobs.append((lo, _Reserved(zone, granted, ticket)))
                if lo + granted < hi:
                    rest[0] = (lo + granted, hi)
                else:
                    rest.pop(0)
            await self.sealer.close_zones(to_finish)
        except BaseException:
            self._give_up([r for _, r in jobs])
            raise
        return jobs, rest

    def _checksum_and_append(self, jobs: list[tuple[int, memoryview, int]]
                             ) -> list[tuple[list[tuple[int, int]], bytes] | OSError]:
        """Worker thread: for each (zone, piece, ticket) in order, checksum the
        blocks, then append them (one thread hop for the chunk's pieces); return
        per piece [(device offset, bytes)] of consecutive slices and the
        checksums, or the OSError its append failed with.

        With a `ticket` (>= 0) an append waits for the zone's earlier ones
        (`fs/data/append_order.py`): a file's chunks then land in file order.
        """
        out: list[tuple[list[tuple[int, int]], bytes] | OSError] = []
        order = self.append_order
        scattered = self._scattered
        for zone, piece, ticket in jobs:
            try:
                csums = block_checksums(piece, self.bs)
                if ticket >= 0 and order is not None:
                    order.wait(zone, ticket)
                if scattered is not None:
                    out.append((scattered(zone, piece), csums))
                else:
                    out.append(([(self.dev.append(zone, piece), piece.nbytes)], csums))
            except OSError as exc:
                out.append(exc)
            finally:
                if ticket >= 0 and order is not None:
                    order.done(zone, ticket)
        return out

    def _slices(self, landed: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """(device offset, first block, blocks) per slice, device-contiguous ones merged."""
        out: list[tuple[int, int, int]] = []
        b0 = 0
        for dev_off, nbytes in landed:
            nb = nbytes // self.bs
            if out and out[-1][0] + out[-1][2] * self.bs == dev_off:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + nb)
            else:
                out.append((dev_off, b0, nb))
            b0 += nb
        return out

    def discard_placed(self, placed: list[tuple[Op, int]]) -> None:
        """Give back the zones of placed pieces that will never be applied (garbage)."""
        for _op, zone in placed:
            if zone != NO_ZONE:
                self.alloc.append_done(zone, ok=True)

    def apply_placed(self, inode: Inode, placed: list[tuple[Op, int]]) -> list[Op]:
        """Apply placed EXTENT ops (never awaits) and release their zones' in-flight marks.

        On a lazy mount (format 5) each zone's owner list must be in memory before
        an EXTENT into it applies: they are faulted in first (`_write_chunk_now`
        read them ahead in a worker thread, `lazyio.warm_zone_owners`), and one
        that cannot be read raises IOFailure or CorruptionError before anything
        is applied; the pieces are given back then (garbage), as for a failed
        write.
        """
        try:
            for _op, zone in placed:
                if zone != NO_ZONE:
                    self.state.zone_owners.get(zone)
        except (errors.IOFailure, errors.CorruptionError):
            self.discard_placed(placed)
            raise
        ops: list[Op] = []
        for op, zone in placed:
            if inode.ino in self.state.inodes:
                self.state.apply(op)
                ops.append(op)
            if zone != NO_ZONE:
                self.alloc.append_done(zone, ok=True)
        return ops

    def _wants_private_head(self, inode: Inode, fblock: int, nbytes: int) -> bool:
        """Checkpoint files, and files written sequentially past a quarter of a zone,
        get heads of their own (checkpoints: of their directory's group): their
        data dies together, so their zones are reset, never cleaned."""
        end = fblock * self.bs + nbytes
        if inode.stream != Stream.CHECKPOINT and end < self.alloc.private_head_bytes:
            return False
        assert inode.extents is not None
        # Sequential: the chunk continues the file's last mapped block.
        last = inode.extents.exts[-1].fend if len(inode.extents) else 0
        return fblock >= last

    # -- read ------------------------------------------------------------------------
