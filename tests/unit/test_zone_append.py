"""The emulator's zone-append mode against a model of NVMe Zone Append.

A drive places concurrent Zone Appends to one zone in whatever order it
processes them and returns each one's address; QEMU's ZNS namespace was seen
doing so in reverse submission order (docs/kernel-zoned-behaviour.md). The
model: the successful appends of a zone tile [start, write pointer) with no
gap or overlap, each holds its own data, the write pointer never passes the
capacity, an append that failed for room could not have fitted in what is
left, and the zone is FULL exactly when the write pointer reaches capacity.
"""

from __future__ import annotations

import errno
import random
import threading
from pathlib import Path

import pytest

from zonefs_py.device.base import ZoneCond
from zonefs_py.device.emulated import SCATTER_PIECE_BYTES, EmulatedZonedDevice

MiB = 1 << 20
BS = 4096


def _dev(tmp_path: Path, zone_append: bool = True) -> EmulatedZonedDevice:
    return EmulatedZonedDevice.create(tmp_path / "za.img", size_bytes=8 * 4 * MiB,
                                      zone_size_bytes=4 * MiB, zone_capacity_bytes=3 * MiB,
                                      nr_conventional=1, zone_append=zone_append)


def _fill(i: int, n: int) -> bytes:
    return bytes([(i * 29 + 3) & 0xFF]) * n


def test_info_says_zone_append(tmp_path: Path) -> None:
    with _dev(tmp_path) as dev:
        assert dev.info.zone_append
    with EmulatedZonedDevice.open(tmp_path / "za.img") as dev:
        assert not dev.info.zone_append
    with EmulatedZonedDevice.open(tmp_path / "za.img", read_only=True,
                                  zone_append=True) as dev:
        assert not dev.info.zone_append


