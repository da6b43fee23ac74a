"""fsck of format 5 in bounded memory (fsck/bounded.py) against the
whole-namespace fsck: the same invariants broken on the same images, clean
ones clean, with and without a journal tail, a crash, forged damage and
damaged data."""

from __future__ import annotations

import os
from pathlib import Path

from engine_helpers import (
    CTX,
    TEST_OPTIONS,
    Geometry,
    MiB,
    corrupt_image,
    new_image5,
    pattern,
    resolve,
    write_file,
)

from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.format.constants import OpType
from zonefs_py.fs.api import ROOT_INO, FallocFlags, XattrFlags
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.fsck import Report, check_filesystem

GEO5 = Geometry(size_bytes=64 * MiB, zone_size_bytes=512 << 10, meta_zones=24)


def both(image: Path) -> tuple[list[str], list[str], int, int]:
    """(whole-namespace findings, bounded findings, inodes each counted)."""
    dev = EmulatedZonedDevice.open(image, read_only=True)
    try:
        whole = check_filesystem(dev, check_data=False, bounded=False)
        bounded = check_filesystem(dev, check_data=False)
    finally:
        dev.close()
    return ([f"{f.invariant}" for f in whole.findings],
            [f"{f.invariant}" for f in bounded.findings], whole.inodes, bounded.inodes)


async def populate(fs: ZoneFS) -> None:
    for d in range(3):
        dino = (await fs.mkdir(ROOT_INO, b"d%d" % d, 0o755, CTX)).ino
        fs.forget([(dino, 1)])
        for i in range(30):
            await write_file(fs, f"/d{d}/f{i}", pattern(d * 100 + i, [0, 100, 5000, 70000][i % 4]),
                             fsync=False)
    sub = (await fs.mkdir(await resolve(fs, "/d1"), b"sub", 0o755, CTX)).ino
    fs.forget([(sub, 1)])
    await write_file(fs, "/d1/sub/deep", pattern(7, 9000))
    link = await fs.symlink(ROOT_INO, b"link", b"d0/f0", CTX)
    fs.forget([(link.ino, 1)])
    f1 = await resolve(fs, "/d0/f1")
    await fs.link(f1, await resolve(fs, "/d2"), b"hard")
    fs.forget([(f1, 1)])
    await fs.setxattr(await resolve(fs, "/d0"), b"user.tag", b"x", XattrFlags.NONE, CTX)
    await fs.setxattr(await resolve(fs, "/d2"), b"user.zonefs.quota", b"10000000",
                      XattrFlags.NONE, CTX)
    fh, attr = await fs.create(ROOT_INO, b"falloc", 0o644, os.O_RDWR, CTX)
    fs.forget([(attr.ino, 1)])
    await fs.fallocate(fh, FallocFlags(0), 0, 1 << 20)
    await fs.release(fh)


async def test_clean_images_are_clean_both_ways(tmp_path: Path) -> None:
    image = tmp_path / "a.img"
    new_image5(image, GEO5)
    dev = EmulatedZonedDevice.open(image)
    try:
        async with ZoneFS.mount(dev, TEST_OPTIONS) as fs:
            await populate(fs)
            await fs.journal.checkpoint()
            for i in range(10):
                await write_file(fs, f"/d0/after{i}", pattern(500 + i, 3000), fsync=False)
            await fs.unlink(await resolve(fs, "/d1"), b"f3")
    finally:
        dev.close()
    whole, bounded, n1, n2 = both(image)
    assert whole == bounded == []
    assert n1 == n2 > 100
    # A crash with a journal tail and a file unlinked while open.
    dev = EmulatedZonedDevice.open(image)
    try:
        async with ZoneFS.mount(dev, TEST_OPTIONS, close=False) as fs:
            await write_file(fs, "/d2/tail", pattern(9, 20000))
            fh, attr = await fs.create(ROOT_INO, b"open", 0o644, os.O_RDWR, CTX)
            await fs.write(fh, 0, b"held")
            await fs.unlink(ROOT_INO, b"open")
            await fs.fsync(fh, False)
            await fs.journal.commit()
    finally:
        dev.close()
    whole, bounded, n1, n2 = both(image)
    assert whole == bounded == []
    assert n1 == n2


