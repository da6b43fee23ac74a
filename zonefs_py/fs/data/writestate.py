"""Per-file write state: buffers, chunks in flight, write errors, locks, arrivals.

Everything the engine holds for a file between a WRITE request and the moment
its bytes are on the device and in the extent map lives in one `FileWrites`
object, shared by the read path (`fs/data/readpath.py`: a file with write state is
read under its lock, layers merged), the write pipeline (`fs/data/writepipe.py`:
chunks land and leave the in-flight list) and `DataPath` (buffering, flush,
truncate).

* `buffers[ino]`: one block-aligned `WriteBuffer` per file being written.
* `inflight[ino]`: chunks carved from the buffer and not yet applied, in
  carve order (each knows its predecessor).
* `write_errors[ino]`: a chunk that could not be written; the next flush or
  fsync of the file raises it (Linux reports writeback errors at fsync).
* `locks[ino]`: one trio.Lock per file with write state; a file without write
  state is read without a lock.
* arrivals: write requests that entered the engine and have not finished, so
  that a read arriving after a write waits for it (`after_earlier_writes`).

`pending_bytes()` (bytes accepted and not yet placed: the space check of
every growing write) is a running count, O(1): the buffers' bytes as
`DataPath` changes them (`buffered_delta`), the chunks' as they are queued
and land. Nothing here awaits except `after_earlier_writes` and `drain`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import trio

from zonefs_py import errors
from zonefs_py.fs.data.qos import ReadLatencyController
from zonefs_py.fs.data.tenantqos import TenantBandwidth
from zonefs_py.model.state import Inode


class WriteBuffer:
    """Buffered bytes of one file from block-aligned `start` (fs/data/datapath.py),
    with the mtime they carry.
    """

    __slots__ = ("data", "mtime", "start")

    def __init__(self, start: int) -> None:
        self.start = start
        self.data = bytearray()
        self.mtime = 0

    @property
    def end(self) -> int:
        return self.start + len(self.data)


class Chunk:
    """A carved piece of a file's buffer on its way to the device."""

    __slots__ = ("applied", "data", "fblock", "logical_end", "mtime", "prev")

    def __init__(self, fblock: int, data: bytes | bytearray, logical_end: int, mtime: int,
                 prev: Chunk | None) -> None:
        self.fblock = fblock
        self.data = data
        self.logical_end = logical_end
        self.mtime = mtime
        self.prev = prev
        self.applied = trio.Event()


class Admitted:
    """Bytes of one write request counted in `FileWrites.admitted_bytes` until
    `settle` (called, without an await before it, where the request's bytes join
    the buffer or the chunks in flight; and again, harmlessly, when it ends).
    `on_settle` is called once, at the first settle (a tenant's own count,
    fs/tenantspace.py)."""

    __slots__ = ("_writes", "_nbytes", "_on_settle")

    def __init__(self, writes: FileWrites, nbytes: int,
                 on_settle: Callable[[], None] | None = None) -> None:
        self._writes = writes
        self._nbytes = nbytes
        self._on_settle = on_settle

    def settle(self) -> None:
        self._writes.admitted_bytes -= self._nbytes
        self._nbytes = 0
        if self._on_settle is not None:
            on_settle, self._on_settle = self._on_settle, None
            on_settle()


