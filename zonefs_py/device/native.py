"""Typed Python wrapper over the cffi extension `zonefs_py._native`.

Every function here is a thin call into native/zonefs_native.c, which returns
-errno on failure; this module turns that into `OSError(errno, message)` whose
message names the path or fd and the byte offset. Everything is in bytes.

I/O goes through aligned buffers of a `BufferPool` (a C slab of fixed-size
4096-aligned buffers; transfers longer than one buffer are done in chunks), so
O_DIRECT works with ordinary `bytes`. Offsets and lengths must be multiples
of `block_size` (512 by default; pass the device's logical block size or the
emulator image's block size): anything else raises EINVAL before any I/O.

Threading: every call releases the GIL (cffi API mode) and may block; call
them from worker threads. A `BufferPool` and an `IoRing` are safe to share
between threads (a ring runs one batch at a time).

Caveats:
  * io_uring may be unavailable (old kernel, `kernel.io_uring_disabled`,
    seccomp): `IoRing.create()` then returns None and the batch calls run
    the requests one after another in C.
  * A read or write reaching the end of the file/device raises EIO.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

try:
    from zonefs_py._native import ffi, lib
except ImportError as _exc:  # pragma: no cover - depends on the build
    raise ImportError(
        "zonefs_py._native is not built: run `pip install -e .` or "
        "`python native/build_native.py` (needs build-essential python3-dev liburing-dev)"
    ) from _exc

#: Default size of one pool buffer (and of the chunks of a long transfer).
DEFAULT_BUF_BYTES = 1 << 20
#: Default number of buffers of the default pool (bounds concurrent transfers).
DEFAULT_NR_BUFS = 16
#: Default io_uring submission queue size.
DEFAULT_RING_ENTRIES = 64

ZONE_OPS = {
    "reset": lib.ZN_OP_RESET,
    "open": lib.ZN_OP_OPEN,
    "close": lib.ZN_OP_CLOSE,
    "finish": lib.ZN_OP_FINISH,
}
MODEL_NAMES = {
    lib.ZN_MODEL_NONE: "none",
    lib.ZN_MODEL_HOST_MANAGED: "host-managed",
    lib.ZN_MODEL_HOST_AWARE: "host-aware",
}

Buffer = bytes | bytearray | memoryview


def _raise(rc: int, what: str) -> None:
    """Raise OSError(-rc, what: strerror) for a negative return code."""
    code = -rc
    raise OSError(code, f"{what}: {os.strerror(code)}")


@dataclass(frozen=True, slots=True)
class BlockGeometry:
    """Geometry and limits of a block device, in bytes (0 means "none/no limit")."""

    path: str
    size_bytes: int
    logical_block_size: int
    physical_block_size: int
    zoned_model: str  # "host-managed", "host-aware" or "none"
    zone_size_bytes: int
    nr_zones: int
    max_open_zones: int
    max_active_zones: int
    zone_append_max_bytes: int
    max_io_bytes: int

    @property
    def is_zoned(self) -> bool:
        return self.zoned_model != "none"


@dataclass(frozen=True, slots=True)
class RawZone:
    """One zone from BLKREPORTZONE, in absolute bytes (type/cond as in blkzoned.h)."""

    start_bytes: int
    len_bytes: int
    capacity_bytes: int
    wp_bytes: int
    type: int
    cond: int
    non_seq: bool
    reset_recommended: bool


@dataclass(frozen=True, slots=True)
class PoolStats:
    """Counters of a `BufferPool`."""

    buf_size: int
    nr_bufs: int
    nr_free: int
    acquires: int
    waits: int


class BufferPool:
    """A slab of `nr_bufs` aligned buffers of `buf_size` bytes, owned by C."""

    def __init__(self, nr_bufs: int = DEFAULT_NR_BUFS, buf_size: int = DEFAULT_BUF_BYTES) -> None:
        """Allocate the slab.

        Raises OSError(EINVAL) if buf_size is not a positive multiple of 4096
        (at most 1 GiB) or nr_bufs is not positive; ENOMEM if allocation fails.
        """
        if nr_bufs <= 0 or buf_size <= 0 or nr_bufs >= 1 << 32:
            raise OSError(errno.EINVAL, f"bad buffer pool shape {nr_bufs} x {buf_size} bytes")
        err = ffi.new("int *")
        ptr = lib.zn_pool_new(nr_bufs, buf_size, err)
        if ptr == ffi.NULL:
            _raise(err[0], f"buffer pool {nr_bufs} x {buf_size} bytes")
        self._ptr: Any = ffi.gc(ptr, lib.zn_pool_free)

    @property
    def ptr(self) -> Any:
        """The `struct zn_pool *` for calls into the extension."""
        return self._ptr

    def stats(self) -> PoolStats:
        """Return the pool's counters."""
        out = ffi.new("struct zn_pool_stats *")
        lib.zn_pool_get_stats(self._ptr, out)
        return PoolStats(out.buf_size, out.nr_bufs, out.nr_free, out.acquires, out.waits)


