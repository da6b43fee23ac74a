"""BlockZonedDevice and the native layer on real zoned null_blk devices (guest only).

These pin the kernel behaviours recorded in docs/kernel-zoned-behaviour.md,
exercised through zonefs-py's own code: real ioctls, BLK_ZONE_REP_CAPACITY,
the kernel's open/active limit errors, write-pointer caching and recovery.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from tests.guest.conftest import NullBlkFactory
from zonefs_py.device import native, open_device
from zonefs_py.device.base import ZoneCond, ZoneType
from zonefs_py.device.blockdev import BlockZonedDevice
from zonefs_py.errors import DeviceRefused

pytestmark = pytest.mark.guest

MiB = 1 << 20
BLK = 4096


def blocks(n: int, fill: int) -> bytes:
    return bytes([fill]) * (n * BLK)


def test_geometry_matches_configfs_and_sysfs(nullblk_factory: NullBlkFactory) -> None:
    path = nullblk_factory.create_raw(nr_zones=8, zone_size_mb=4, zone_capacity_mb=3,
                                      nr_conv=1, max_open=3, max_active=4)
    name = Path(path).name
    fd = native.open_path(path, read_only=True)
    try:
        geo = native.block_geometry(fd, path)
    finally:
        native.close_fd(fd)
    assert geo.zoned_model == "host-managed"
    assert (geo.zone_size_bytes, geo.nr_zones, geo.logical_block_size) == (4 * MiB, 8, BLK)
    assert (geo.max_open_zones, geo.max_active_zones) == (3, 4)
    assert geo.size_bytes == 32 * MiB
    sysfs = Path("/sys/block") / name / "queue" / "zone_append_max_bytes"
    assert geo.zone_append_max_bytes == int(sysfs.read_text())
    assert native.is_zoned_block_device(path)


def test_report_honours_zone_capacity(nullblk_factory: NullBlkFactory) -> None:
    dev = nullblk_factory(nr_zones=4, zone_size_mb=4, zone_capacity_mb=3, nr_conv=1)
    zones = dev.report_zones()
    assert zones[0].type is ZoneType.CONVENTIONAL
    assert zones[0].cond is ZoneCond.NOT_WP
    assert zones[0].capacity_bytes == 4 * MiB
    for zone in zones[1:]:
        assert zone.type is ZoneType.SEQ_WRITE_REQUIRED
        assert (zone.size_bytes, zone.capacity_bytes) == (4 * MiB, 3 * MiB)
        assert zone.cond is ZoneCond.EMPTY
        assert zone.wp_bytes == zone.start_bytes


def test_append_to_capacity_then_full_and_eio(nullblk_factory: NullBlkFactory) -> None:
    dev = nullblk_factory(nr_zones=4, zone_size_mb=4, zone_capacity_mb=3)
    assert dev.append(1, b"\1" * (3 * MiB - BLK)) == 4 * MiB
    with pytest.raises(OSError) as exc:  # crossing capacity: nothing may be written
        dev.append(1, blocks(2, 2))
    assert exc.value.errno == errno.EIO
    zone = dev.report_zones(1, 1)[0]
    assert zone.wp_bytes == 7 * MiB - BLK
    assert zone.cond is ZoneCond.IMPLICIT_OPEN
    assert dev.append(1, blocks(1, 3)) == 7 * MiB - BLK
    zone = dev.report_zones(1, 1)[0]
    assert zone.cond is ZoneCond.FULL
    assert zone.wp_bytes == 7 * MiB
    with pytest.raises(OSError) as exc:
        dev.append(1, blocks(1, 4))
    assert exc.value.errno == errno.EIO


def test_open_limit_gives_etoomanyrefs(nullblk_factory: NullBlkFactory) -> None:
    dev = nullblk_factory(nr_zones=8, max_open=2)
    dev.open_zone(0)
    dev.open_zone(1)
    with pytest.raises(OSError) as exc:
        dev.open_zone(2)
    assert exc.value.errno == errno.ETOOMANYREFS
    with pytest.raises(OSError) as exc:
        dev.append(2, blocks(1, 1))
    assert exc.value.errno == errno.ETOOMANYREFS
    dev.close_zone(0)  # explicit open, nothing written: back to EMPTY
    assert dev.report_zones(0, 1)[0].cond is ZoneCond.EMPTY
    assert dev.append(2, blocks(1, 1)) == 2 * 4 * MiB


def test_implicit_open_zone_is_closed_by_kernel(nullblk_factory: NullBlkFactory) -> None:
    dev = nullblk_factory(nr_zones=8, max_open=2)
    for zone_idx in range(3):
        dev.append(zone_idx, blocks(1, zone_idx))
    conds = [z.cond for z in dev.report_zones(0, 3)]
    assert conds == [ZoneCond.CLOSED, ZoneCond.IMPLICIT_OPEN, ZoneCond.IMPLICIT_OPEN]


def test_active_limit_gives_eoverflow(nullblk_factory: NullBlkFactory) -> None:
    dev = nullblk_factory(nr_zones=8, max_open=2, max_active=3)
    for zone_idx in range(3):
        dev.append(zone_idx, blocks(1, 1))
    for attempt in (lambda: dev.append(3, blocks(1, 1)), lambda: dev.open_zone(3),
                    lambda: dev.finish_zone(3)):
        with pytest.raises(OSError) as exc:
            attempt()
        assert exc.value.errno == errno.EOVERFLOW
    dev.finish_zone(2)  # an IMPLICIT_OPEN zone: frees an active slot
    assert dev.append(3, blocks(1, 1)) == 3 * 4 * MiB


def test_write_off_wp_is_eio_and_cache_recovers(nullblk_factory: NullBlkFactory) -> None:
    dev = nullblk_factory(nr_zones=4)
    assert dev.append(0, blocks(2, 1)) == 0
    with pytest.raises(OSError) as exc:
        dev.write(0, blocks(1, 9))  # behind the WP
    assert exc.value.errno == errno.EIO
    with pytest.raises(OSError) as exc:
        dev.write(4 * BLK, blocks(1, 9))  # ahead of the WP
    assert exc.value.errno == errno.EIO
    dev.write(2 * BLK, blocks(1, 2))  # at the WP
    assert dev.append(0, blocks(1, 3)) == 3 * BLK
    assert dev.read(0, 4 * BLK) == blocks(2, 1) + blocks(1, 2) + blocks(1, 3)


def test_wp_cache_refreshed_after_foreign_write(nullblk_factory: NullBlkFactory) -> None:
    path = nullblk_factory.create_raw(nr_zones=4)
    dev = BlockZonedDevice.open(path)
    try:
        dev.append(1, blocks(1, 1))
        fd = native.open_path(path)  # not exclusive: allowed while dev holds O_EXCL
        try:
            native.pwrite(fd, 4 * MiB + BLK, blocks(1, 2), block_size=BLK)
        finally:
            native.close_fd(fd)
        with pytest.raises(OSError) as exc:  # the cached WP is stale
            dev.append(1, blocks(1, 3))
        assert exc.value.errno == errno.EIO
        assert dev.append(1, blocks(1, 3)) == 4 * MiB + 2 * BLK
    finally:
        dev.close()


def test_reads_past_wp_are_zeros_though_kernel_gives_ff(nullblk_factory: NullBlkFactory) -> None:
    path = nullblk_factory.create_raw(nr_zones=4)
    dev = BlockZonedDevice.open(path)
    try:
        dev.append(0, blocks(1, 7))
        fd = native.open_path(path, read_only=True)
        try:
            raw = native.pread(fd, 0, 2 * BLK, block_size=BLK)
        finally:
            native.close_fd(fd)
        assert raw[BLK:] == b"\xff" * BLK  # null_blk's fill past the WP
        assert dev.read(0, 2 * BLK) == blocks(1, 7) + bytes(BLK)
        dev.finish_zone(0)
        assert dev.read(0, 2 * BLK) == blocks(1, 7) + bytes(BLK)
    finally:
        dev.close()


def test_conventional_zone_rules(nullblk_factory: NullBlkFactory) -> None:
    dev = nullblk_factory(nr_zones=4, nr_conv=2)
    dev.write(MiB, blocks(2, 5))
    dev.write(0, blocks(1, 6))
    assert dev.read(MiB, 2 * BLK) == blocks(2, 5)
    for attempt in (lambda: dev.reset_zone(0), lambda: dev.append(0, blocks(1, 1))):
        with pytest.raises(OSError) as exc:
            attempt()
        assert exc.value.errno == errno.EIO


def test_zone_commands_on_empty_and_full_zones(nullblk_factory: NullBlkFactory) -> None:
    dev = nullblk_factory(nr_zones=4)
    with pytest.raises(OSError) as exc:
        dev.close_zone(0)
    assert exc.value.errno == errno.EIO
    dev.finish_zone(0)
    zone = dev.report_zones(0, 1)[0]
    assert zone.cond is ZoneCond.FULL
    assert zone.written_bytes == zone.capacity_bytes
    for op in (dev.open_zone, dev.close_zone):
        with pytest.raises(OSError) as exc:
            op(0)
        assert exc.value.errno == errno.EIO
    dev.finish_zone(0)
    dev.reset_zone(0)
    assert dev.append(0, blocks(1, 1)) == 0


def test_exclusive_open_and_read_only(nullblk_factory: NullBlkFactory) -> None:
    path = nullblk_factory.create_raw(nr_zones=4)
    dev = open_device(path)
    try:
        assert isinstance(dev, BlockZonedDevice)
        with pytest.raises(OSError) as exc:
            BlockZonedDevice.open(path)
        assert exc.value.errno == errno.EBUSY
        ro = open_device(path, read_only=True)
        try:
            assert ro.info.read_only
            with pytest.raises(OSError) as exc:
                ro.append(0, blocks(1, 1))
            assert exc.value.errno == errno.EBADF
        finally:
            ro.close()
    finally:
        dev.close()


def test_open_device_refuses_conventional_disk(nullblk_factory: NullBlkFactory) -> None:
    path = nullblk_factory.create_raw(nr_zones=4, zoned=False)
    with pytest.raises(DeviceRefused, match="conventional"):
        open_device(path)
    assert not native.is_zoned_block_device(path)


def test_native_batches_across_zones(nullblk_factory: NullBlkFactory) -> None:
    path = nullblk_factory.create_raw(nr_zones=4)
    fd = native.open_path(path)
    try:
        writes = [(z * 4 * MiB + i * 64 * 1024, bytes([z * 16 + i]) * 64 * 1024)
                  for z in range(4) for i in range(4)]
        native.pwrite_batch(fd, writes, block_size=BLK, zone_size_bytes=4 * MiB)
        got = native.pread_batch(fd, [(off, len(d)) for off, d in writes], block_size=BLK)
        assert got == [d for _off, d in writes]
        with pytest.raises(OSError) as exc:  # off the WP: names the failed request
            native.pwrite_batch(fd, [(0, blocks(1, 1))], block_size=BLK)
        assert exc.value.errno == errno.EIO
        assert "offset 0" in str(exc.value)
    finally:
        native.close_fd(fd)


def test_512_byte_logical_blocks(nullblk_factory: NullBlkFactory) -> None:
    dev = nullblk_factory(nr_zones=4, block_size=512)
    assert dev.info.block_size == 512
    assert dev.append(0, b"\1" * 512) == 0
    assert dev.append(0, b"\2" * 1024) == 512
    with pytest.raises(OSError) as exc:
        dev.append(0, b"\3" * 100)
    assert exc.value.errno == errno.EINVAL
    assert dev.read(0, 2048) == b"\1" * 512 + b"\2" * 1024 + bytes(512)
