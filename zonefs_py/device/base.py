"""The zoned device contract shared by every backend.

A `ZonedDevice` is deliberately small (after littlefs's `struct lfs_config` and
libzbd's flat API): geometry, zone report, the four zone management commands,
block-aligned reads, zone append, and a flush barrier. Everything is in bytes;
sectors never leave `native/`.

Backends:
  * `zonefs_py.device.blockdev.BlockZonedDevice` -- a Linux zoned block device
    (NVMe ZNS, null_blk, SMR) through the cffi extension.
  * `zonefs_py.device.emulated.EmulatedZonedDevice` -- a regular file laid out
    as described in docs/SPEC.md ("Emulator image"), with null_blk semantics.

Threading: every method may block and is called from worker threads
(`trio.to_thread.run_sync`), never from the trio thread. Implementations must be
safe to call from several threads at once: reads run concurrently; appends to
one zone are serialised by the backend (at most one in-flight write per zone)
unless `info.zone_append` is true, in which case several appends to one zone
may be in flight and land in any order (each call still returns where its own
data landed); appends to different zones may run in parallel.

Optional extensions. Each is declared below as a small Protocol
(`ScatteredAppend`, `DataZoneDeclaration`, `DirectReadTarget`); callers never
probe a device themselves but ask `capabilities(dev)` once, which returns a
`DeviceCapabilities` record with the bound method of each extension the
device implements, None for the others:

`append_scattered(zone_idx, data) -> [(offset, length), ...]`
(both backends have it; callers fall back to `append` without it): append
`data` as several zone appends in flight at once, each landing wherever the
device puts it, and return where each consecutive slice of `data` went, in
data order. With `info.zone_append` the slices need not be contiguous nor in
order; otherwise it is one `append`. On failure (OSError) some slices may
have landed: they are garbage below the write pointer.

`declare_data_zones(first_zone)` (the emulator only):
mkfs tells the device that zones from `first_zone` on hold file data; an
emulator image created in data-discarding mode then stops storing the all-zero
blocks written there, keeping every other block (SPEC.md, "Emulator image").
Other devices lack it.

`direct_read_target(offset_bytes, length_bytes) -> (fd, file_offset) | None`
(both backends): where a plain O_DIRECT read of written data may go, so that
io_uring reads it without a thread (device/aread.py); None sends that read
through `read()`.

Errors: misuse and device failures raise `OSError` carrying the errno the Linux
kernel would return for the same request (EIO for a write off the write
pointer or past capacity, EINVAL for misalignment, ETOOMANYREFS / EOVERFLOW for
the open / active zone limits, ...). Nothing here returns partial results.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

#: What appends and writes take.
Buffer = bytes | bytearray | memoryview


class ZoneType(enum.IntEnum):
    """`enum blk_zone_type` of <linux/blkzoned.h>."""

    CONVENTIONAL = 0x1
    SEQ_WRITE_REQUIRED = 0x2
    SEQ_WRITE_PREFERRED = 0x3


class ZoneCond(enum.IntEnum):
    """`enum blk_zone_cond` of <linux/blkzoned.h>."""

    NOT_WP = 0x0
    EMPTY = 0x1
    IMPLICIT_OPEN = 0x2
    EXPLICIT_OPEN = 0x3
    CLOSED = 0x4
    READONLY = 0xD
    FULL = 0xE
    OFFLINE = 0xF


#: Conditions that count against the device's max open zone limit.
OPEN_CONDS = frozenset({ZoneCond.IMPLICIT_OPEN, ZoneCond.EXPLICIT_OPEN})
#: Conditions that count against the device's max active zone limit.
ACTIVE_CONDS = frozenset({ZoneCond.IMPLICIT_OPEN, ZoneCond.EXPLICIT_OPEN, ZoneCond.CLOSED})


@dataclass(frozen=True, slots=True)
class Zone:
    """One zone as reported by the device (all positions in bytes, absolute)."""

    index: int
    start_bytes: int
    size_bytes: int
    capacity_bytes: int
    wp_bytes: int
    type: ZoneType
    cond: ZoneCond

    @property
    def written_bytes(self) -> int:
        """Bytes between the zone start and the write pointer."""
        if self.cond is ZoneCond.FULL:
            return self.capacity_bytes
        return self.wp_bytes - self.start_bytes

    @property
    def remaining_bytes(self) -> int:
        """Bytes that can still be appended before the zone is full."""
        if self.cond in (ZoneCond.FULL, ZoneCond.READONLY, ZoneCond.OFFLINE):
            return 0
        return self.capacity_bytes - self.written_bytes

    @property
    def is_sequential(self) -> bool:
        return self.type is not ZoneType.CONVENTIONAL


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """Geometry and limits of a zoned device.

    `max_open_zones` / `max_active_zones` of 0 mean "no limit" (as in sysfs).
    All zones have the same size; capacity may differ per zone (see `Zone`).
    """

    path: str
    kind: str  # "block" or "emulated"
    block_size: int
    zone_size_bytes: int
    nr_zones: int
    max_open_zones: int
    max_active_zones: int
    zone_append_max_bytes: int
    read_only: bool = False
    #: Appends are true zone appends: the device picks the address, several may be
    #: in flight per zone (NVMe Zone Append, or the emulator's model of it).
    zone_append: bool = False

    @property
    def size_bytes(self) -> int:
        return self.zone_size_bytes * self.nr_zones

    def zone_start(self, zone_idx: int) -> int:
        return zone_idx * self.zone_size_bytes

    def zone_of(self, offset_bytes: int) -> int:
        return offset_bytes // self.zone_size_bytes


@runtime_checkable
class ZonedDevice(Protocol):
    """What the filesystem needs from a zoned device. See the module docstring."""

    @property
    def info(self) -> DeviceInfo: ...

    def report_zones(self, first_zone: int = 0, count: int | None = None) -> list[Zone]:
        """Return the current state of zones [first_zone, first_zone + count)."""
        ...

    def reset_zone(self, zone_idx: int) -> None:
        """Rewind the write pointer to the zone start; the zone becomes EMPTY."""
        ...

    def open_zone(self, zone_idx: int) -> None:
        """Explicitly open the zone (EXPLICIT_OPEN)."""
        ...

    def close_zone(self, zone_idx: int) -> None:
        """Close an open zone (CLOSED, or EMPTY if nothing was written)."""
        ...

    def finish_zone(self, zone_idx: int) -> None:
        """Move the write pointer to the end; the zone becomes FULL."""
        ...

    def read(self, offset_bytes: int, length_bytes: int) -> bytes:
        """Read block-aligned bytes; bytes past a zone's write pointer read as zeros."""
        ...

    def append(self, zone_idx: int, data: bytes | bytearray | memoryview) -> int:
        """Write `data` (a multiple of the block size) at the zone's write pointer.

        Returns the absolute byte offset at which the data landed. Appends to
        one zone are serialised, or (with `info.zone_append`) placed by the
        device in completion order; the data is durable only after `flush()`.
        """
        ...

    def write(self, offset_bytes: int, data: bytes | bytearray | memoryview) -> None:
        """Write at an explicit offset: anywhere in a conventional zone, or
        exactly at the write pointer of a sequential zone (as pwrite would)."""
        ...

    def flush(self) -> None:
        """Make every write acknowledged so far durable (a cache flush / FUA barrier)."""
        ...

    def close(self) -> None:
        """Release the device. Unflushed writes are flushed first."""
        ...


