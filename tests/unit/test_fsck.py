"""fsck: corrupt one thing, check that its invariant is flagged, repair where possible."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
from engine_helpers import (
    CTX,
    TEST_OPTIONS,
    assert_fsck_clean,
    corrupt_image,
    fsck,
    mounted,
    new_image,
    pattern,
    read_file,
    resolve,
    write_file,
)

from zonefs_py import errors
from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.format.constants import OpType, RecordType
from zonefs_py.format.records import RecordError, decode_record
from zonefs_py.fs.api import ROOT_INO
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.fsck import repair_filesystem
from zonefs_py.journal.recovery import read_superblock


def meta_records(image: Path) -> list[tuple[RecordType, int, int]]:
    """(type, seq, device offset) of every valid record in the meta and superblock zones."""
    dev = EmulatedZonedDevice.open(image, read_only=True)
    try:
        sb, _ = read_superblock(dev)
        bs = dev.info.block_size
        out = []
        zones = dev.report_zones(sb.sb_zone_a, 2 + sb.meta_zone_count)
        for z in zones:
            if not z.written_bytes:
                continue
            buf = dev.read(z.start_bytes, z.written_bytes)
            off = 0
            while off < len(buf):
                try:
                    rec = decode_record(buf, off, sb.fs_id, bs)
                except RecordError:
                    off += bs
                    continue
                out.append((rec.type, rec.seq, z.start_bytes + off))
                off += rec.size_bytes
        return out
    finally:
        dev.close()


def offsets_of(image: Path, rtype: RecordType) -> list[int]:
    return [off for t, _seq, off in meta_records(image) if t == rtype]


async def repair(image: Path) -> list[str]:
    dev = EmulatedZonedDevice.open(image)
    try:
        return await trio.to_thread.run_sync(repair_filesystem, dev)
    finally:
        dev.close()


async def load_fails(image: Path) -> str:
    dev = EmulatedZonedDevice.open(image)
    try:
        with pytest.raises((errors.CorruptionError, errors.NotAFilesystem)) as info:
            await ZoneFS.load(dev, TEST_OPTIONS)
    finally:
        dev.close()
    msg = str(info.value)
    assert "\n" not in msg
    return msg


async def journal_image(image: Path, files: int = 4) -> None:
    """A filesystem whose log holds `files` fsync'ed JOURNAL records after its checkpoint
    (the power is cut instead of unmounting, so no checkpoint folds them in)."""
    new_image(image)
    dev = EmulatedZonedDevice.open(image)
    try:
        async with ZoneFS.mount(dev, TEST_OPTIONS, close=False) as fs:
            for i in range(files):
                await write_file(fs, f"/f{i}", pattern(i, 3000))
            dev.simulate_power_cut("drop")
    finally:
        dev.close()


async def test_full_check_of_a_clean_image_passes(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True) as fs:
        await write_file(fs, "/a", pattern(1, 50000))
        await fs.mkdir(ROOT_INO, b"d", 0o755, CTX)
    report = fsck(image)
    assert report.clean
    assert not report.fatal
    assert report.inodes == 3
    assert report.data_blocks_checked == 13


@pytest.mark.expect_log("zonefs_py.fs.data.readpath", "ERROR", "checksum mismatch in /a")
async def test_flipped_data_block_is_inv12(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True) as fs:
        await write_file(fs, "/a", pattern(1, 20000))
        ext = next(iter(fs.state.inodes[await resolve(fs, "/a")].extents or []))
        bad = ext.dev + 2 * 4096 + 5
    corrupt_image(image, bad)
    report = fsck(image)
    assert [f.invariant for f in report.findings] == ["INV-12"]
    assert "file offset 8192" in report.findings[0].message
    async with mounted(image, fsck_after=False) as fs:
        with pytest.raises(errors.IOFailure):
            await read_file(fs, "/a")
    assert await repair(image) == []  # data is reported, never "fixed"
    assert [f.invariant for f in fsck(image).findings] == ["INV-12"]


async def test_journal_record_damaged_at_the_tail_is_a_torn_tail(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    await journal_image(image)
    journal = offsets_of(image, RecordType.JOURNAL)
    assert len(journal) >= 4
    corrupt_image(image, journal[-1] + 40)
    assert_fsck_clean(image)
    async with mounted(image) as fs:
        assert await read_file(fs, "/f0") == pattern(0, 3000)
        assert await read_file(fs, "/f2") == pattern(2, 3000)


@pytest.mark.expect_log(
    "zonefs_py.journal.recovery", "WARNING",
    "stopping the log replay at damage")
async def test_journal_record_damaged_in_the_middle_refuses_mount(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    await journal_image(image)
    journal = offsets_of(image, RecordType.JOURNAL)
    corrupt_image(image, journal[1] + 40)
    msg = await load_fails(image)
    assert "fsck" in msg
    assert "damaged" in msg
    report = fsck(image)
    assert report.fatal
    assert [f.invariant for f in report.findings] == ["INV-3"]
    fixed = await repair(image)
    assert any("lost" in line for line in fixed), fixed
    assert_fsck_clean(image)
    async with mounted(image) as fs:
        assert await read_file(fs, "/f0") == pattern(0, 3000)  # before the damage: kept


async def test_damaged_checkpoint_record_refuses_mount(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True) as fs:
        await write_file(fs, "/a", b"a")
    data = offsets_of(image, RecordType.CHECKPOINT_DATA)
    corrupt_image(image, data[-1] + 40)
    msg = await load_fails(image)
    assert "fsck" in msg
    report = fsck(image)
    assert report.fatal
    assert [f.invariant for f in report.findings] == ["INV-3"]
    with pytest.raises(errors.CorruptionError):  # nothing to salvage from
        await repair(image)


async def test_damaged_newest_superblock_falls_back_to_the_other_copy(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True) as fs:
        await write_file(fs, "/a", b"kept")
    dev = EmulatedZonedDevice.open(image)
    try:
        sb, store = read_superblock(dev)
        store.write(sb)  # a second copy of the same superblock
    finally:
        dev.close()
    corrupt_image(image, offsets_of(image, RecordType.SUPERBLOCK)[-1] + 60)
    assert_fsck_clean(image)
    async with mounted(image) as fs:
        assert await read_file(fs, "/a") == b"kept"


async def test_no_valid_superblock_is_not_a_filesystem(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    new_image(image)
    for off in offsets_of(image, RecordType.SUPERBLOCK):
        corrupt_image(image, off + 60)
    msg = await load_fails(image)
    assert "mkfs" in msg
    report = fsck(image)
    assert report.fatal
    assert [f.invariant for f in report.findings] == ["INV-1"]


async def test_unlinked_open_file_after_crash_is_freed_by_mount(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    new_image(image)
    dev = EmulatedZonedDevice.open(image)
    try:
        async with ZoneFS.mount(dev, TEST_OPTIONS, close=False) as fs:
            fh, attr = await fs.create(ROOT_INO, b"o", 0o600, os.O_RDWR, CTX)
            await fs.write(fh, 0, b"x" * 10000)
            await fs.fsync(fh, False)
            await fs.unlink(ROOT_INO, b"o")
            await fs.sync()
            dev.simulate_power_cut("drop")
    finally:
        dev.close()
    assert_fsck_clean(image)  # nlink 0 and no names: expected, every mount frees it
    async with mounted(image) as fs:
        assert attr.ino not in fs.state.inodes
        assert sum(fs.state.zone_live_blocks.values()) == 0


async def test_orphan_with_links_is_inv11_and_repaired(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True, fsck_after=False) as fs:
        await write_file(fs, "/a", b"a")
        fs._txn([(OpType.DIRENT_DEL, ROOT_INO, b"a")])  # name gone, nlink still 1
    report = fsck(image)
    assert [f.invariant for f in report.findings] == ["INV-11"]
    assert report.findings[0].repairable
    assert "orphan" in report.findings[0].message
    await repair(image)
    assert_fsck_clean(image)


async def test_link_count_damage_is_inv11_and_repaired(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True, fsck_after=False) as fs:
        await write_file(fs, "/a", b"a")
        ino = await resolve(fs, "/a")
        fs._txn([fs.state.inodes[ino].op(nlink=5)])  # what a bug would leave behind
    report = fsck(image)
    assert [f.invariant for f in report.findings] == ["INV-11"]
    assert "nlink 5, expected 1" in report.findings[0].message
    fixed = await repair(image)
    assert any("link count 5 -> 1" in line for line in fixed)
    assert_fsck_clean(image)


async def test_repair_keeps_every_zone_of_its_checkpoint_until_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Repair writes a checkpoint and resets the other meta zones. A checkpoint
    that spans zones must keep all of them: resetting all but the zone the log
    appends to reset its BEGIN, and a crash before the checkpoint of `close`
    left an image that did not mount."""
    from engine_helpers import Geometry

    from zonefs_py.journal.journal import Journal

    geo = Geometry(size_bytes=16 << 20, zone_size_bytes=64 << 10, meta_zones=32)
    image = tmp_path / "fs.img"
    async with mounted(image, geo=geo, create=True, fsck_after=False) as fs:
        for i in range(700):  # random bytes: a checkpoint of several 64 KiB zones
            await write_file(fs, f"/f{i:04d}", os.urandom(120))
        fs._txn([(OpType.DIRENT_DEL, ROOT_INO, b"f0000")])  # an orphan to repair
    real = Journal.checkpoint
    calls = 0

    async def first_only(self: Journal) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            await real(self)  # repair's own; the one of close is "lost to a crash"

    monkeypatch.setattr(Journal, "checkpoint", first_only)
    await repair(image)
    monkeypatch.setattr(Journal, "checkpoint", real)
    assert calls == 2
    assert_fsck_clean(image)
    async with mounted(image, geo=geo) as fs:
        assert fs.state.inode_count == 700  # root + 699 files: the orphan is freed