class IoRing:
    """An io_uring for `pread_batch` / `pwrite_batch`; one batch runs at a time."""

    def __init__(self, ptr: Any) -> None:
        self._ptr: Any = ffi.gc(ptr, lib.zn_ring_free)

    @classmethod
    def create(cls, entries: int = DEFAULT_RING_ENTRIES) -> IoRing | None:
        """Return a new ring, or None when the kernel refuses io_uring.

        Raises OSError(EINVAL) for a bad `entries` (must be 1..4096).
        """
        if not 0 < entries <= 4096:
            raise OSError(errno.EINVAL, f"io_uring entries {entries} not in 1..4096")
        err = ffi.new("int *")
        ptr = lib.zn_ring_new(entries, err)
        if ptr == ffi.NULL:
            if -err[0] in (errno.ENOSYS, errno.EPERM, errno.EACCES, errno.EOPNOTSUPP):
                return None
            _raise(err[0], f"io_uring setup ({entries} entries)")
        return cls(ptr)

    @property
    def ptr(self) -> Any:
        """The `struct zn_ring *` for calls into the extension."""
        return self._ptr


_default_lock = threading.Lock()
_default_pool: BufferPool | None = None
_default_ring: list[IoRing | None] = []


def default_pool() -> BufferPool:
    """Return the process-wide pool used when a call gets no `pool` (created lazily)."""
    global _default_pool
    with _default_lock:
        if _default_pool is None:
            _default_pool = BufferPool()
        return _default_pool


def default_ring() -> IoRing | None:
    """Return the process-wide io_uring (None if unavailable), created lazily."""
    with _default_lock:
        if not _default_ring:
            _default_ring.append(IoRing.create())
        return _default_ring[0]


# ---------------------------------------------------------------- files


def open_path(path: str, *, direct: bool = True, read_only: bool = False,
              exclusive: bool = False) -> int:
    """Open `path` and return the fd (O_CLOEXEC; O_DIRECT unless direct=False).

    `exclusive` adds O_EXCL for block devices (EBUSY if another opener holds
    it exclusively); it is ignored for regular files. Raises OSError.
    """
    flags = (lib.ZN_O_DIRECT if direct else 0) | (lib.ZN_O_RDONLY if read_only else 0)
    flags |= lib.ZN_O_EXCL if exclusive else 0
    fd = lib.zn_open(os.fsencode(path), flags)
    if fd < 0:
        _raise(fd, f"open {path!r}")
    return int(fd)


def close_fd(fd: int) -> None:
    """Close `fd`. Raises OSError (EBADF, or EIO from a deferred write error)."""
    rc = lib.zn_close(fd)
    if rc < 0:
        _raise(rc, f"close fd {fd}")


def fdatasync(fd: int) -> None:
    """Flush the data of `fd` (and the device's write cache). Raises OSError."""
    rc = lib.zn_fdatasync(fd)
    if rc < 0:
        _raise(rc, f"fdatasync fd {fd}")


def file_size(fd: int) -> int:
    """Return the size in bytes of a regular file or block device. Raises OSError."""
    size = lib.zn_file_size(fd)
    if size < 0:
        _raise(size, f"size of fd {fd}")
    return int(size)


# ---------------------------------------------------------------- I/O


def _check_aligned(what: str, offset_bytes: int, length_bytes: int, block_size: int) -> None:
    if block_size not in (512, 1024, 2048, 4096):
        raise OSError(errno.EINVAL, f"{what}: block size {block_size} is not 512..4096")
    if offset_bytes < 0 or length_bytes < 0:
        raise OSError(errno.EINVAL, f"{what}: negative offset or length")
    if offset_bytes % block_size or length_bytes % block_size:
        raise OSError(errno.EINVAL,
                      f"{what}: offset {offset_bytes} / length {length_bytes} not a multiple "
                      f"of the {block_size}-byte block")


