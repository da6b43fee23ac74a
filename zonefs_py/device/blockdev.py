"""`BlockZonedDevice`: the `ZonedDevice` protocol on a real Linux zoned block device.

NVMe ZNS namespaces, SMR disks and zoned null_blk devices all look alike
here: zone reports and zone management through the BLK*ZONE ioctls, data
through O_DIRECT pread/pwrite (`zonefs_py.device.native`).

Append: Linux offers no zone-append command to user space for block devices,
only NVMe passthrough via io_uring_cmd. Behind the `ZoneAppender` seam:
  * `zappend.ZoneAppendAppender` -- NVMe Zone Append through the namespace's
    generic char device; the device picks the address, appends to one zone
    run concurrently (`info.zone_append` is true). Chosen at open when the
    device supports it (`zone_append="auto"`, the default; "on" requires it).
  * `WritePointerAppender` -- a write at the cached write pointer, serialised
    per zone by a lock (one in-flight write per zone), the cache advanced on
    success. The fallback (null_blk, SMR, `zone_append="off"`).
The cache is loaded from a zone report at open and refreshed from one after
any failed write or zone command, so after an error the next append lands at
the device's real write pointer.

Errors are the kernel's (docs/kernel-zoned-behaviour.md): EIO for a write off
the write pointer, past capacity or into a FULL zone, and for a zone command
the zone's state does not allow; ETOOMANYREFS / EOVERFLOW at the open /
active limits; EBADF for writes on a read-only open. Two checks are made here
first so that nothing is half-written: an append or write that would cross
the zone capacity fails with EIO before any I/O (the kernel would accept the
leading chunks of a multi-chunk transfer), and ranges outside the device fail
with EINVAL.

Caveats:
  * null_blk returns 0xFF for blocks past the write pointer; `read()` turns
    everything past the cached end of written data into zeros, as the
    protocol promises. For a zone that was already FULL when the device was
    opened, the end of written data is unknown and taken to be the capacity.
  * A device failure in the middle of a large write can leave part of it on
    the device (the write pointer shows how much); the call still raises.
  * Zones must all have the same size (no smaller last zone); such devices
    are refused.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from zonefs_py.device import native
from zonefs_py.device.appender import ZoneState as _ZoneState
from zonefs_py.device.base import DeviceInfo, Zone, ZoneCond, ZoneType
from zonefs_py.errors import DeviceRefused

Buffer = bytes | bytearray | memoryview


class ZoneAppender(Protocol):
    """How `BlockZonedDevice.append` puts data at a zone's write pointer."""

    def append(self, dev: BlockZonedDevice, zone_idx: int, data: memoryview) -> int:
        """Write `data` at the zone's write pointer; return its absolute offset."""
        ...


class WritePointerAppender:
    """Append as a plain write at the cached write pointer, under the zone lock."""

    def append(self, dev: BlockZonedDevice, zone_idx: int, data: memoryview) -> int:
        """Write at the cached WP and advance it. Raises OSError (see the module doc)."""
        st = dev.zone_state(zone_idx)
        with st.lock:
            offset = st.wp
            dev.check_fits_locked(st, zone_idx, offset, data.nbytes)
            dev.write_locked(st, zone_idx, offset, data)
            return offset


