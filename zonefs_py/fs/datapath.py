"""File data: write buffers, appends to zones, verified reads, truncation.

Writes are buffered per file in one block-aligned `WriteBuffer` (a bytearray
that starts on a block boundary and holds the newest bytes of its range).
Sequential writes extend it; once it holds `CHUNK_BYTES` the whole blocks go
out as one zone append (a 1 MiB FUSE write becomes one device append). A
write that does not continue the buffer flushes it first. The partial block
at either end of a flushed range is completed from the file's existing
content (read-modify-write), so every device block of a file holds exactly
the file's bytes, and bytes of the last block past EOF are zero (INV-10).

A block-aligned write of a chunk or more that starts where the buffer is
empty skips the buffer: its bytes object becomes the chunk (no copy).

Reads merge the extent map (device reads, every block checked against its
xxh3 checksum, a mismatch is `errors.IOFailure` and a log line naming the
file and offset) with the buffer. Reads of written data go through the
engine's io_uring reader (`device/aread.py`, no worker thread; the checksums,
in C, are then verified on the trio thread), others through the read thread
budget. The device reads of a range that maps to several pieces (zone
appends scatter a chunk) are all in flight at once. A read pins the zones it
reads so that none is reset under it.
Appends run in worker threads, checksumming (in C, GIL released) and
appending in one call, behind the read-latency controller (`fs/qos.py`); the
appends of a file being flushed, fsynced or truncated pass it at once.

Pipelining: a full chunk carved from a streaming buffer is written by a
system task while the writer goes on filling the next one (at most
`MAX_INFLIGHT` chunks per file). Chunks are reserved in carve order and
their EXTENT ops are applied in carve order, so a later write of the same
blocks always wins. Until its ops are applied a chunk stays readable from
the in-flight list. fsync, close, truncate and non-sequential writes drain
the file's in-flight chunks first; a chunk that could not be written makes
the next flush/fsync of that file fail with EIO (as Linux reports writeback
errors at fsync).

Zone append: on a device with `info.zone_append`, a chunk goes out through
`append_scattered` as several appends in flight at once (NVMe Zone Append:
128 KiB each on QEMU), which land wherever the device puts them; each landed
slice gets its own EXTENT op at its returned address (device-contiguous
slices merged), so with up to MAX_INFLIGHT chunks in flight many appends
fill one zone at once. docs/DESIGN.md "Zone append" has the crash argument.

Locking: one trio.Lock per file with buffered or in-flight data; reads of a
file without write state take no lock, so dataset reads never queue behind
another file's writes. Readers of a file with write state take its lock and
see extents, then in-flight chunks, then the buffer, newest last.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple, NoReturn

import trio

from zonefs_py import errors
from zonefs_py.alloc.allocator import Allocator, NeedCleaning
from zonefs_py.alloc.streams import classify_stream
from zonefs_py.device.aread import AsyncReader
from zonefs_py.device.base import ZonedDevice
from zonefs_py.format.checksum import Data, block_checksums, first_bad_block
from zonefs_py.format.constants import OpType, Stream
from zonefs_py.format.ops import Op
from zonefs_py.fs.append_order import AppendOrder
from zonefs_py.fs.prefetch import Prefetcher
from zonefs_py.fs.qos import ReadLatencyController
from zonefs_py.fs.zonesums import SumCache, ZoneSealer
from zonefs_py.journal.journal import Journal
from zonefs_py.model.extents import Piece
from zonefs_py.model.state import Inode, State

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
#: Inode flag: the stream in the low byte has been decided.
FLAG_STREAM_SET = 0x100

# Counter ids (persisted in COUNTERS ops; docs/SPEC.md "Counters").
C_USER_BYTES = 1
C_DATA_BYTES = 2
C_META_BYTES = 3
C_CLEANER_BYTES = 4
C_PAD_BYTES = 5
C_STREAM_BASE = 100  # + stream id: device data bytes per stream


class WriteBuffer:
    __slots__ = ("data", "mtime", "start")

    def __init__(self, start: int) -> None:
        self.start = start
        self.data = bytearray()
        self.mtime = 0

    @property
    def end(self) -> int:
        return self.start + len(self.data)


MAX_INFLIGHT = 4
#: Zone of a placed EXTENT op that is not its append's first slice (no in-flight mark).
NO_ZONE = -1


class _Reserved(NamedTuple):
    """A piece of a chunk reserved in a zone and not yet appended."""

    zone: int
    granted: int
    #: `AppendOrder` ticket, -1 without (zone append devices).
    ticket: int


class Chunk:
    """A carved piece of a file's buffer on its way to the device."""

    __slots__ = ("applied", "data", "fblock", "logical_end", "mtime", "prev")

    def __init__(self, fblock: int, data: bytes, logical_end: int, mtime: int,
                 prev: Chunk | None) -> None:
        self.fblock = fblock
        self.data = data
        self.logical_end = logical_end
        self.mtime = mtime
        self.prev = prev
        self.applied = trio.Event()