def pread(fd: int, offset_bytes: int, length_bytes: int, *, block_size: int = 512,
          pool: BufferPool | None = None) -> bytes:
    """Read exactly `length_bytes` at `offset_bytes` (retrying EINTR and short reads).

    Raises OSError: EINVAL for misalignment, EIO at end of file/device, or
    the kernel's errno.
    """
    what = f"read fd {fd} at offset {offset_bytes} ({length_bytes} bytes)"
    _check_aligned(what, offset_bytes, length_bytes, block_size)
    out = bytearray(length_bytes)
    rc = lib.zn_pread(fd, (pool or default_pool()).ptr, block_size, offset_bytes,
                      ffi.from_buffer(out), length_bytes)
    if rc < 0:
        _raise(rc, what)
    return bytes(out)


def pwrite(fd: int, offset_bytes: int, data: Buffer, *, block_size: int = 512,
           pool: BufferPool | None = None) -> None:
    """Write all of `data` at `offset_bytes` (retrying EINTR and short writes).

    Raises OSError: EINVAL for misalignment, or the kernel's errno (EIO for a
    write off a sequential zone's write pointer). Part of the data may have
    been written when it raises.
    """
    view = memoryview(data).cast("B")
    what = f"write fd {fd} at offset {offset_bytes} ({view.nbytes} bytes)"
    _check_aligned(what, offset_bytes, view.nbytes, block_size)
    rc = lib.zn_pwrite(fd, (pool or default_pool()).ptr, block_size, offset_bytes,
                       ffi.from_buffer(view), view.nbytes)
    if rc < 0:
        _raise(rc, what)


def _run_batch(fd: int, is_write: bool, bufs: Sequence[Any], spans: Sequence[tuple[int, int]],
               groups: Sequence[int], block_size: int, pool: BufferPool | None,
               ring: IoRing | None | bool) -> None:
    kind = "write" if is_write else "read"
    for offset_bytes, length_bytes in spans:
        _check_aligned(f"batch {kind} fd {fd} at offset {offset_bytes}", offset_bytes,
                       length_bytes, block_size)
    n = len(spans)
    if n == 0:
        return
    reqs = ffi.new("struct zn_io[]", n)
    keep = []  # the cdata buffers must outlive the call
    for i, ((offset_bytes, length_bytes), buf, group) in enumerate(
            zip(spans, bufs, groups, strict=True)):
        cbuf = ffi.from_buffer(buf)
        keep.append(cbuf)
        reqs[i].offset = offset_bytes
        reqs[i].length = length_bytes
        reqs[i].buf = cbuf
        reqs[i].group = group
    the_ring = default_ring() if ring is True else (ring or None)
    rc = lib.zn_batch(the_ring.ptr if the_ring is not None else ffi.NULL, fd,
                      (pool or default_pool()).ptr, block_size, int(is_write), reqs, n)
    if rc < 0:
        failed = next((i for i in range(n) if reqs[i].result < 0
                       and reqs[i].result != -errno.ECANCELED), None)
        if failed is None:
            _raise(rc, f"batch {kind} fd {fd}")
        else:
            _raise(int(reqs[failed].result),
                   f"batch {kind} fd {fd} at offset {spans[failed][0]} "
                   f"({spans[failed][1]} bytes, request {failed} of {n})")


def pread_batch(fd: int, spans: Iterable[tuple[int, int]], *, block_size: int = 512,
                pool: BufferPool | None = None, ring: IoRing | None | bool = True
                ) -> list[bytes]:
    """Read every (offset_bytes, length_bytes) span, in parallel, and return the data.

    `ring=True` uses the default io_uring, an `IoRing` that ring, and
    None/False runs the spans one after another. Raises OSError naming the
    first failed span (no partial results).
    """
    span_list = [(int(o), int(n)) for o, n in spans]
    outs = [bytearray(max(n, 0)) for _o, n in span_list]
    _run_batch(fd, False, outs, span_list, range(len(span_list)), block_size, pool, ring)
    return [bytes(o) for o in outs]


