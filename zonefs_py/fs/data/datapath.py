"""File data: buffered writes, flush, truncate; the read path and the write pipeline.

`DataPath` is the engine's one door to file data. It holds three parts, each
in its own module with the state it owns:

* `fs/data/writestate.py` (`FileWrites`): per-file write state (buffers, chunks in
  flight, write errors, locks, unfinished write requests, visible size);
* `fs/data/readpath.py` (`ReadPath`): verified reads (the fast path and the
  general one), read-ahead;
* `fs/data/writepipe.py` (`WritePipeline`): chunks to zones, their EXTENT ops
  applied in carve order.

What stays here is what needs all three: buffering a WRITE, flushing a
buffer, truncating.

Writes are buffered per file in one block-aligned `WriteBuffer` (a bytearray
that starts on a block boundary and holds the newest bytes of its range).
Sequential writes extend it; once it holds `CHUNK_BYTES` the whole blocks go
out as one chunk (a 1 MiB FUSE write becomes one device append). A write that
does not continue the buffer flushes it first. The partial block at either
end of a flushed range is completed from the file's existing content
(read-modify-write), so every device block of a file holds exactly the file's
bytes, and bytes of the last block past EOF are zero (INV-10).

A block-aligned write of a chunk or more that starts where the buffer is
empty skips the buffer: its bytes object becomes the chunk (no copy).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

import trio

from zonefs_py.alloc.allocator import Allocator
from zonefs_py.device.aread import AsyncReader
from zonefs_py.device.base import ZonedDevice
from zonefs_py.format.constants import C_USER_BYTES, OpType
from zonefs_py.format.ops import Op
from zonefs_py.fs.clock import now_ns
from zonefs_py.fs.data.append_order import AppendOrder
from zonefs_py.fs.data.prefetch import Prefetcher
from zonefs_py.fs.data.qos import ReadLatencyController
from zonefs_py.fs.data.readpath import ReadPath
from zonefs_py.fs.data.tenantqos import TenantBandwidth
from zonefs_py.fs.data.writepipe import WritePipeline
from zonefs_py.fs.data.writestate import Admitted, Chunk, FileWrites, WriteBuffer
from zonefs_py.fs.data.zonesums import SumCache, ZoneSealer
from zonefs_py.fs.tasks import MountTasks
from zonefs_py.journal.journal import Journal
from zonefs_py.model.state import Inode, State

CHUNK_BYTES = 1 << 20
#: A close returns before its file's last chunk is on the device only while at most
#: this many bytes of all files are buffered or in flight (DataPath._can_send_and_go).
ASYNC_CLOSE_MAX_BYTES = 32 << 20

__all__ = ["CHUNK_BYTES", "Chunk", "DataPath", "WriteBuffer"]


class DataPath:
    """The engine's one door to file data: buffered writes, flush, truncate, reads.

    Built once per mount with everything it needs: `qos` gates appends behind
    reads (`read_latency_ms=`), `reader` does thread-free reads (io_uring)
    or is None, `stamp_times` False leaves mtime/ctime to the caller (the
    kernel's writeback cache), `prefetch_bytes` is the read-ahead window (0:
    off), `fast_read` enables the read fast path, and `on_need_space` is the
    foreground cleaning a write calls when no zone has room.
    """

    def __init__(self, dev: ZonedDevice, state: State, journal: Journal, alloc: Allocator,
                 limiter: trio.CapacityLimiter, path_of: Callable[[int], str],
                 read_limiter: trio.CapacityLimiter | None = None,
                 cache_bytes: int = 256 << 20, *,
                 qos: ReadLatencyController | None = None,
                 reader: AsyncReader | None = None, stamp_times: bool = True,
                 prefetch_bytes: int = 0, fast_read: bool = True,
                 on_need_space: Callable[[int], Awaitable[bool]] | None = None,
                 device_write_bps: float = 0.0, tasks: MountTasks) -> None:
        self.dev = dev
        self.state = state
        self.journal = journal
        self.alloc = alloc
        self.bs = dev.info.block_size
        self.zone_size = dev.info.zone_size_bytes
        self.path_of = path_of
        self.counters = state.counters
        read_limiter = read_limiter or limiter
        #: Per-file write state; its `qos` is the read QoS gate for appends
        #: (disabled without a target).
        self.writes = FileWrites(qos or ReadLatencyController(0),
                                 TenantBandwidth(state, device_write_bps=device_write_bps))
        self.buffers = self.writes.buffers
        self.inflight = self.writes.inflight
        self.locks = self.writes.locks
        #: Zone summaries: sealing full zones, and the checksums of sealed ones.
        #: The mount's task group (fs/tasks.py): chunks, seals, read-ahead run in it.
        self.tasks = tasks
        self.sealer = ZoneSealer(dev, state, journal, alloc, limiter, tasks)
        self.sums = SumCache(dev, state, read_limiter, cache_bytes, path_of, reader=reader)
        self.reads = ReadPath(dev, state, alloc, self.writes, self.sums, read_limiter, path_of,
                              tasks, reader=reader, prefetch_bytes=prefetch_bytes, fast=fast_read)
        self.pipe = WritePipeline(dev, state, journal, alloc, limiter, self.writes,
                                  self.sealer, path_of, tasks, on_need_space=on_need_space)
        #: Writes set the file's mtime/ctime to their arrival time. False when the
        #: caller owns the times (FUSE writeback cache: FsOptions.kernel_write_times);
        #: a buffer or chunk then carries time 0, "leave the times as they are".
        self.stamp_times = stamp_times
        state.subscribe(data_changed=self.reads.data_changed,
                        layout_changed=self.reads.layout_changed)
        # Request order and write state, as the engine and the drain use them.
        self.write_arriving = self.writes.write_arriving
        self.writes_arriving = self.writes.writes_arriving
        self.after_earlier_writes = self.writes.after_earlier_writes
        self.lock = self.writes.lock
        self.pending_bytes = self.writes.pending_bytes
        self.visible_size = self.writes.visible_size
        self.forget_file = self.writes.forget_file
        self.times_set = self.writes.times_set
        self.read = self.reads.read
        self.discard_placed = self.pipe.discard_placed

    # -- the parts' settings, as the engine and its status read them -------------------
    @property
    def qos(self) -> ReadLatencyController:
        return self.writes.qos

    @property
    def reader(self) -> AsyncReader | None:
        return self.reads.reader

    @property
    def prefetch(self) -> Prefetcher | None:
        return self.reads.prefetch

    @property
    def on_need_space(self) -> Callable[[int], Awaitable[bool]] | None:
        return self.pipe.on_need_space

    @property
    def append_order(self) -> AppendOrder | None:
        return self.pipe.append_order

    def chunks_held_at(
            self, hook: Callable[[], Awaitable[None]]) -> contextlib.AbstractContextManager[None]:
        """TEST HOOK: `WritePipeline.chunks_held_at`."""
        return self.pipe.chunks_held_at(hook)

    # -- what the engine's DrainHost API uses of the parts ------------------------------
    async def read_stored(self, inode: Inode, offset: int, length: int) -> bytes:
        """The file's bytes from its extents only (holes are zeros), verified."""
        return await self.reads.read_stored(inode, offset, length)

    async def place_file_data(self, inode: Inode, fblock: int,
                              data: bytes) -> list[tuple[Op, int]]:
        """Append data for file blocks from `fblock`; the EXTENT ops are not applied."""
        return await self.pipe.place_file_data(inode, fblock, data)

    def has_unwritten_data(self, ino: int) -> bool:
        """True while the file has buffered bytes or chunks in flight."""
        return ino in self.buffers or ino in self.inflight

    def _count(self, key: int, n: int) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    # -- write -----------------------------------------------------------------------
    async def write(self, inode: Inode, offset: int, data: bytes,
                    admitted: Admitted | None = None) -> int:
        """Buffer (or send as a chunk) `data` at `offset`; `admitted`, the space
        the caller's check counted for it, is settled where the bytes join
        `pending_bytes`, with no await between (FileWrites.admit)."""
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
                    self.writes.drop_buffer(inode.ino)
                if admitted is not None:
                    admitted.settle()  # queue_chunk counts the chunk before any await
                self._count(C_USER_BYTES, len(data))
                await self.pipe.queue_chunk(inode, offset // self.bs,
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
                    buf.data += await self.reads.read_locked(inode, start, offset - start)
                self.buffers[inode.ino] = buf
                self.writes.buffered_delta(len(buf.data))
            if admitted is not None:
                admitted.settle()
            rel = offset - buf.start
            before = len(buf.data)
            if rel == before:
                buf.data += data
            else:
                buf.data[rel:rel + len(data)] = data
            self.writes.buffered_delta(len(buf.data) - before)
            buf.mtime = self.write_time()
            self._count(C_USER_BYTES, len(data))
            if len(buf.data) >= CHUNK_BYTES:
                await self._flush_locked(inode, final=False)
        return len(data)

    def queue_staged(self, inode: Inode, offset: int, data: bytes) -> None:
        """Bytes a C write stream took for the file (whole blocks at `offset`): a chunk
        in flight now, after every chunk of the file before it (no await)."""
        self._count(C_USER_BYTES, len(data))
        self.pipe.queue_chunk_nowait(inode, offset // self.bs, data, offset + len(data),
                                     self.write_time())

    def write_time(self) -> int:
        """The mtime/ctime a write gives its file: now, or 0 (unchanged) when the
        caller owns the times."""
        return now_ns() if self.stamp_times else 0

    async def flush(self, inode: Inode, wait: bool = True) -> None:
        """Write the file's buffer and in-flight chunks to the device (not yet durable:
        see Journal.commit); raise the error of a chunk that could not be written.

        `wait=False` (a close: FUSE FLUSH) sends the buffer and returns without
        waiting for the device when that is safe (`_can_send_and_go`); the error
        of that chunk, if any, is raised by the next flush or fsync of the file.
        """
        ino = inode.ino
        if not self.writes.has_state(ino) and ino not in self.writes.write_errors:
            return
        with self.qos.expedited(ino):
            async with self.lock(ino):
                await self._flush_locked(inode, final=True, wait=wait)

    def _can_send_and_go(self, inode: Inode, buf: WriteBuffer | None) -> bool:
        """Whether a close may return once the buffer is queued: nothing of the file is
        in flight (so no stored bytes are needed to pad the last block, and the chunk
        has no predecessor to wait for), the file holds no bytes past the buffer, and
        not too many bytes are in flight already (memory stays bounded)."""
        return (buf is not None and inode.ino not in self.writes.inflight
                and inode.size <= buf.end
                and self.writes.pending_bytes() <= ASYNC_CLOSE_MAX_BYTES)

    async def _flush_locked(self, inode: Inode, final: bool, wait: bool = True) -> None:
        """Send the buffer's whole blocks to the device (all of it, padded, if `final`).

        Non-final flushes (a full streaming chunk) return once the chunk is
        queued; final ones return once everything of the file is applied, unless
        `wait` is False and `_can_send_and_go` (then once the chunk is queued).
        """
        buf = self.buffers.get(inode.ino)
        if final and not wait and self._can_send_and_go(inode, buf):
            err = self.writes.write_errors.pop(inode.ino, None)
            if err is not None:
                raise err
            final = wait = False
            go_padded = True
        else:
            go_padded = False
        if buf is None:
            if final:
                await self.writes.drain(inode.ino)
            return
        bs = self.bs
        if final or go_padded:
            if final:
                await self.writes.drain(inode.ino)
            data = buf.data
            logical_end = buf.end
            tail = b""
            if len(data) % bs:
                tail_start = buf.end
                tail_end = (tail_start // bs + 1) * bs
                fill = b""
                if inode.size > tail_start:
                    fill = await self.reads.read_stored(inode, tail_start,
                                                        min(tail_end, inode.size) - tail_start)
                tail = fill + bytes(tail_end - tail_start - len(fill))
            # Dropped (and its bytes uncounted) before the padding makes it longer.
            self.writes.drop_buffer(inode.ino)
            data += tail
        else:
            assert not go_padded
            whole = len(buf.data) // bs * bs
            rest = WriteBuffer(buf.start + whole)
            rest.data = buf.data[whole:]
            rest.mtime = buf.mtime
            self.writes.drop_buffer(inode.ino)
            del buf.data[whole:]
            data = buf.data
            logical_end = buf.start + whole
            if rest.data:
                self.buffers[inode.ino] = rest
                self.writes.buffered_delta(len(rest.data))
        if not data:
            return
        # The buffer's bytearray is the chunk's data as it is (no copy): nothing
        # holds the buffer any more (dropped, or its tail moved to `rest`).
        await self.pipe.queue_chunk(inode, buf.start // bs, data, logical_end,
                                    buf.mtime, final)

    async def wait_written(self, inode: Inode) -> None:
        """Wait until every chunk of the file in flight is applied, without taking the
        error of a chunk that failed (the next flush or fsync reports it)."""
        chunks = self.writes.inflight.get(inode.ino)
        if chunks:
            await chunks[-1].applied.wait()


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
        stored = await self.reads.read_stored(inode, start,
                                              max(0, min(self.bs, inode.size - start)))
        block = bytearray(stored + bytes(self.bs - len(stored)))
        block[lo:hi] = bytes(hi - lo)
        return await self.pipe.place_file_data(inode, fblock, block)

    def apply_placed(self, inode: Inode, placed: list[tuple[Op, int]]) -> list[Op]:
        """Apply placed EXTENT ops (never awaits); return them."""
        return self.pipe.apply_placed(inode, placed)

    # -- truncate ------------------------------------------------------------------
    async def truncate(self, inode: Inode, new_size: int, ctime: int) -> list[Op]:
        """Change the size; return (applied) ops for the caller's transaction."""
        if self.writes.before_change is not None:
            self.writes.before_change(inode.ino)
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
                        head = await self.reads.read_stored(inode, block_start,
                                                            new_size - block_start)
                        block = head + bytes(bs - len(head))
                        ops += await self.pipe.append_file_data(inode, block_start // bs, block)
                op = (OpType.TRUNCATE, inode.ino, keep_blocks)
                self.state.apply(op)
                ops.append(op)
            op = inode.op(size=new_size, mtime=ctime, ctime=ctime)
            self.state.apply(op)
            ops.append(op)
            return ops
