"""zonefs-py on QEMU's zoned NVMe namespace through the kernel's nvme driver (guest only).

The filesystem tests of test_fs_nullblk.py on NVMe ZNS (64 x 16 MiB zones,
capacity 12 MiB, max open / active 14, no conventional zones), with appends
as NVMe Zone Append through io_uring passthrough and as writes at the write
pointer, plus the zone append path itself: concurrent appends to one zone,
appends past capacity, and the same file contents with zone_append=off.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading

import pytest

from tests.guest.conftest import NVME_SKIP, NvmeFactory, nvme_namespace, reset_all_zones
from tests.guest.test_fs_nullblk import _blob, _read, _write, assert_reads_use_ring
from zonefs_py.device.base import ZoneCond, ZonedDevice
from zonefs_py.device.blockdev import BlockZonedDevice
from zonefs_py.device.zappend import ZoneAppendAppender
from zonefs_py.fs.api import Ctx, RenameFlags
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.fs.mkfs import make_filesystem
from zonefs_py.fs.options import FsOptions
from zonefs_py.fsck import check_filesystem

pytestmark = pytest.mark.guest
MiB = 1 << 20
KiB = 1 << 10
CTX = Ctx()


def _main_path() -> str:
    path = nvme_namespace("zonefs0", 1)
    if path is None:
        pytest.skip(NVME_SKIP)
    return path


def _appender(dev: ZonedDevice) -> ZoneAppendAppender:
    assert isinstance(dev, BlockZonedDevice)
    appender = dev.appender
    assert isinstance(appender, ZoneAppendAppender), "zone append was not chosen"
    return appender


def test_zone_append_is_chosen_on_nvme_only(nvme_factory: NvmeFactory) -> None:
    dev = nvme_factory.main()
    info = dev.info
    assert info.zone_append_max_bytes == 128 * KiB  # 4 KiB << zasl=5
    assert info.zone_append is (nvme_factory.zone_append == "on")
    assert (info.max_open_zones, info.max_active_zones, info.nr_zones) == (14, 14, 64)
    assert {z.capacity_bytes for z in dev.report_zones()} == {12 * MiB}


async def test_mkfs_write_remount_fsck_on_nvme(nvme_factory: NvmeFactory) -> None:
    dev = nvme_factory.main()
    make_filesystem(dev)  # mkfs's default: format 5
    # ZoneFS.mount: the io_uring reader needs the mount's tasks (ZoneFS.load has none).
    async with ZoneFS.mount(dev, FsOptions(commit_interval_s=3600)) as fs:
        ckdir = (await fs.mkdir(1, b"checkpoints", 0o755, CTX)).ino
        big = _blob(1, 30 * MiB)  # spans three 12 MiB-capacity zones
        await _write(fs, b"step-1.pt.tmp", big, ckdir)
        await fs.rename(ckdir, b"step-1.pt.tmp", ckdir, b"step-1.pt", RenameFlags.NONE)
        for i in range(16):
            await _write(fs, b"shard-%05d.tar" % i, _blob(i, 64 * KiB))
        await fs.sync()
        if nvme_factory.zone_append == "on":
            # The data path sent its 1 MiB chunks as 128 KiB Zone Appends (append_scattered).
            assert _appender(dev).appends >= 30 * MiB // (128 * KiB)
        # The zones the big file filled are sealed (their checksums written after their
        # data, format/zonesum.py), FULL on the drive, and read through the summaries.
        assert len(fs.state.zone_seals) >= 2, fs.state.zone_seals
        conds = {z.index: z.cond for z in dev.report_zones()}
        assert all(conds[z] == ZoneCond.FULL for z in fs.state.zone_seals), conds
        assert await _read(fs, b"step-1.pt", ckdir) == big
        assert fs.data.sums.misses > 0
        await assert_reads_use_ring(fs, b"step-1.pt", ckdir)
    report = check_filesystem(dev)
    assert report.clean, [f.message for f in report.findings]
    fs = await ZoneFS.load(dev, FsOptions())
    assert await _read(fs, b"step-1.pt", ckdir) == big
    assert await _read(fs, b"shard-00007.tar") == _blob(7, 64 * KiB)
    await fs.close()


async def test_recovery_after_crash_on_nvme(nvme_factory: NvmeFactory) -> None:
    dev = nvme_factory.main()
    make_filesystem(dev)  # mkfs's default: format 5
    fs = await ZoneFS.load(dev, FsOptions(commit_interval_s=3600))
    await _write(fs, b"durable", _blob(3, 3 * MiB))
    fh, _ = await fs.create(1, b"volatile", 0o644, os.O_WRONLY, CTX)
    await fs.write(fh, 0, _blob(4, 2 * MiB))
    await fs.flush(fh)
    del fs  # "crash": the device keeps what reached it
    fs = await ZoneFS.load(dev, FsOptions())
    assert await _read(fs, b"durable") == _blob(3, 3 * MiB)
    await fs.close()
    report = check_filesystem(dev)
    assert report.clean, [f.message for f in report.findings]


async def _tree_digest(dev: ZonedDevice) -> dict[bytes, str]:
    """Write the same small tree (sequential, interleaved, overwritten) and hash it."""
    make_filesystem(dev, meta_zones=4)  # format 4 (too few meta zones for 5) on a real device
    fs = await ZoneFS.load(dev, FsOptions(commit_interval_s=3600))
    await _write(fs, b"ckpt", _blob(5, 13 * MiB))
    handles = []
    for i in range(3):
        fh, _ = await fs.create(1, b"inter-%d" % i, 0o644, os.O_WRONLY, CTX)
        handles.append(fh)
    for off in range(0, 3 * MiB, 256 * KiB):
        for i, fh in enumerate(handles):
            await fs.write(fh, off, _blob(10 + i, 256 * KiB))
    for fh in handles:
        await fs.fsync(fh, False)
        await fs.release(fh)
    fh = await fs.open((await fs.lookup(1, b"ckpt")).ino, os.O_WRONLY)
    await fs.write(fh, 5 * MiB + 4096, b"overwritten" * 1000)
    await fs.fsync(fh, False)
    await fs.release(fh)
    await fs.close()
    fs = await ZoneFS.load(dev, FsOptions())
    names = [b"ckpt", b"inter-0", b"inter-1", b"inter-2"]
    out = {n: hashlib.sha256(await _read(fs, n)).hexdigest() for n in names}
    await fs.close()
    report = check_filesystem(dev)
    assert report.clean, [f.message for f in report.findings]
    return out


async def test_zone_append_off_gives_the_same_contents() -> None:
    path = _main_path()
    digests = []
    for mode in ("on", "off"):
        reset_all_zones(path)
        dev = BlockZonedDevice.open(path, zone_append=mode)
        try:
            assert dev.info.zone_append is (mode == "on")
            digests.append(await _tree_digest(dev))
        finally:
            dev.close()
    assert digests[0] == digests[1]


def _fill(i: int, n: int) -> bytes:
    return bytes([(i * 37 + 1) & 0xFF]) * n


def test_eight_concurrent_zone_appends_to_one_zone() -> None:
    path = _main_path()
    reset_all_zones(path)
    with BlockZonedDevice.open(path, zone_append="on") as dev:
        appender = _appender(dev)
        zone = dev.report_zones(5, 1)[0]
        # One ring, 8 appends in flight at once (QD 8).
        datas = [memoryview(_fill(i, 64 * KiB)) for i in range(8)]
        landed = appender.append_many(dev, 5, datas)
        # And 8 threads, one append each, racing for the same zone.
        more: dict[int, int] = {}
        errors: list[BaseException] = []

        def worker(i: int) -> None:
            try:
                more[i] = dev.append(5, _fill(8 + i, 128 * KiB))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        spans = [(off, 64 * KiB, i) for i, off in enumerate(landed)]
        spans += [(off, 128 * KiB, 8 + i) for i, off in more.items()]
        starts = sorted(s for s, _n, _i in spans)
        assert len(set(starts)) == 16
        end = zone.start_bytes
        for off, n, _i in sorted(spans):
            assert off == end, "appends must tile the zone from its start, without gaps"
            end += n
        assert end - zone.start_bytes == 8 * 64 * KiB + 8 * 128 * KiB
        after = dev.report_zones(5, 1)[0]
        assert after.wp_bytes == end
        dev.flush()
        for off, n, i in spans:
            assert dev.read(off, n) == _fill(i, n)


def test_zone_append_past_capacity_fails_as_the_device_says() -> None:
    path = _main_path()
    reset_all_zones(path)
    with BlockZonedDevice.open(path, zone_append="on") as dev:
        appender = _appender(dev)
        cap = dev.report_zones(6, 1)[0].capacity_bytes
        chunk = memoryview(bytes(128 * KiB))
        n = cap // chunk.nbytes - 1
        appender.append_many(dev, 6, [chunk] * n)
        # One chunk of room left; two race for it: one lands, one is refused.
        with pytest.raises(OSError) as info:
            appender.append_many(dev, 6, [chunk, chunk])
        assert info.value.errno == errno.EIO
        assert "NVMe status" in str(info.value), info.value
        zone = dev.report_zones(6, 1)[0]
        assert zone.cond is ZoneCond.FULL
        with pytest.raises(OSError) as info:
            dev.append(6, bytes(4096))
        assert info.value.errno == errno.EIO
        assert "Zone Is Full" in str(info.value), info.value
        # A multi-piece append (over the 128 KiB command limit) that would cross
        # capacity fails before any I/O.
        dev.append(7, bytes(cap - 128 * KiB))
        with pytest.raises(OSError) as info:
            dev.append(7, bytes(256 * KiB))
        assert info.value.errno == errno.EIO
        assert dev.report_zones(7, 1)[0].wp_bytes == 7 * dev.info.zone_size_bytes + cap - 128 * KiB


async def test_format5_index_on_nvme(nvme_factory: NvmeFactory) -> None:
    """Format 5 (the namespace index, issue 32) on QEMU's zoned NVMe namespace
    (12 MiB capacity in 16 MiB zones): checkpoints, remount, fsck (INV-25)."""
    dev = nvme_factory.main()
    make_filesystem(dev, meta_zones=6, disk_version=5)
    async with ZoneFS.mount(dev, FsOptions(commit_interval_s=3600)) as fs:
        assert fs.journal.index is not None
        for i in range(200):
            await _write(fs, b"s-%04d" % i, _blob(i, 200 + i))
        await fs.journal.checkpoint()
        await _write(fs, b"late", _blob(5, 9000))
        await fs.journal.checkpoint()
    report = check_filesystem(dev)
    assert report.clean, [f.message for f in report.findings]
    fs = await ZoneFS.load(dev, FsOptions())
    assert fs.recovered.index is not None
    assert await _read(fs, b"s-0042") == _blob(42, 242)
    assert await _read(fs, b"late") == _blob(5, 9000)
    await fs.close()
