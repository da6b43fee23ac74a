"""The namespace index borrows data zones when the meta zones run short (format 6,
issue 42 item 5; DESIGN.md 3.14 "Meta area").

A small geometry (256 KiB zones, 6 meta zones) whose meta zones alone held
~600 files of 256 bytes: filled past that without ENOSPC, until the bound that
`df -i` predicted on the empty filesystem; remounted; fsck clean.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from engine_helpers import (
    CTX,
    CountingDevice,
    Geometry,
    KiB,
    MiB,
    assert_fsck_clean,
    create_files,
    fsck,
    new_image5,
)

from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.errors import CorruptionError, ZoneFSError
from zonefs_py.format.constants import INDEX_DISK_VERSION, LENDING_DISK_VERSION
from zonefs_py.format.superblock import Superblock
from zonefs_py.fs.api import ROOT_INO
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.fs.options import FsOptions
from zonefs_py.journal.metaroom import index_budget_bytes
from zonefs_py.journal.recovery import superblock_zones
from zonefs_py.journal.sbstore import SuperblockStore

GEO = Geometry(size_bytes=12 * MiB, zone_size_bytes=256 * KiB, meta_zones=6)
OPTIONS = FsOptions(commit_interval_s=3600.0)
PER_DIR = 500
CONTENT = bytes(range(256))


def superblock(path: Path) -> Superblock:
    dev = EmulatedZonedDevice.open(path)
    try:
        sb = SuperblockStore(dev, *superblock_zones(dev)).read_latest()
        assert sb is not None
        return sb
    finally:
        dev.close()


async def fill(fs: ZoneFS, limit: int) -> list[tuple[bytes, int, int]]:
    """Files of 256 bytes in directories of PER_DIR, a checkpoint after each
    directory (as bench/namespace_scale's fill), until ENOSPC or `limit`;
    return (name, inode, files) of each directory."""
    made = 0
    dirs: list[tuple[bytes, int, int]] = []
    while made < limit:
        name = b"d%04d" % len(dirs)
        attr = await fs.mkdir(ROOT_INO, name, 0o755, CTX)
        fs.forget([(attr.ino, 1)])
        n = await create_files(fs, attr.ino, b"f", min(PER_DIR, limit - made), CONTENT)
        dirs.append((name, attr.ino, n))
        made += n
        await fs.checkpoint()
        if n < PER_DIR:
            break
    return dirs


@pytest.mark.slow
async def test_creates_fill_data_zones_lent_to_the_index_up_to_what_df_i_said(
        tmp_path: Path, expect_log: Callable[[str, str, str], None]) -> None:
    expect_log("zonefs_py.fs.namespace", "WARNING", "the metadata area is full")
    path = tmp_path / "a.img"
    new_image5(path, GEO)
    dev = EmulatedZonedDevice.open(path)
    try:
        async with ZoneFS.mount(dev, OPTIONS) as fs:
            predicted = (await fs.statfs()).free_inodes
            cap = fs.journal.log.zone_capacity_bytes
            # What the meta zones alone held before: ~443 device bytes a file.
            old_bound = index_budget_bytes(GEO.meta_zones or 0, cap) // 443
            dirs = await fill(fs, 3 * predicted)
            made = sum(n for _, _, n in dirs) + len(dirs)  # files and directories
            lent = len(fs.alloc.lent)
            inodes = fs.state.inode_count
    finally:
        dev.close()
    assert made > 5 * old_bound
    assert lent > 0
    assert abs(made - predicted) <= predicted // 10, (made, predicted)
    assert superblock(path).disk_version == LENDING_DISK_VERSION
    dev = EmulatedZonedDevice.open(path)
    try:
        async with ZoneFS.mount(dev, OPTIONS) as fs:
            assert fs.state.inode_count == inodes
            assert len(fs.alloc.lent) == lent
    finally:
        dev.close()
    assert_fsck_clean(path)


async def test_lent_zones_go_back_to_data_once_the_index_shrinks(tmp_path: Path) -> None:
    path = tmp_path / "a.img"
    new_image5(path, GEO)
    dev = EmulatedZonedDevice.open(path)
    try:
        async with ZoneFS.mount(dev, OPTIONS) as fs:
            capacity0 = fs.alloc.user_capacity_bytes()
            dirs = await fill(fs, 4000)
            assert fs.alloc.lent
            assert fs.alloc.user_capacity_bytes() < capacity0
            for name, ino, n in dirs:
                for i in range(n):
                    await fs.unlink(ino, b"f%06d" % i)
                await fs.rmdir(ROOT_INO, name)
                await fs.checkpoint()
            for _ in range(4):  # cleaning moves what is left out of the sparse zones
                await fs.checkpoint()
            assert not fs.alloc.lent
            assert fs.alloc.user_capacity_bytes() == capacity0
    finally:
        dev.close()
    assert_fsck_clean(path)


async def test_a_version_5_log_whose_index_lists_a_data_zone_is_refused(
        tmp_path: Path) -> None:
    """Only version 6 lends data zones to the index: an older image's
    CHECKPOINT_INDEX naming one is damage, never loaded as index pages."""
    path = tmp_path / "a.img"
    new_image5(path, GEO)
    dev = EmulatedZonedDevice.open(path)
    try:
        async with ZoneFS.mount(dev, OPTIONS) as fs:
            await fill(fs, 2000)
            lent = sorted(fs.alloc.lent)
            assert lent
    finally:
        dev.close()
    dev = EmulatedZonedDevice.open(path)
    try:
        store = SuperblockStore(dev, *superblock_zones(dev))
        sb = store.read_latest()
        assert sb is not None
        assert sb.disk_version == LENDING_DISK_VERSION
        store.write(sb.as_version(INDEX_DISK_VERSION))
        with pytest.raises(CorruptionError, match=f"lists data zone {lent[0]}"):
            async with ZoneFS.mount(dev, OPTIONS):
                pass
    finally:
        dev.close()


async def _add_dir(fs: ZoneFS, d: int) -> None:
    attr = await fs.mkdir(ROOT_INO, b"d%04d" % d, 0o755, CTX)
    fs.forget([(attr.ino, 1)])
    assert await create_files(fs, attr.ino, b"f", PER_DIR, CONTENT) == PER_DIR


async def _entries(fs: ZoneFS, ino: int) -> int:
    dh = await fs.opendir(ino)
    count = offset = 0
    try:
        while batch := await fs.readdir(dh, offset):
            count += sum(e.name not in (b".", b"..") for e in batch)
            offset = batch[-1].next_offset
    finally:
        await fs.releasedir(dh)
    return count


def _fill_superblock_zone(path: Path) -> None:
    """Append copies of the newest superblock until its zone has no room for
    one more: the next superblock write resets the other zone first."""
    dev = EmulatedZonedDevice.open(path)
    try:
        store = SuperblockStore(dev, *superblock_zones(dev))
        sb = store.read_latest()
        assert sb is not None
        zone = store.current_zone
        while dev.report_zones(zone, 1)[0].remaining_bytes >= dev.info.block_size:
            store.write(sb)
        assert store.current_zone == zone
    finally:
        dev.close()


@pytest.mark.slow  # ~10 s: two mounts and two fscks per cut point
@pytest.mark.expect_log("zonefs_py", "ERROR", "")  # every cut point fails writes on purpose
@pytest.mark.parametrize("superblock_zone_full", [False, True])
async def test_power_cut_at_each_write_of_the_checkpoint_that_rewrites_the_superblock_as_6(
        tmp_path: Path, superblock_zone_full: bool) -> None:
    """The first lend of a version 5 image rewrites its superblock as version 6
    inside a checkpoint (with the superblock zone full: a reset of the other
    zone, then the append). A power cut after each write of that checkpoint:
    fsck clean, the mount finds version 5 with no index page in a data zone or
    version 6, and every directory made before it whole."""
    # How many directories (each followed by a checkpoint) before the first lend.
    probe = tmp_path / "probe.img"
    new_image5(probe, GEO)
    dev = EmulatedZonedDevice.open(probe)
    dirs = 0
    try:
        async with ZoneFS.mount(dev, OPTIONS) as fs:
            while True:
                await _add_dir(fs, dirs)
                await fs.checkpoint()
                if fs.journal.sb.disk_version == LENDING_DISK_VERSION:
                    break
                dirs += 1
    finally:
        dev.close()
    probe.unlink()
    base = tmp_path / "base.img"
    new_image5(base, GEO)
    dev = EmulatedZonedDevice.open(base)
    try:
        async with ZoneFS.mount(dev, OPTIONS) as fs:
            for d in range(dirs):
                await _add_dir(fs, d)
                await fs.checkpoint()
            assert fs.journal.sb.disk_version == INDEX_DISK_VERSION
    finally:
        dev.close()
    if superblock_zone_full:
        _fill_superblock_zone(base)

    async def run(image: Path, cut_after: int | None) -> tuple[int, int, int]:
        """Mount, one more directory, a checkpoint, unmount; return the writes
        before the checkpoint, after it, and in all."""
        edev = EmulatedZonedDevice.open(image, volatile_cache=True)
        cdev = CountingDevice(edev, cut_after=cut_after, mode="drop")
        before = after = -1
        try:
            async with ZoneFS.mount(cdev, OPTIONS) as fs:
                await _add_dir(fs, dirs)
                await fs.sync()
                before = cdev.writes
                await fs.checkpoint()
                after = cdev.writes
                if cut_after is None:
                    assert fs.journal.sb.disk_version == LENDING_DISK_VERSION
                    assert fs.alloc.lent
        except (OSError, ZoneFSError):
            if cut_after is None or not cdev.cut:
                raise
        finally:
            edev.close()
        return before, after, cdev.writes

    plain = tmp_path / "plain.img"
    shutil.copyfile(base, plain)
    first, last, _ = await run(plain, None)
    assert last - first >= 2, (first, last)
    on_disk: set[int] = set()
    for k in range(first + 1, last + 1):
        image = tmp_path / f"k{k}.img"
        shutil.copyfile(base, image)
        await run(image, k)
        where = f"cut after write {k} ({first + 1}-{last})"
        assert fsck(image).clean, f"{where}: {fsck(image).findings}"
        # Version 5 on the device: the mount refuses it if its index lists a
        # data zone (`recovery._check_index_zones`), so mounting proves it.
        on_disk.add(superblock(image).disk_version)
        dev = EmulatedZonedDevice.open(image)
        try:
            async with ZoneFS.mount(dev, OPTIONS) as fs:
                index = fs.journal.index
                assert index is not None
                version = fs.journal.sb.disk_version  # its own checkpoint may lend
                if version == INDEX_DISK_VERSION:
                    assert not index.store.data_zones(), where
                    assert not fs.alloc.lent, where
                else:
                    assert version == LENDING_DISK_VERSION, where
                for d in range(dirs):
                    attr = await fs.lookup(ROOT_INO, b"d%04d" % d)
                    assert await _entries(fs, attr.ino) == PER_DIR, where
                    fs.forget([(attr.ino, 1)])
        finally:
            dev.close()
        assert fsck(image).clean, f"{where}: after the mount"
        image.unlink()
    # The cuts fell before and after the rewrite (and nothing else was written).
    assert on_disk == {INDEX_DISK_VERSION, LENDING_DISK_VERSION}
