"""A clean unmount writes a checkpoint only when the one the mount loaded does
not already hold everything (docs/DESIGN.md 4.5): reading a million files and
unmounting no longer costs seconds of metadata writes, and whatever changed the
image (a write, a crash's repair, a format conversion) still gets one.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import trio
from crashlib import TEST_DISK_VERSION
from engine_helpers import (
    CTX,
    TEST_OPTIONS,
    listdir,
    mounted,
    pattern,
    read_file,
    read_tree,
    write_file,
)

from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.fs.api import ROOT_INO, SetAttrRequest
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.journal.recovery import read_superblock

#: The conversion of older formats to format 4.
FORMAT4_ONLY = pytest.mark.skipif(
    TEST_DISK_VERSION != 4, reason="format 4's whole-namespace checkpoints "
    "(format 5: tests/unit/test_nsindex.py)")


def meta_write_pointers(image: Path) -> list[int]:
    dev = EmulatedZonedDevice.open(image, read_only=True)
    try:
        sb = read_superblock(dev)[0]
        zones = dev.report_zones(sb.meta_first_zone, sb.meta_zone_count)
        zones += dev.report_zones(sb.sb_zone_a, 1) + dev.report_zones(sb.sb_zone_b, 1)
        return [z.wp_bytes for z in zones]
    finally:
        dev.close()


async def fill(fs: ZoneFS) -> None:
    d = await fs.mkdir(ROOT_INO, b"d", 0o755, CTX)
    for i in range(20):
        await write_file(fs, f"/d/f{i}", pattern(i, 300 + 5000 * (i % 3)), fsync=False)
    await fs.symlink(d.ino, b"link", b"f1", CTX)


async def test_unmount_after_reading_writes_nothing(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True) as fs:
        await fill(fs)
    assert fs.journal.checkpoints_written == 1  # the unmount's: something changed
    before = meta_write_pointers(image)
    async with mounted(image) as fs:
        files, dirs = await read_tree(fs)
        assert len(files) == 20
        assert dirs == {"/d"}
        d = (await fs.lookup(ROOT_INO, b"d")).ino
        assert await fs.readlink((await fs.lookup(d, b"link")).ino) == b"f1"
        await fs.statfs()
        fs.status()
        await fs.background_step()  # the periodic work of an idle mount
    assert fs.journal.checkpoints_written == 0
    assert fs.journal.log.bytes_written == 0
    assert fs.journal.sbstore.bytes_written == 0
    assert meta_write_pointers(image) == before
    # The next mount loads the same checkpoint and replays nothing.
    async with mounted(image) as fs:
        assert fs.recovered.journal_bytes == 0
        assert await read_tree(fs) == (files, dirs)
    assert fs.journal.checkpoints_written == 0


async def test_unmount_after_a_change_writes_a_checkpoint(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True) as fs:
        await fill(fs)
    for change in ("chmod", "write", "unlink_open"):
        async with mounted(image) as fs:
            d = (await fs.lookup(ROOT_INO, b"d")).ino
            f1 = (await fs.lookup(d, b"f1")).ino
            if change == "chmod":
                await fs.setattr(f1, SetAttrRequest(mode=0o600), CTX)
            elif change == "write":
                await write_file(fs, "/d/f2", b"new bytes", fsync=False)
            else:
                fh = await fs.open(f1, os.O_RDONLY)
                await fs.unlink(d, b"f1")
                await fs.release(fh)
                # Still looked up by the "kernel": unmount frees it.
        assert fs.journal.checkpoints_written == 1, change
    async with mounted(image) as fs:
        assert fs.recovered.journal_bytes == 0
        d = (await fs.lookup(ROOT_INO, b"d")).ino
        assert b"f1" not in await listdir(fs, d)
        assert await read_file(fs, "/d/f2") == b"new bytes"


async def test_unmount_after_a_crash_writes_a_checkpoint(tmp_path: Path) -> None:
    """The journal tail a crash left is replayed by the mount; the unmount then
    checkpoints it, even though this mount only read."""
    image = tmp_path / "fs.img"
    async with mounted(image, create=True) as fs:
        await fill(fs)
    dev = EmulatedZonedDevice.open(image)
    try:
        async with ZoneFS.mount(dev, TEST_OPTIONS, close=False) as fs:
            await write_file(fs, "/synced", pattern(7, 700), fsync=True)
            await trio.to_thread.run_sync(dev.flush)  # then the power goes
    finally:
        dev.close()
    async with mounted(image) as fs:
        assert fs.recovered.journal_bytes > 0
        assert await read_file(fs, "/synced") == pattern(7, 700)
    assert fs.journal.checkpoints_written == 1
    async with mounted(image) as fs:
        assert fs.recovered.journal_bytes == 0
        assert await read_file(fs, "/synced") == pattern(7, 700)
    assert fs.journal.checkpoints_written == 0


@FORMAT4_ONLY
async def test_unmount_after_a_format_conversion_writes_a_checkpoint(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True) as fs:
        await fill(fs)
    dev = EmulatedZonedDevice.open(image)
    try:
        sb, store = read_superblock(dev)
        store.write(dataclasses.replace(sb, disk_version=2))
        dev.flush()
    finally:
        dev.close()
    async with mounted(image) as fs:
        assert fs.journal.sb.disk_version == 4
        await read_file(fs, "/d/f0")
    assert fs.journal.checkpoints_written == 1
