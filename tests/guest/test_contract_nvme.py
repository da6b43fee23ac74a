"""Re-run the device contract tests (tests/unit/test_device_contract.py) on NVMe ZNS.

QEMU's zoned NVMe namespaces through the kernel's nvme driver (see the NVMe
part of conftest.py), each test twice: appends as NVMe Zone Append through
io_uring passthrough, and as writes at the write pointer. ZNS namespaces have
no conventional zones, so the four tests about conventional zones are left out
here (`test_no_conventional_zones` states the difference instead).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.guest.conftest import NvmeFactory
from zonefs_py.device.base import ZonedDevice, ZoneType

contract = pytest.importorskip("tests.unit.test_device_contract")

NEEDS_CONVENTIONAL = {
    "test_fresh_report", "test_conventional_zone_random_writes",
    "test_zone_management_on_conventional_zone_is_eio",
    "test_write_from_conventional_into_empty_sequential_zone",
}
globals().update({name: getattr(contract, name) for name in dir(contract)
                  if not name.startswith("__") and name not in ("pytest", "pytestmark")
                  and name not in NEEDS_CONVENTIONAL})

pytestmark = pytest.mark.guest


@pytest.fixture
def zdev_factory(nvme_factory: NvmeFactory) -> Callable[..., ZonedDevice]:
    return nvme_factory


def test_no_conventional_zones(dev: ZonedDevice) -> None:
    zones = dev.report_zones()
    assert {z.type for z in zones} == {ZoneType.SEQ_WRITE_REQUIRED}
    assert {z.capacity_bytes for z in zones} == {3 << 20}
