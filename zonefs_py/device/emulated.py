"""`EmulatedZonedDevice`: a host-managed zoned block device kept in a regular file.

The image (layout in docs/SPEC.md, "Emulator image") holds a header, a zone
table in two alternating xxhash-checked copies, then the zone data. Zone
semantics follow Linux null_blk (see `emu_zones`); all data I/O goes through
`emu_io` (O_DIRECT via the native layer, buffered only where O_DIRECT is
impossible).

Durability (docs/DESIGN.md, "Emulator"):
  * Appends and writes land in the image at once but are durable only after
    `flush()`: fdatasync the data, then write the next table copy, fdatasync.
    The recorded write pointer therefore never points past data that did not
    reach the image (EMU-1), and a crash anywhere leaves the last flushed
    state, possibly with later appends dropped.
  * reset and finish (and a zone turning READONLY/OFFLINE) are durable on
    return. They write a table copy holding the new state of that one zone
    and the last *flushed* state of all others, so no other zone's unflushed
    data is ever claimed (EMU-2). finish first fdatasyncs the data.
  * open and close are not written: after a power cycle open zones come back
    CLOSED (or EMPTY), exactly what they would be after the close.

Around it, each in its own module with one job: the image's state and the
argument checks (`emu_base.EmuBase`), power cuts and the volatile cache
(`emu_powercut`), the data-discarding mode (`emu_discard`), the zone append
model (`emu_append`); creating and loading the image file (`emu_image`), the
image layout (`emu_format`), zone semantics
(`emu_zones`), data I/O (`emu_io`) and fault injection (`emu_faults`).

Threading: every method may be called from several threads. `_state_lock`
guards zone states and is never held across I/O; one lock per zone serialises
writes and management commands of that zone; `_table_lock` serialises table
writes. Reads take no zone lock and run concurrently with everything.

Caveats:
  * The exclusive lock is fcntl.flock on the image; read-only opens take no
    lock and see the last flushed state of a writer.
  * A simulated power cut does not wait for I/O in flight on other threads.
  * A write spanning zones is split at the boundaries and its pieces run one
    after another; the kernel submits the split bios together, so after a
    failed first piece it may still write a later one, the emulator does not.
"""

from __future__ import annotations

import errno
import fcntl
import os
from types import TracebackType

from zonefs_py.device.base import DeviceInfo, Zone, ZoneCond
from zonefs_py.device.emu_append import SCATTER_PIECE_BYTES, EmuZoneAppend
from zonefs_py.device.emu_base import _power_loss
from zonefs_py.device.emu_faults import FaultInjector
from zonefs_py.device.emu_format import (
    DataDiscard,
    Geometry,
    TableEntry,
)
from zonefs_py.device.emu_image import load_image, probe_image, write_fresh_image
from zonefs_py.device.emu_io import Buffer, ImageIO, IOMode, open_image_io
from zonefs_py.errors import Busy, DeviceRefused

__all__ = ["EmulatedZonedDevice", "probe_image"]