def test_appends_in_flight_together_complete_out_of_order(tmp_path: Path) -> None:
    """The first-placed append is held back until the others are done: with
    zone append they do not wait for it, and each returns its own address."""
    dev = _dev(tmp_path)
    zone_start = 2 * 4 * MiB
    others_done = threading.Event()
    real_pwrite = dev._io.pwrite

    def slow_first(offset: int, data: object) -> None:
        if offset == dev._data_offset + zone_start:
            assert others_done.wait(10), "later appends waited for the first one"
        real_pwrite(offset, data)  # type: ignore[arg-type]

    dev._io.pwrite = slow_first  # type: ignore[method-assign]
    landed: dict[int, int] = {}
    first = threading.Thread(target=lambda: landed.__setitem__(0, dev.append(2, _fill(0, BS))))
    first.start()
    while dev.report_zones(2, 1)[0].wp_bytes == zone_start:
        pass  # until the first append has been placed
    for i in range(1, 8):
        landed[i] = dev.append(2, _fill(i, 2 * BS))
    others_done.set()
    first.join()
    assert landed[0] == zone_start  # placed first, completed last
    ends = sorted((off, off + (BS if i == 0 else 2 * BS), i) for i, off in landed.items())
    pos = zone_start
    for lo, hi, i in ends:
        assert lo == pos
        assert dev.read(lo, hi - lo) == _fill(i, hi - lo)
        pos = hi
    dev.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_concurrent_appends_match_the_model(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    dev = _dev(tmp_path)
    cap = 3 * MiB
    results: list[tuple[int, int, int, int | OSError]] = []  # zone, i, len, landed/error
    lock = threading.Lock()
    jobs = [(rng.randrange(1, 4), i, rng.randrange(1, 64) * BS) for i in range(120)]

    def worker(chunk: list[tuple[int, int, int]]) -> None:
        for zone, i, n in chunk:
            try:
                out: int | OSError = dev.append(zone, _fill(i, n))
            except OSError as exc:
                out = exc
            with lock:
                results.append((zone, i, n, out))

    threads = [threading.Thread(target=worker, args=(jobs[k::8],)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"seed {seed}")
    for zone in (1, 2, 3):
        z = dev.report_zones(zone, 1)[0]
        wp = z.wp_bytes - z.start_bytes
        ok = sorted((out, n, i) for zz, i, n, out in results
                    if zz == zone and isinstance(out, int))
        pos = z.start_bytes
        for off, n, i in ok:
            assert off == pos, f"zone {zone}: gap or overlap at {off} (expected {pos})"
            assert dev.read(off, n) == _fill(i, n)
            pos += n
        assert pos - z.start_bytes == wp <= cap
        for zz, _i, n, out in results:
            if zz == zone and isinstance(out, OSError):
                assert out.errno == errno.EIO
                assert n > cap - wp, "an append was refused although it fitted"
        assert (z.cond is ZoneCond.FULL) == (wp == cap)
    dev.close()


def test_append_past_capacity_fails_without_effect(tmp_path: Path) -> None:
    with _dev(tmp_path) as dev:
        dev.append(1, bytes(3 * MiB - BS))
        with pytest.raises(OSError) as info:
            dev.append(1, bytes(2 * BS))
        assert info.value.errno == errno.EIO
        z = dev.report_zones(1, 1)[0]
        assert (z.cond, z.wp_bytes - z.start_bytes) == (ZoneCond.IMPLICIT_OPEN, 3 * MiB - BS)
        dev.append(1, bytes(BS))
        assert dev.report_zones(1, 1)[0].cond is ZoneCond.FULL


@pytest.mark.parametrize("zone_append", [True, False])
def test_append_scattered_returns_each_slice(tmp_path: Path, zone_append: bool) -> None:
    with _dev(tmp_path, zone_append) as dev:
        data = b"".join(_fill(k, SCATTER_PIECE_BYTES) for k in range(5)) + _fill(9, BS)
        slices = dev.append_scattered(2, data)
        assert sum(n for _off, n in slices) == len(data)
        pos = 0
        for off, n in slices:
            assert dev.read(off, n) == data[pos:pos + n]
            pos += n
        offs = [off for off, _n in slices]
        if zone_append:
            assert len(slices) == 6
            assert offs != sorted(offs), "slices landed in data order (seeded shuffle)"
        else:
            assert slices == [(2 * 4 * MiB, len(data))]


def test_power_cut_with_an_append_in_flight(tmp_path: Path) -> None:
    """A flush while an append is in flight records a write pointer past it: after
    a crash its blocks hold what the image held (EMU-1 covers acknowledged data)."""
    dev = EmulatedZonedDevice.create(tmp_path / "pc.img", size_bytes=4 * 4 * MiB,
                                     zone_size_bytes=4 * MiB, volatile_cache=True,
                                     zone_append=True)
    dev.append(1, _fill(1, BS))
    release = threading.Event()
    real_pwrite = dev._io.pwrite

    def stalled(offset: int, data: object) -> None:
        if offset == dev._data_offset + 4 * MiB + BS:
            release.wait(10)
            return  # the data never reaches the image
        real_pwrite(offset, data)  # type: ignore[arg-type]

    dev._io.pwrite = stalled  # type: ignore[method-assign]
    t = threading.Thread(target=dev.append, args=(1, _fill(2, BS)))
    t.start()
    while dev.report_zones(1, 1)[0].wp_bytes == 4 * MiB + BS:
        pass
    acked = dev.append(1, _fill(3, BS))  # placed after the stalled one, completes first
    dev.flush()
    dev.simulate_power_cut("drop")
    release.set()
    t.join()
    dev.close()
    with EmulatedZonedDevice.open(tmp_path / "pc.img") as dev:
        z = dev.report_zones(1, 1)[0]
        assert z.wp_bytes == 4 * MiB + 3 * BS
        assert dev.read(acked, BS) == _fill(3, BS)
        assert dev.read(4 * MiB + BS, BS) == bytes(BS)  # the lost append: old image bytes
        assert dev.read(4 * MiB, BS) == _fill(1, BS)


def test_zone_append_handle_refuses_what_is_not_nvme(tmp_path: Path) -> None:
    from zonefs_py.device import native

    with pytest.raises(OSError) as info:
        native.ZoneAppendHandle("/dev/null", block_size=4096, max_bytes=128 << 10)
    assert info.value.errno == errno.ENOTTY
    with pytest.raises(OSError) as info:
        native.ZoneAppendHandle(str(tmp_path / "missing"), block_size=4096, max_bytes=1 << 17)
    assert info.value.errno == errno.ENOENT
    with pytest.raises(OSError) as info:
        native.ZoneAppendHandle("/dev/null", block_size=4096, max_bytes=1000)
    assert info.value.errno == errno.EINVAL
    assert native.nvme_status_name(0x41B9) == "Zone Is Full"


def test_choose_appender_modes() -> None:
    from zonefs_py.device import native
    from zonefs_py.device.zappend import choose_appender

    geo = native.BlockGeometry(
        path="/dev/nullb0", size_bytes=64 * MiB, logical_block_size=4096,
        physical_block_size=4096, zoned_model="host-managed", zone_size_bytes=4 * MiB,
        nr_zones=16, max_open_zones=0, max_active_zones=0, zone_append_max_bytes=126976,
        max_io_bytes=126976)
    assert choose_appender("/dev/nullb0", geo, "auto", read_only=False) is None
    assert choose_appender("/dev/nullb0", geo, "off", read_only=False) is None
    with pytest.raises(OSError) as info:
        choose_appender("/dev/nullb0", geo, "on", read_only=False)
    assert info.value.errno == errno.EOPNOTSUPP
    assert "no NVMe generic char device" in str(info.value)
    with pytest.raises(ValueError, match="zone_append"):
        choose_appender("/dev/nullb0", geo, "maybe", read_only=False)


def test_zone_append_mount_option() -> None:
    from zonefs_py.fs.options import FsOptions

    assert FsOptions().zone_append == "auto"
    opts, rest = FsOptions.from_mount_options({"zone_append": "off", "allow_other": None})
    assert (opts.zone_append, rest) == ("off", {"allow_other": None})
    assert FsOptions.from_mount_options({"zone_append": "1"})[0].zone_append == "on"
    with pytest.raises(ValueError, match="zone_append"):
        FsOptions.from_mount_options({"zone_append": "sometimes"})


def test_open_device_zone_append_modes(tmp_path: Path) -> None:
    from zonefs_py.device import open_device

    _dev(tmp_path, zone_append=False).close()
    for mode, expected in (("auto", False), ("on", True), ("off", False)):
        dev = open_device(str(tmp_path / "za.img"), zone_append=mode)
        try:
            assert dev.info.zone_append is expected
        finally:
            dev.close()