class FileWrites:
    """The write state of every file (see the module docstring)."""

    def __init__(self, qos: ReadLatencyController, bandwidth: TenantBandwidth) -> None:
        self.qos = qos
        #: Per-tenant write caps and read shares (fs/data/tenantqos.py).
        self.bandwidth = bandwidth
        self.buffers: dict[int, WriteBuffer] = {}
        self.locks: dict[int, trio.Lock] = {}
        self.inflight: dict[int, list[Chunk]] = {}
        self.write_errors: dict[int, errors.ZoneFSError] = {}
        #: Bytes in `buffers` and in the chunks of `inflight` (pending_bytes).
        self._buffered = 0
        self._inflight_bytes = 0
        #: Bytes of write requests admitted (the space check passed) that are not in
        #: `buffers` or `inflight` yet: the request is parked on the file's lock, a
        #: flush, or an inline conversion (`Admitted`; counted by `used_bytes`).
        self.admitted_bytes = 0
        #: Unfinished write requests per file: arrival number -> the end of the bytes
        #: it writes (None: not a plain write), and the event set (and replaced)
        #: whenever one of them finishes.
        self._arrivals: dict[int, tuple[dict[int, int | None], list[trio.Event]]] = {}
        self._arrival = 0
        #: Called (no await) before Python changes a file's bytes or size (a write,
        #: fallocate, copy into it, truncate): C's write stream of the file ends and
        #: what it staged enters the pipeline first (fs/cstreams.py). None without.
        self.before_change: Callable[[int], None] | None = None
        #: Called when a chunk of the file left the in-flight list (C streams' credit).
        self.after_chunk: Callable[[int], None] | None = None

    # -- request order ---------------------------------------------------------------
    @contextmanager
    def write_arriving(self, ino: int, end: int | None = None) -> Iterator[int]:
        """Mark a write request of `ino` as arrived, from before its first await to
        its end, so that a read arriving after it waits for it (`after_earlier_writes`).
        Yields the request's arrival number: a request that reads as well as
        writes (a copy within one file) passes it to `after_earlier_writes` as
        `before`, or it would wait for itself (issue 42).

        The kernel sends requests in order, but every request runs in its own
        task: a WRITE parked on the file's lock, or on anything before it buffers
        its data, would let a READ that arrived after it be answered from the
        older bytes. Without the writeback cache that READ fills the kernel's page
        cache, where its stale pages outlive the write. (The stale reads fsx
        finds with `writeback_cache=off` and two processes on one file did not
        become rarer with this: those READs reach us before the WRITE does,
        DESIGN 4.3. This closes the engine's part.)

        No object is made per request unless a reader waits: the event list
        is filled by `after_earlier_writes` only.
        """
        if self.before_change is not None:
            self.before_change(ino)
        self._arrival += 1
        seq = self._arrival
        arr = self._arrivals.get(ino)
        if arr is None:
            arr = self._arrivals[ino] = ({}, [])
        arr[0][seq] = end
        try:
            yield seq
        finally:
            pending, waiters = arr
            del pending[seq]
            if waiters:
                for ev in waiters:
                    ev.set()
                waiters.clear()
            if not pending and self._arrivals.get(ino) is arr:
                del self._arrivals[ino]

    def arrivals_of(self, ino: int) -> int:
        """Unfinished write requests of `ino` (no await)."""
        arr = self._arrivals.get(ino)
        return len(arr[0]) if arr is not None else 0

    def arriving_end(self, ino: int) -> int | None:
        """The highest end of the unfinished write requests of `ino` (0: none), or None
        when one of them is not a plain write (no await)."""
        arr = self._arrivals.get(ino)
        if arr is None:
            return 0
        ends = arr[0].values()
        return None if None in ends else max(ends, default=0)  # type: ignore[type-var]

    def writes_arriving(self, ino: int) -> bool:
        """Whether write requests of `ino` are unfinished (no await: a dict lookup)."""
        return ino in self._arrivals

    async def after_earlier_writes(self, ino: int, before: int | None = None) -> None:
        """Wait until every write request of `ino` that arrived before now has finished
        (its appends pass the QoS gate at once meanwhile: a read is waiting).

        `before`: wait only for those that arrived before the request of that
        arrival number (`write_arriving`'s), never for it nor later ones: the
        reads of a copy within one file, whose own request is unfinished until
        they are done.
        """
        arr = self._arrivals.get(ino)
        if arr is None:
            return
        last = self._arrival if before is None else before - 1
        pending, waiters = arr
        with self.qos.expedited(ino):
            while pending and next(iter(pending)) <= last:
                ev = trio.Event()
                waiters.append(ev)
                await ev.wait()

    # -- state -------------------------------------------------------------------------
    def lock(self, ino: int) -> trio.Lock:
        lk = self.locks.get(ino)
        if lk is None:
            lk = self.locks[ino] = trio.Lock()
        return lk

    def has_state(self, ino: int) -> bool:
        """Whether the file has buffered or in-flight data (then reads take its lock)."""
        return ino in self.buffers or ino in self.inflight

    def admit(self, nbytes: int, on_settle: Callable[[], None] | None = None) -> Admitted:
        """Count `nbytes` of a write request as taken from the free space from its
        space check until its bytes are counted in `pending_bytes` (`Admitted.settle`).

        Without it, concurrent write requests (the kernel sends up to its
        background limit of WRITEs at once, and a file's are served one at a
        time under its lock) each passed the check against the same free space
        while the others waited on the lock, and together took more than there
        was; how much more depended on the interleaving (issue 42, item 6).
        """
        self.admitted_bytes += nbytes
        return Admitted(self, nbytes, on_settle)

    def pending_bytes(self) -> int:
        """File bytes accepted but not yet placed on the device (O(1))."""
        return self._buffered + self._inflight_bytes

    def pending_bytes_of(self, ino: int) -> int:
        """The bytes of `ino` in `pending_bytes()`."""
        buf = self.buffers.get(ino)
        return (len(buf.data) if buf is not None else 0) + sum(
            len(c.data) for c in self.inflight.get(ino, ()))

    def pending_blocks(self, ino: int, block_size: int) -> list[tuple[int, int]]:
        """File blocks [lo, hi) of `ino` with bytes accepted and not yet placed: its
        chunks in flight and its buffer (they may overlap, as they do in
        `pending_bytes`)."""
        spans = [(c.fblock, c.fblock + -(-len(c.data) // block_size))
                 for c in self.inflight.get(ino, ())]
        buf = self.buffers.get(ino)
        if buf is not None and buf.data:
            spans.append((buf.start // block_size, -(-buf.end // block_size)))
        return spans

    def buffered_delta(self, nbytes: int) -> None:
        """A buffer grew (or shrank, negative) by `nbytes`."""
        self._buffered += nbytes

    def drop_buffer(self, ino: int) -> WriteBuffer | None:
        buf = self.buffers.pop(ino, None)
        if buf is not None:
            self._buffered -= len(buf.data)
        return buf

    def visible_size(self, inode: Inode) -> int:
        buf = self.buffers.get(inode.ino)
        size = max(inode.size, buf.end) if buf is not None else inode.size
        # Chunks in flight left the buffer but have not grown inode.size yet.
        for chunk in self.inflight.get(inode.ino, ()):
            size = max(size, chunk.logical_end)
        return size

    def add_chunk(self, ino: int, fblock: int, data: bytes | bytearray, logical_end: int,
                  mtime: int) -> tuple[Chunk, list[Chunk]]:
        """Append a new chunk to the file's in-flight list; return it and the list."""
        chunks = self.inflight.setdefault(ino, [])
        chunk = Chunk(fblock, data, logical_end, mtime, chunks[-1] if chunks else None)
        chunks.append(chunk)
        self._inflight_bytes += len(data)
        return chunk, chunks

    def chunk_done(self, ino: int, chunk: Chunk) -> None:
        """The chunk's ops are applied (or it failed): it leaves the in-flight list."""
        chunks = self.inflight.get(ino)
        if chunks and chunks[0] is chunk:
            chunks.pop(0)
            self._inflight_bytes -= len(chunk.data)
            if not chunks:
                del self.inflight[ino]
        chunk.applied.set()
        if self.after_chunk is not None:
            self.after_chunk(ino)

    async def drain(self, ino: int) -> None:
        """Wait until every in-flight chunk of the file is applied; report a lost chunk
        (the caller holds the file's lock)."""
        chunks = self.inflight.get(ino)
        if chunks:
            await chunks[-1].applied.wait()
        err = self.write_errors.pop(ino, None)
        if err is not None:
            raise err

    def times_set(self, ino: int) -> None:
        """A SETATTR set the file's mtime: data written before it (buffered or in
        flight) must not stamp its own older write time over it when it lands
        (`cp -p` and tar set the times on the open file before close)."""
        buf = self.buffers.get(ino)
        if buf is not None:
            buf.mtime = 0
        for chunk in self.inflight.get(ino, ()):
            chunk.mtime = 0

    def forget_file(self, ino: int) -> None:
        """Drop the write state of a freed file (its buffer is discarded)."""
        self.drop_buffer(ino)
        self.write_errors.pop(ino, None)
        lk = self.locks.get(ino)
        if lk is not None and not lk.locked() and not self.inflight.get(ino):
            del self.locks[ino]