class EmulatedZonedDevice(EmuZoneAppend):
    """A `ZonedDevice` on a regular file with null_blk semantics (see the module docstring)."""

    def __init__(self, path: str, io: ImageIO, geo: Geometry, seq: int,
                 entries: list[TableEntry], *, read_only: bool, volatile_cache: bool,
                 zone_append: bool = False, discard: DataDiscard | None = None) -> None:
        """Wrap an opened, locked and validated image; use `open` or `create` instead."""
        super().__init__(path, io, geo, seq, entries, read_only=read_only,
                         volatile_cache=volatile_cache, zone_append=zone_append,
                         discard=discard)
        self.faults = FaultInjector(self)

    # -- lifecycle ----------------------------------------------------------------

    @classmethod
    def create(cls, path: str | os.PathLike[str], *, size_bytes: int, zone_size_bytes: int,
               zone_capacity_bytes: int | None = None, nr_conventional: int = 0,
               max_open: int = 0, max_active: int = 0, block_size: int = 4096,
               overwrite: bool = False, volatile_cache: bool = False,
               io_mode: IOMode = "auto", zone_append: bool = False,
               discard_data: bool = False) -> EmulatedZonedDevice:
        """Create a sparse image for the given geometry and open it for writing.

        `discard_data`: the data-discarding mode (`declare_data_zones`): data
        zones keep their state and non-zero blocks but not their zeros, for
        benchmarks at sizes the backing disk cannot hold.

        Raises ValueError for an impossible geometry (message is one line),
        FileExistsError if `path` exists and not `overwrite`, Busy if another
        process has it open for writing, OSError from the file system
        (EOPNOTSUPP with `discard_data` where it cannot punch holes; the file
        is removed then).
        """
        if zone_size_bytes <= 0 or size_bytes <= 0 or size_bytes % zone_size_bytes:
            raise ValueError(
                f"device size {size_bytes} is not a positive multiple of zone size "
                f"{zone_size_bytes}"
            )
        nr_seq = size_bytes // zone_size_bytes - nr_conventional
        # null_blk turns a limit >= the number of sequential zones into "no limit".
        max_open = 0 if max_open >= nr_seq else max_open
        max_active = 0 if max_active >= nr_seq else max_active
        geo = Geometry(block_size, zone_size_bytes, zone_capacity_bytes or zone_size_bytes,
                       size_bytes // zone_size_bytes, nr_conventional, max_open, max_active)
        geo.validate()
        path = os.fspath(path)
        write_fresh_image(path, geo, overwrite=overwrite, discard_data=discard_data)
        return cls.open(path, volatile_cache=volatile_cache, io_mode=io_mode,
                        zone_append=zone_append)

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, read_only: bool = False,
             volatile_cache: bool = False, io_mode: IOMode = "auto",
             cut_after_writes: int | None = None,
             zone_append: bool = False) -> EmulatedZonedDevice:
        """Open an existing image (`zone_append`: concurrent appends, module doc).

        Raises DeviceRefused (one-line message) for a missing, damaged,
        truncated or too-small image, Busy if another process holds it for
        writing, OSError for other I/O failures.
        """
        path = os.fspath(path)
        try:
            io = open_image_io(path, read_only=read_only, mode=io_mode)
        except FileNotFoundError:
            raise DeviceRefused(f"{path}: no such file") from None
        try:
            if not read_only:
                try:
                    fcntl.flock(io.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise Busy(f"{path}: image is open for writing by another process") from None
            geo, discard, seq, entries = load_image(path, io)
        except BaseException:
            io.close()
            raise
        dev = cls(path, io, geo, seq, entries, read_only=read_only,
                  volatile_cache=volatile_cache, zone_append=zone_append, discard=discard)
        if cut_after_writes is not None:
            dev.faults.cut_after_writes(cut_after_writes)
        return dev

    def close(self) -> None:
        """Flush (unless dead or read-only) and release the image; idempotent.

        Raises OSError if the final flush fails (the image is released anyway).
        """
        if self._closed:
            return
        try:
            if not self._dead and not self._read_only:
                self.flush()
        finally:
            self._closed = True
            self._release()

    def _release(self) -> None:
        if self._io.fd >= 0:
            if not self._read_only:
                fcntl.flock(self._io.fd, fcntl.LOCK_UN)
            self._io.close()
            self._io.fd = -1

    def __enter__(self) -> EmulatedZonedDevice:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- ZonedDevice: reporting -------------------------------------------------------

    @property
    def info(self) -> DeviceInfo:
        return self._info

    @property
    def path(self) -> str:
        return self._path

    @property
    def direct_io(self) -> bool:
        """True when the image is accessed with O_DIRECT (see emu_io)."""
        return self._io.direct

    @property
    def geometry(self) -> Geometry:
        return self._geo

    def report_zones(self, first_zone: int = 0, count: int | None = None) -> list[Zone]:
        """Return zones [first_zone, first_zone + count), clipped to the device.

        Raises OSError: EINVAL for a negative or out-of-range first zone, EIO
        after a power cut, EBADF after close.
        """
        self._check_alive()
        nr = self._geo.nr_zones
        if not 0 <= first_zone < nr or (count is not None and count < 0):
            raise OSError(errno.EINVAL, f"zone {first_zone} out of range")
        end = nr if count is None else min(nr, first_zone + count)
        with self._state_lock:
            return [self._zones.zone(i) for i in range(first_zone, end)]

    def reset_count(self, zone_idx: int) -> int:
        """Return how often the zone was reset since the image was created."""
        self._check_zone_idx(zone_idx)
        return self._zones.resets[zone_idx]

    # -- ZonedDevice: data path -----------------------------------------------------

    def read(self, offset_bytes: int, length_bytes: int) -> bytes:
        """Read block-aligned bytes; bytes past a zone's written data read as zeros.

        Raises OSError: EINVAL (misaligned or out of range), EIO (OFFLINE
        zone, injected fault, power cut), EBADF after close.
        """
        self._check_alive()
        self._check_range(offset_bytes, length_bytes)
        if self.faults.io_armed:
            self.faults.check_read(offset_bytes, length_bytes)
        zsize = self._geo.zone_size_bytes
        first = offset_bytes >> self._zone_shift
        if (offset_bytes + length_bytes - 1) >> self._zone_shift == first:
            data = self._read_in_zone(first, offset_bytes, length_bytes)
        else:
            parts = []
            pos, end = offset_bytes, offset_bytes + length_bytes
            while pos < end:
                zone_idx = pos >> self._zone_shift
                seg = min(end, (zone_idx + 1) * zsize) - pos
                parts.append(self._read_in_zone(zone_idx, pos, seg))
                pos += seg
            data = b"".join(parts)
        if self.faults.io_armed:
            data = self.faults.apply_flips(offset_bytes, data)
        return data

    def direct_read_target(self, offset_bytes: int, length_bytes: int) -> tuple[int, int] | None:
        """Where a plain O_DIRECT read of written data may go: (fd, file offset).

        None when `read()` must serve it: not O_DIRECT, faults armed, power
        cut or closed, misaligned, spanning zones, past the written data, or
        a zone that is OFFLINE or conventional. Lets an event loop read
        without a worker thread (`aread.AsyncReader`).
        """
        if self._closed or self._dead or not self._io.direct or self.faults.io_armed:
            return None
        try:
            self._check_range(offset_bytes, length_bytes)
        except OSError:
            return None  # read() raises the error
        zone_idx = offset_bytes >> self._zone_shift
        if (offset_bytes + length_bytes - 1) >> self._zone_shift != zone_idx:
            return None
        zones = self._zones
        if zones.cond[zone_idx] in (ZoneCond.OFFLINE, ZoneCond.NOT_WP):
            return None
        valid = zones.data_end[zone_idx] - (offset_bytes - (zone_idx << self._zone_shift))
        if valid < length_bytes:
            return None
        return self._io.fd, self._data_offset + offset_bytes

    def _read_in_zone(self, zone_idx: int, offset_bytes: int, length_bytes: int) -> bytes:
        zones = self._zones
        cond = zones.cond[zone_idx]
        if cond is ZoneCond.OFFLINE:
            raise OSError(errno.EIO, f"read of OFFLINE zone {zone_idx}")
        if cond is ZoneCond.NOT_WP:
            data = self._io.pread(self._data_offset + offset_bytes, length_bytes)
            return self._apply_overlay(offset_bytes, data) if self._overlay else data
        valid = zones.data_end[zone_idx] - (offset_bytes - (zone_idx << self._zone_shift))
        if valid >= length_bytes:
            return self._io.pread(self._data_offset + offset_bytes, length_bytes)
        if valid <= 0:
            return bytes(length_bytes)
        return self._io.pread(self._data_offset + offset_bytes, valid) + bytes(
            length_bytes - valid
        )

    def append(self, zone_idx: int, data: Buffer) -> int:
        """Write `data` at the zone's write pointer and return the absolute offset.

        Raises OSError: EINVAL (bad zone index, empty or misaligned length),
        EIO (conventional/FULL/READONLY/OFFLINE zone, past capacity, injected
        fault, power cut), ETOOMANYREFS / EOVERFLOW (zone limits), EBADF
        (closed or read-only device).
        """
        self._check_writable()
        self._check_zone_idx(zone_idx)
        length = self._check_length(data)
        if zone_idx < self._geo.nr_conventional:
            raise OSError(errno.EIO, f"zone append to conventional zone {zone_idx}")
        if self._zone_append:
            return self._zone_append_write(zone_idx, data, length)
        return self._seq_write(zone_idx, None, data, length)

    def append_scattered(self, zone_idx: int, data: Buffer) -> list[tuple[int, int]]:
        """Append `data` as slices of up to SCATTER_PIECE_BYTES placed in a random
        order (a drive completing concurrent Zone Appends out of order); return
        [(offset, length)] of its consecutive slices, in data order.

        Without zone-append mode it is one `append`. Raises OSError like
        `append`; slices placed before a failure stay written.
        """
        view = memoryview(data).cast("B")
        if not self._zone_append or view.nbytes <= SCATTER_PIECE_BYTES:
            return [(self.append(zone_idx, view), view.nbytes)]
        step = SCATTER_PIECE_BYTES
        starts = list(range(0, view.nbytes, step))
        order = list(starts)
        self._scatter_rng.shuffle(order)
        where = {pos: self.append(zone_idx, view[pos:pos + step]) for pos in order}
        return [(where[pos], min(step, view.nbytes - pos)) for pos in starts]

    def write(self, offset_bytes: int, data: Buffer) -> None:
        """Write at an explicit offset (anywhere in conventional zones, else at the WP).

        A write crossing zone boundaries is split at them, as the kernel splits
        the bio; the pieces run in order and the first failure is raised (the
        earlier pieces stay written). Raises OSError like `append`; EIO also
        for a piece off its zone's write pointer.
        """
        self._check_writable()
        length = self._check_length(data)
        self._check_range(offset_bytes, length)
        view = memoryview(data).cast("B")
        pos, end = offset_bytes, offset_bytes + length
        while pos < end:
            zone_idx = pos >> self._zone_shift
            seg = min(end, (zone_idx + 1) << self._zone_shift) - pos
            piece = view if seg == length else view[pos - offset_bytes : pos - offset_bytes + seg]
            if zone_idx < self._geo.nr_conventional:
                self._conv_write(pos, piece, seg)
            else:
                self._seq_write(zone_idx, pos - (zone_idx << self._zone_shift), piece, seg)
            pos += seg

    def _seq_write(self, zone_idx: int, expected_rel: int | None, data: Buffer,
                   length: int) -> int:
        with self._zone_locks[zone_idx]:
            with self._state_lock:
                self._check_alive()
                rel = self._zones.begin_write(zone_idx, expected_rel, length)
            offset = (zone_idx << self._zone_shift) + rel
            try:
                if self.faults.io_armed:
                    self.faults.check_write(offset, length)
                self._check_alive()
                discards = self._claim_range_zl(zone_idx, rel, length)
                self._store(zone_idx, offset, data, discards)
            except BaseException:
                with self._state_lock:
                    self._zones.abort_write(zone_idx)
                raise
            with self._state_lock:
                self._zones.end_write(zone_idx, length)
                self._count_write_locked()
        return offset

    def _conv_write(self, offset_bytes: int, data: Buffer, length: int) -> None:
        if self.faults.io_armed:
            self.faults.check_write(offset_bytes, length)
        if self._volatile:
            view = memoryview(data).cast("B")
            bs = self._geo.block_size
            with self._state_lock:
                self._check_alive()
                for pos in range(0, length, bs):
                    self._overlay[offset_bytes + pos] = bytes(view[pos : pos + bs])
                self._count_write_locked()
            return
        self._check_alive()
        self._io.pwrite(self._data_offset + offset_bytes, data)
        with self._state_lock:
            self._count_write_locked()

    def flush(self) -> None:
        """Make every write acknowledged so far durable (fdatasync, table copy, fdatasync).

        Raises OSError: EIO after a power cut (or from the file system),
        EBADF after close. A no-op on a read-only device.
        """
        self._check_alive()
        if self._read_only:
            return
        with self._table_lock:
            with self._state_lock:
                self._check_alive()
                if self._overlay:
                    self._write_back_overlay_locked(self._overlay)
                snapshot = [self._zones.entry(i) for i in range(self._geo.nr_zones)]
            self._io.fdatasync()
            stage = self.faults.flush_cut
            if stage == "before_table":
                self.power_cut_now()
                raise _power_loss()
            if snapshot != self._durable or stage is not None:
                self._write_table_locked(snapshot, torn=stage == "torn_table")

    # -- zone management --------------------------------------------------------------

    def reset_zone(self, zone_idx: int) -> None:
        """Rewind the write pointer; the zone becomes EMPTY, durably (EMU-2).

        In a discarding zone its file range is then punched (module doc).
        Raises OSError: EINVAL (bad index), EIO (conventional, READONLY or
        OFFLINE zone, power cut), EBADF (closed or read-only); EOPNOTSUPP
        when the punch is impossible (the zone is reset nonetheless).
        """
        self._zone_mgmt(zone_idx, "reset")

    def open_zone(self, zone_idx: int) -> None:
        """Open the zone explicitly (EXPLICIT_OPEN).

        Raises OSError: EIO (conventional, FULL, READONLY, OFFLINE zone),
        ETOOMANYREFS / EOVERFLOW (zone limits), EINVAL, EBADF.
        """
        self._zone_mgmt(zone_idx, "open")

    def close_zone(self, zone_idx: int) -> None:
        """Close an open zone (CLOSED, or EMPTY if nothing was written).

        Raises OSError: EIO (conventional, EMPTY, FULL, READONLY, OFFLINE
        zone), EINVAL, EBADF.
        """
        self._zone_mgmt(zone_idx, "close")

    def finish_zone(self, zone_idx: int) -> None:
        """Move the write pointer to the zone end; FULL, durably (EMU-2).

        Raises OSError: EIO (conventional, READONLY, OFFLINE zone),
        ETOOMANYREFS / EOVERFLOW (finishing an EMPTY or CLOSED zone needs
        resources on null_blk), EINVAL, EBADF.
        """
        self._zone_mgmt(zone_idx, "finish")

    def _zone_mgmt(self, zone_idx: int, op: str) -> None:
        self._check_writable()
        self._check_zone_idx(zone_idx)
        zones = self._zones
        with self._zone_locks[zone_idx]:
            with self._state_lock:
                self._check_alive()
                changed = getattr(zones, op)(zone_idx)
                entry = zones.entry(zone_idx)
            if changed and op in ("reset", "finish"):
                self._persist_zone(zone_idx, entry, sync_data=op == "finish")
            if changed and op == "reset" and self._discard.discards(zone_idx) and not self._dead:
                self._punch_zone_zl(zone_idx, 0)  # once durable (module doc)
            with self._state_lock:
                self._count_write_locked()

    def _persist_zone(self, zone_idx: int, entry: TableEntry, *, sync_data: bool) -> None:
        """Write a table copy with `entry` for this zone and flushed state elsewhere (EMU-2)."""
        with self._table_lock:
            self._check_alive()
            if sync_data:
                self._io.fdatasync()
            entries = list(self._durable)
            entries[zone_idx] = entry
            self._write_table_locked(entries)

    def set_zone_bad(self, zone_idx: int, cond: ZoneCond) -> None:
        """Turn a zone READONLY/OFFLINE durably (test hook: reach it as `faults.set_zone_*`)."""
        self._check_writable()
        self._check_zone_idx(zone_idx)
        with self._zone_locks[zone_idx]:
            with self._state_lock:
                self._zones.set_bad(zone_idx, cond)
                entry = self._zones.entry(zone_idx)
            self._persist_zone(zone_idx, entry, sync_data=True)
