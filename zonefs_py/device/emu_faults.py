"""Fault injection for the emulated zoned device (test hook, never on a user path).

Reach it as `EmulatedZonedDevice.faults`. Every hook is off until armed, and
the device pays one attribute test per I/O while none is armed. The injector
holds the faults as data the emulator consults, and reaches back only through
`FaultTarget` (so it does not import the emulator; docs/DESIGN.md §1). The
daemon's environment-variable hook is in `emu_hook`.

Hooks:
  * `fail_writes` / `fail_reads`: EIO for I/O touching a byte range of a zone,
    forever or for the next `times` matching requests.
  * `set_zone_readonly` / `set_zone_offline`: a zone turns READONLY or OFFLINE
    durably, as a drive reports a worn-out zone (null_blk's configfs
    `zone_readonly` / `zone_offline`; arming the same condition twice restores
    the zone to EMPTY, as null_blk does).
  * `flip_bit_on_read`: a read covering a byte returns it with one bit flipped.
  * `cut_after_writes`: power is cut right after the N-th successful
    write/append/zone-management call (see `EmulatedZonedDevice`).
  * `cut_in_next_flush`: the next flush dies after syncing data but before
    writing the zone table ("before_table"), or after writing half of it
    ("torn_table").

Caveats:
  * Ranges are checked against the request, not the media: a failed append
    has already moved an EMPTY or CLOSED zone to IMPLICIT_OPEN (as null_blk
    does when the backing write fails) but not its write pointer.
"""

from __future__ import annotations

import errno
import threading
from dataclasses import dataclass
from typing import Literal, Protocol

from zonefs_py.device.base import DeviceInfo, ZoneCond

FlushCutStage = Literal["before_table", "torn_table"]


class FaultTarget(Protocol):
    """What the injector asks of the device it is armed on (`EmulatedZonedDevice`).

    Everything else the hooks do is data the device consults on its own I/O
    path (`io_armed`, `check_read`, `check_write`, `apply_flips`, `cut_after`,
    `writes_seen`, `flush_cut`), so this module never imports the emulator.
    """

    @property
    def info(self) -> DeviceInfo: ...

    def set_zone_bad(self, zone_idx: int, cond: ZoneCond) -> None:
        """Turn a zone READONLY/OFFLINE durably (again: back to EMPTY)."""

    def power_cut_now(self) -> None:
        """Mark the device dead at once, keeping the image as it is."""


@dataclass(slots=True)
class _RangeFault:
    start_bytes: int  # absolute, inclusive
    end_bytes: int  # absolute, exclusive
    remaining: int | None  # None: forever

    def hits(self, offset_bytes: int, length_bytes: int) -> bool:
        return offset_bytes < self.end_bytes and self.start_bytes < offset_bytes + length_bytes


@dataclass(slots=True)
class _BitFlip:
    offset_bytes: int
    bit: int
    remaining: int | None