async def test_forged_damage_is_found_both_ways(tmp_path: Path) -> None:
    """A wrong link count, a directory given a second name and a name of a freed
    inode, forged in the journal and in a checkpoint: the same invariants."""
    for where in ("journal", "checkpoint"):
        image = tmp_path / f"{where}.img"
        new_image5(image, GEO5)
        dev = EmulatedZonedDevice.open(image)
        try:
            async with ZoneFS.mount(dev, TEST_OPTIONS, close=False) as fs:
                await populate(fs)
                await fs.journal.checkpoint()
                f5 = await resolve(fs, "/d0/f5")
                d1 = await resolve(fs, "/d1")
                d2 = await resolve(fs, "/d2")
                fs._txn([fs.state.inodes[f5].op(nlink=3),
                         (OpType.DIRENT_ADD, d2, d1, b"alias")])
                if where == "checkpoint":
                    await fs.journal.checkpoint()
                await fs.journal.commit()
        finally:
            dev.close()
        whole, bounded, _, _ = both(image)
        assert "INV-11" in whole
        assert sorted(set(whole)) == sorted(set(bounded)), (where, whole, bounded)
        assert sorted(whole) == sorted(bounded), (where, whole, bounded)


async def test_data_checks_stream_too_and_find_what_the_whole_fsck_finds(
        tmp_path: Path) -> None:
    """`zonefs-py fsck` (data checked) on format 5 streams the index and checks each
    batch's extents then: a flipped block of an unsealed zone (checksums in its
    extent), one of a sealed zone (checksums in the summary) and a flipped
    summary block are found, with the same findings as with the namespace
    loaded whole; the bounded walk checked as many blocks."""
    image = tmp_path / "a.img"
    new_image5(image, GEO5)
    dev = EmulatedZonedDevice.open(image)
    try:
        async with ZoneFS.mount(dev, TEST_OPTIONS) as fs:
            await populate(fs)
            await write_file(fs, "/big", pattern(9, 3 << 20))  # fills and seals zones
            await write_file(fs, "/small", pattern(10, 40000))
            await fs.data.sealer.wait_idle()
            await fs.journal.checkpoint()
            big = fs.state.inodes[await resolve(fs, "/big")].extents
            small = fs.state.inodes[await resolve(fs, "/small")].extents
            assert big is not None
            assert small is not None
            sealed = [e for e in big if e.csums is None]
            assert len(sealed) >= 2
            unsealed = next(e for e in small if e.csums is not None)
            seals = dict(fs.state.zone_seals)
    finally:
        dev.close()
    clean_whole = check(image, bounded=False)
    clean_bounded = check(image, bounded=True)
    assert clean_whole.findings == clean_bounded.findings == []
    assert clean_whole.data_blocks_checked == clean_bounded.data_blocks_checked > 0
    corrupt_image(image, unsealed.dev + 4096 + 3)
    corrupt_image(image, sealed[0].dev + 7)
    zone = sealed[1].dev // GEO5.zone_size_bytes
    corrupt_image(image, zone * GEO5.zone_size_bytes + seals[zone][1] * 4096 + 40)
    whole = check(image, bounded=False)
    bounded = check(image, bounded=True)
    found = sorted(f"{f.invariant}: {f.message}" for f in whole.findings)
    assert {f.invariant for f in whole.findings} == {"INV-12", "INV-23"}, found
    assert sorted(f"{f.invariant}: {f.message}" for f in bounded.findings) == found


def check(image: Path, *, bounded: bool) -> Report:
    dev = EmulatedZonedDevice.open(image, read_only=True)
    try:
        return check_filesystem(dev, check_data=True, bounded=bounded)
    finally:
        dev.close()
