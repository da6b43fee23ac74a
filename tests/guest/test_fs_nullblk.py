"""The filesystem itself on real zoned null_blk devices (inside the QEMU guest).

The device contract tests prove BlockZonedDevice; these prove the engine on
top of it: mkfs, writes through the data path (pipelined appends at the
kernel's write pointers), checkpoint, remount, fsck, with zone capacity below
zone size, conventional zones first, and the WD ZN540's limits of 14 open /
14 active zones (the kernel, not our emulator, enforces them here), and
recovery after the process "crashes" (the device is reopened without a clean
unmount).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from zonefs_py.device.base import ZonedDevice
from zonefs_py.fs.api import Ctx, RenameFlags
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.fs.mkfs import make_filesystem
from zonefs_py.fs.options import FsOptions
from zonefs_py.fsck import check_filesystem

pytestmark = pytest.mark.guest
MiB = 1 << 20
CTX = Ctx()


def _blob(seed: int, size: int) -> bytes:
    return bytes((seed * 131 + i * 7) & 0xFF for i in range(256)) * (size // 256)


async def _write(fs: ZoneFS, name: bytes, data: bytes, parent: int = 1) -> None:
    fh, _ = await fs.create(parent, name, 0o644, os.O_WRONLY, CTX)
    for off in range(0, len(data), MiB):
        await fs.write(fh, off, data[off:off + MiB])
    await fs.fsync(fh, False)
    await fs.release(fh)


async def _read(fs: ZoneFS, name: bytes, parent: int = 1) -> bytes:
    attr = await fs.lookup(parent, name)
    fh = await fs.open(attr.ino, os.O_RDONLY)
    try:
        return await fs.read(fh, 0, attr.size)
    finally:
        await fs.release(fh)


async def assert_reads_use_ring(fs: ZoneFS, name: bytes, parent: int) -> None:
    """A read of written data goes to the kernel's zoned device through the io_uring
    completion ring (device/aread.py), not a worker thread.

    Only device reads of up to aread.MAX_RING_READ (1 MiB) take the ring. Whether
    reading a whole multi-MiB file makes any such read depends on its extents:
    chunks that landed in order merge into one extent per zone (6 MiB here, read
    through a thread), chunks that completed out of order do not (1 MiB extents,
    read through the ring) -- a race between the worker threads of in-flight
    chunks, hence the old flaky `ring_reads > 0` after the whole-file read. A
    64 KiB read is one device read of at most 64 KiB whatever the layout.
    """
    assert fs.data.reader is not None
    assert fs.data.reader.uses_ring
    before = fs.data.reader.ring_reads
    attr = await fs.lookup(parent, name)
    fh = await fs.open(attr.ino, os.O_RDONLY)
    try:
        head = await fs.read(fh, MiB, 64 * 1024)
    finally:
        await fs.release(fh)
    assert len(head) == 64 * 1024
    assert fs.data.reader.ring_reads > before
    # The 64 KiB read is one mapped piece: the fast path (submitted with its
    # checksums, verified in C at completion) served it.
    assert fs.data.reads.fast_reads > 0


async def test_mkfs_write_remount_fsck_on_nullblk(
        zdev_factory: Callable[..., ZonedDevice]) -> None:
    dev = zdev_factory(nr_zones=32, zone_size_mb=8, zone_capacity_mb=6, nr_conv=2,
                       max_open=14, max_active=14)
    make_filesystem(dev)  # mkfs's default: format 5
    # ZoneFS.mount: the io_uring reader needs the mount's tasks (ZoneFS.load has none).
    async with ZoneFS.mount(dev, FsOptions(commit_interval_s=3600)) as fs:
        ckdir = (await fs.mkdir(1, b"checkpoints", 0o755, CTX)).ino
        big = _blob(1, 20 * MiB)  # spans several 6 MiB-capacity zones of its own
        await _write(fs, b"step-1.pt.tmp", big, ckdir)
        await fs.rename(ckdir, b"step-1.pt.tmp", ckdir, b"step-1.pt", RenameFlags.NONE)
        for i in range(20):
            await _write(fs, b"shard-%05d.tar" % i, _blob(i, 64 * 1024))
        await fs.sync()
        assert await _read(fs, b"step-1.pt", ckdir) == big
        await assert_reads_use_ring(fs, b"step-1.pt", ckdir)
    report = check_filesystem(dev)
    assert report.clean, [f.message for f in report.findings]
    fs = await ZoneFS.load(dev, FsOptions())
    assert await _read(fs, b"step-1.pt", ckdir) == big
    assert await _read(fs, b"shard-00007.tar") == _blob(7, 64 * 1024)
    await fs.close()


async def test_recovery_after_crash_on_nullblk(
        zdev_factory: Callable[..., ZonedDevice]) -> None:
    dev = zdev_factory(nr_zones=24, zone_size_mb=4, max_active=14)
    make_filesystem(dev)  # mkfs's default: format 5
    fs = await ZoneFS.load(dev, FsOptions(commit_interval_s=3600))
    await _write(fs, b"durable", _blob(3, 3 * MiB))
    # Acknowledged by fsync above; the next file is written but never synced.
    fh, _ = await fs.create(1, b"volatile", 0o644, os.O_WRONLY, CTX)
    await fs.write(fh, 0, _blob(4, 2 * MiB))
    await fs.flush(fh)
    # "Crash": drop the engine without close(); the kernel device keeps what reached it.
    del fs
    fs = await ZoneFS.load(dev, FsOptions())
    assert await _read(fs, b"durable") == _blob(3, 3 * MiB)
    await fs.close()
    report = check_filesystem(dev)
    assert report.clean, [f.message for f in report.findings]


async def test_format5_index_on_nullblk(zdev_factory: Callable[..., ZonedDevice]) -> None:
    """Format 5 (the namespace index, issue 32) on the kernel's zoned null_blk:
    index pages in meta zones of 6 MiB capacity in 8 MiB zones, checkpoints that
    write what changed, a crash, the remount loading the tree, fsck (INV-25)."""
    dev = zdev_factory(nr_zones=32, zone_size_mb=8, zone_capacity_mb=6, nr_conv=2,
                       max_open=14, max_active=14)
    make_filesystem(dev, meta_zones=6, disk_version=5)
    fs = await ZoneFS.load(dev, FsOptions(commit_interval_s=3600))
    assert fs.journal.index is not None
    for i in range(300):
        await _write(fs, b"s-%04d" % i, _blob(i, 300 + i))
    await fs.journal.checkpoint()
    full = fs.journal.last_checkpoint_disk_bytes
    for i in range(5):
        await _write(fs, b"late-%d" % i, _blob(1000 + i, 5000))
    await fs.journal.checkpoint()
    assert fs.journal.last_checkpoint_disk_bytes * 4 < full
    await _write(fs, b"after", _blob(7, 70000))  # journaled, then a "crash"
    del fs
    fs = await ZoneFS.load(dev, FsOptions())
    assert fs.recovered.index is not None
    assert await _read(fs, b"s-0123") == _blob(123, 423)
    assert await _read(fs, b"after") == _blob(7, 70000)
    await fs.close()
    report = check_filesystem(dev)
    assert report.clean, [f.message for f in report.findings]