class FaultInjector:
    """Arm and disarm the emulator's failure hooks (see the module docstring)."""

    def __init__(self, device: FaultTarget) -> None:
        self._dev = device
        self._lock = threading.Lock()
        self._write_faults: list[_RangeFault] = []
        self._read_faults: list[_RangeFault] = []
        self._flips: list[_BitFlip] = []
        #: True while any read/write range hook or bit flip is armed (checked lock-free).
        self.io_armed = False
        #: Stop after this many successful mutating calls (None: never).
        self.cut_after: int | None = None
        #: Successful write/append/zone-management calls since open.
        self.writes_seen = 0
        self.flush_cut: FlushCutStage | None = None

    def _range(self, zone_idx: int, start_bytes: int, length_bytes: int | None,
               times: int | None) -> _RangeFault:
        info = self._dev.info
        if not 0 <= zone_idx < info.nr_zones:
            raise ValueError(f"zone {zone_idx} out of range")
        if times is not None and times < 1:
            raise ValueError("times must be >= 1 or None")
        zstart = info.zone_start(zone_idx)
        end = info.zone_size_bytes if length_bytes is None else start_bytes + length_bytes
        return _RangeFault(zstart + start_bytes, zstart + min(end, info.zone_size_bytes), times)

    def fail_writes(self, zone_idx: int, *, start_bytes: int = 0,
                    length_bytes: int | None = None, times: int | None = None) -> None:
        """Fail writes/appends touching [start, start+length) of the zone with EIO.

        `start_bytes` is relative to the zone start; `length_bytes=None` means
        to the end of the zone; `times=None` means every matching request.
        """
        fault = self._range(zone_idx, start_bytes, length_bytes, times)
        with self._lock:
            self._write_faults.append(fault)
            self.io_armed = True

    def fail_reads(self, zone_idx: int, *, start_bytes: int = 0,
                   length_bytes: int | None = None, times: int | None = None) -> None:
        """Fail reads touching [start, start+length) of the zone with EIO (see fail_writes)."""
        fault = self._range(zone_idx, start_bytes, length_bytes, times)
        with self._lock:
            self._read_faults.append(fault)
            self.io_armed = True

    def flip_bit_on_read(self, offset_bytes: int, *, bit: int = 0,
                         times: int | None = None) -> None:
        """Flip bit `bit` (0-7) of the byte at absolute `offset_bytes` in reads covering it."""
        if not 0 <= bit <= 7:
            raise ValueError("bit must be in 0..7")
        with self._lock:
            self._flips.append(_BitFlip(offset_bytes, bit, times))
            self.io_armed = True

    def set_zone_readonly(self, zone_idx: int) -> None:
        """Turn a sequential zone READONLY, durably (again: back to EMPTY, as null_blk)."""
        self._dev.set_zone_bad(zone_idx, ZoneCond.READONLY)

    def set_zone_offline(self, zone_idx: int) -> None:
        """Turn a sequential zone OFFLINE, durably (again: back to EMPTY, as null_blk)."""
        self._dev.set_zone_bad(zone_idx, ZoneCond.OFFLINE)

    def cut_after_writes(self, count: int | None) -> None:
        """Cut power right after `count` more successful mutating calls (None disarms)."""
        if count is not None and count < 0:
            raise ValueError("count must be >= 0")
        with self._lock:
            self.cut_after = None if count is None else self.writes_seen + count
        if count == 0:
            self._dev.power_cut_now()

    def cut_in_next_flush(self, stage: FlushCutStage) -> None:
        """Make the next flush cut power at `stage` ("before_table" or "torn_table")."""
        if stage not in ("before_table", "torn_table"):
            raise ValueError(f"unknown flush cut stage {stage!r}")
        self.flush_cut = stage

    def clear(self) -> None:
        """Disarm every I/O hook and power-cut trigger (zone conditions stay as they are)."""
        with self._lock:
            self._write_faults.clear()
            self._read_faults.clear()
            self._flips.clear()
            self.io_armed = False
            self.cut_after = None
            self.flush_cut = None

    # -- called by the device -------------------------------------------------

    def check_write(self, offset_bytes: int, length_bytes: int) -> None:
        """Raise OSError(EIO) if an armed write fault covers the request."""
        self._check(self._write_faults, offset_bytes, length_bytes, "write")

    def check_read(self, offset_bytes: int, length_bytes: int) -> None:
        """Raise OSError(EIO) if an armed read fault covers the request."""
        self._check(self._read_faults, offset_bytes, length_bytes, "read")

    def _check(self, faults: list[_RangeFault], offset_bytes: int, length_bytes: int,
               what: str) -> None:
        with self._lock:
            for fault in faults:
                if fault.hits(offset_bytes, length_bytes):
                    if fault.remaining is not None:
                        fault.remaining -= 1
                        if fault.remaining == 0:
                            faults.remove(fault)
                    self._update_armed_locked()
                    raise OSError(errno.EIO, f"injected {what} error at {offset_bytes}")

    def apply_flips(self, offset_bytes: int, data: bytes) -> bytes:
        """Return `data` (read at `offset_bytes`) with armed bit flips applied."""
        with self._lock:
            hits = [f for f in self._flips
                    if offset_bytes <= f.offset_bytes < offset_bytes + len(data)]
            if not hits:
                return data
            out = bytearray(data)
            for flip in hits:
                out[flip.offset_bytes - offset_bytes] ^= 1 << flip.bit
                if flip.remaining is not None:
                    flip.remaining -= 1
                    if flip.remaining == 0:
                        self._flips.remove(flip)
            self._update_armed_locked()
            return bytes(out)

    def _update_armed_locked(self) -> None:
        self.io_armed = bool(self._write_faults or self._read_faults or self._flips)