class _Arrivals:
    """Write requests of one file that entered the engine and have not finished."""

    __slots__ = ("changed", "pending")

    def __init__(self) -> None:
        #: Arrival numbers (DataPath._arrival) of the unfinished writes.
        self.pending: set[int] = set()
        #: Set (and replaced) whenever one of them finishes.
        self.changed = trio.Event()


class DataPath:
    def __init__(self, dev: ZonedDevice, state: State, journal: Journal, alloc: Allocator,
                 limiter: trio.CapacityLimiter, path_of: Callable[[int], str],
                 read_limiter: trio.CapacityLimiter | None = None,
                 cache_bytes: int = 256 << 20) -> None:
        self.dev = dev
        self.state = state
        self.journal = journal
        self.alloc = alloc
        self.limiter = limiter
        self.read_limiter = read_limiter or limiter
        self.bs = dev.info.block_size
        self.zone_size = dev.info.zone_size_bytes
        self.buffers: dict[int, WriteBuffer] = {}
        self.locks: dict[int, trio.Lock] = {}
        self.path_of = path_of
        self.inflight: dict[int, list[Chunk]] = {}
        self.write_errors: dict[int, errors.ZoneFSError] = {}
        #: Writes set the file's mtime/ctime to their arrival time. False when the
        #: caller owns the times (FUSE writeback cache: FsOptions.kernel_write_times);
        #: a buffer or chunk then carries time 0, "leave the times as they are".
        self.stamp_times = True
        #: Foreground cleaning, set by the engine: returns False when nothing was freed.
        self.on_need_space: Callable[[], Awaitable[bool]] | None = None
        self.counters = state.counters
        self.stream_hint: Callable[[Inode], int] = lambda inode: classify_stream(
            self.state, inode)
        #: Zone summaries: sealing full zones, and the checksums of sealed ones.
        self.sealer = ZoneSealer(dev, state, journal, alloc, limiter)
        self.sums = SumCache(dev, state, self.read_limiter, cache_bytes, path_of)
        #: Thread-free reads (io_uring), set by the engine when the device allows.
        self.reader: AsyncReader | None = None
        #: Read QoS gate for appends (disabled until the engine sets a target).
        self.qos = ReadLatencyController(0)
        state.on_data_changed = self.data_changed
        #: Sequential read-ahead (None: off; set by the engine, `prefetch_mb=`).
        self.prefetch: Prefetcher | None = None
        #: Appends at the write pointer go to the device in reservation order (None
        #: with zone append, where the device places them).
        self.append_order: AppendOrder | None = (
            None if dev.info.zone_append else AppendOrder())
        #: TEST HOOK: awaited by every chunk after its data is placed and before its
        #: ops are applied, so tests can make chunks land before, during or after
        #: another request (tests/unit/test_chunk_landing.py). None in production.
        self.chunk_landing_hook: Callable[[], Awaitable[None]] | None = None
        #: Unfinished write requests per file, and the arrival counter (`write_arriving`).
        self._arrivals: dict[int, _Arrivals] = {}
        self._arrival = 0

    # -- request order ---------------------------------------------------------------
    @contextmanager
    def write_arriving(self, ino: int) -> Iterator[None]:
        """Mark a write request of `ino` as arrived, from before its first await to
        its end, so that a read arriving after it waits for it (`after_earlier_writes`).

        The kernel sends requests in order, but every request runs in its own
        task: a WRITE parked on the file's lock, or on anything before it buffers
        its data, would let a READ that arrived after it be answered from the
        older bytes. Without the writeback cache that READ fills the kernel's page
        cache, where its stale pages outlive the write. (The stale reads fsx
        finds with `writeback_cache=off` and two processes on one file did not
        become rarer with this: those READs reach us before the WRITE does,
        DESIGN 4.3. This closes the engine's part.)
        """
        self._arrival += 1
        seq = self._arrival
        arr = self._arrivals.get(ino)
        if arr is None:
            arr = self._arrivals[ino] = _Arrivals()
        arr.pending.add(seq)
        try:
            yield
        finally:
            arr.pending.discard(seq)
            arr.changed.set()
            arr.changed = trio.Event()
            if not arr.pending and self._arrivals.get(ino) is arr:
                del self._arrivals[ino]

    def writes_arriving(self, ino: int) -> bool:
        """Whether write requests of `ino` are unfinished (no await: a dict lookup)."""
        return ino in self._arrivals

    async def after_earlier_writes(self, ino: int) -> None:
        """Wait until every write request of `ino` that arrived before now has finished
        (its appends pass the QoS gate at once meanwhile: a read is waiting)."""
        arr = self._arrivals.get(ino)
        if arr is None:
            return
        last = self._arrival
        with self.qos.expedited(ino):
            while any(seq <= last for seq in arr.pending):
                await arr.changed.wait()

    # -- helpers -----------------------------------------------------------------
    def lock(self, ino: int) -> trio.Lock:
        lk = self.locks.get(ino)
        if lk is None:
            lk = self.locks[ino] = trio.Lock()
        return lk

    def pending_bytes(self) -> int:
        """File bytes accepted but not yet placed on the device."""
        return sum(len(b.data) for b in self.buffers.values()) + sum(
            len(c.data) for chunks in self.inflight.values() for c in chunks)

    def visible_size(self, inode: Inode) -> int:
        buf = self.buffers.get(inode.ino)
        size = max(inode.size, buf.end) if buf is not None else inode.size
        # Chunks in flight left the buffer but have not grown inode.size yet.
        for chunk in self.inflight.get(inode.ino, ()):
            size = max(size, chunk.logical_end)
        return size

    def data_changed(self, ino: int) -> None:
        """State hook: the file's stored bytes change now; read-ahead of it is stale."""
        if self.prefetch is not None:
            self.prefetch.forget(ino)

    def enable_prefetch(self, window_bytes: int) -> None:
        """Read files that are read sequentially ahead of their requests (fs/prefetch.py)."""
        async def read_stored(ino: int, offset: int, length: int) -> bytes | memoryview:
            return await self._read_view(self.state.inodes[ino], offset, length)

        self.prefetch = Prefetcher(read_stored, window_bytes)

    def _count(self, key: int, n: int) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def forget_file(self, ino: int) -> None:
        """Drop the write state of a freed file (its buffer is discarded)."""
        self.buffers.pop(ino, None)
        self.write_errors.pop(ino, None)
        lk = self.locks.get(ino)
        if lk is not None and not lk.locked() and not self.inflight.get(ino):
            del self.locks[ino]

    async def _drain_locked(self, inode: Inode) -> None:
        """Wait until every in-flight chunk of the file is applied; report a lost chunk."""
        chunks = self.inflight.get(inode.ino)
        if chunks:
            await chunks[-1].applied.wait()
        err = self.write_errors.pop(inode.ino, None)
        if err is not None:
            raise err

    # -- write -----------------------------------------------------------------------
    async def write(self, inode: Inode, offset: int, data: bytes) -> int:
        async with self.lock(inode.ino):
            buf = self.buffers.get(inode.ino)
            if buf is not None and not buf.start <= offset <= buf.end:
                await self._flush_locked(inode, final=True)
                buf = None
            if (buf is None or (buf.start == offset and not buf.data)) \
                    and offset % self.bs == 0 and len(data) >= CHUNK_BYTES \
                    and len(data) % self.bs == 0:
                # Streaming fast path: a block-aligned request of a chunk or more
                # becomes a chunk as it is, without copying it twice through the
                # buffer (2 MiB of memcpy per MiB, on the trio thread).
                if buf is not None:
                    del self.buffers[inode.ino]
                self._count(C_USER_BYTES, len(data))
                await self._queue_chunk(inode, offset // self.bs,
                                        data if isinstance(data, bytes) else bytes(data),
                                        offset + len(data), self.write_time(), final=False)
                return len(data)
            if buf is None:
                start = offset // self.bs * self.bs
                buf = WriteBuffer(start)
                if start < offset:
                    # The head of the block from the file as readers see it: chunks
                    # still in flight included (the extents alone may be older, and
                    # this buffer lands after those chunks, so stale bytes here
                    # would overwrite newer ones).
                    buf.data += await self._read_locked(inode, start, offset - start)
                self.buffers[inode.ino] = buf
            rel = offset - buf.start
            if rel == len(buf.data):
                buf.data += data
            else:
                buf.data[rel:rel + len(data)] = data
            buf.mtime = self.write_time()
            self._count(C_USER_BYTES, len(data))
            if len(buf.data) >= CHUNK_BYTES:
                await self._flush_locked(inode, final=False)
        return len(data)

    def write_time(self) -> int:
        """The mtime/ctime a write gives its file: now, or 0 (unchanged) when the
        caller owns the times."""
        return time.time_ns() if self.stamp_times else 0

    def times_set(self, ino: int) -> None:
        """A SETATTR set the file's mtime: data written before it (buffered or in
        flight) must not stamp its own older write time over it when it lands
        (`cp -p` and tar set the times on the open file before close)."""
        buf = self.buffers.get(ino)
        if buf is not None:
            buf.mtime = 0
        for chunk in self.inflight.get(ino, ()):
            chunk.mtime = 0

    async def flush(self, inode: Inode) -> None:
        """Write the file's buffer and in-flight chunks to the device (not yet durable:
        see Journal.commit); raise the error of a chunk that could not be written."""
        ino = inode.ino
        if ino not in self.buffers and ino not in self.inflight and ino not in self.write_errors:
            return
        with self.qos.expedited(ino):
            async with self.lock(ino):
                await self._flush_locked(inode, final=True)

    async def _flush_locked(self, inode: Inode, final: bool) -> None:
        """Send the buffer's whole blocks to the device (all of it, padded, if `final`).

        Non-final flushes (a full streaming chunk) return once the chunk is
        queued; final ones return once everything of the file is applied.
        """
        buf = self.buffers.get(inode.ino)
        if buf is None:
            if final:
                await self._drain_locked(inode)
            return
        bs = self.bs
        if final:
            await self._drain_locked(inode)
            data = buf.data
            logical_end = buf.end
            if len(data) % bs:
                tail_start = buf.end
                tail_end = (tail_start // bs + 1) * bs
                fill = b""
                if inode.size > tail_start:
                    fill = await self._read_stored(inode, tail_start,
                                                   min(tail_end, inode.size) - tail_start)
                data += fill + bytes(tail_end - tail_start - len(fill))
            del self.buffers[inode.ino]
        else:
            whole = len(buf.data) // bs * bs
            rest = WriteBuffer(buf.start + whole)
            rest.data = buf.data[whole:]
            rest.mtime = buf.mtime
            del buf.data[whole:]
            data = buf.data
            logical_end = buf.start + whole
            if rest.data:
                self.buffers[inode.ino] = rest
            else:
                del self.buffers[inode.ino]
        if not data:
            return
        await self._queue_chunk(inode, buf.start // bs, bytes(data), logical_end,
                                buf.mtime, final)

    async def _queue_chunk(self, inode: Inode, fblock: int, data: bytes, logical_end: int,
                           mtime: int, final: bool) -> None:
        """Send one chunk: written before returning if `final`, else by a system task
        (returning once at most MAX_INFLIGHT chunks of the file are in flight)."""
        chunks = self.inflight.setdefault(inode.ino, [])
        chunk = Chunk(fblock, data, logical_end, mtime, chunks[-1] if chunks else None)
        chunks.append(chunk)
        if final:
            await self._write_chunk(inode, chunk)
            err = self.write_errors.pop(inode.ino, None)
            if err is not None:
                raise err
            return
        trio.lowlevel.spawn_system_task(self._write_chunk, inode, chunk,
                                        name=f"zonefs-chunk-{inode.ino}")
        if len(chunks) > MAX_INFLIGHT:
            await chunks[-1 - MAX_INFLIGHT].applied.wait()

    async def _write_chunk(self, inode: Inode, chunk: Chunk) -> None:
        """Write one chunk and apply its ops after its predecessor's. Never raises."""
        ops: list[Op] = []
        error: errors.ZoneFSError | None = None
        try:
            await self.qos.admit_write(len(chunk.data), inode.ino)
            placed = await self._place_file_data(inode, chunk.fblock, chunk.data)
        except errors.ZoneFSError as exc:
            error = exc
            placed = []
        except trio.Cancelled:
            # The event loop is ending (an unclean exit: a clean one flushes
            # first); the chunk is not written, and nothing acknowledged it.
            log.debug("write of a chunk of inode %d cancelled", inode.ino)
            error = errors.IOFailure("cancelled: the filesystem is shutting down")
            placed = []
        except BaseException as exc:  # a system task must not raise
            log.exception("unexpected error writing file data of inode %d", inode.ino)
            error = errors.IOFailure(f"unexpected error: {exc!r}")
            placed = []
        if self.chunk_landing_hook is not None:
            await self.chunk_landing_hook()
        if chunk.prev is not None:
            await chunk.prev.applied.wait()
        try:
            # Always account the placed pieces (their zones' in-flight marks), even
            # when the file was deleted meanwhile: then they are garbage, not leaks.
            ops = self._apply_placed(inode, placed)
            if error is None and inode.ino in self.state.inodes:
                times = {"mtime": chunk.mtime, "ctime": chunk.mtime} if chunk.mtime else {}
                op = inode.op(size=max(inode.size, chunk.logical_end), flags=inode.flags,
                              **times)
                self.state.apply(op)
                ops.append(op)
            elif error is not None:
                self.write_errors[inode.ino] = error
            if ops:
                self.journal.add(ops)
        finally:
            chunks = self.inflight.get(inode.ino)
            if chunks and chunks[0] is chunk:
                chunks.pop(0)
                if not chunks:
                    del self.inflight[inode.ino]
            chunk.applied.set()

    async def _append_file_data(self, inode: Inode, fblock: int, data: bytes) -> list[Op]:
        """Write data for file blocks from `fblock` now; apply and return the ops."""
        return self._apply_placed(inode, await self._place_file_data(inode, fblock, data))

    async def _place_file_data(self, inode: Inode, fblock: int,
                               data: bytes) -> list[tuple[Op, int]]:
        """Append data to zones; return (EXTENT op, zone) pairs not yet applied.

        ZONE_STATE ops of newly opened zones are applied and journaled here.
        """
        if not inode.flags & FLAG_STREAM_SET:
            stream = self.stream_hint(inode)
            op = inode.op(flags=(inode.flags & ~0xFF) | stream | FLAG_STREAM_SET)
            self.state.apply(op)
        stream = inode.stream
        owner = inode.ino if self._wants_private_head(inode, fblock, len(data)) else 0
        placed: list[tuple[Op, int]] = []
        try:
            await self._place_pieces(inode, fblock, data, stream, owner, placed)
        except BaseException:
            # The pieces already written are garbage now; give their zones back.
            self.discard_placed(placed)
            raise
        self.journal.data_dirty = True
        return placed

    async def _place_pieces(self, inode: Inode, fblock: int, data: bytes,
                            stream: int, owner: int, placed: list[tuple[Op, int]]) -> None:
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

    async def _reserve_pieces(self, stream: int, owner: int, todo: list[tuple[int, int]]
                              ) -> tuple[list[tuple[int, _Reserved]], list[tuple[int, int]]]:
        """Reserve the byte ranges `todo` for (stream, owner), one piece per zone;
        then finish the zones the allocator gave up for their tokens.

        Returns the pieces as (offset in the chunk, reservation), and the ranges
        left for later. With no space for the first piece: ask for cleaning, then
        NoSpace. With no space for a later one: stop there; the pieces reserved
        are appended first (waiting for the cleaner while holding them could wait
        on their own zones). Raises OSError if a zone cannot be finished (the
        pieces are given up).
        """
        jobs: list[tuple[int, _Reserved]] = []
        rest = list(todo)
        to_finish: list[int] = []
        try:
            while rest:
                lo, hi = rest[0]
                zone_ops: list[Op] = []
                try:
                    zone, granted = self.alloc.reserve(stream, owner, hi - lo, zone_ops,
                                                       to_finish)
                except (NeedCleaning, errors.NoSpace) as exc:
                    if jobs:
                        break
                    if (isinstance(exc, NeedCleaning) and self.on_need_space is not None
                            and await self.on_need_space()):
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
        (`fs/append_order.py`): a file's chunks then land in file order.
        """
        out: list[tuple[list[tuple[int, int]], bytes] | OSError] = []
        order = self.append_order
        scattered = getattr(self.dev, "append_scattered", None)
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

    def _apply_placed(self, inode: Inode, placed: list[tuple[Op, int]]) -> list[Op]:
        """Apply placed EXTENT ops (never awaits) and release their zones' in-flight marks."""
        ops: list[Op] = []
        for op, zone in placed:
            if inode.ino in self.state.inodes:
                self.state.apply(op)
                ops.append(op)
            if zone != NO_ZONE:
                self.alloc.append_done(zone, ok=True)
        return ops

    def _wants_private_head(self, inode: Inode, fblock: int, nbytes: int) -> bool:
        """Checkpoint files, and files written sequentially past a zone's worth, get zones
        of their own: they die together, so their zones are reset, never cleaned."""
        end = fblock * self.bs + nbytes
        if inode.stream != Stream.CHECKPOINT and end < self.alloc.private_head_bytes:
            return False
        assert inode.extents is not None
        # Sequential: the chunk continues the file's last mapped block.
        last = inode.extents.exts[-1].fend if len(inode.extents) else 0
        return fblock >= last

    # -- read ------------------------------------------------------------------------
    async def read(self, inode: Inode, offset: int, length: int) -> bytes | memoryview:
        """The file's bytes; a read-only view when one device read served it."""
        size = self.visible_size(inode)
        if offset >= size or length <= 0:
            return b""
        length = min(length, size - offset)
        qos_token = self.qos.read_started()
        try:
            if inode.ino in self.buffers or inode.ino in self.inflight:
                # The writer may hold the lock while its chunks wait at the gate:
                # release them rather than make this read wait for the allowance.
                with self.qos.expedited(inode.ino):
                    async with self.lock(inode.ino):
                        return await self._read_locked(inode, offset, length)
            if self.prefetch is not None:
                ahead = await self.prefetch.read(inode.ino, offset, length, size)
                if ahead is not None:
                    return ahead
            return await self._read_view(inode, offset, length)
        finally:
            self.qos.read_done(qos_token)

    async def _read_locked(self, inode: Inode, offset: int, length: int
                           ) -> bytes | memoryview:
        """The file's bytes as readers see them: extents, then in-flight chunks, then
        the buffer, newest last (the caller holds the file's lock)."""
        # Snapshot the in-flight chunks first: one that lands while the extents
        # are read leaves the in-flight list but may be missing from the extent
        # map as it was looked up (that read would see a hole).
        layers: list[tuple[int, bytes | bytearray]] = [
            (c.fblock * self.bs, c.data) for c in self.inflight.get(inode.ino, ())]
        data = await self._read_view(inode, offset, length)
        buf = self.buffers.get(inode.ino)
        if buf is not None:
            layers.append((buf.start, buf.data))
        out: bytearray | None = None
        for start, blob in layers:
            lo = max(offset, start)
            hi = min(offset + length, start + len(blob))
            if lo >= hi:
                continue
            if out is None:
                out = bytearray(data)
                if len(out) < length:
                    out += bytes(length - len(out))
            out[lo - offset:hi - offset] = blob[lo - start:hi - start]
        return data if out is None else bytes(out)

    async def _read_stored(self, inode: Inode, offset: int, length: int) -> bytes:
        """Read [offset, offset+length) from the extents only (holes are zeros)."""
        data = await self._read_view(inode, offset, length)
        return data if isinstance(data, bytes) else bytes(data)

    async def _read_view(self, inode: Inode, offset: int, length: int) -> bytes | memoryview:
        """`_read_stored`, but a single device read comes back as the reader's
        read-only view (no copy): for `read()`, whose result goes straight to
        the reply.

        The mapping is looked up and every zone it touches pinned in one step
        (no await between): the read is of the file as it was at that instant,
        however the map changes while the device reads run (chunks landing,
        the cleaner re-pointing), and no zone it reads is reset under it
        (INV-8).
        """
        assert inode.extents is not None
        bs = self.bs
        end = min(offset + length, max(inode.size, offset))
        if end <= offset:
            return bytes(length)
        fb0 = offset // bs
        fb1 = (end + bs - 1) // bs
        pieces = inode.extents.lookup(fb0, fb1 - fb0, bs)
        zsize = self.zone_size
        pinned = [z for p in pieces if p.dev is not None
                  for z in range(p.dev // zsize, (p.dev + p.nblocks * bs - 1) // zsize + 1)]
        for z in pinned:
            self.alloc.pin_read(z)
        parts: list[bytes | memoryview] = []
        try:
            if any(p.csums is None for p in pieces if p.dev is not None):
                pieces = await self._with_checksums(inode.ino, pieces)
            scattered = sum(1 for p in pieces if p.dev is not None) > 1
            if scattered and self.reader is not None and self.reader.uses_ring:
                # Scattered pieces (zone append): all device reads in flight at once.
                parts = await self._read_pieces(inode.ino, pieces)
            else:
                for p in pieces:
                    if p.dev is None:
                        parts.append(bytes(p.nblocks * bs))
                    else:
                        parts.append(await self._read_extent(inode.ino, p.fblock, p.dev,
                                                             p.nblocks * bs, p.csums))
        finally:
            for z in pinned:
                self.alloc.unpin_read(z)
        blob = b"".join(parts) if len(parts) != 1 else parts[0]
        skip = offset - fb0 * bs
        out = blob[skip:skip + (end - offset)]
        if len(out) < length:
            return bytes(out) + bytes(length - len(out))
        return out

    async def _with_checksums(self, ino: int, pieces: list[Piece]) -> list[Piece]:
        """The pieces, those of sealed zones with their checksums from the zone
        summaries (`SumCache`; the caller pinned their zones)."""
        out: list[Piece] = []
        for p in pieces:
            if p.dev is not None and p.csums is None:
                p = p._replace(csums=await self.sums.checksums(ino, p.fblock, p.dev, p.nblocks))
            out.append(p)
        return out

    async def _read_pieces(self, ino: int, pieces: list[Piece]) -> list[bytes | memoryview]:
        """Every piece's bytes (holes as zeros), the device reads in flight at once
        through the ring reader, each verified against its own checksums."""
        assert self.reader is not None
        bs = self.bs
        spans = [(p.dev, p.nblocks * bs) for p in pieces if p.dev is not None]
        try:
            datas = iter(await self.reader.read_many(spans))
        except OSError as exc:
            self._read_failed(ino, next(p.fblock for p in pieces if p.dev is not None), exc)
        parts: list[bytes | memoryview] = []
        for p in pieces:
            if p.dev is None:
                parts.append(bytes(p.nblocks * bs))
                continue
            data = next(datas)
            self._verify(ino, p.fblock, p.dev, data, p.csums)
            parts.append(data)
        return parts

    async def _read_extent(self, ino: int, fblock: int, dev_off: int, nbytes: int,
                           csums: bytes | None) -> bytes | memoryview:
        if self.reader is not None and self.reader.uses_ring:
            # Read without a worker thread; verify here (C, ~0.1 ms per MiB).
            try:
                data = await self.reader.read(dev_off, nbytes)
            except OSError as exc:
                self._read_failed(ino, fblock, exc)
            self._verify(ino, fblock, dev_off, data, csums)
            return data
        data = await trio.to_thread.run_sync(self._read_verify, ino, fblock, dev_off, nbytes,
                                             csums, limiter=self.read_limiter)
        return data

    def _read_verify(self, ino: int, fblock: int, dev_off: int, nbytes: int,
                     csums: bytes | None) -> bytes:
        """Worker thread: read device blocks and check every checksum."""
        try:
            data = self.dev.read(dev_off, nbytes)
        except OSError as exc:
            self._read_failed(ino, fblock, exc)
        self._verify(ino, fblock, dev_off, data, csums)
        return data

    def _read_failed(self, ino: int, fblock: int, exc: OSError) -> NoReturn:
        log.error("read error in %s at file offset %d: %s", self.path_of(ino),
                  fblock * self.bs, exc)
        raise errors.IOFailure(f"device read failed: {exc}") from exc

    def _verify(self, ino: int, fblock: int, dev_off: int, data: Data,
                csums: bytes | None) -> None:
        """Check every block of `data` against `csums`; a mismatch (or a mapping whose
        checksums do not cover its blocks) is an `IOFailure` for this file alone."""
        nblocks = len(data) // self.bs
        if csums is None or len(csums) != nblocks * 4:
            # An inconsistency of this file's mapping, not of the device or the
            # metadata as a whole: EIO for this read, the mount stays writable.
            log.error("internal error in %s at file offset %d: %d checksums for %d blocks "
                      "(device offset %d); the read fails with EIO", self.path_of(ino),
                      fblock * self.bs, len(csums or b"") // 4, nblocks, dev_off)
            raise errors.IOFailure(f"inconsistent mapping at file offset {fblock * self.bs}")
        bad = first_bad_block(data, self.bs, csums)
        if bad is not None:
            file_off = (fblock + bad) * self.bs
            log.error("checksum mismatch in %s at file offset %d (device offset %d)",
                      self.path_of(ino), file_off, dev_off + bad * self.bs)
            raise errors.IOFailure(f"checksum mismatch at file offset {file_off}")

    # -- hooks for fallocate (fs/prealloc.py) ------------------------------------------
    async def flush_locked(self, inode: Inode) -> None:
        """`flush` for a caller that holds the file's lock."""
        await self._flush_locked(inode, final=True)

    async def place_zeroed_locked(self, inode: Inode, fblock: int, lo: int,
                                  hi: int) -> list[tuple[Op, int]]:
        """Append file block `fblock` with its bytes [lo, hi) (offsets in the block)
        zeroed: a read-modify-write of the stored block, bytes past EOF kept zero
        (INV-10). Returns the placed, not yet applied, ops (`apply_placed`, or
        `discard_placed`). The caller holds the lock and flushed (`flush_locked`)."""
        start = fblock * self.bs
        stored = await self._read_stored(inode, start, max(0, min(self.bs, inode.size - start)))
        block = bytearray(stored + bytes(self.bs - len(stored)))
        block[lo:hi] = bytes(hi - lo)
        return await self._place_file_data(inode, fblock, bytes(block))

    def apply_placed(self, inode: Inode, placed: list[tuple[Op, int]]) -> list[Op]:
        """Apply placed EXTENT ops (never awaits); return them."""
        return self._apply_placed(inode, placed)

    # -- truncate ------------------------------------------------------------------
    async def truncate(self, inode: Inode, new_size: int, ctime: int) -> list[Op]:
        """Change the size; return (applied) ops for the caller's transaction."""
        with self.qos.expedited(inode.ino):
            return await self._truncate(inode, new_size, ctime)

    async def _truncate(self, inode: Inode, new_size: int, ctime: int) -> list[Op]:
        async with self.lock(inode.ino):
            await self._flush_locked(inode, final=True)
            ops: list[Op] = []
            bs = self.bs
            if new_size < inode.size:
                assert inode.extents is not None
                keep_blocks = (new_size + bs - 1) // bs
                if new_size % bs:
                    block_start = new_size // bs * bs
                    pieces = inode.extents.lookup(new_size // bs, 1, bs)
                    if pieces and pieces[0].dev is not None:
                        head = await self._read_stored(inode, block_start, new_size - block_start)
                        block = head + bytes(bs - len(head))
                        ops += await self._append_file_data(inode, block_start // bs, block)
                op = (OpType.TRUNCATE, inode.ino, keep_blocks)
                self.state.apply(op)
                ops.append(op)
            op = inode.op(size=new_size, mtime=ctime, ctime=ctime)
            self.state.apply(op)
            ops.append(op)
            return ops
