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

Threading: every method may be called from several threads. `_state_lock`
guards zone states and is never held across I/O; one lock per zone serialises
writes and management commands of that zone; `_table_lock` serialises table
writes. Reads take no zone lock and run concurrently with everything.

Zone append (`zone_append=True`, what `open_device` gives with
`zone_append=on`): an append is placed as a ZNS drive places a Zone Append
-- under the zone lock only long enough to move the write pointer past it --
and its data is written after the lock is released, so several appends to
one zone are in flight at once and complete in any order, each returning
where it landed (`info.zone_append` is true). A flush then records write
pointers that may cover appends still in flight: after a crash their blocks
hold whatever the image held there (EMU-1 holds for acknowledged appends
only), as on a drive. Without it, an append is a write at the write pointer
under the zone lock (one in flight per zone), as null_blk behaves.

Data-discarding mode (`create(..., discard_data=True)`, `emu create
--discard-data`): after mkfs declared where its data zones start
(`declare_data_zones`, recorded in the header), the all-zero blocks written to
those zones are not stored (their file ranges stay holes), while every block
holding anything else is (contiguous runs of them with one pwrite each), so
the filesystem's per-zone summary blocks read back exactly. Zone states, write
pointers and the superblock/metadata zones behave as always. It lets a
benchmark fill a multi-terabyte device with zeros on a small disk. Skipping a
zero block is right only where the file already reads zeros, so:
  * EMU-4: in a discarding zone, the file range from `_zeros_from[zone]` to the
    zone end is holes. A write or append starting below that mark first
    punches its zone's range from its start to the zone end (fallocate
    PUNCH_HOLE); the mark is unknown (the zone size) after open, so stale
    blocks of a generation the table forgot (power cut, torn flush, failed
    write) never resurface under skipped zeros.
  * reset punches the whole zone's range after the reset is durable (EMU-2),
    so its stored blocks give their space back and a crash in between leaves
    the zone reset (the next write punches again). The zone lock is held
    throughout; reads of the zone already see zeros (its data end is 0).
  * a file system that cannot punch holes fails `create(discard_data=True)`,
    and a punch later, with OSError(EOPNOTSUPP); writing zeros instead would
    allocate the very space the mode saves.

Test hooks (not for user paths): `volatile_cache=True` with
`simulate_power_cut()`, `faults` (`emu_faults.FaultInjector`) including
`cut_after_writes`. After a power cut the object is dead: every call raises
OSError(EIO, "simulated power loss"), `close()` only releases it, and the
image, reopened, shows the cut state.

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
import random
import threading
from types import TracebackType
from typing import Literal

from zonefs_py.device.base import DeviceInfo, Zone, ZoneCond
from zonefs_py.device.emu_faults import FaultInjector
from zonefs_py.device.emu_format import (
    ENTRY_BYTES,
    HEADER_BYTES,
    HEADER_MAGIC,
    TABLE_ENTRIES_AT,
    DataDiscard,
    Geometry,
    ImageFormatError,
    TableEntry,
    decode_header_full,
    encode_header,
    encode_table,
    pick_newest_table,
)
from zonefs_py.device.emu_io import (
    Buffer,
    ImageIO,
    IOMode,
    nonzero_runs,
    open_image_io,
    punch_hole,
)
from zonefs_py.device.emu_zones import ZoneStates
from zonefs_py.errors import Busy, DeviceRefused

__all__ = ["EmulatedZonedDevice", "probe_image"]

PowerCutMode = Literal["drop", "tear"]
#: Slice size of `append_scattered` in zone-append mode (QEMU's NVMe with zasl=5).
SCATTER_PIECE_BYTES = 128 << 10


def _power_loss() -> OSError:
    return OSError(errno.EIO, "simulated power loss")


def _punch_unsupported(path: str, exc: OSError) -> OSError:
    return OSError(errno.EOPNOTSUPP,
                   f"{path}: the image's file system cannot punch holes "
                   f"(fallocate PUNCH_HOLE: {exc.strerror}), which the data-discarding "
                   "mode needs; put the image on ext4, xfs, btrfs or tmpfs")


def _probe_punch_hole(path: str, fd: int, geo: Geometry) -> None:
    """Punch the last zone of a new (all-holes) image; unlink it and raise if impossible."""
    try:
        punch_hole(fd, geo.image_bytes - geo.zone_size_bytes, geo.zone_size_bytes)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        os.unlink(path)
        raise _punch_unsupported(path, exc) from None