def pwrite_batch(fd: int, writes: Iterable[tuple[int, Buffer]], *, block_size: int = 512,
                 pool: BufferPool | None = None, ring: IoRing | None | bool = True,
                 zone_size_bytes: int = 0) -> None:
    """Write every (offset_bytes, data) pair; writes to one zone stay in order.

    With `zone_size_bytes`, writes falling in the same zone form one group:
    they are issued in the given order with one in flight at a time (as a
    sequential zone needs), while different zones proceed in parallel. With 0
    every write is its own group. After a failure, the later writes of the
    same group are not issued. Raises OSError naming the first failed write.
    """
    pairs = [(int(o), memoryview(d).cast("B")) for o, d in writes]
    spans = [(o, v.nbytes) for o, v in pairs]
    if zone_size_bytes > 0:
        groups: Sequence[int] = [o // zone_size_bytes for o, _v in pairs]
    else:
        groups = range(len(pairs))
    _run_batch(fd, True, [v for _o, v in pairs], spans, groups, block_size, pool, ring)


# ---------------------------------------------------------------- zoned block devices


def block_geometry(fd: int, path: str) -> BlockGeometry:
    """Return the geometry of the block device open as `fd` (`path` names it in errors).

    Raises OSError: ENOTBLK for a regular file, or the ioctl's errno.
    """
    out = ffi.new("struct zn_geometry *")
    rc = lib.zn_geometry(fd, out)
    if rc < 0:
        _raise(rc, f"geometry of {path!r}")
    return BlockGeometry(
        path=path,
        size_bytes=out.size_bytes,
        logical_block_size=out.logical_block_size,
        physical_block_size=out.physical_block_size,
        zoned_model=MODEL_NAMES.get(out.model, "none"),
        zone_size_bytes=out.zone_size_bytes,
        nr_zones=out.nr_zones,
        max_open_zones=out.max_open_zones,
        max_active_zones=out.max_active_zones,
        zone_append_max_bytes=out.zone_append_max_bytes,
        max_io_bytes=out.max_io_bytes,
    )


def report_zones(fd: int, first_offset_bytes: int, max_zones: int) -> list[RawZone]:
    """Return up to `max_zones` zones starting with the one holding `first_offset_bytes`.

    Capacity equals the zone length when the kernel does not report
    BLK_ZONE_REP_CAPACITY. Returns fewer zones past the end of the device.
    Raises OSError: EINVAL for a negative or non-512-aligned offset, ENOTTY
    on a regular file or non-zoned device, or the ioctl's errno.
    """
    if first_offset_bytes < 0 or max_zones < 0 or max_zones >= 1 << 31:
        raise OSError(errno.EINVAL, f"report zones fd {fd}: bad offset {first_offset_bytes} "
                      f"or count {max_zones}")
    if max_zones == 0:
        return []
    out = ffi.new("struct zn_zone[]", max_zones)
    rc = lib.zn_report_zones(fd, first_offset_bytes, out, max_zones)
    if rc < 0:
        _raise(rc, f"report zones fd {fd} at offset {first_offset_bytes}")
    return [
        RawZone(z.start, z.len, z.capacity, z.wp, z.type, z.cond,
                bool(z.flags & lib.ZN_ZONE_NON_SEQ),
                bool(z.flags & lib.ZN_ZONE_RESET_RECOMMENDED))
        for z in (out[i] for i in range(rc))
    ]


def zone_mgmt(fd: int, op: str, offset_bytes: int, length_bytes: int) -> None:
    """Apply "reset", "open", "close" or "finish" to the zones in [offset, offset+length).

    Raises OSError: EINVAL for an unknown op or a range that is not
    zone-aligned, EIO for a transition the device refuses, ETOOMANYREFS /
    EOVERFLOW at the open / active limits, EBADF on a read-only fd.
    """
    code = ZONE_OPS.get(op)
    what = f"zone {op} fd {fd} at offset {offset_bytes} ({length_bytes} bytes)"
    if code is None:
        raise OSError(errno.EINVAL, f"{what}: unknown operation (one of {sorted(ZONE_OPS)})")
    if offset_bytes < 0 or length_bytes <= 0:
        raise OSError(errno.EINVAL, f"{what}: bad range")
    rc = lib.zn_zone_mgmt(fd, code, offset_bytes, length_bytes)
    if rc < 0:
        _raise(rc, what)


def zoned_model(path: str) -> str:
    """Return the sysfs zoned model of block device `path` ("none" if not zoned).

    Raises OSError: ENOENT if missing, ENOTBLK if not a block device.
    """
    rc = lib.zn_sysfs_zoned_model(os.fsencode(path))
    if rc < 0:
        _raise(rc, f"zoned model of {path!r}")
    return MODEL_NAMES.get(rc, "none")


def is_zoned_block_device(path: str) -> bool:
    """Return True if `path` is a host-managed or host-aware zoned block device."""
    try:
        return zoned_model(path) != "none"
    except OSError:
        return False


# ---------------------------------------------------------------- NVMe zone append


class ZoneAppendHandle:
    """NVMe Zone Append through io_uring passthrough on a generic char device (/dev/ngXnY).

    One fd, one ring (128-byte SQEs, 32-byte CQEs) and `entries` aligned
    bounce buffers of `max_bytes`, owned by C (native/zonefs_zappend.c). One
    `run` at a time per handle: use one handle per thread for appends from
    several threads, or `run` several appends at once.
    """

    def __init__(self, chardev: str, *, block_size: int, max_bytes: int,
                 entries: int = 8) -> None:
        """Open `chardev` and prove passthrough works (an NVMe Flush).

        Raises OSError: ENOENT/EACCES opening it, ENOTTY if it is not an NVMe
        namespace, EOPNOTSUPP/EINVAL where the kernel has no NVMe passthrough
        over io_uring, EINVAL for a bad shape.
        """
        err = ffi.new("int *")
        ptr = lib.zn_zapp_open(os.fsencode(chardev), block_size, max_bytes, entries, err)
        if ptr == ffi.NULL:
            _raise(err[0], f"zone append through {chardev!r}")
        self._ptr: Any = ffi.gc(ptr, lib.zn_zapp_free)
        self.chardev = chardev
        self.block_size = block_size
        self.max_bytes = max_bytes
        self.entries = entries
        self.nsid = int(lib.zn_zapp_nsid(ptr))

    def run(self, appends: Sequence[tuple[int, Buffer]]) -> list[int | OSError]:
        """Zone-append each (zone_start_bytes, data); return where each landed, or its error.

        Up to `entries` appends are in flight at once; the device decides
        their order. A refusal by the device is OSError(EIO) (EOVERFLOW /
        ETOOMANYREFS at the active / open limits, as the kernel maps them)
        whose message gives the NVMe status. Raises OSError(EINVAL), nothing
        issued, for a length that is empty, unaligned or over `max_bytes`.
        """
        n = len(appends)
        if n == 0:
            return []
        reqs = ffi.new("struct zn_zappend[]", n)
        keep = []
        for i, (zone_start, data) in enumerate(appends):
            view = memoryview(data).cast("B")
            cbuf = ffi.from_buffer(view)
            keep.append(cbuf)
            reqs[i].zone_start = zone_start
            reqs[i].length = view.nbytes
            reqs[i].buf = cbuf
        rc = lib.zn_zapp_run(self._ptr, reqs, n)
        if rc < 0 and rc != -errno.EIO:
            _raise(rc, f"zone append through {self.chardev!r} ({n} appends)")
        out: list[int | OSError] = []
        for i in range(n):
            r = reqs[i]
            if r.result == 0:
                out.append(int(r.landed))
                continue
            code = -int(r.result)
            what = (f"zone append of {int(r.length)} bytes to the zone at {int(r.zone_start)} "
                    f"through {self.chardev!r}")
            if r.nvme_status:
                out.append(OSError(code, f"{what}: NVMe status {int(r.nvme_status):#x} "
                                         f"({nvme_status_name(int(r.nvme_status))})"))
            else:
                out.append(OSError(code, f"{what}: {os.strerror(code)}"))
        return out


#: Command-specific status codes (SCT 1) of the NVMe ZNS command set, and generic ones.
_NVME_STATUS = {
    0x1B8: "Zone Boundary Error", 0x1B9: "Zone Is Full", 0x1BA: "Zone Is Read Only",
    0x1BB: "Zone Is Offline", 0x1BC: "Zone Invalid Write", 0x1BD: "Too Many Active Zones",
    0x1BE: "Too Many Open Zones", 0x1BF: "Invalid Zone State Transition",
    0x002: "Invalid Field in Command", 0x080: "LBA Out of Range",
}


def nvme_status_name(status: int) -> str:
    """Name an NVMe status (SCT << 8 | SC, with the DNR/More bits ignored)."""
    return _NVME_STATUS.get(status & 0x7FF, "see the NVMe specification")
