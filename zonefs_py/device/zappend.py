"""True zone append for `BlockZonedDevice`: NVMe Zone Append through io_uring passthrough.

`ZoneAppendAppender` is the `ZoneAppender` (blockdev.py) that sends an append
to the zone, not to an offset: the drive picks the address and returns it
(native/zonefs_zappend.c), so appends to one zone need no write-pointer lock
and several are in flight at once. It is chosen by `choose_appender` when
the device reports `zone_append_max_bytes` > 0 and its NVMe generic char
device (/dev/ngXnY) opens for passthrough; otherwise appends stay plain
writes at the cached write pointer (`WritePointerAppender`: null_blk, SMR,
kernels without passthrough, `-o zone_append=off`).

Appends larger than `zone_append_max_bytes` (128 KiB on QEMU with zasl=5)
cannot be one command, and pieces of one append must land contiguously (the
protocol returns one offset), so such an append takes the zone exclusively:
it waits for the zone's appends in flight, holds back new ones, and issues
its pieces one at a time (each must land where the previous ended, or the
call fails with EIO). Appends up to the limit share the zone.

Threading: one `ZoneAppendHandle` (fd + ring) per concurrent caller, kept on
a free list (at most `MAX_HANDLES`; more callers wait for one).

Caveats:
  * Zone management commands and explicit-offset writes to a zone do not
    wait for its appends in flight; the caller orders them (the filesystem's
    allocator never resets or finishes a zone with appends in flight).
  * The cached end of written data is the highest end of any completed
    append; blocks below it of an append still in flight read as whatever
    the device holds there (the filesystem never reads unacknowledged data).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from zonefs_py.device import native
from zonefs_py.device.appender import AppendTarget, ZoneState

log = logging.getLogger(__name__)

#: Most handles (fd + ring + bounce buffers) per device; more concurrent callers wait.
MAX_HANDLES = 16
#: Appends in flight per handle (for `append_many`).
HANDLE_ENTRIES = 8
#: Values of the `zone_append` mount option.
MODES = ("auto", "on", "off")


class _Gate:
    """Shared (appends up to the limit) / exclusive (a multi-piece append) use of a zone."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._shared = 0
        self._exclusive = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cv:
            while self._exclusive:
                self._cv.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cv:
                self._shared -= 1
                self._cv.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cv:
            while self._exclusive:
                self._cv.wait()
            self._exclusive = True
            while self._shared:
                self._cv.wait()
        try:
            yield
        finally:
            with self._cv:
                self._exclusive = False
                self._cv.notify_all()


def _sysfs_nsid(block_name: str) -> int | None:
    try:
        return int(Path(f"/sys/block/{block_name}/nsid").read_text())
    except (OSError, ValueError):
        return None


def generic_chardev_candidates(block_path: str) -> list[str]:
    """The NVMe generic char devices that may belong to block device `block_path`.

    nvmeXnY's twin is ngXnY without multipath naming; otherwise every
    /dev/ng* of the same controller. Empty for a device that is not NVMe.
    """
    name = os.path.basename(os.path.realpath(block_path))
    if not name.startswith("nvme"):
        return []
    out = [f"/dev/ng{name[4:]}"]
    ctrl = os.path.realpath(f"/sys/block/{name}/device")
    generic = Path("/sys/class/nvme-generic")
    if generic.is_dir():
        for entry in sorted(generic.iterdir()):
            dev = f"/dev/{entry.name}"
            if dev not in out and os.path.realpath(entry / "device") == ctrl:
                out.append(dev)
    return [p for p in out if os.path.exists(p)]


def open_handle(block_path: str, block_size: int,
                max_bytes: int) -> tuple[native.ZoneAppendHandle | None, str]:
    """Open zone append for `block_path`: (handle, "") or (None, why not)."""
    name = os.path.basename(os.path.realpath(block_path))
    want_nsid = _sysfs_nsid(name)
    candidates = generic_chardev_candidates(block_path)
    if not candidates:
        return None, "no NVMe generic char device (/dev/ngXnY) for this device"
    why = ""
    for chardev in candidates:
        try:
            handle = native.ZoneAppendHandle(chardev, block_size=block_size,
                                             max_bytes=max_bytes, entries=HANDLE_ENTRIES)
        except OSError as exc:
            why = f"{chardev}: {exc.strerror or exc}"
            continue
        if want_nsid is None or handle.nsid == want_nsid:
            return handle, ""
        why = f"{chardev} is namespace {handle.nsid}, not {want_nsid}"
    return None, why