@runtime_checkable
class ScatteredAppend(Protocol):
    """Optional extension: one append as several in flight (module docstring)."""

    def append_scattered(self, zone_idx: int, data: Buffer) -> list[tuple[int, int]]:
        """Append `data`; return [(offset, length)] of its consecutive slices."""
        ...


@runtime_checkable
class DataZoneDeclaration(Protocol):
    """Optional extension: mkfs says where file data starts (module docstring)."""

    def declare_data_zones(self, first_zone: int) -> None:
        """Record that zones from `first_zone` on hold file data."""
        ...


@runtime_checkable
class DirectReadTarget(Protocol):
    """Optional extension: where an O_DIRECT read may go (module docstring)."""

    def direct_read_target(self, offset_bytes: int,
                           length_bytes: int) -> tuple[int, int] | None:
        """(fd, file offset) for a plain O_DIRECT read of written data, or None."""
        ...


@dataclass(frozen=True, slots=True)
class DeviceCapabilities:
    """The optional extensions of one device: the bound method of each, or None."""

    append_scattered: Callable[[int, Buffer], list[tuple[int, int]]] | None = None
    declare_data_zones: Callable[[int], None] | None = None
    direct_read_target: Callable[[int, int], tuple[int, int] | None] | None = None


def capabilities(dev: object) -> DeviceCapabilities:
    """Return which optional extensions `dev` implements (module docstring)."""
    return DeviceCapabilities(
        append_scattered=dev.append_scattered if isinstance(dev, ScatteredAppend) else None,
        declare_data_zones=(dev.declare_data_zones
                            if isinstance(dev, DataZoneDeclaration) else None),
        direct_read_target=(dev.direct_read_target
                            if isinstance(dev, DirectReadTarget) else None))
