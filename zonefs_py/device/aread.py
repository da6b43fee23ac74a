"""Device reads for the trio thread: io_uring completions on an eventfd, no worker thread.

`trio.to_thread.run_sync` costs two thread wake-ups per call (trio thread ->
worker -> trio thread); on the 2-vCPU machines we measured, that was ~100 us
per call against ~60 us for the 4 KiB O_DIRECT read itself, and the trio
thread's share of it capped random reads at a few thousand per second
whatever the queue depth. Here the trio thread submits the read to an
io_uring (non-blocking: the kernel issues O_DIRECT reads without waiting, or
hands them to its own workers) and sleeps until the ring's eventfd is
readable; one wake-up then delivers every completion that arrived, so reads
at queue depth 16 share wake-ups instead of paying two each.

Submission polling (`sqpoll_ms` > 0, IORING_SETUP_SQPOLL): a kernel thread
picks submissions up, so the trio thread does not pay the io_uring_enter
syscall that issues the read (26% of its time at QD16 in py-spy). It sleeps
after `sqpoll_ms` without reads. Only reads up to SQPOLL_MAX_READ, submitted
while SQPOLL_MIN_INFLIGHT others are in flight, use the polled ring; larger
ones, and reads that come one at a time, go to a second, plain ring (a
paced reader would keep the polling thread spinning for nothing). Polling pays for many
small reads, but a stream of 1 MiB reads keeps the polling thread from ever
sleeping, and on 2 vCPUs that core is what the reader and the FUSE replies
need (figures at SQPOLL_MAX_READ). Mount option sqpoll_ms=0: one plain ring.

Only reads of data known to be written, in one zone, with nothing to emulate
(`dev.direct_read_target()` gives the fd and offset) take this path;
everything else (the emulator's zeros past the write pointer, fault
injection, conventional-zone overlays, devices without the method, no
io_uring on this kernel) goes through `dev.read` in a worker thread, as before.

Buffers: aligned buffers from C (`zn_aligned_alloc`), kept on free lists per
power-of-two size. A buffer belongs to the kernel from submission until its
completion is reaped: a read whose caller was cancelled leaves its buffer to
the reaper, and a reader dropped with reads in flight leaks their buffers
rather than free memory the kernel may still write. A completed read is
returned as a read-only memoryview of its buffer, not a copy; the buffer goes
back to its free list when the last view of it is dropped (pyfuse3 replies
straight from the view), so steady reads reuse the same warm pages.
"""

from __future__ import annotations

import errno
import logging
import weakref
from typing import Any, Protocol

import trio

try:
    from zonefs_py._native import ffi, lib
except ImportError:  # pragma: no cover - depends on the build
    ffi = lib = None

log = logging.getLogger(__name__)

#: Largest read sent through a ring (larger ones take a worker thread).
MAX_RING_READ = 1 << 20
#: Largest read sent to the submission-polled ring; larger ones use the plain
#: ring. Polling pays off for many small reads (the trio thread skips a
#: syscall per read); under a stream of 1 MiB reads the polling thread never
#: sleeps and takes a whole core from the reader itself (2 vCPUs, alternating
#: mounts: 1 MiB cold sequential reads 0.63-0.82 GB/s with polling vs
#: 0.89-1.27 GB/s without; 4 KiB QD16 reads 12.9-13.7k IOPS vs 7.5-8.5k).
SQPOLL_MAX_READ = 128 << 10
#: Reads already in flight before one goes to the submission-polled ring. The
#: polling thread spins for `sqpoll_ms` after every submission, so reads
#: arriving one at a time (a paced reader: 1,000 4 KiB reads/s, 2 vCPUs shared)
#: kept it from ever sleeping: 0.6-0.9 of a core of daemon CPU and p99 17-19 ms,
#: against 0.16-0.19 of a core and p99 4-7 ms with the plain ring. Only a queue
#: of reads (QD16) gains from skipping the submit syscall.
SQPOLL_MIN_INFLIGHT = 4
#: Ring size: reads in flight at once (more wait for a free entry).
RING_ENTRIES = 128
#: Buffers kept per size class once returned.
FREE_PER_CLASS = 32

#: Buffers of readers dropped while reads were in flight (never freed; see above).
_LEAKED: list[Any] = []


class _Device(Protocol):
    def read(self, offset_bytes: int, length_bytes: int) -> bytes: ...

    def direct_read_target(self, offset_bytes: int,
                           length_bytes: int) -> tuple[int, int] | None: ...


class _Slot:
    __slots__ = ("buf", "event", "orphan", "result")

    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.event = trio.Event()
        self.result = 0
        self.orphan = False


class _Ring:
    """One C ring and what it owns; freed by `close()` or when garbage-collected."""

    def __init__(self, ptr: Any, name: str) -> None:
        self.ptr = ptr
        self.name = name
        self.efd: int = lib.zn_aring_eventfd(ptr)
        self.slots: dict[int, _Slot] = {}
        self.room = trio.Event()
        self.reaper_started = False

    @staticmethod
    def free(ptr: Any, slots: dict[int, _Slot]) -> None:
        if slots:
            _LEAKED.extend(s.buf for s in slots.values())
            slots.clear()
        lib.zn_aring_free(ptr)


