"""Fixtures for device-level unit tests.

`zdev_factory` builds emulated zoned devices (images under tmp_path) and closes
them at teardown. tests/unit/test_device_contract.py uses nothing else, so the
same module runs against a real null_blk device when a guest conftest provides
a `zdev_factory` with the same signature. Every test using it runs twice: with
appends as writes at the write pointer ("wp", null_blk's behaviour) and as
concurrent zone appends ("zappend", an NVMe drive's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from zonefs_py.device.base import ZonedDevice
from zonefs_py.device.emulated import EmulatedZonedDevice

MiB = 1 << 20

ZdevFactory = Callable[..., ZonedDevice]


@pytest.fixture(params=[False, True], ids=["wp", "zappend"])
def zdev_factory(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ZdevFactory]:
    """Return `make(*, nr_zones=16, zone_size_mb=4, zone_capacity_mb=None, nr_conv=0,
    max_open=0, max_active=0, block_size=4096) -> ZonedDevice` (emulated, fresh image)."""
    made: list[EmulatedZonedDevice] = []

    def make(*, nr_zones: int = 16, zone_size_mb: int = 4, zone_capacity_mb: int | None = None,
             nr_conv: int = 0, max_open: int = 0, max_active: int = 0,
             block_size: int = 4096) -> ZonedDevice:
        dev = EmulatedZonedDevice.create(
            tmp_path / f"zdev{len(made)}.img", size_bytes=nr_zones * zone_size_mb * MiB,
            zone_size_bytes=zone_size_mb * MiB,
            zone_capacity_bytes=None if zone_capacity_mb is None else zone_capacity_mb * MiB,
            nr_conventional=nr_conv, max_open=max_open, max_active=max_active,
            block_size=block_size, zone_append=request.param,
        )
        made.append(dev)
        return dev

    yield make
    for dev in made:
        dev.close()
