"""Zoned devices: the `ZonedDevice` protocol and `open_device()`, which picks a backend.

`open_device(path)` returns a `BlockZonedDevice` for a zoned block device
(NVMe ZNS, SMR, null_blk) and an `EmulatedZonedDevice` for an emulator image
file; anything else raises `DeviceRefused` with a one-line reason. Backends
are imported lazily, so importing this package needs neither the compiled
extension nor the emulator.
"""

from __future__ import annotations

import errno
import os
import stat

from zonefs_py.device.base import (
    ACTIVE_CONDS,
    OPEN_CONDS,
    DeviceInfo,
    Zone,
    ZoneCond,
    ZonedDevice,
    ZoneType,
)
from zonefs_py.errors import DeviceRefused

__all__ = [
    "ACTIVE_CONDS",
    "OPEN_CONDS",
    "DeviceInfo",
    "Zone",
    "ZoneCond",
    "ZoneType",
    "ZonedDevice",
    "open_device",
]

_EXPECTED = "expected a zoned block device or a zonefs-py emulator image"


def _open_block(path: str, *, read_only: bool, zone_append: str) -> ZonedDevice:
    from zonefs_py.device import native
    from zonefs_py.device.blockdev import BlockZonedDevice

    try:
        model = native.zoned_model(path)
    except OSError as exc:
        raise DeviceRefused(f"{path}: cannot inspect block device ({exc.strerror}); "
                            f"{_EXPECTED}") from exc
    if model == "none":
        raise DeviceRefused(f"{path} is a conventional (non-zoned) block device; {_EXPECTED}")
    return BlockZonedDevice.open(path, read_only=read_only, zone_append=zone_append)


def _open_image(path: str, size_bytes: int, *, read_only: bool,
                zone_append: str) -> ZonedDevice:
    try:
        from zonefs_py.device import emulated
    except ModuleNotFoundError as exc:
        if exc.name != "zonefs_py.device.emulated":
            raise
        raise DeviceRefused(f"{path} is a regular file but the emulator backend "
                            "(zonefs_py.device.emulated) is not installed") from exc
    try:
        is_image = emulated.probe_image(path)
    except OSError as exc:
        raise DeviceRefused(f"{path}: cannot read the file ({exc.strerror}); "
                            f"{_EXPECTED}") from exc
    if not is_image:
        raise DeviceRefused(f"{path} is a regular file of {size_bytes} bytes that is not a "
                            f"valid zonefs-py emulator image (too small, damaged or another "
                            f"format); {_EXPECTED} (create one with `zonefs-py emu create`)")
    from zonefs_py.device.emu_hook import EnvTestHook

    hook = EnvTestHook.from_env()  # TEST HOOK (tests/torture); None unless the variable is set
    dev = emulated.EmulatedZonedDevice.open(
        path, read_only=read_only, volatile_cache=bool(hook and hook.volatile_cache),
        zone_append=zone_append == "on")
    if hook is not None and not read_only:
        hook.install(dev)
    device: ZonedDevice = dev
    return device


def open_device(path: str, *, read_only: bool = False, zone_append: str = "auto") -> ZonedDevice:
    """Open `path` with the backend that fits it.

    `zone_append` ("auto", "on", "off"): whether appends are true zone
    appends (the device picks the address; `info.zone_append` says which was
    chosen). "on" fails with OSError(EOPNOTSUPP) on a block device without
    NVMe Zone Append passthrough. The emulator has it only with "on": its
    model lands a chunk's slices in random order (a drive completing appends
    out of order), which tests need and users pay for (8 extents per MiB,
    cold reads at 0.4x, writes at 0.7x of "off", bench/results/2026-12-01-issue12),
    so "auto" leaves it off there.

    Raises DeviceRefused (one line: what `path` is and what is expected) for a
    missing path, a directory, a conventional disk, a file that is not an
    emulator image or any other kind of file; OSError for failures opening a
    device that is acceptable (EBUSY when another process holds it
    exclusively, EACCES, ...).
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DeviceRefused(f"{path} does not exist; {_EXPECTED}") from None
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ENAMETOOLONG, errno.ELOOP):
            raise DeviceRefused(f"{path} is not a usable path ({exc.strerror}); "
                                f"{_EXPECTED}") from None
        raise
    if stat.S_ISBLK(st.st_mode):
        return _open_block(path, read_only=read_only, zone_append=zone_append)
    if stat.S_ISREG(st.st_mode):
        return _open_image(path, st.st_size, read_only=read_only, zone_append=zone_append)
    if stat.S_ISDIR(st.st_mode):
        raise DeviceRefused(f"{path} is a directory; {_EXPECTED}")
    raise DeviceRefused(f"{path} is a special file (mode {stat.filemode(st.st_mode)}); "
                        f"{_EXPECTED}")