def probe_image(path: str | os.PathLike[str]) -> bool:
    """Return True if `path` starts with the emulator image magic (no validation)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(len(HEADER_MAGIC)) == HEADER_MAGIC
    except OSError:
        return False


class EmulatedZonedDevice:
    """A `ZonedDevice` on a regular file with null_blk semantics (see the module docstring)."""

    def __init__(self, path: str, io: ImageIO, geo: Geometry, seq: int,
                 entries: list[TableEntry], *, read_only: bool, volatile_cache: bool,
                 zone_append: bool = False, discard: DataDiscard | None = None) -> None:
        """Wrap an opened, locked and validated image; use `open` or `create` instead."""
        self._path = path
        self._discard = discard or DataDiscard()
        #: Per zone, relative offset from which its file range is holes (EMU-4);
        #: guarded by the zone lock. Unknown (the zone size) until a punch.
        self._zeros_from = [geo.zone_size_bytes] * geo.nr_zones
        self._io = io
        self._geo = geo
        self._read_only = read_only
        self._volatile = volatile_cache
        self._zone_append = zone_append and not read_only
        self._scatter_rng = random.Random(0)
        self._zones = ZoneStates(geo, entries)
        self._durable = list(entries)
        self._seq = seq
        self._data_offset = geo.data_offset
        self._zone_shift = geo.zone_size_bytes.bit_length() - 1
        self._state_lock = threading.Lock()
        self._table_lock = threading.Lock()
        self._zone_locks = [threading.Lock() for _ in range(geo.nr_zones)]
        #: Unflushed conventional-zone blocks in volatile-cache mode: offset -> block.
        self._overlay: dict[int, bytes] = {}
        self._dead = False
        self._closed = False
        self.faults = FaultInjector(self)
        self._info = DeviceInfo(
            path=path, kind="emulated", block_size=geo.block_size,
            zone_size_bytes=geo.zone_size_bytes, nr_zones=geo.nr_zones,
            max_open_zones=geo.max_open, max_active_zones=geo.max_active,
            zone_append_max_bytes=geo.zone_capacity_bytes, read_only=read_only,
            zone_append=self._zone_append,
        )

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
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (0 if overwrite else os.O_EXCL)
        fd = os.open(path, flags, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise Busy(f"{path}: image is open for writing by another process") from None
            os.ftruncate(fd, 0)
            os.ftruncate(fd, geo.image_bytes)
            if discard_data:
                _probe_punch_hole(path, fd, geo)
            os.pwrite(fd, encode_header(geo, DataDiscard(enabled=discard_data)), 0)
            os.pwrite(fd, encode_table(geo, 1, ZoneStates.fresh_entries(geo)), geo.table_offset)
            os.fsync(fd)
        finally:
            os.close(fd)
        dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
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
            geo, discard, seq, entries = cls._load(path, io)
        except BaseException:
            io.close()
            raise
        dev = cls(path, io, geo, seq, entries, read_only=read_only,
                  volatile_cache=volatile_cache, zone_append=zone_append, discard=discard)
        if cut_after_writes is not None:
            dev.faults.cut_after_writes(cut_after_writes)
        return dev

    @staticmethod
    def _load(path: str, io: ImageIO) -> tuple[Geometry, DataDiscard, int, list[TableEntry]]:
        size = io.file_size()
        if size < HEADER_BYTES:
            raise DeviceRefused(f"{path}: too small to be an emulator image ({size} bytes)")
        try:
            geo, discard = decode_header_full(io.pread(0, HEADER_BYTES))
            if size < geo.image_bytes:
                raise DeviceRefused(
                    f"{path}: truncated image ({size} bytes, geometry needs {geo.image_bytes})"
                )
            tbytes = geo.table_copy_bytes
            copies = [io.pread(geo.table_offset + i * tbytes, tbytes) for i in range(2)]
            _slot, seq, entries = pick_newest_table(geo, copies)
        except ImageFormatError as exc:
            raise DeviceRefused(f"{path}: not a valid emulator image: {exc}") from None
        return geo, discard, seq, entries

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

    @property
    def discard(self) -> DataDiscard:
        """The data-discarding mode recorded in the header (`declare_data_zones`)."""
        return self._discard

    def declare_data_zones(self, first_zone: int) -> None:
        """Record that zones from `first_zone` on hold file data (mkfs calls it).

        Only an image created with `discard_data` acts on it: from then on the
        all-zero blocks written to those zones are not stored (the write
        pointer and zone state move as usual; they read back as zeros from
        the holes) while other blocks are, and the zones before it -- the
        superblock and metadata log -- keep every byte. Persisted in the
        header (fdatasync) before it returns; a no-op otherwise.

        Raises OSError: EINVAL for a zone out of range, EBADF when read-only.
        """
        if not self._discard.enabled:
            return
        self._check_writable()
        if not self._geo.nr_conventional <= first_zone < self._geo.nr_zones:
            raise OSError(errno.EINVAL, f"zone {first_zone} out of range")
        discard = DataDiscard(enabled=True, first_zone=first_zone)
        with self._table_lock:
            self._io.pwrite(0, encode_header(self._geo, discard))
            self._io.fdatasync()
            self._discard = discard

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

    def _apply_overlay(self, offset_bytes: int, data: bytes) -> bytes:
        bs = self._geo.block_size
        out: bytearray | None = None
        with self._state_lock:
            for pos in range(offset_bytes, offset_bytes + len(data), bs):
                block = self._overlay.get(pos)
                if block is not None:
                    out = out if out is not None else bytearray(data)
                    out[pos - offset_bytes : pos - offset_bytes + bs] = block
        return data if out is None else bytes(out)

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

    def _zone_append_write(self, zone_idx: int, data: Buffer, length: int) -> int:
        """Place the append under the zone lock, write it outside (module doc)."""
        start = zone_idx << self._zone_shift
        ok = False
        with self._zone_locks[zone_idx]:
            if self.faults.io_armed:  # where it would land: nothing moves if it fails
                self.faults.check_write(start + self._zones.wp_rel[zone_idx], length)
            with self._state_lock:
                self._check_alive()
                rel = self._zones.reserve_append(zone_idx, length)
            try:
                discards = self._claim_range_zl(zone_idx, rel, length)
            except BaseException:
                with self._state_lock:
                    self._zones.end_append(zone_idx, rel, length, False)
                raise
        try:
            self._check_alive()
            self._store(zone_idx, start + rel, data, discards)
            ok = True
        finally:
            with self._state_lock:
                self._zones.end_append(zone_idx, rel, length, ok)
                if ok:
                    self._count_write_locked()
        return start + rel

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

    def _claim_range_zl(self, zone_idx: int, rel: int, length: int) -> bool:
        """Prepare a write of zone-relative [rel, rel + length); return whether it discards.

        Keeps EMU-4 (module doc): a discarding write starting below the zone's
        zeros mark punches from `rel` to the zone end first. Caller holds the
        zone lock. Raises OSError from the punch (EOPNOTSUPP: `_punch_zone_zl`).
        """
        discards = self._discard.discards(zone_idx)
        if discards and rel < self._zeros_from[zone_idx]:
            self._punch_zone_zl(zone_idx, rel)
        self._zeros_from[zone_idx] = max(self._zeros_from[zone_idx], rel + length)
        return discards

    def _punch_zone_zl(self, zone_idx: int, rel: int) -> None:
        """Punch the zone's file range from `rel` to its end; caller holds the zone lock."""
        zsize = self._geo.zone_size_bytes
        try:
            self._io.punch_hole(self._data_offset + (zone_idx << self._zone_shift) + rel,
                                zsize - rel)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                raise _punch_unsupported(self._path, exc) from None
            raise
        self._zeros_from[zone_idx] = rel

    def _store(self, zone_idx: int, offset_bytes: int, data: Buffer, discards: bool) -> None:
        """Write `data` at device offset `offset_bytes`, all-zero blocks skipped if `discards`."""
        if not discards:
            self._io.pwrite(self._data_offset + offset_bytes, data)
            return
        view = memoryview(data).cast("B")
        for start, end in nonzero_runs(view, self._geo.block_size):
            self._io.pwrite(self._data_offset + offset_bytes + start, view[start:end])

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

    def _write_back_overlay_locked(self, blocks: dict[int, bytes]) -> None:
        for pos in sorted(blocks):
            self._io.pwrite(self._data_offset + pos, blocks[pos])
        blocks.clear()

    def _write_table_locked(self, entries: list[TableEntry], *, torn: bool = False) -> None:
        """Write the next table copy and fdatasync; caller holds `_table_lock`."""
        seq = self._seq + 1
        tbytes = self._geo.table_copy_bytes
        buf = encode_table(self._geo, seq, entries)
        offset = self._geo.table_offset + (seq % 2) * tbytes
        if torn:
            # Test hook: the copy's last meaningful 512-byte sector never reaches
            # the media, so the slot keeps old bytes there and fails its checksum.
            used = TABLE_ENTRIES_AT + ENTRY_BYTES * self._geo.nr_zones
            cut = (used - 1) // 512 * 512
            old = self._io.pread(offset, tbytes)
            self._io.pwrite(offset, buf[:cut] + old[cut:])
            self._io.fdatasync()
            self.power_cut_now()
            raise _power_loss()
        self._io.pwrite(offset, buf)
        self._io.fdatasync()
        self._seq = seq
        self._durable = entries

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

    # -- power cuts (test hooks) --------------------------------------------------------

    def simulate_power_cut(self, mode: PowerCutMode = "drop",
                           rng: random.Random | None = None) -> None:
        """Cut power now: unflushed writes are lost ("drop") or torn ("tear").

        "tear" keeps, per sequential zone, a random block-aligned prefix of
        the appends since the last flush (zoned devices persist in order), and
        each unflushed conventional block with probability 1/2. The device is
        dead afterwards; reopen the image to see the result. Raises ValueError
        for an unknown mode, OSError(EIO) if the device is already dead.
        """
        if mode not in ("drop", "tear"):
            raise ValueError(f"unknown power cut mode {mode!r}")
        self._check_alive()
        rng = rng or random.Random(0)
        with self._table_lock:
            with self._state_lock:
                if mode == "tear":
                    kept = {pos: blk for pos, blk in sorted(self._overlay.items())
                            if rng.random() < 0.5}
                    self._write_back_overlay_locked(kept)
                    entries = self._torn_entries_locked(rng)
                else:
                    entries = self._durable
                self._overlay.clear()
            if entries != self._durable:
                self._io.fdatasync()
                self._write_table_locked(entries)
            self.power_cut_now()

    def _torn_entries_locked(self, rng: random.Random) -> list[TableEntry]:
        bs = self._geo.block_size
        entries = list(self._durable)
        for idx in range(self._geo.nr_conventional, self._geo.nr_zones):
            old = entries[idx]
            live_end = self._zones.data_end[idx]
            if old.cond in (ZoneCond.FULL, ZoneCond.READONLY, ZoneCond.OFFLINE):
                continue
            if live_end <= old.data_end_rel_bytes or self._zones.wp_rel[idx] < old.wp_rel_bytes:
                continue
            keep = rng.randint(0, (live_end - old.data_end_rel_bytes) // bs) * bs
            end = old.data_end_rel_bytes + keep
            entries[idx] = TableEntry(end, end, ZoneCond.CLOSED if end else ZoneCond.EMPTY,
                                      old.reset_count)
        return entries

    def power_cut_now(self) -> None:
        """Mark the device dead and drop the image lock (the image stays as it is; test hook)."""
        self._dead = True
        self._overlay.clear()
        if self._io.fd >= 0 and not self._read_only:
            fcntl.flock(self._io.fd, fcntl.LOCK_UN)

    def _count_write_locked(self) -> None:
        faults = self.faults
        faults.writes_seen += 1
        if faults.cut_after is not None and faults.writes_seen >= faults.cut_after:
            self.power_cut_now()

    # -- argument checks ------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._closed:
            raise OSError(errno.EBADF, "device is closed")
        if self._dead:
            raise _power_loss()

    def _check_writable(self) -> None:
        self._check_alive()
        if self._read_only:
            raise OSError(errno.EBADF, "device is open read-only")

    def _check_zone_idx(self, zone_idx: int) -> None:
        if not 0 <= zone_idx < self._geo.nr_zones:
            raise OSError(errno.EINVAL, f"zone {zone_idx} out of range")

    def _check_length(self, data: Buffer) -> int:
        length = memoryview(data).nbytes
        if length == 0 or length % self._geo.block_size:
            raise OSError(errno.EINVAL, f"length {length} is not a positive multiple of "
                                        f"the block size {self._geo.block_size}")
        return length

    def _check_range(self, offset_bytes: int, length_bytes: int) -> None:
        bs = self._geo.block_size
        if offset_bytes % bs or length_bytes % bs or length_bytes <= 0 or offset_bytes < 0:
            raise OSError(errno.EINVAL, f"I/O at {offset_bytes}+{length_bytes} is not aligned "
                                        f"to the block size {bs}")
        if offset_bytes + length_bytes > self._info.size_bytes:
            raise OSError(errno.EINVAL, f"I/O at {offset_bytes}+{length_bytes} is past the end")

