"""Fixtures for tests on real zoned devices (in the QEMU guest of tests/guest/run): null_blk,
and QEMU's zoned NVMe namespaces through the nvme driver (`nvme_factory`, below).

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
SKIP_REASON = "needs a zoned block device: run in the QEMU guest (bash tests/guest/run)"
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


# ---------------------------------------------------------------- NVMe ZNS (QEMU)
#
# tests/guest/run attaches QEMU zoned NVMe namespaces (the kernel's nvme driver):
#   serial zonefs0 (tests/guest/qemu-run's GUEST_NVME_ZNS), namespace 1:
#       64 x 16 MiB zones, capacity 12 MiB, max open / active 14 -- the filesystem tests;
#   serial zonefs-contract, namespace 1: 16 x 4 MiB zones, capacity 3 MiB, max open 2,
#       max active 3 (the contract suite's `dev`); namespace 2: 16 x 4 MiB, no limits.
# Controllers are numbered in probe order, so namespaces are found by serial, not name.
# ZNS namespaces have no conventional zones.

NVME_MAIN = ("zonefs0", 1)
NVME_CONTRACT = {  # (zone_size_mb, zone_capacity_mb, max_open, max_active) -> namespace
    (4, 3, 2, 3): ("zonefs-contract", 1),
    (4, 4, 0, 0): ("zonefs-contract", 2),
}
NVME_SKIP = "needs QEMU's zoned NVMe namespaces: run through tests/guest/run"


def nvme_namespace(serial: str, nsid: int) -> str | None:
    """/dev path of namespace `nsid` of the NVMe controller with `serial`, if present."""
    root = Path("/sys/class/nvme")
    if not root.is_dir():
        return None
    for ctrl in sorted(root.iterdir()):
        try:
            if (ctrl / "serial").read_text().strip() != serial:
                continue
        except OSError:
            continue
        for entry in sorted(ctrl.iterdir()):
            name = entry.name
            if (name.startswith("nvme") and "n" in name[4:] and (entry / "nsid").exists()
                    and int((entry / "nsid").read_text()) == nsid
                    and Path(f"/dev/{name}").exists()):
                return f"/dev/{name}"
    return None


def reset_all_zones(path: str) -> None:
    """Reset every zone of a (closed) zoned block device."""
    from zonefs_py.device import native

    fd = native.open_path(path, exclusive=True)
    try:
        geo = native.block_geometry(fd, path)
        native.zone_mgmt(fd, "reset", 0, geo.size_bytes)
    finally:
        native.close_fd(fd)


class NvmeFactory:
    """Hand out QEMU's NVMe namespaces (reset first) as BlockZonedDevices."""

    def __init__(self, zone_append: str) -> None:
        self.zone_append = zone_append
        self.devices: list[ZonedDevice] = []

    def open(self, path: str) -> ZonedDevice:
        from zonefs_py.device.blockdev import BlockZonedDevice

        reset_all_zones(path)
        dev = BlockZonedDevice.open(path, zone_append=self.zone_append)
        self.devices.append(dev)
        return dev

    def main(self) -> ZonedDevice:
        path = nvme_namespace(*NVME_MAIN)
        if path is None:
            pytest.skip(NVME_SKIP)
        return self.open(path)

    def __call__(self, *, nr_zones: int = 16, zone_size_mb: int = 4,
                 zone_capacity_mb: int | None = None, nr_conv: int = 0, max_open: int = 0,
                 max_active: int = 0, block_size: int = 4096) -> ZonedDevice:
        """The contract suite's `zdev_factory` (nr_conv is ignored: ZNS has none)."""
        key = (zone_size_mb, zone_capacity_mb or zone_size_mb, max_open, max_active)
        where = NVME_CONTRACT.get(key)
        if where is None or nr_zones > 16 or block_size != 4096:
            pytest.skip(f"no QEMU NVMe namespace with geometry {key}, {nr_zones} zones")
        path = nvme_namespace(*where)
        if path is None:
            pytest.skip(NVME_SKIP)
        return self.open(path)

    def cleanup(self) -> None:
        for dev in self.devices:
            try:
                dev.close()
            except OSError:
                pass


@pytest.fixture(params=["on", "off"], ids=["zone_append", "wp_writes"])
def nvme_factory(request: pytest.FixtureRequest) -> Iterator[NvmeFactory]:
    """NVMe namespaces, with appends as NVMe Zone Append ("on") or WP writes ("off")."""
    if request.node.get_closest_marker("guest") is not None and nvme_namespace(
            *NVME_MAIN) is None:
        pytest.skip(NVME_SKIP)
    factory = NvmeFactory(request.param)
    try:
        yield factory
    finally:
        factory.cleanup()