async def test_blocks_shared_without_a_share_record_are_inv6(tmp_path: Path) -> None:
    """A file mapping another's device blocks with no SHARE op (what a copy that
    forgot it would leave) is flagged; with the SHARE op the same image is clean."""
    for record_share in (False, True):
        image = tmp_path / f"fs{int(record_share)}.img"
        async with mounted(image, create=True, fsck_after=False) as fs:
            await write_file(fs, "/a", pattern(1, 64 * 1024))
            await write_file(fs, "/b", b"")
            a = fs.state.inodes[await resolve(fs, "/a")]
            b = await resolve(fs, "/b")
            assert a.extents is not None
            e = a.extents.exts[0]
            ops = [(OpType.EXTENT, b, 0, e.nblocks, e.dev, e.csums)]
            if record_share:
                ops.append((OpType.SHARE, e.dev, e.nblocks, 1))
            fs._txn(ops)
            await fs.journal.commit()
        report = fsck(image)
        found = [f for f in report.findings if f.invariant == "INV-6"]
        assert bool(found) != record_share, report.findings


async def test_reservations_past_the_capacity_are_inv24(tmp_path: Path) -> None:
    """A PREALLOC no admission check let through (a journaled bug) is flagged."""
    image = tmp_path / "fs.img"
    async with mounted(image, create=True, fsck_after=False) as fs:
        await write_file(fs, "/f", b"")
        ino = await resolve(fs, "/f")
        fs._txn([(OpType.PREALLOC, ino, 0, 1 << 30)])
        await fs.journal.commit()
    report = fsck(image)
    assert [f for f in report.findings if f.invariant == "INV-24"], report.findings
