"""`EmuBase`: the emulator's state and argument checks (device/emulated.py).

The first of the classes `EmulatedZonedDevice` is built from, each in a
module with one job: `EmuBase` (the state of one opened image, its locks,
and the checks every call makes), `emu_powercut.EmuPowerCut` (the zone
table write, power cuts, the volatile cache), `emu_discard.EmuDiscard` (the
data-discarding mode), `emu_append.EmuZoneAppend` (the zone append model),
then `emulated.EmulatedZonedDevice` (lifecycle, reads, writes, zone
management, flush). The threading rules of emulated.py hold for all.
"""

from __future__ import annotations

import errno
import random
import threading

from zonefs_py.device.base import DeviceInfo
from zonefs_py.device.emu_faults import FaultInjector
from zonefs_py.device.emu_format import DataDiscard, Geometry, TableEntry
from zonefs_py.device.emu_io import Buffer, ImageIO
from zonefs_py.device.emu_zones import ZoneStates


def _power_loss() -> OSError:
    return OSError(errno.EIO, "simulated power loss")


class EmuBase:
    """An opened emulator image's state and argument checks (module docstring)."""

    #: Fault injection (test hooks), armed on the whole device: EmulatedZonedDevice
    #: creates it, being the `FaultTarget` it needs.
    faults: FaultInjector

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
        self._info = DeviceInfo(
            path=path, kind="emulated", block_size=geo.block_size,
            zone_size_bytes=geo.zone_size_bytes, nr_zones=geo.nr_zones,
            max_open_zones=geo.max_open, max_active_zones=geo.max_active,
            zone_append_max_bytes=geo.zone_capacity_bytes, read_only=read_only,
            zone_append=self._zone_append,
        )

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
