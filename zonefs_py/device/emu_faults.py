"""Fault injection for the emulated zoned device (test hook, never on a user path).

Reach it as `EmulatedZonedDevice.faults`. Every hook is off until armed, and
the device pays one attribute test per I/O while none is armed.

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
from typing import TYPE_CHECKING, Literal

from zonefs_py.device.base import ZoneCond

if TYPE_CHECKING:
    from zonefs_py.device.emulated import EmulatedZonedDevice

FlushCutStage = Literal["before_table", "torn_table"]


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

    def __init__(self, device: EmulatedZonedDevice) -> None:
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
        self._dev._set_zone_bad(zone_idx, ZoneCond.READONLY)

    def set_zone_offline(self, zone_idx: int) -> None:
        """Turn a sequential zone OFFLINE, durably (again: back to EMPTY, as null_blk)."""
        self._dev._set_zone_bad(zone_idx, ZoneCond.OFFLINE)

    def cut_after_writes(self, count: int | None) -> None:
        """Cut power right after `count` more successful mutating calls (None disarms)."""
        if count is not None and count < 0:
            raise ValueError("count must be >= 0")
        with self._lock:
            self.cut_after = None if count is None else self.writes_seen + count
        if count == 0:
            self._dev._power_cut_now()

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


# -- TEST HOOK for a separate process (the mount daemon) -----------------------------------

#: Environment variable read by `open_device` for emulator images. TEST HOOK: ignored unless set.
ENV_HOOK = "ZONEFS_PY_EMU_TEST_HOOK"


@dataclass(slots=True)
class EnvTestHook:
    """What `ZONEFS_PY_EMU_TEST_HOOK` asks of an emulator opened by a daemon (TEST HOOK).

    The value is comma-separated `key=value` items:
      * ``powercut=drop|tear``: open with `volatile_cache=True`; on SIGUSR1 a
        thread runs `simulate_power_cut(mode, Random(seed))` and then the
        process SIGKILLs itself, so a test can cut power of a running daemon
        (a plain SIGKILL loses no write the emulator acknowledged).
      * ``seed=N``: seed of the tear (default 0).
      * ``cut_after_writes=N``: the device dies after N mutating calls, counted
        from open, or (with ``arm=sigusr2``) from when the process gets SIGUSR2,
        so that a test can let mount and recovery finish first.
    Crash-torture runs (tests/torture) set it; users never should.
    """

    powercut: str | None = None
    seed: int = 0
    cut_after_writes: int | None = None
    arm_on_sigusr2: bool = False

    @classmethod
    def from_env(cls) -> EnvTestHook | None:
        """Parse the variable; None when unset or empty. Raises ValueError for a bad value."""
        import os

        spec = os.environ.get(ENV_HOOK, "").strip()
        if not spec:
            return None
        hook = cls()
        for item in spec.split(","):
            key, _, value = item.strip().partition("=")
            if key == "powercut" and value in ("drop", "tear"):
                hook.powercut = value
            elif key == "seed":
                hook.seed = int(value)
            elif key == "cut_after_writes":
                hook.cut_after_writes = int(value)
            elif key == "arm" and value == "sigusr2":
                hook.arm_on_sigusr2 = True
            else:
                raise ValueError(f"{ENV_HOOK}: bad item {item!r}")
        return hook

    @property
    def volatile_cache(self) -> bool:
        return self.powercut is not None

    def install(self, dev: EmulatedZonedDevice) -> None:
        """Arm the hooks on a freshly opened device (SIGUSR1 only from the main thread)."""
        import logging
        import os
        import random
        import signal

        main = threading.current_thread() is threading.main_thread()
        count = self.cut_after_writes
        if count is not None and self.arm_on_sigusr2 and main:

            def arm(_signum: int, _frame: object) -> None:
                threading.Thread(target=dev.faults.cut_after_writes, args=(count,),
                                 name="emu-arm-cut", daemon=True).start()

            signal.signal(signal.SIGUSR2, arm)
        elif count is not None:
            dev.faults.cut_after_writes(count)
        if self.powercut is None or not main:
            return
        mode = self.powercut
        rng = random.Random(self.seed)

        def cut_and_die() -> None:
            try:
                dev.simulate_power_cut(mode, rng)  # type: ignore[arg-type]
                logging.getLogger(__name__).warning("TEST HOOK: power cut (%s)", mode)
            finally:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_sigusr1(_signum: int, _frame: object) -> None:
            threading.Thread(target=cut_and_die, name="emu-power-cut", daemon=True).start()

        signal.signal(signal.SIGUSR1, on_sigusr1)