class ZoneAppendAppender:
    """Append with NVMe Zone Append: the device picks the address (see the module doc)."""

    def __init__(self, first: native.ZoneAppendHandle) -> None:
        self.chardev = first.chardev
        self.block_size = first.block_size
        self.max_bytes = first.max_bytes
        self._free = [first]
        self._made = 1
        self._cv = threading.Condition()
        self._gates: dict[int, _Gate] = {}
        self.appends = 0

    @contextmanager
    def _handle(self) -> Iterator[native.ZoneAppendHandle]:
        with self._cv:
            while not self._free and self._made >= MAX_HANDLES:
                self._cv.wait()
            handle = self._free.pop() if self._free else None
            if handle is None:
                self._made += 1
        if handle is None:
            try:
                handle = native.ZoneAppendHandle(self.chardev, block_size=self.block_size,
                                                 max_bytes=self.max_bytes,
                                                 entries=HANDLE_ENTRIES)
            except BaseException:
                with self._cv:
                    self._made -= 1
                    self._cv.notify()
                raise
        try:
            yield handle
        finally:
            with self._cv:
                self._free.append(handle)
                self._cv.notify()

    def _gate(self, zone_idx: int) -> _Gate:
        with self._cv:
            return self._gates.setdefault(zone_idx, _Gate())

    def append(self, dev: AppendTarget, zone_idx: int, data: memoryview) -> int:
        """Zone-append `data`; return the absolute offset where it landed. Raises OSError."""
        if data.nbytes > self.max_bytes:
            return self._append_pieces(dev, zone_idx, data)
        return self.append_many(dev, zone_idx, [data])[0]

    def append_many(self, dev: AppendTarget, zone_idx: int,
                    datas: Sequence[memoryview]) -> list[int]:
        """Zone-append each buffer (each <= max_bytes) at once; return where each landed.

        Raises the first failure as OSError (the others may have landed).
        """
        st = dev.zone_state(zone_idx)
        with self._gate(zone_idx).shared(), self._handle() as handle:
            results = handle.run([(st.start, d) for d in datas])
        return self._account(dev, st, zone_idx, results, [d.nbytes for d in datas])

    def _account(self, dev: AppendTarget, st: ZoneState, zone_idx: int,
                 results: Sequence[int | OSError], lengths: Sequence[int]) -> list[int]:
        """Advance the zone's cache past what landed; raise the first error."""
        failed = next((r for r in results if isinstance(r, OSError)), None)
        with st.lock:
            for landed, n in zip(results, lengths, strict=True):
                if isinstance(landed, int):
                    st.wp = max(st.wp, landed + n)
                    st.data_end = max(st.data_end, landed + n)
            self.appends += sum(isinstance(r, int) for r in results)
            if failed is not None:
                dev.refresh_after_error_locked(st, zone_idx)
        if failed is not None:
            raise OSError(failed.errno, f"{dev.info.path}: zone {zone_idx}: "
                                        f"{failed.strerror}")
        for landed, n in zip(results, lengths, strict=True):
            assert isinstance(landed, int)
            if not st.start <= landed <= st.start + st.capacity - n:
                raise OSError(errno.EIO, f"{dev.info.path}: zone append to zone {zone_idx} "
                              f"reported address {landed} outside the zone")
        return [r for r in results if isinstance(r, int)]

    def _append_pieces(self, dev: AppendTarget, zone_idx: int, data: memoryview) -> int:
        """An append over the command limit: pieces in order, the zone held exclusively."""
        st = dev.zone_state(zone_idx)
        with self._gate(zone_idx).exclusive(), self._handle() as handle:
            with st.lock:
                start = st.wp
                dev.check_fits_locked(st, zone_idx, start, data.nbytes)
            pos = 0
            while pos < data.nbytes:
                piece = data[pos:pos + self.max_bytes]
                landed = self._account(dev, st, zone_idx, handle.run([(st.start, piece)]),
                                       [piece.nbytes])[0]
                if landed != start + pos:
                    raise OSError(errno.EIO, f"{dev.info.path}: zone {zone_idx}: piece of a "
                                  f"zone append landed at {landed}, not {start + pos} "
                                  "(another writer in the zone)")
                pos += piece.nbytes
        return start


def choose_appender(path: str, geometry: native.BlockGeometry, mode: str, *,
                    read_only: bool) -> ZoneAppendAppender | None:
    """The appender for `mode` ("auto", "on", "off"): a `ZoneAppendAppender` or None.

    None means writes at the write pointer. Raises OSError(EOPNOTSUPP) when
    `mode` is "on" and the device cannot do zone append, ValueError for an
    unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"zone_append must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "off" or read_only:
        return None
    if geometry.zone_append_max_bytes <= 0:
        why = "the device reports zone_append_max_bytes = 0"
        handle = None
    else:
        max_bytes = min(geometry.zone_append_max_bytes, geometry.max_io_bytes or (1 << 30))
        max_bytes -= max_bytes % geometry.logical_block_size
        handle, why = open_handle(path, geometry.logical_block_size, max_bytes)
    if handle is None:
        if mode == "on":
            raise OSError(errno.EOPNOTSUPP, f"{path}: zone_append=on but zone append is not "
                                            f"available: {why}")
        log.info("%s: appends are writes at the write pointer (%s)", path, why)
        return None
    log.info("%s: appends are NVMe Zone Appends through %s (up to %d bytes each)", path,
             handle.chardev, handle.max_bytes)
    return ZoneAppendAppender(handle)