class AsyncReader:
    """`await reader.read(offset, length)`: a device read that never blocks trio."""

    def __init__(self, dev: Any, limiter: trio.CapacityLimiter | None = None,
                 sqpoll_ms: int = 0) -> None:
        self.dev = dev
        self.sqpoll_ms = sqpoll_ms
        self.limiter = limiter
        #: Plain ring (every read when there is no polled one; large reads otherwise).
        self._ring: _Ring | None = None
        #: Submission-polled ring for reads up to SQPOLL_MAX_READ, if sqpoll_ms > 0.
        self._polled: _Ring | None = None
        self._finalizers: list[weakref.finalize] = []
        self._free: dict[int, list[Any]] = {}
        self._next_tag = 1
        self.ring_reads = 0
        self.thread_reads = 0
        if getattr(dev, "direct_read_target", None) is not None:
            self._ring = self._open_ring(0)
            if self._ring is not None and sqpoll_ms > 0:
                self._polled = self._open_ring(sqpoll_ms)

    @property
    def uses_ring(self) -> bool:
        return self._ring is not None

    def _open_ring(self, sqpoll_ms: int) -> _Ring | None:
        """A ring, or None without io_uring (a polled ring falls back to plain submission)."""
        if lib is None:  # pragma: no cover - depends on the build
            return None
        err = ffi.new("int *")
        ptr = lib.zn_aring_new(RING_ENTRIES, sqpoll_ms, err)
        if ptr == ffi.NULL:
            log.info("io_uring unavailable (%s): device reads use worker threads",
                     errno.errorcode.get(-err[0], err[0]))
            return None
        ring = _Ring(ptr, "polled" if sqpoll_ms else "plain")
        self._finalizers.append(weakref.finalize(self, _Ring.free, ptr, ring.slots))
        return ring

    # -- reading ------------------------------------------------------------------
    async def read(self, offset_bytes: int, length_bytes: int) -> bytes | memoryview:
        """The bytes at `offset_bytes`: from a ring a read-only view of a pooled
        buffer (returned to the pool when the view is dropped), else bytes."""
        ring, target = self._route(offset_bytes, length_bytes)
        if ring is None or target is None:
            self.thread_reads += 1
            data: bytes = await trio.to_thread.run_sync(self.dev.read, offset_bytes,
                                                        length_bytes, limiter=self.limiter)
            return data
        self.ring_reads += 1
        fd, pos = target
        return await self._ring_read(ring, fd, pos, offset_bytes, length_bytes)

    async def read_many(self, spans: list[tuple[int, int]]) -> list[bytes | memoryview]:
        """`read` of every (offset, length) in `spans`, the ring reads all in flight
        at once (a file range that zone appends scattered over several places of a
        zone is one request's worth of reads, not one device round trip after
        another); results in the order of `spans`. Raises the first failure, in
        that order (reads still in flight then finish unseen)."""
        slots: list[_Slot | None] = []
        waited = 0
        try:
            for offset_bytes, length_bytes in spans:
                ring, target = self._route(offset_bytes, length_bytes)
                if ring is None or target is None:
                    slots.append(None)
                    continue
                self.ring_reads += 1
                slots.append(await self._submit(ring, target[0], target[1], offset_bytes,
                                                length_bytes))
            out: list[bytes | memoryview] = []
            for slot, (offset_bytes, length_bytes) in zip(slots, spans, strict=True):
                if slot is None:
                    out.append(await self.read(offset_bytes, length_bytes))
                else:
                    out.append(await self._complete(slot, offset_bytes, length_bytes))
                waited += 1
            return out
        finally:
            for slot in slots[waited:]:
                if slot is not None and not slot.event.is_set():
                    slot.orphan = True  # the reaper drops its buffer once the kernel is done

    def _route(self, offset_bytes: int, length_bytes: int
               ) -> tuple[_Ring | None, tuple[int, int] | None]:
        """The ring for this read and its (fd, position), or (None, None): a thread."""
        ring = self._ring
        if ring is None or not 0 < length_bytes <= MAX_RING_READ:
            return None, None
        target = self.dev.direct_read_target(offset_bytes, length_bytes)
        if target is None:
            return None, None
        polled = self._polled
        if (polled is not None and length_bytes <= SQPOLL_MAX_READ
                and len(polled.slots) + len(ring.slots) >= SQPOLL_MIN_INFLIGHT):
            return polled, target
        return ring, target

    async def _ring_read(self, ring: _Ring, fd: int, pos: int, offset_bytes: int,
                         length_bytes: int) -> bytes | memoryview:
        slot = await self._submit(ring, fd, pos, offset_bytes, length_bytes)
        return await self._complete(slot, offset_bytes, length_bytes)

    async def _submit(self, ring: _Ring, fd: int, pos: int, offset_bytes: int,
                      length_bytes: int) -> _Slot:
        """Queue one read on `ring`; the slot's event is set when it completes."""
        buf = self._get_buf(length_bytes)
        tag = self._next_tag
        self._next_tag += 1
        while True:
            rc = lib.zn_aring_read(ring.ptr, fd, buf, length_bytes, pos, tag)
            if rc != -errno.EBUSY:
                break
            # Ring full: wait for the reaper to free entries.
            self._ensure_reaper(ring)
            await ring.room.wait()
        if rc < 0:
            self._put_buf(length_bytes, buf)
            raise OSError(-rc, f"read of {length_bytes} bytes at device offset {offset_bytes} "
                          f"could not be submitted: {errno.errorcode.get(-rc, rc)}")
        slot = _Slot(buf)
        ring.slots[tag] = slot
        self._ensure_reaper(ring)
        return slot

    async def _complete(self, slot: _Slot, offset_bytes: int,
                        length_bytes: int) -> bytes | memoryview:
        """Wait for a submitted read; its bytes (a lent view), or OSError."""
        try:
            await slot.event.wait()
        except BaseException:
            # Cancelled: the kernel still owns the buffer; the reaper drops it.
            slot.orphan = True
            raise
        res = slot.result
        buf = slot.buf
        if res == length_bytes:
            return self._lend(buf, length_bytes)
        self._put_buf(length_bytes, buf)
        if res < 0:
            raise OSError(-res, f"read of {length_bytes} bytes at device offset "
                                f"{offset_bytes}: {errno.errorcode.get(-res, res)}")
        # Short read (not expected for written data): let the device's own path
        # retry and report it.
        self.thread_reads += 1
        data = await trio.to_thread.run_sync(self.dev.read, offset_bytes, length_bytes,
                                             limiter=self.limiter)
        return data

    def _ensure_reaper(self, ring: _Ring) -> None:
        if not ring.reaper_started:
            ring.reaper_started = True
            trio.lowlevel.spawn_system_task(self._reap, ring,
                                            name=f"zonefs-py io_uring reaper ({ring.name})")

    async def _reap(self, ring: _Ring) -> None:
        tags = ffi.new("uint64_t[]", RING_ENTRIES)
        results = ffi.new("int32_t[]", RING_ENTRIES)
        try:
            while True:
                try:
                    await trio.lowlevel.wait_readable(ring.efd)
                except trio.ClosedResourceError:
                    return  # close() freed the ring
                while True:
                    n = lib.zn_aring_reap(ring.ptr, tags, results, RING_ENTRIES)
                    if n < 0:
                        log.error("io_uring reap failed: %s", errno.errorcode.get(-n, n))
                        n = 0
                    for i in range(n):
                        slot = ring.slots.pop(tags[i], None)
                        if slot is None:
                            continue
                        if slot.orphan:
                            continue  # the buffer is garbage now: nobody waits for it
                        slot.result = results[i]
                        slot.event.set()
                    if n:
                        ring.room.set()
                        ring.room = trio.Event()
                    if n < RING_ENTRIES:
                        break
        finally:
            ring.reaper_started = False

    def _lend(self, buf: Any, length: int) -> memoryview:
        """A read-only view of `buf` that puts the buffer back on its free list
        when the last reference to the view is dropped (no copy of the data).

        Allocating a fresh 1 MiB object per read costs more than the read on
        a VM: every new page faults in (measured: a no-op FUSE server that
        returns a new 1 MiB bytes per read drops from ~3 GB/s to ~0.6 GB/s).
        """
        owner = ffi.gc(ffi.cast("char *", buf), lambda _ptr: self._put_buf(length, buf))
        return memoryview(ffi.buffer(owner, length)).toreadonly()

    @staticmethod
    def _size_class(length: int) -> int:
        return max(4096, 1 << (length - 1).bit_length())

    def _get_buf(self, length: int) -> Any:
        size = self._size_class(length)
        free = self._free.get(size)
        if free:
            return free.pop()
        ptr = lib.zn_aligned_alloc(size)
        if ptr == ffi.NULL:
            raise MemoryError(f"no memory for a {size}-byte read buffer")
        return ffi.gc(ptr, lib.zn_aligned_free)

    def _put_buf(self, length: int, buf: Any) -> None:
        free = self._free.setdefault(self._size_class(length), [])
        if len(free) < FREE_PER_CLASS:
            free.append(buf)

    # -- closing ------------------------------------------------------------------
    def _rings(self) -> list[_Ring]:
        return [r for r in (self._ring, self._polled) if r is not None]

    async def aclose(self) -> None:
        """Wait for reads in flight, then free the rings (the reader reads through threads)."""
        with trio.move_on_after(10):
            while any(r.slots and r.reaper_started for r in self._rings()):
                await trio.sleep(0.001)
        self.close()

    def close(self) -> None:
        """Free the rings now (buffers of reads still in flight are leaked, not freed)."""
        for ring in self._rings():
            if ring.reaper_started:
                try:
                    trio.lowlevel.notify_closing(ring.efd)
                except RuntimeError:
                    pass  # outside trio: the reaper's run is over
        for fin in self._finalizers:
            fin()
        self._finalizers.clear()
        self._ring = self._polled = None
        self._free.clear()
