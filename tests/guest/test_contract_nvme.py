"""Re-run the device contract tests (tests/unit/test_device_contract.py) on NVMe ZNS.

QEMU's zoned NVMe namespaces through the kernel's nvme driver (see the NVMe
part of conftest.py), each test twice: appends as NVMe Zone Append through
io_uring passthrough, and as writes at the write pointer. ZNS namespaces have
no conventional zones, so the four tests about conventional zones are left out
here (`test_no_conventional_zones` states the difference instead), and two
tests pin NVMe's own answers where they differ from null_blk's.
"""

from __future__ import annotations

import errno
from collections.abc import Callable

import pytest

from tests.guest.conftest import NvmeFactory
from zonefs_py.device.base import ZoneCond, ZonedDevice, ZoneType

contract = pytest.importorskip("tests.unit.test_device_contract")

NEEDS_CONVENTIONAL = {
    "test_fresh_report", "test_conventional_zone_random_writes",
    "test_zone_management_on_conventional_zone_is_eio",
    "test_write_from_conventional_into_empty_sequential_zone",
}
#: Where NVMe ZNS (QEMU 7.2, nvme driver) answers differently from null_blk; the
#: NVMe versions below pin what it does (docs/kernel-zoned-behaviour.md).
DIFFERS = {"test_open_close_transitions", "test_max_active"}
globals().update({name: getattr(contract, name) for name in dir(contract)
                  if not name.startswith("__") and name not in ("pytest", "pytestmark")
                  and name not in NEEDS_CONVENTIONAL | DIFFERS})

pytestmark = pytest.mark.guest


@pytest.fixture
def zdev_factory(nvme_factory: NvmeFactory) -> Callable[..., ZonedDevice]:
    return nvme_factory


def test_no_conventional_zones(dev: ZonedDevice) -> None:
    zones = dev.report_zones()
    assert {z.type for z in zones} == {ZoneType.SEQ_WRITE_REQUIRED}
    assert {z.capacity_bytes for z in zones} == {3 << 20}


def test_open_close_transitions_nvme(dev: ZonedDevice) -> None:
    blocks, cond, raises_errno = contract.blocks, contract.cond, contract.raises_errno
    dev.open_zone(2)
    assert cond(dev, 2) is ZoneCond.EXPLICIT_OPEN
    dev.open_zone(2)  # no-op
    dev.close_zone(2)  # nothing written: CLOSED on NVMe (null_blk: EMPTY)
    assert cond(dev, 2) is ZoneCond.CLOSED
    dev.reset_zone(2)
    raises_errno(errno.EIO, dev.close_zone, 2)  # close EMPTY
    dev.append(2, blocks(1))
    dev.close_zone(2)
    assert cond(dev, 2) is ZoneCond.CLOSED
    dev.close_zone(2)  # CLOSED: no-op
    dev.open_zone(2)
    assert cond(dev, 2) is ZoneCond.EXPLICIT_OPEN
    dev.append(2, blocks(1))
    assert cond(dev, 2) is ZoneCond.EXPLICIT_OPEN
    dev.close_zone(2)
    dev.append(2, blocks(1))
    assert (cond(dev, 2), contract.wp_rel(dev, 2)) == (ZoneCond.IMPLICIT_OPEN, 3 * 4096)
    dev.finish_zone(3)
    raises_errno(errno.EIO, dev.open_zone, 3)
    raises_errno(errno.EIO, dev.close_zone, 3)


def test_max_active_nvme(dev: ZonedDevice) -> None:
    blocks, cond, raises_errno = contract.blocks, contract.cond, contract.raises_errno
    dev.append(2, blocks(1))
    dev.append(3, blocks(1))
    dev.append(4, blocks(1))  # closes zone 2: 2 open + 1 closed = 3 active
    assert [cond(dev, i) for i in (2, 3, 4)] == [
        ZoneCond.CLOSED, ZoneCond.IMPLICIT_OPEN, ZoneCond.IMPLICIT_OPEN]
    raises_errno(errno.EOVERFLOW, dev.open_zone, 5)
    raises_errno(errno.EOVERFLOW, dev.append, 5, blocks(1))
    # null_blk refuses this with EOVERFLOW; QEMU's ZNS closes an implicitly open
    # zone and finishes the EMPTY one (it ends FULL, holding nothing).
    dev.finish_zone(5)
    assert [cond(dev, i) for i in (2, 3, 4, 5)] == [
        ZoneCond.CLOSED, ZoneCond.CLOSED, ZoneCond.IMPLICIT_OPEN, ZoneCond.FULL]
    dev.reset_zone(4)  # frees an active resource
    dev.append(6, blocks(1))
    assert cond(dev, 6) is ZoneCond.IMPLICIT_OPEN
