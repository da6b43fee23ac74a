"""Backend-independent tests of the ZonedDevice protocol (zonefs_py.device.base).

Only `zdev_factory` is used, so this exact module also runs against a real
null_blk device in the guest. Every expectation here is what Linux 6.1's
null_blk was observed to do (docs/kernel-zoned-behaviour.md), except that
bytes past the write pointer read as zeros, which the contract requires.
At most 16 zones of 4 MiB per device.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable

import pytest

from zonefs_py.device.base import ZoneCond, ZonedDevice, ZoneType, capabilities

MiB = 1 << 20
BS = 4096
ZS = 4 * MiB


def blocks(n: int, fill: int = 0xA5) -> bytes:
    return bytes([fill]) * (n * BS)


def cond(dev: ZonedDevice, zone_idx: int) -> ZoneCond:
    return dev.report_zones(zone_idx, 1)[0].cond


def wp_rel(dev: ZonedDevice, zone_idx: int) -> int:
    zone = dev.report_zones(zone_idx, 1)[0]
    return zone.wp_bytes - zone.start_bytes


def raises_errno(code: int, fn: Callable[..., object], *args: object) -> None:
    with pytest.raises(OSError) as info:
        fn(*args)
    assert info.value.errno == code, f"expected {errno.errorcode[code]}, got {info.value!r}"


@pytest.fixture
def dev(zdev_factory: Callable[..., ZonedDevice]) -> ZonedDevice:
    """16 x 4 MiB zones, 3 MiB capacity, 2 conventional, max open 2, max active 3."""
    return zdev_factory(nr_zones=16, zone_size_mb=4, zone_capacity_mb=3, nr_conv=2,
                        max_open=2, max_active=3)


def test_is_a_zoned_device(dev: ZonedDevice) -> None:
    assert isinstance(dev, ZonedDevice)
    info = dev.info
    assert (info.nr_zones, info.zone_size_bytes, info.block_size) == (16, ZS, BS)
    assert (info.max_open_zones, info.max_active_zones) == (2, 3)
    assert info.size_bytes == 16 * ZS
    assert info.kind in ("emulated", "block")


def test_optional_extensions_are_declared_capabilities(dev: ZonedDevice) -> None:
    """Callers find the optional extensions through `capabilities` (device/base.py),
    never by probing: the emulator has all three, a block device all but
    declare_data_zones, and a device with only the protocol has none."""
    caps = capabilities(dev)
    assert caps.append_scattered is not None
    # The data-discarding mode (mkfs tells it where data starts) is the emulator's.
    assert (caps.declare_data_zones is not None) == (dev.info.kind == "emulated")
    assert caps.direct_read_target is not None
    assert caps.append_scattered(2, blocks(1))[0][1] == BS

    class Bare:
        def read(self, offset_bytes: int, length_bytes: int) -> bytes:
            return bytes(length_bytes)

    bare = capabilities(Bare())
    assert (bare.append_scattered, bare.declare_data_zones, bare.direct_read_target) \
        == (None, None, None)


def test_fresh_report(dev: ZonedDevice) -> None:
    zones = dev.report_zones()
    assert [z.index for z in zones] == list(range(16))
    for z in zones[:2]:
        assert (z.type, z.cond) == (ZoneType.CONVENTIONAL, ZoneCond.NOT_WP)
        assert z.wp_bytes == z.start_bytes + ZS
    for z in zones[2:]:
        assert z.type is ZoneType.SEQ_WRITE_REQUIRED
        assert (z.cond, z.wp_bytes, z.capacity_bytes) == (ZoneCond.EMPTY, z.start_bytes, 3 * MiB)
    assert [z.index for z in dev.report_zones(5, 3)] == [5, 6, 7]


def test_append_returns_offsets_and_opens_zone(dev: ZonedDevice) -> None:
    first = dev.append(3, blocks(1, 1))
    second = dev.append(3, blocks(2, 2))
    assert (first, second) == (3 * ZS, 3 * ZS + BS)
    assert cond(dev, 3) is ZoneCond.IMPLICIT_OPEN
    assert wp_rel(dev, 3) == 3 * BS
    assert dev.read(3 * ZS, 3 * BS) == blocks(1, 1) + blocks(2, 2)


def test_read_past_wp_is_zeros(dev: ZonedDevice) -> None:
    dev.append(4, blocks(1, 7))
    assert dev.read(4 * ZS, 2 * BS) == blocks(1, 7) + bytes(BS)
    assert dev.read(5 * ZS, 4 * BS) == bytes(4 * BS)
    assert dev.read(4 * ZS + 3 * MiB, BS) == bytes(BS)  # between capacity and zone size


def test_write_must_be_at_wp(dev: ZonedDevice) -> None:
    dev.write(2 * ZS, blocks(1))
    raises_errno(errno.EIO, dev.write, 2 * ZS + 2 * BS, blocks(1))  # ahead
    raises_errno(errno.EIO, dev.write, 2 * ZS, blocks(1))  # behind
    dev.write(2 * ZS + BS, blocks(1))
    assert wp_rel(dev, 2) == 2 * BS


def test_misaligned_io_is_einval(dev: ZonedDevice) -> None:
    raises_errno(errno.EINVAL, dev.write, 2 * ZS, b"x" * 512)
    raises_errno(errno.EINVAL, dev.write, 2 * ZS + 512, blocks(1))
    raises_errno(errno.EINVAL, dev.append, 2, b"x" * 100)
    raises_errno(errno.EINVAL, dev.read, 2 * ZS + 512, BS)
    assert cond(dev, 2) is ZoneCond.EMPTY


def test_fill_to_capacity_then_full(dev: ZonedDevice) -> None:
    dev.append(5, bytes(3 * MiB))
    zone = dev.report_zones(5, 1)[0]
    assert zone.cond is ZoneCond.FULL
    # null_blk reports start + capacity here; the nvme driver reports start + zone
    # size for every FULL zone (docs/kernel-zoned-behaviour.md).
    assert zone.wp_bytes in (zone.start_bytes + 3 * MiB, zone.start_bytes + ZS)
    assert zone.remaining_bytes == 0
    raises_errno(errno.EIO, dev.append, 5, blocks(1))
    raises_errno(errno.EIO, dev.write, 5 * ZS + 3 * MiB, blocks(1))


def test_write_crossing_capacity_fails_without_effect(dev: ZonedDevice) -> None:
    dev.append(6, bytes(3 * MiB - BS))
    raises_errno(errno.EIO, dev.append, 6, blocks(2))
    assert (cond(dev, 6), wp_rel(dev, 6)) == (ZoneCond.IMPLICIT_OPEN, 3 * MiB - BS)


def test_conventional_zone_random_writes(dev: ZonedDevice) -> None:
    dev.write(ZS + 8 * BS, blocks(1, 0x11))
    dev.write(ZS, blocks(1, 0x22))
    dev.write(ZS + 8 * BS, blocks(1, 0x33))
    assert dev.read(ZS, BS) == blocks(1, 0x22)
    assert dev.read(ZS + 8 * BS, BS) == blocks(1, 0x33)
    assert cond(dev, 1) is ZoneCond.NOT_WP


@pytest.mark.parametrize("op", ["reset_zone", "open_zone", "close_zone", "finish_zone"])
def test_zone_management_on_conventional_zone_is_eio(dev: ZonedDevice, op: str) -> None:
    raises_errno(errno.EIO, getattr(dev, op), 0)


def test_reset(dev: ZonedDevice) -> None:
    dev.reset_zone(7)  # EMPTY: no-op
    dev.append(7, blocks(2, 9))
    dev.reset_zone(7)
    assert (cond(dev, 7), wp_rel(dev, 7)) == (ZoneCond.EMPTY, 0)
    assert dev.read(7 * ZS, 2 * BS) == bytes(2 * BS)
    dev.append(7, bytes(3 * MiB))
    dev.reset_zone(7)
    assert dev.append(7, blocks(1, 3)) == 7 * ZS
    assert dev.read(7 * ZS, 2 * BS) == blocks(1, 3) + bytes(BS)


def test_finish(dev: ZonedDevice) -> None:
    dev.finish_zone(8)  # EMPTY -> FULL
    zone = dev.report_zones(8, 1)[0]
    assert (zone.cond, zone.wp_bytes) == (ZoneCond.FULL, zone.start_bytes + ZS)
    dev.finish_zone(8)  # FULL: no-op
    dev.append(9, blocks(1, 4))
    dev.finish_zone(9)  # IMPLICIT_OPEN -> FULL
    assert cond(dev, 9) is ZoneCond.FULL
    assert dev.read(9 * ZS, 2 * BS) == blocks(1, 4) + bytes(BS)
    raises_errno(errno.EIO, dev.append, 9, blocks(1))


def test_open_close_transitions(dev: ZonedDevice) -> None:
    dev.open_zone(2)
    assert cond(dev, 2) is ZoneCond.EXPLICIT_OPEN
    dev.open_zone(2)  # no-op
    dev.close_zone(2)  # nothing written: back to EMPTY
    assert cond(dev, 2) is ZoneCond.EMPTY
    raises_errno(errno.EIO, dev.close_zone, 2)  # close EMPTY
    dev.append(2, blocks(1))
    dev.close_zone(2)
    assert cond(dev, 2) is ZoneCond.CLOSED
    dev.close_zone(2)  # CLOSED: no-op
    dev.open_zone(2)
    assert cond(dev, 2) is ZoneCond.EXPLICIT_OPEN
    dev.append(2, blocks(1))
    assert cond(dev, 2) is ZoneCond.EXPLICIT_OPEN  # writes keep an explicit open
    dev.close_zone(2)
    dev.append(2, blocks(1))
    assert (cond(dev, 2), wp_rel(dev, 2)) == (ZoneCond.IMPLICIT_OPEN, 3 * BS)
    dev.finish_zone(3)
    raises_errno(errno.EIO, dev.open_zone, 3)
    raises_errno(errno.EIO, dev.close_zone, 3)


def test_max_open_explicit(dev: ZonedDevice) -> None:
    dev.open_zone(2)
    dev.open_zone(3)
    raises_errno(errno.ETOOMANYREFS, dev.open_zone, 4)
    raises_errno(errno.ETOOMANYREFS, dev.append, 4, blocks(1))
    assert cond(dev, 4) is ZoneCond.EMPTY


def test_implicit_open_zone_closed_to_make_room(dev: ZonedDevice) -> None:
    dev.append(2, blocks(1))
    dev.append(3, blocks(1))
    dev.append(4, blocks(1))
    conds = [z.cond for z in dev.report_zones(2, 3)]
    assert conds == [ZoneCond.CLOSED, ZoneCond.IMPLICIT_OPEN, ZoneCond.IMPLICIT_OPEN]


def test_max_active(dev: ZonedDevice) -> None:
    dev.append(2, blocks(1))
    dev.append(3, blocks(1))
    dev.append(4, blocks(1))  # closes zone 2: 2 open + 1 closed = 3 active
    raises_errno(errno.EOVERFLOW, dev.open_zone, 5)
    raises_errno(errno.EOVERFLOW, dev.append, 5, blocks(1))
    raises_errno(errno.EOVERFLOW, dev.finish_zone, 5)
    raises_errno(errno.ETOOMANYREFS, dev.finish_zone, 2)
    dev.open_zone(3)  # IMPLICIT -> EXPLICIT needs nothing new
    dev.close_zone(4)
    assert cond(dev, 4) is ZoneCond.CLOSED
    dev.append(2, blocks(1))  # CLOSED -> IMPLICIT_OPEN: one open resource is free
    assert cond(dev, 2) is ZoneCond.IMPLICIT_OPEN
    dev.reset_zone(4)  # frees an active resource
    dev.append(5, blocks(1))
    assert cond(dev, 5) is ZoneCond.IMPLICIT_OPEN
    assert cond(dev, 2) is ZoneCond.CLOSED


def test_read_across_zone_boundary(dev: ZonedDevice) -> None:
    dev.append(3, bytes(3 * MiB))
    dev.append(4, blocks(1, 8))
    data = dev.read(3 * ZS + ZS - BS, 2 * BS)
    assert data == bytes(BS) + blocks(1, 8)


def test_write_from_conventional_into_empty_sequential_zone(dev: ZonedDevice) -> None:
    dev.write(2 * ZS - BS, blocks(2, 6))
    assert dev.read(2 * ZS - BS, 2 * BS) == blocks(2, 6)
    assert (cond(dev, 2), wp_rel(dev, 2)) == (ZoneCond.IMPLICIT_OPEN, BS)


def test_write_across_sequential_zones_past_capacity_fails(dev: ZonedDevice) -> None:
    raises_errno(errno.EIO, dev.write, 2 * ZS, bytes(ZS + BS))
    assert wp_rel(dev, 3) == 0


def test_flush_and_concurrent_appends(zdev_factory: Callable[..., ZonedDevice]) -> None:
    dev = zdev_factory(nr_zones=4, zone_size_mb=4)
    offsets: list[int] = []
    lock = threading.Lock()

    def worker(fill: int) -> None:
        for _ in range(8):
            off = dev.append(1, blocks(1, fill))
            with lock:
                offsets.append(off)

    threads = [threading.Thread(target=worker, args=(i + 1,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dev.flush()
    assert sorted(offsets) == [ZS + i * BS for i in range(32)]
    data = dev.read(ZS, 32 * BS)
    for off in offsets:
        rel = off - ZS
        assert len(set(data[rel : rel + BS])) == 1
    assert wp_rel(dev, 1) == 32 * BS


def test_no_limits_many_open(zdev_factory: Callable[..., ZonedDevice]) -> None:
    dev = zdev_factory(nr_zones=8, zone_size_mb=4)
    for zone_idx in range(4):
        dev.append(zone_idx, blocks(1))
    assert {z.cond for z in dev.report_zones(0, 4)} == {ZoneCond.IMPLICIT_OPEN}
    assert dev.info.max_open_zones == dev.info.max_active_zones == 0
