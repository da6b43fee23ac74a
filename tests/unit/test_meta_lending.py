"""The namespace index borrows data zones when the meta zones run short (format 6,
issue 42 item 5; DESIGN.md 3.14 "Meta area").

A small geometry (256 KiB zones, 6 meta zones) whose meta zones alone held
~600 files of 256 bytes: filled past that without ENOSPC, until the bound that
`df -i` predicted on the empty filesystem; remounted; fsck clean.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from engine_helpers import CTX, Geometry, KiB, MiB, assert_fsck_clean, create_files, new_image5

from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.errors import CorruptionError
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