class BlockZonedDevice:
    """A zoned block device behind the `ZonedDevice` protocol (thread-safe)."""

    def __init__(self, path: str, fd: int, geometry: native.BlockGeometry, *,
                 read_only: bool, pool: native.BufferPool | None = None,
                 appender: ZoneAppender | None = None, zone_append: bool = False) -> None:
        """Wrap an fd opened by `open()`; use `open()` instead of calling this."""
        self._path = path
        self._fd = fd
        self._closed = False
        self._close_lock = threading.Lock()
        self._bs = geometry.logical_block_size
        self._zone_size = geometry.zone_size_bytes
        self._pool = pool or native.default_pool()
        self._appender = appender or WritePointerAppender()
        self._info = DeviceInfo(
            path=path, kind="block", block_size=geometry.logical_block_size,
            zone_size_bytes=geometry.zone_size_bytes, nr_zones=geometry.nr_zones,
            max_open_zones=geometry.max_open_zones, max_active_zones=geometry.max_active_zones,
            zone_append_max_bytes=geometry.zone_append_max_bytes, read_only=read_only,
            zone_append=zone_append)
        self._zones = [self._state_of(z) for z in self._raw_report(0, geometry.nr_zones)]
        if len(self._zones) != geometry.nr_zones:
            raise OSError(errno.EIO, f"{path}: report gave {len(self._zones)} zones, "
                          f"expected {geometry.nr_zones}")

    @classmethod
    def open(cls, path: str, *, read_only: bool = False,
             pool: native.BufferPool | None = None,
             zone_append: str = "auto") -> BlockZonedDevice:
        """Open zoned block device `path` (O_DIRECT; O_EXCL unless read-only).

        `zone_append`: "auto" uses NVMe Zone Append when the device has it,
        "on" requires it, "off" writes at the write pointer (zappend.py).
        Raises DeviceRefused if `path` is not a zoned block device or has a
        smaller last zone, OSError for open/ioctl failures (EBUSY if another
        process holds it exclusively; EOPNOTSUPP for "on" without zone
        append), ValueError for an unknown `zone_append`.
        """
        from zonefs_py.device.zappend import choose_appender

        fd = native.open_path(path, direct=True, read_only=read_only, exclusive=not read_only)
        try:
            geo = native.block_geometry(fd, path)
            if not geo.is_zoned:
                raise DeviceRefused(f"{path} is a block device that is not zoned "
                                    "(expected a host-managed or host-aware zoned device)")
            if geo.zone_size_bytes * geo.nr_zones != geo.size_bytes:
                raise DeviceRefused(f"{path} has zones of unequal size ({geo.nr_zones} zones of "
                                    f"{geo.zone_size_bytes} bytes != {geo.size_bytes} bytes)")
            appender = choose_appender(path, geo, zone_append, read_only=read_only)
            return cls(path, fd, geo, read_only=read_only, pool=pool, appender=appender,
                       zone_append=appender is not None)
        except BaseException:
            native.close_fd(fd)
            raise

    # ------------------------------------------------------------ helpers

    def _raw_report(self, first_zone: int, count: int) -> list[native.RawZone]:
        return native.report_zones(self._fd, first_zone * self._zone_size, count)

    @staticmethod
    def _state_of(raw: native.RawZone) -> _ZoneState:
        ztype = ZoneType(raw.type)
        cond = ZoneCond(raw.cond)
        if ztype is ZoneType.CONVENTIONAL:
            wp = data_end = raw.start_bytes + raw.len_bytes
        elif cond is ZoneCond.FULL:
            wp = data_end = raw.start_bytes + raw.capacity_bytes
        else:
            wp = data_end = raw.wp_bytes
        return _ZoneState(raw.start_bytes, raw.len_bytes, raw.capacity_bytes, ztype, wp, data_end)

    def _refresh_locked(self, st: _ZoneState, zone_idx: int) -> ZoneCond:
        """Reload the zone's write pointer from the device (caller holds st.lock)."""
        raw = self._raw_report(zone_idx, 1)[0]
        cond = ZoneCond(raw.cond)
        if st.sequential:
            if cond is ZoneCond.FULL:
                st.wp = st.start + st.capacity
                st.data_end = min(max(st.data_end, st.start), st.wp)
            else:
                st.wp = st.data_end = raw.wp_bytes
        return cond

    def _check_open(self) -> None:
        if self._closed:
            raise OSError(errno.EBADF, f"{self._path}: device is closed")

    def _check_zone(self, zone_idx: int) -> None:
        if not 0 <= zone_idx < self._info.nr_zones:
            raise OSError(errno.EINVAL, f"{self._path}: zone {zone_idx} out of range "
                          f"0..{self._info.nr_zones - 1}")

    def _check_range(self, what: str, offset_bytes: int, length_bytes: int) -> None:
        bs = self._bs
        if offset_bytes < 0 or length_bytes < 0 or offset_bytes % bs or length_bytes % bs:
            raise OSError(errno.EINVAL, f"{self._path}: {what} at offset {offset_bytes} "
                          f"({length_bytes} bytes) is not aligned to {self._bs}-byte blocks")
        if offset_bytes + length_bytes > self._info.size_bytes:
            raise OSError(errno.EINVAL, f"{self._path}: {what} at offset {offset_bytes} "
                          f"({length_bytes} bytes) ends past the device "
                          f"({self._info.size_bytes} bytes)")

    def zone_state(self, zone_idx: int) -> _ZoneState:
        """Return the cached state of a zone (for `ZoneAppender`s). Raises OSError(EINVAL)."""
        self._check_open()
        self._check_zone(zone_idx)
        return self._zones[zone_idx]

    @property
    def appender(self) -> ZoneAppender:
        """How appends are issued (`zappend.ZoneAppendAppender` or `WritePointerAppender`)."""
        return self._appender

    def refresh_after_error_locked(self, st: _ZoneState, zone_idx: int) -> None:
        """Reload a sequential zone's write pointer after a failed write (caller holds
        st.lock); a failing report is ignored (the next write fails and retries)."""
        if st.sequential:
            try:
                self._refresh_locked(st, zone_idx)
            except OSError:
                pass

    def check_fits_locked(self, st: _ZoneState, zone_idx: int, offset_bytes: int,
                          length_bytes: int) -> None:
        """Fail with EIO, before any I/O, a sequential write that would cross capacity."""
        if st.sequential and offset_bytes + length_bytes > st.start + st.capacity:
            raise OSError(errno.EIO, f"{self._path}: write of {length_bytes} bytes at offset "
                          f"{offset_bytes} crosses the capacity of zone {zone_idx} "
                          f"(ends at {st.start + st.capacity})")

    def write_locked(self, st: _ZoneState, zone_idx: int, offset_bytes: int,
                     data: memoryview) -> None:
        """Write inside one zone and advance its cache (caller holds st.lock).

        Raises the kernel's OSError; the cache is then refreshed from the device.
        """
        try:
            native.pwrite(self._fd, offset_bytes, data, block_size=self._bs, pool=self._pool)
        except OSError as exc:
            self.refresh_after_error_locked(st, zone_idx)
            raise OSError(exc.errno, f"{self._path}: zone {zone_idx}: {exc.strerror}") from exc
        if st.sequential:
            st.wp = st.data_end = offset_bytes + data.nbytes

    # ------------------------------------------------------------ protocol

    @property
    def info(self) -> DeviceInfo:
        """Geometry and limits, from the ioctls and sysfs at open."""
        return self._info

    def report_zones(self, first_zone: int = 0, count: int | None = None) -> list[Zone]:
        """Return the device's report of zones [first_zone, first_zone + count).

        Raises OSError(EINVAL) for a range outside the device, or the ioctl's error.
        """
        self._check_open()
        nr = self._info.nr_zones
        if count is None:
            count = nr - first_zone
        if not 0 <= first_zone <= nr or count < 0 or first_zone + count > nr:
            raise OSError(errno.EINVAL, f"{self._path}: zones {first_zone}..+{count} "
                          f"outside 0..{nr - 1}")
        return [
            Zone(index=first_zone + i, start_bytes=raw.start_bytes, size_bytes=raw.len_bytes,
                 capacity_bytes=raw.capacity_bytes, wp_bytes=raw.wp_bytes,
                 type=ZoneType(raw.type), cond=ZoneCond(raw.cond))
            for i, raw in enumerate(self._raw_report(first_zone, count))
        ]

    def _mgmt(self, op: str, zone_idx: int) -> None:
        st = self.zone_state(zone_idx)
        with st.lock:
            try:
                native.zone_mgmt(self._fd, op, st.start, st.size)
            except OSError as exc:
                raise OSError(exc.errno, f"{self._path}: {op} zone {zone_idx}: "
                              f"{exc.strerror}") from exc
            finally:
                if st.sequential:
                    self._refresh_locked(st, zone_idx)

    def reset_zone(self, zone_idx: int) -> None:
        """Rewind the write pointer (EMPTY). Raises OSError (EIO for a conventional zone)."""
        self._mgmt("reset", zone_idx)

    def open_zone(self, zone_idx: int) -> None:
        """Open the zone explicitly. Raises OSError (EIO if FULL, ETOOMANYREFS, EOVERFLOW)."""
        self._mgmt("open", zone_idx)

    def close_zone(self, zone_idx: int) -> None:
        """Close an open zone (EMPTY if nothing written). Raises OSError (EIO if EMPTY/FULL)."""
        self._mgmt("close", zone_idx)

    def finish_zone(self, zone_idx: int) -> None:
        """Make the zone FULL. Raises OSError (EOVERFLOW/ETOOMANYREFS at the limits)."""
        self._mgmt("finish", zone_idx)

    def direct_read_target(self, offset_bytes: int, length_bytes: int) -> tuple[int, int] | None:
        """(fd, offset) for a plain O_DIRECT read of written data in one zone, else None.

        None sends the read through `read()` (which masks unwritten bytes).
        """
        if self._closed or length_bytes <= 0:
            return None
        try:
            self._check_range("read", offset_bytes, length_bytes)
        except OSError:
            return None  # read() raises the error
        end = offset_bytes + length_bytes
        zone_idx = offset_bytes // self._zone_size
        if (end - 1) // self._zone_size != zone_idx:
            return None
        st = self._zones[zone_idx]
        if st.sequential and st.data_end < end:
            return None
        return self._fd, offset_bytes

    def read(self, offset_bytes: int, length_bytes: int) -> bytes:
        """Read block-aligned bytes; bytes past a zone's written data read as zeros.

        Raises OSError: EINVAL for misalignment or a range past the device end,
        or the kernel's errno.
        """
        self._check_open()
        self._check_range("read", offset_bytes, length_bytes)
        if length_bytes == 0:
            return b""
        # Snapshot the end of written data first: data landing during the read
        # is masked, as if the read had come before the write.
        masks = []
        end = offset_bytes + length_bytes
        for zone_idx in range(offset_bytes // self._zone_size, (end - 1) // self._zone_size + 1):
            st = self._zones[zone_idx]
            if st.sequential and st.data_end < st.start + st.size:
                masks.append((max(st.data_end, offset_bytes), min(st.start + st.size, end)))
        data = native.pread(self._fd, offset_bytes, length_bytes, block_size=self._bs,
                            pool=self._pool)
        masks = [(lo, hi) for lo, hi in masks if lo < hi]
        if not masks:
            return data
        out = bytearray(data)
        for lo, hi in masks:
            out[lo - offset_bytes:hi - offset_bytes] = bytes(hi - lo)
        return bytes(out)

    def append(self, zone_idx: int, data: Buffer) -> int:
        """Write `data` at the zone's write pointer and return the absolute offset.

        Raises OSError: EINVAL for an empty or misaligned buffer or a bad zone,
        EIO for a conventional zone (as the kernel answers a zone append
        there), a FULL zone or one without room, ETOOMANYREFS / EOVERFLOW at
        the open / active limits, EBADF on a read-only device.
        """
        view = memoryview(data).cast("B")
        st = self.zone_state(zone_idx)
        if view.nbytes == 0 or view.nbytes % self._bs:
            raise OSError(errno.EINVAL, f"{self._path}: append of {view.nbytes} bytes to zone "
                          f"{zone_idx} is not a positive multiple of {self._bs}")
        if not st.sequential:
            raise OSError(errno.EIO, f"{self._path}: append to conventional zone {zone_idx}")
        return self._appender.append(self, zone_idx, view)

    def append_scattered(self, zone_idx: int, data: Buffer) -> list[tuple[int, int]]:
        """Append `data` as zone appends of up to `zone_append_max_bytes`, all in flight
        at once; return [(offset, length)] of its consecutive slices, in data order.

        Without zone append it is one `append`. Raises OSError like `append`;
        slices of a failed call may have landed (garbage below the WP).
        """
        from zonefs_py.device.zappend import ZoneAppendAppender

        view = memoryview(data).cast("B")
        appender = self._appender
        if not isinstance(appender, ZoneAppendAppender) or view.nbytes <= appender.max_bytes:
            return [(self.append(zone_idx, view), view.nbytes)]
        st = self.zone_state(zone_idx)
        if view.nbytes % self._bs or not st.sequential:
            return [(self.append(zone_idx, view), view.nbytes)]  # append() raises
        step = appender.max_bytes
        pieces = [view[pos:pos + step] for pos in range(0, view.nbytes, step)]
        landed = appender.append_many(self, zone_idx, pieces)
        return [(off, p.nbytes) for off, p in zip(landed, pieces, strict=True)]

    @contextmanager
    def _locked_zones(self, first: int, last: int) -> Iterator[None]:
        """Hold the locks of sequential zones first..last, taken in index order."""
        held = []
        try:
            for zone_idx in range(first, last + 1):
                st = self._zones[zone_idx]
                if st.sequential:
                    st.lock.acquire()
                    held.append(st)
            yield
        finally:
            for st in reversed(held):
                st.lock.release()

    def write(self, offset_bytes: int, data: Buffer) -> None:
        """Write at an explicit offset (anywhere in conventional zones, at the WP otherwise).

        Raises OSError: EINVAL for misalignment or a range past the device,
        EIO off the write pointer or across a sequential zone's capacity or
        end, or the kernel's errno.
        """
        view = memoryview(data).cast("B")
        self._check_open()
        self._check_range("write", offset_bytes, view.nbytes)
        if view.nbytes == 0:
            return
        first = offset_bytes // self._zone_size
        last = (offset_bytes + view.nbytes - 1) // self._zone_size
        if first == last:
            st = self._zones[first]
            if not st.sequential:
                self.write_locked(st, first, offset_bytes, view)
                return
            with st.lock:
                self.check_fits_locked(st, first, offset_bytes, view.nbytes)
                self.write_locked(st, first, offset_bytes, view)
            return
        # Spanning zones: only conventional zones, possibly followed by one
        # sequential zone written from its start, can succeed on the kernel.
        with self._locked_zones(first, last):
            try:
                native.pwrite(self._fd, offset_bytes, view, block_size=self._bs,
                              pool=self._pool)
            finally:
                for zone_idx in range(first, last + 1):
                    if self._zones[zone_idx].sequential:
                        self._refresh_locked(self._zones[zone_idx], zone_idx)

    def flush(self) -> None:
        """Make acknowledged writes durable (fdatasync). Raises OSError."""
        self._check_open()
        native.fdatasync(self._fd)

    def close(self) -> None:
        """Flush (unless read-only) and close; a second close does nothing. Raises OSError."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            try:
                if not self._info.read_only:
                    native.fdatasync(self._fd)
            finally:
                native.close_fd(self._fd)

    def __enter__(self) -> BlockZonedDevice:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"BlockZonedDevice({self._path!r}, {self._info.nr_zones} zones of "
                f"{self._info.zone_size_bytes} bytes)")
