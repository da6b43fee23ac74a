"""Fixtures for tests on real zoned null_blk devices (inside ../shared/run-in-guest.sh).

`zdev_factory` has the signature of the emulator's fixture in
tests/unit/conftest.py, so the device contract tests run unchanged on the
kernel: each call creates a memory-backed null_blk device through configfs
(with mount_helpers/nullblk, loaded in-process: a subprocess costs seconds in
the emulated guest) and opens it as a `BlockZonedDevice`; teardown closes and
destroys every device it made.

Tests marked `guest` skip where null_blk's configfs cannot be had (the host).

Caveats of null_blk the emulator may not share: zone sizes must be powers of
two MiB here; zone_max_open >= the number of sequential zones is turned into
"no limit" by the kernel; zone_max_active < zone_max_open lowers max_open.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import itertools
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

from zonefs_py.device.base import ZonedDevice

HELPER_PATH = Path(__file__).resolve().parents[2] / "mount_helpers" / "nullblk"
SKIP_REASON = "needs a zoned block device: run in the guest (../shared/run-in-guest.sh)"
_names = itertools.count()


def _load_helper() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("nullblk_helper", str(HELPER_PATH))
    spec = importlib.util.spec_from_loader("nullblk_helper", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


nullblk = _load_helper()


def _nullblk_available() -> bool:
    if os.geteuid() != 0:
        return False
    if not nullblk.NULLB.is_dir():
        subprocess.run(["modprobe", "null_blk", "nr_devices=0"], capture_output=True,
                       check=False)
    return bool(nullblk.NULLB.is_dir())


GUEST_OK = _nullblk_available()


@pytest.fixture(autouse=True)
def _require_guest(request: pytest.FixtureRequest) -> None:
    """Skip tests marked `guest` where no zoned null_blk can be made."""
    if request.node.get_closest_marker("guest") is not None and not GUEST_OK:
        pytest.skip(SKIP_REASON)


class NullBlkFactory:
    """Create configfs null_blk devices and remember them for teardown."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.devices: list[ZonedDevice] = []

    def create_raw(self, *, nr_zones: int = 16, zone_size_mb: int = 4,
                   zone_capacity_mb: int | None = None, nr_conv: int = 0, max_open: int = 0,
                   max_active: int = 0, block_size: int = 4096, memory_backed: bool = True,
                   zoned: bool = True) -> str:
        """Create a device and return its /dev path (not opened)."""
        name = f"zt{os.getpid()}_{next(_names)}"
        if not zoned:
            return self._create_conventional(name, nr_zones * zone_size_mb, block_size)
        args = nullblk.argparse.Namespace(
            name=name, size_mb=nr_zones * zone_size_mb, zone_size_mb=zone_size_mb,
            zone_capacity_mb=zone_capacity_mb, conventional=nr_conv, max_open=max_open,
            max_active=max_active, block_size=block_size, memory_backed=memory_backed)
        nullblk.create(args)
        self.names.append(name)
        return f"/dev/{name}"

    def _create_conventional(self, name: str, size_mb: int, block_size: int) -> str:
        nullblk.ensure_configfs()
        dev_dir = nullblk.NULLB / name
        dev_dir.mkdir()
        self.names.append(name)
        for attr, value in (("blocksize", block_size), ("size", size_mb),
                            ("memory_backed", 1), ("power", 1)):
            (dev_dir / attr).write_text(f"{value}\n")
        return f"/dev/{name}"

    def __call__(self, *, nr_zones: int = 16, zone_size_mb: int = 4,
                 zone_capacity_mb: int | None = None, nr_conv: int = 0, max_open: int = 0,
                 max_active: int = 0, block_size: int = 4096) -> ZonedDevice:
        """Create a zoned null_blk device and return it opened as a BlockZonedDevice."""
        from zonefs_py.device.blockdev import BlockZonedDevice

        if zone_capacity_mb is not None and zone_capacity_mb != int(zone_capacity_mb):
            pytest.skip("null_blk takes zone_capacity in whole MiB")
        path = self.create_raw(
            nr_zones=nr_zones, zone_size_mb=zone_size_mb,
            zone_capacity_mb=None if zone_capacity_mb is None else int(zone_capacity_mb),
            nr_conv=nr_conv, max_open=max_open, max_active=max_active, block_size=block_size)
        dev = BlockZonedDevice.open(path)
        self.devices.append(dev)
        return dev

    def cleanup(self) -> None:
        """Close every device and destroy every configfs entry made."""
        for dev in self.devices:
            try:
                dev.close()
            except OSError:
                pass
        for name in reversed(self.names):
            nullblk._destroy_dir(nullblk.NULLB / name)


@pytest.fixture
def nullblk_factory() -> Iterator[NullBlkFactory]:
    """The factory object itself (for tests needing raw paths or conventional devices)."""
    factory = NullBlkFactory()
    try:
        yield factory
    finally:
        factory.cleanup()


@pytest.fixture
def zdev_factory(nullblk_factory: NullBlkFactory) -> Callable[..., ZonedDevice]:
    """`zdev_factory(**geometry) -> ZonedDevice` on null_blk (see the module docstring)."""
    return nullblk_factory
