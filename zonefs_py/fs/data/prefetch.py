"""Sequential read-ahead in the engine: device reads of a stream kept in flight ahead of it.

A cold sequential read through FUSE is latency-bound, not CPU-bound: the
kernel's readahead keeps a few 1 MiB READ requests in flight, and each one
waits for its device read before the trio thread can reply (py-spy on a cold
1 GiB read, 2 vCPUs: the trio thread idle in epoll 52% of the time). When a
file is read sequentially, `Prefetcher` starts device reads of `SEGMENT_BYTES`
up to a window (`prefetch_mb=` mount option, default 8 MiB) beyond the newest
request, so the next requests find
their bytes in memory (or already on their way) and are answered at once.

Measured (2 vCPUs, shared, cold 1-2 GiB fio reads of 1 MiB, mounts
alternated on one image): 1024/1062/1206/883 MiB/s with read-ahead against
998/1086/1098/815 without, i.e. +3-8%, for +10-12% daemon CPU per GiB; py-spy:
the trio thread idle 22% instead of 37%, the rest of it mostly pyfuse3's own
request/reply loop (29%) and checksum verification (10%). The kernel's own
readahead (readahead_kb=4096) already keeps several requests in flight.

Streams: one per file (inode), at most `MAX_STREAMS` (least recently read
dropped). The rule that keeps read-ahead off random reads (issue 42):
  * A read continues the stream's run when it starts exactly where one of the
    last `RECENT_ENDS` requests *of this run* ended (the kernel's readahead
    requests may reach the engine slightly out of order) or inside the
    segments already read ahead. Any other read starts a new run of its own:
    run 1, the segments dropped, the remembered ends forgotten (only this
    read's end is kept).
  * After `TRIGGER_READS` reads in a row that continue the run, the stream
    reads ahead of the run's furthest end as far as the run itself has come
    (at least `START_REQUESTS` of its requests' length, at most the window).
    The read-ahead grows linearly with the bytes the run really read, not by
    doubling per request served: fio's random map makes chance runs of a few
    adjacent blocks near the end of each pass, and doubling took those to 4-5
    MiB ahead (now, two passes over 2 GiB at 128 KiB: at most 7 requests past
    one, 0.23% of the bytes read; tests/unit/test_prefetch_rules.py).
  * At most `max_filling` segment reads are in flight at once (mount-wide):
    past that a request reads the device itself.
("Near the last read" is not enough: random 32 KiB samples of a 32 MiB shard
are often near each other, and the first bench run of this code read 9,000
2 MiB segments ahead for one DataLoader epoch of 10,000 samples.) Issue 42:
the ends of earlier runs were kept across a reset and the run's reach was the
furthest end of any of them, so under fio randread 128 KiB (whose random map
picks the next free block when it draws a taken one, i.e. often the end of
some earlier read) three reads at old ends made a "run" that read ahead from
the request to the furthest read ever seen: one stream had 1,549 segments
(1.6 GB) queued, and every random read inside them continued it. Those
hundreds of segment reads filled the io_uring reader and met its lost
wake-up (device/aread.py `_submit`, fixed there): the READ waiting on a
segment was never answered.

Correctness: `State.apply` calls `forget(ino)` (through
`DataPath.data_changed`) before every EXTENT, TRUNCATE and INODE_FREE op of
the file: a write applied, a truncate, a cleaner move, a delete. That drops
the stream and marks each of its segments stale, read or still being read;
a stale segment is never served, also not to a request already waiting for
it (checked after the wait) (the tests overwrite, truncate
and clean while a stream is read and compare every byte). Files with write
state (buffered or in-flight data) are read under their lock as before and
never served from here. Segments are verified against their checksums like
every read (`DataPath._read_view`); a failed segment is dropped and the
request reads the device itself, so errors surface exactly as without
read-ahead. Segment reads run in the mount's task group (fs/tasks.py); nothing
here holds a lock.

Memory: at most MAX_STREAMS x (window + RECENT_ENDS x request + SEGMENT_BYTES)
of segments kept, and `max_filling` segment reads in flight.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable

import trio

from zonefs_py import errors
from zonefs_py.fs.tasks import MountTasks

#: Bytes of one device read ahead of a stream: at most the ring's largest read
#: (device/aread.py MAX_RING_READ), so segments use its warm pooled buffers (2 MiB
#: segments went through worker threads into fresh buffers: torch.load cost 2.2x
#: the daemon CPU per GiB of no read-ahead, bench/results/2026-12-01-issue12-ab).
SEGMENT_BYTES = 1 << 20
#: How far ahead of the newest request segments are kept in flight (default).
WINDOW_BYTES = 8 << 20
#: A stream that starts reading ahead reads at least this many of its requests'
#: length ahead (then as far as its run has come, up to the window).
START_REQUESTS = 4
#: Reads in a row continuing a stream before it reads ahead.
TRIGGER_READS = 3
#: Request ends remembered per stream (out-of-order arrival of readahead requests).
RECENT_ENDS = 8
#: Files read ahead at once.
MAX_STREAMS = 8

ReadFn = Callable[[int, int, int], Awaitable["bytes | memoryview"]]


class _Segment:
    __slots__ = ("data", "end", "ready", "stale", "start")

    def __init__(self, start: int, end: int) -> None:
        self.start = start
        self.end = end
        self.data: bytes | memoryview | None = None
        self.ready = trio.Event()
        #: The file's bytes changed after this segment's read began: never serve it.
        self.stale = False


class _Stream:
    __slots__ = ("ahead", "ends", "first", "reach", "run", "segments")

    def __init__(self, offset: int, end: int) -> None:
        self.first = offset  # start of the run's first request
        self.reach = end  # end of the run's furthest request
        self.ends: deque[int] = deque((end,), maxlen=RECENT_ENDS)
        self.run = 1  # reads in a row continuing the stream
        self.segments: list[_Segment] = []  # by offset, not overlapping
        #: How far ahead of `reach` this stream reads now (0: not started): as far
        #: as the run has come, at least START_REQUESTS requests, at most the window.
        self.ahead = 0

    def continues(self, offset: int) -> bool:
        if offset in self.ends:
            return True
        segs = self.segments
        return bool(segs) and segs[0].start <= offset < segs[-1].end


class Prefetcher:
    """Per-file sequential read-ahead (see the module docstring).

    `read_stored(ino, offset, length)` reads the file's stored bytes (verified).
    """

    def __init__(self, read_stored: ReadFn, tasks: MountTasks,
                 window_bytes: int = WINDOW_BYTES) -> None:
        self._read_stored = read_stored
        self.tasks = tasks
        self.window = window_bytes
        self._streams: OrderedDict[int, _Stream] = OrderedDict()
        #: Requests answered from read-ahead, and segments read / dropped unused.
        self.hits = 0
        self.segments_read = 0
        self.segments_dropped = 0
        #: Runs that began to read ahead, and reads that started a new run (broke one).
        self.runs_started = 0
        self.run_breaks = 0
        #: Segments not read because `max_filling` were in flight.
        self.segments_refused = 0
        #: Segment reads in flight at most, mount-wide: every stream's window and one
        #: more segment (72 at the default window, below the io_uring reader's 128
        #: slots), so no rule gone wrong can queue thousands of device reads again.
        self.max_filling = MAX_STREAMS * (-(-window_bytes // SEGMENT_BYTES) + 1)
        #: Segment reads in flight, and an event set whenever there are none.
        self._filling = 0
        self._idle = trio.Event()
        self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no read-ahead is in flight (tests; nothing waits for it else)."""
        while self._filling:
            await self._idle.wait()

    def status(self) -> dict[str, object]:
        """Read-ahead figures for `zonefs-py stat`."""
        return {"window_bytes": self.window, "streams": len(self._streams),
                "hits": self.hits, "segments_read": self.segments_read,
                "segments_dropped": self.segments_dropped,
                "segments_in_flight": self._filling,
                "segments_refused": self.segments_refused,
                "runs_started": self.runs_started, "run_breaks": self.run_breaks}

    def forget(self, ino: int) -> None:
        """Drop the file's stream and make its segments stale (its data changes now)."""
        st = self._streams.pop(ino, None)
        if st is not None:
            for seg in st.segments:
                seg.stale = True
            self.segments_dropped += len(st.segments)

    async def read(self, ino: int, offset: int, length: int, size: int
                   ) -> bytes | memoryview | None:
        """Return [offset, offset+length) of the file (`size` bytes now) from read-ahead,
        or None (the caller reads the device); start reading ahead if it streams."""
        st = self._track(ino, offset, length)
        if st is None:
            return None
        if st.run >= TRIGGER_READS:
            self._top_up(ino, st, offset, length, size)
        return await self._serve(st, offset, length)

    def _track(self, ino: int, offset: int, length: int) -> _Stream | None:
        st = self._streams.get(ino)
        if st is None:
            self._streams[ino] = _Stream(offset, offset + length)
            while len(self._streams) > MAX_STREAMS:
                self.forget(next(iter(self._streams)))
            return None
        self._streams.move_to_end(ino)
        if st.continues(offset):
            st.run += 1
            if st.run == TRIGGER_READS:
                self.runs_started += 1
            st.ends.append(offset + length)
            st.reach = max(st.reach, offset + length)
        else:
            # A new run of this one read: nothing of the old run may continue it
            # (its ends, its reach, its segments).
            self.run_breaks += 1
            st.run = 1
            st.ahead = 0
            self.segments_dropped += len(st.segments)
            st.segments = []
            st.ends.clear()
            st.ends.append(offset + length)
            st.first = offset
            st.reach = offset + length
        return st

    def _top_up(self, ino: int, st: _Stream, offset: int, length: int, size: int) -> None:
        """Drop the segments behind the request; read ahead up to the stream's reach.

        How far: as far as the run has come (`reach - first`), at least
        `START_REQUESTS` requests, at most the window. A run of a few requests
        that happen to follow each other (random 128 KiB reads: fio's random
        map picks the next free block when it draws a taken one) then costs a
        few hundred KiB of device reads, not the whole window.
        """
        keep = [seg for seg in st.segments if seg.end > offset]
        st.segments = keep
        st.ahead = min(self.window, max(START_REQUESTS * length, st.reach - st.first))
        start = keep[-1].end if keep else offset
        limit = min(size, st.reach + st.ahead)
        while start < limit:
            if not self.tasks.is_open:
                return  # no mount runs (an engine from ZoneFS.load): no read-ahead
            if self._filling >= self.max_filling:
                self.segments_refused += 1
                return
            end = min(start + SEGMENT_BYTES, limit)
            seg = _Segment(start, end)
            st.segments.append(seg)
            self.tasks.start_soon(self._fill, ino, seg, name=f"zonefs-readahead-{ino}")
            if not self._filling:
                self._idle = trio.Event()
            self._filling += 1
            start = end

    async def _fill(self, ino: int, seg: _Segment) -> None:
        """Read one segment (a task of the mount); a failed read leaves it empty (the
        request then reads the device itself); a bug propagates to the mount."""
        try:
            seg.data = await self._read_stored(ino, seg.start, seg.end - seg.start)
            self.segments_read += 1
        except (errors.ZoneFSError, OSError, KeyError):
            # KeyError: the file was deleted before its segment was read.
            seg.data = None
        finally:
            seg.ready.set()
            self._filling -= 1
            if not self._filling:
                self._idle.set()

    async def _serve(self, st: _Stream, offset: int, length: int
                     ) -> bytes | memoryview | None:
        end = offset + length
        parts: list[bytes | memoryview] = []
        pos = offset
        for seg in list(st.segments):
            if seg.end <= pos or seg.start > pos:
                continue
            if not seg.ready.is_set():
                await seg.ready.wait()
            # Checked after the wait: the file may have changed while it was read.
            if seg.data is None or seg.stale:
                return None
            hi = min(end, seg.end)
            parts.append(memoryview(seg.data)[pos - seg.start:hi - seg.start])
            pos = hi
            if pos >= end:
                break
        if pos < end:
            return None
        self.hits += 1
        return parts[0] if len(parts) == 1 else b"".join(parts)
