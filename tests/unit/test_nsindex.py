"""Format 5: the namespace in the on-device index (issue 32), through the engine.

A checkpoint writes only the index entries changed since the previous one,
mount loads the tree, sparse index zones are cleaned and reset, and a damaged
index page refuses the mount (fsck named), never yields a wrong name.
"""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path

import pytest
from engine_helpers import (
    CTX,
    TEST_OPTIONS,
    Geometry,
    MiB,
    assert_fsck_clean,
    mounted,
    new_image,
    new_image5,
    pattern,
    read_tree,
    write_file,
)

from zonefs_py import errors
from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.format.constants import INDEX_DISK_VERSION
from zonefs_py.fs import after_recovery
from zonefs_py.fs.after_recovery import estimated_index_bytes
from zonefs_py.fs.api import ROOT_INO, RenameFlags, XattrFlags
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.fs.options import AUTO_FORMAT, FsOptions
from zonefs_py.journal.nsindex import NamespaceIndex
from zonefs_py.journal.recovery import read_superblock, recover
from zonefs_py.model.dirty import IndexSnapshot, inode_record

#: Small meta zones, many of them: index zones fill and get cleaned quickly.
GEO5 = Geometry(size_bytes=64 * MiB, zone_size_bytes=256 << 10, meta_zones=24)


async def populate(fs: ZoneFS, rng: random.Random, dirs: int = 4, files: int = 30) -> None:
    for d in range(dirs):
        dino = (await fs.mkdir(ROOT_INO, b"d%d" % d, 0o755, CTX)).ino
        fs.forget([(dino, 1)])
        for f in range(files):
            size = rng.choice([0, 100, 600, 5000, 70000])
            await write_file(fs, f"/d{d}/f{f}", pattern(d * 1000 + f, size), fsync=False)
        await fs.setxattr(dino, b"user.tag", b"dir%d" % d, XattrFlags.NONE, CTX)
    link = await fs.symlink(ROOT_INO, b"link", b"d0/f0", CTX)
    fs.forget([(link.ino, 1)])
    await fs.sync()


async def test_format5_mount_loads_what_checkpoints_wrote(tmp_path: Path) -> None:
    image = tmp_path / "a.img"
    new_image5(image, GEO5)
    rng = random.Random(5)
    async with mounted(image) as fs:
        assert fs.journal.index is not None
        await populate(fs, rng)
        await fs.journal.checkpoint()
        d1 = (await fs.lookup(ROOT_INO, b"d1")).ino
        d2 = (await fs.lookup(ROOT_INO, b"d2")).ino
        await fs.rename(d1, b"f3", d2, b"moved", RenameFlags.NONE)
        await fs.unlink(d1, b"f4")
        await write_file(fs, "/d3/f5", pattern(77, 12345))
        fs.forget([(d1, 1), (d2, 1)])
        before = await read_tree(fs)
        await fs.journal.checkpoint()
    dev = EmulatedZonedDevice.open(image)
    try:
        assert read_superblock(dev)[0].disk_version == INDEX_DISK_VERSION
        async with ZoneFS.mount(dev, TEST_OPTIONS) as fs:
            assert fs.recovered.index is not None
            assert fs.recovered.records <= 8, "mount replayed more than the checkpoint"
            assert await read_tree(fs) == before
    finally:
        dev.close()
    assert_fsck_clean(image)


async def test_checkpoint_writes_what_changed_not_the_namespace(tmp_path: Path) -> None:
    image = tmp_path / "a.img"
    new_image5(image, Geometry(size_bytes=256 * MiB, zone_size_bytes=1 * MiB, meta_zones=32))
    async with mounted(image) as fs:
        dino = (await fs.mkdir(ROOT_INO, b"big", 0o755, CTX)).ino
        for i in range(3000):
            await write_file(fs, f"/big/f{i:05d}", b"x" * 200, fsync=False)
        await fs.journal.checkpoint()
        index = fs.journal.index
        assert index is not None
        full_pages = index.store.live_pages()
        full_bytes = fs.journal.last_checkpoint_disk_bytes
        for i in range(10):
            await write_file(fs, f"/big/new{i}", b"y" * 200, fsync=False)
        await fs.journal.checkpoint()
        small_bytes = fs.journal.last_checkpoint_disk_bytes
        fs.forget([(dino, 1)])
    # Ten creates touch a few leaves and their paths to the root, plus the
    # directory's record; the namespace is ~70 pages.
    assert full_pages > 40
    assert index.last_written <= 12, index.last_written
    assert small_bytes * 5 < full_bytes, (small_bytes, full_bytes)


async def test_sparse_index_zones_are_cleaned_and_reset(tmp_path: Path) -> None:
    image = tmp_path / "a.img"
    new_image5(image, GEO5)
    rng = random.Random(9)
    async with mounted(image) as fs:
        await populate(fs, rng, dirs=2, files=40)
        index = fs.journal.index
        assert index is not None
        most = 0
        reset_before = index.store.mlog.free_zone_count()
        for round_ in range(40):
            # Change a few files everywhere: every leaf gets rewritten now and then.
            for _ in range(8):
                d, f = rng.randrange(2), rng.randrange(40)
                await write_file(fs, f"/d{d}/f{f}", pattern(round_, rng.randrange(1, 3000)),
                                 fsync=False)
            await fs.journal.checkpoint()
            most = max(most, len(index.store.live))
        per_zone = (GEO5.zone_size_bytes // index.store.page_size_bytes)
        allowed = int(index.store.live_pages() * 1.5) // per_zone + 4
        assert len(index.store.live) <= allowed, (index.store.live, allowed)
        assert index.store.mlog.free_zone_count() >= reset_before - allowed
        before = await read_tree(fs)
    async with mounted(image) as fs:
        assert await read_tree(fs) == before


async def test_a_damaged_index_page_refuses_the_mount(tmp_path: Path) -> None:
    image = tmp_path / "a.img"
    new_image5(image, GEO5)
    async with mounted(image) as fs:
        await populate(fs, random.Random(1), dirs=2, files=10)
        await fs.journal.checkpoint()
        index = fs.journal.index
        assert index is not None
        assert index.root_record is not None
        start = index.root_record.root_address  # a live page: the root
    dev = EmulatedZonedDevice.open(image)
    try:
        page = bytearray(dev.read(start, 4096))
    finally:
        dev.close()
    page[100] ^= 0x40
    _write_image(image, _image_offset(image, start), bytes(page))
    dev = EmulatedZonedDevice.open(image)
    try:
        with pytest.raises(errors.CorruptionError, match="fsck"):
            async with ZoneFS.mount(dev, TEST_OPTIONS):
                pass
    finally:
        dev.close()


def _image_offset(image: Path, device_offset: int) -> int:
    """Byte offset in an emulator image of a device offset (docs/SPEC.md, Emulator image)."""
    dev = EmulatedZonedDevice.open(image, read_only=True)
    try:
        return int(dev._data_offset) + device_offset
    finally:
        dev.close()


def _write_image(image: Path, offset: int, data: bytes) -> None:
    with open(image, "r+b") as f:
        f.seek(offset)
        f.write(data)


async def test_an_index_zone_the_log_reused_is_never_reset_by_a_mount(tmp_path: Path) -> None:
    """A checkpoint lists an index zone left with no live page; it is reset after
    the superblock write and the log then takes it for journal records. A mount
    after a crash must not take it for an index zone (it reset journal records)."""
    image = tmp_path / "a.img"
    new_image5(image, GEO5)
    rng = random.Random(9)
    dev = EmulatedZonedDevice.open(image, volatile_cache=True)
    try:
        async with ZoneFS.mount(dev, TEST_OPTIONS, close=False) as fs:
            await populate(fs, rng, dirs=2, files=40)
            index, mlog = fs.journal.index, fs.journal.log
            assert index is not None
            emptied: list[int] = []
            for round_ in range(200):
                for _ in range(8):
                    d, f = rng.randrange(2), rng.randrange(40)
                    await write_file(fs, f"/d{d}/f{f}",
                                     pattern(round_, rng.randrange(1, 3000)), fsync=False)
                await fs.journal.checkpoint()
                assert index.root_record is not None
                emptied = [z for z, n in index.root_record.zones.items()
                           if n == 0 and z not in index.store.live]
                if emptied:
                    break
            assert emptied, "no index zone was emptied and reset"
            checkpoints = fs.journal.checkpoints_written
            i = 0
            while (not any(z in mlog.zone_first_seq for z in emptied)
                   or mlog.cur_zone in emptied) and i < 5000:
                await write_file(fs, f"/j{i}", pattern(i, 1500))
                i += 1
            assert fs.journal.checkpoints_written == checkpoints, "a checkpoint ran"
            before = await read_tree(fs)
            dev.simulate_power_cut("drop")
    finally:
        dev.close()
    for _ in range(2):  # the first mount's own writes must not break the second
        dev = EmulatedZonedDevice.open(image, volatile_cache=True)
        try:
            async with ZoneFS.mount(dev, TEST_OPTIONS, close=False) as fs:
                assert await read_tree(fs) == before
                dev.simulate_power_cut("drop")
        finally:
            dev.close()
    assert_fsck_clean(image)


async def test_a_format4_image_is_converted_by_a_mount_with_format_5(tmp_path: Path) -> None:
    image = tmp_path / "a.img"
    new_image(image, Geometry(meta_zones=8, disk_version=4))
    async with mounted(image) as fs:
        await populate(fs, random.Random(4), dirs=3, files=20)
        before = await read_tree(fs)
    async with mounted(image, options=TEST_OPTIONS.replace(convert_format=5)) as fs:
        assert fs.journal.index is not None
        assert fs.sb.disk_version == INDEX_DISK_VERSION
        assert await read_tree(fs) == before
        await write_file(fs, "/after", b"a" * 100)
        before = await read_tree(fs)
    async with mounted(image) as fs:
        assert fs.recovered.index is not None
        assert await read_tree(fs) == before


@pytest.mark.expect_log("zonefs_py", "ERROR", "")  # every cut fails writes on purpose
async def test_a_power_cut_at_any_write_of_a_conversion_loses_nothing(tmp_path: Path) -> None:
    """The conversion's writes: the index pages, the checkpoint's records, the
    superblock, the resets after it. Cut after each: the image mounts (as
    format 4 or 5), holds the same tree, and fsck finds nothing."""
    base = tmp_path / "base.img"
    new_image(base, Geometry(meta_zones=8, disk_version=4))
    async with mounted(base) as fs:
        await populate(fs, random.Random(6), dirs=2, files=15)
        expected = await read_tree(fs)
    convert = TEST_OPTIONS.replace(convert_format=5)

    async def convert_with_cut(image: Path, cut_after: int | None) -> int:
        dev = EmulatedZonedDevice.open(image, volatile_cache=True, cut_after_writes=cut_after)
        try:
            async with ZoneFS.mount(dev, convert) as fs:
                assert fs.sb.disk_version == INDEX_DISK_VERSION
            return int(dev.faults.writes_seen)
        except (OSError, errors.ZoneFSError):
            assert cut_after is not None
            return cut_after
        finally:
            dev.close()

    image = tmp_path / "count.img"
    shutil.copyfile(base, image)
    total = await convert_with_cut(image, None)
    assert total >= 5
    versions = set()
    for k in range(1, total + 1):
        image = tmp_path / f"k{k}.img"
        shutil.copyfile(base, image)
        await convert_with_cut(image, k)
        async with mounted(image) as fs:
            versions.add(fs.sb.disk_version)
            assert await read_tree(fs) == expected, f"cut after write {k} of {total}"
        image.unlink()
    assert versions == {4, INDEX_DISK_VERSION}, versions


async def test_index_snapshot_is_the_state_of_its_first_instant(tmp_path: Path) -> None:
    """Copy-on-write: an IndexSnapshot encoded a few entries at a time while the
    namespace keeps changing holds exactly what an eager encoding at its start
    would; a failed one gives every entry back to the next checkpoint."""
    image = tmp_path / "a.img"
    new_image5(image, GEO5)
    rng = random.Random(11)
    async with mounted(image) as fs:
        await populate(fs, rng, dirs=3, files=12)
        state = fs.state
        dirty = state.dirty
        assert dirty is not None
        assert len(dirty) > 40
        want_inodes = {ino: None if ino not in state.inodes
                       else inode_record(state, state.inodes[ino]) for ino in dirty.inos}
        want_dirents = {(p, n): (state.inodes[p].entries or {}).get(n)
                        if p in state.inodes else None for p, n in dirty.dirents}
        want_owners = {z: sorted(state.zone_owners[z]) if state.zone_owners.get(z) else None
                       for z in dirty.zones}
        snap = IndexSnapshot(state, dirty)
        try:
            serial = 0
            while not snap.step(3):
                serial += 1
                d = rng.randrange(3)
                dino = (await fs.lookup(ROOT_INO, b"d%d" % d)).ino
                name = b"f%d" % rng.randrange(12)
                try:
                    if serial % 3 == 0:
                        await fs.unlink(dino, name)
                    elif serial % 3 == 1:
                        await write_file(fs, f"/d{d}/{name.decode()}", pattern(serial, 900),
                                         fsync=False)
                    else:
                        await fs.rename(dino, name, ROOT_INO, b"r%d" % serial,
                                        RenameFlags.NONE)
                except errors.NotFound:
                    pass
                fs.forget([(dino, 1)])
        finally:
            snap.close()
        assert serial > 10
        assert snap.copied > 0
        assert snap.inodes == want_inodes
        assert snap.dirents == want_dirents
        assert snap.owners == want_owners
        now = state.dirty
        assert now is not None
        assert len(now) > 0  # the changes meanwhile: the next checkpoint's
        # This snapshot is not written: its entries go back for the checkpoint of close.
        now.inos.update(want_inodes)
        now.dirents.update(want_dirents)
        now.dirs.update(p for p, _ in want_dirents)
        now.zones.update(snap.owners)
        again = IndexSnapshot(state, now)
        taken = len(again)
        assert len(now) == 0
        again.close(failed=True)  # a checkpoint whose BEGIN failed
        assert len(now) == taken


async def test_a_conversion_needs_six_meta_zones(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    image = tmp_path / "a.img"
    new_image(image, Geometry(meta_zones=4, disk_version=4))
    with pytest.raises(errors.InvalidArgument, match="at least 6"):
        async with mounted(image, options=TEST_OPTIONS.replace(convert_format=5)):
            pass
    caplog.set_level(logging.INFO, "zonefs_py")
    # The mount command's default: stays format 4, said at INFO (nothing to be done).
    async with mounted(image, options=TEST_OPTIONS.replace(convert_format=AUTO_FORMAT)) as fs:
        assert fs.sb.disk_version == 4
        assert fs.journal.index is None
    assert any("not converted to on-disk format 5: this image has 4 meta zones" in r.message
               and r.levelno == logging.INFO for r in caplog.records)


def test_mount_options_convert_by_default() -> None:
    """`zonefs-py mount` converts unless told format=4; the engine's own default
    (fsck --repair, tools) keeps the format."""
    assert FsOptions().convert_format == 4
    assert FsOptions.from_mount_options({})[0].convert_format is AUTO_FORMAT
    assert FsOptions.from_mount_options({"format": "4"})[0].convert_format == 4
    assert FsOptions.from_mount_options({"format": "5"})[0].convert_format == 5
    with pytest.raises(ValueError, match="4 keeps a format 4 image"):
        FsOptions.from_mount_options({"format": "3"})


async def test_a_mount_converts_a_filled_format4_image_byte_exact(tmp_path: Path) -> None:
    """The default mount converts a format 4 image holding sealed zones, hard
    links, xattrs, symlinks, inline and sparse files: the same tree, bytes and
    attributes after, the estimate of its index within 25% of what it took,
    fsck clean; the converting mount serves lazily (it mounts the converted
    image again), and so does the next; format=4 would have kept it."""
    image = tmp_path / "a.img"
    new_image(image, Geometry(size_bytes=96 * MiB, zone_size_bytes=1 * MiB, meta_zones=8,
                              disk_version=4))
    rng = random.Random(7)
    async with mounted(image) as fs:
        await populate(fs, rng, dirs=6, files=60)
        for i in range(20):  # big files: several sealed zones
            await write_file(fs, f"/d1/big{i}", pattern(900 + i, (1 << 20) + 4096 * i),
                             fsync=False)
        f0 = (await fs.lookup(ROOT_INO, b"d0")).ino
        target = (await fs.lookup(f0, b"f1")).ino
        await fs.link(target, ROOT_INO, b"hard")
        await fs.unlink((await fs.lookup(ROOT_INO, b"d2")).ino, b"f3")
        await fs.sync()
        assert fs.state.zone_seals  # checksums in zone summaries, not in EXTENT ops
        before = await read_tree(fs)
        attrs = {name: fs.attr(fs.state.inodes[ino])
                 for name, ino in [(b"hard", target), (b"d0", f0)]}
        estimate = estimated_index_bytes(fs.state)
    async with mounted(image, options=TEST_OPTIONS.replace(convert_format=4)) as fs:
        assert fs.sb.disk_version == 4  # format=4 keeps it
    async with mounted(image, options=TEST_OPTIONS.replace(convert_format=AUTO_FORMAT)) as fs:
        assert fs.sb.disk_version == INDEX_DISK_VERSION
        assert fs.journal.index is not None
        # After converting, the mount mounted the format 5 image again: lazily.
        assert fs.state.lazy
        live = fs.journal.index.live_bytes()
        assert 0.75 * live <= estimate <= 1.25 * live, (estimate, live)
        assert await read_tree(fs) == before
        for name, ino in [(b"hard", target), (b"d0", f0)]:
            assert fs.attr(fs.state.inodes[ino]) == attrs[name]
    assert read_superblock_version(image) == INDEX_DISK_VERSION
    async with mounted(image, options=TEST_OPTIONS.replace(convert_format=AUTO_FORMAT)) as fs:
        assert fs.state.lazy
        assert await read_tree(fs) == before


@pytest.mark.expect_log("zonefs_py.fs.filesystem", "WARNING", "not converted to on-disk format 5")
async def test_a_meta_area_without_room_for_the_index_stays_format4(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """6 meta zones of 256 KiB: format 4 holds 2,000 files there, their index would
    take more than half of format 5's bound: the default mount keeps format 4 and
    says why (a WARNING), format=5 refuses, and the image is intact."""
    image = tmp_path / "a.img"
    new_image(image, Geometry(size_bytes=32 * MiB, zone_size_bytes=256 << 10, meta_zones=6,
                              disk_version=4))
    async with mounted(image) as fs:
        d = (await fs.mkdir(ROOT_INO, b"many", 0o755, CTX)).ino
        for i in range(2000):
            fh, _ = await fs.create(d, b"file-%05d" % i, 0o644, 0, CTX)
            await fs.release(fh)
        await fs.sync()
        before = await read_tree(fs)
    with pytest.raises(errors.InvalidArgument, match="format=5: its 2002 files and "
                       "directories would take"):
        async with mounted(image, options=TEST_OPTIONS.replace(convert_format=5)):
            pass
    with caplog.at_level(logging.WARNING, "zonefs_py"):
        async with mounted(image, options=TEST_OPTIONS.replace(
                convert_format=AUTO_FORMAT)) as fs:
            assert fs.sb.disk_version == 4
            assert await read_tree(fs) == before
    assert [r.message for r in caplog.records if r.levelno == logging.WARNING
            and "not converted" in r.message], caplog.records


def read_superblock_version(image: Path) -> int:
    dev = EmulatedZonedDevice.open(image, read_only=True)
    try:
        return read_superblock(dev)[0].disk_version
    finally:
        dev.close()


class _ReadCounter:
    """A device whose reads are counted (the rest passes through)."""

    def __init__(self, dev: EmulatedZonedDevice) -> None:
        self.dev = dev
        self.reads = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.dev, name)

    def read(self, offset_bytes: int, length_bytes: int) -> bytes:
        self.reads += 1
        return self.dev.read(offset_bytes, length_bytes)


async def dirs_of_files(tmp_path: Path, dirs: int, files: int, name: str, size: int, *,
                        checkpoint: bool = False) -> Path:
    """A format-5 image of `dirs` directories of `files` files of `size` bytes
    named by `name` (a format string), each directory checkpointed with `checkpoint`."""
    image = tmp_path / "a.img"
    new_image5(image, Geometry(size_bytes=256 * MiB, zone_size_bytes=1 * MiB, meta_zones=32))
    async with mounted(image) as fs:
        for d in range(dirs):
            dino = (await fs.mkdir(ROOT_INO, b"d%d" % d, 0o755, CTX)).ino
            fs.forget([(dino, 1)])
            for i in range(files):
                await write_file(fs, f"/d{d}/{name.format(i)}", b"j" * size, fsync=False)
            if checkpoint:
                await fs.checkpoint()
    return image


async def test_a_cold_stat_from_the_index_reads_two_leaves(tmp_path: Path) -> None:
    """What lazy loading will ask of the tree: a name and an inode's record, from
    a cold cache: one page per level; with the internal pages cached (a few
    pages even at millions of files), one leaf each."""
    image = await dirs_of_files(tmp_path, 4, 1500, "sample-{:06d}.jpg", 300)
    dev = EmulatedZonedDevice.open(image, read_only=True)
    try:
        rec = recover(dev)
        assert rec.index is not None
        assert rec.index.root_record is not None
        state = rec.state
        counted = _ReadCounter(dev)
        cold = NamespaceIndex(counted, rec.log, rec.index.root_record)  # type: ignore[arg-type]
        height = 1 + cold.tree._load(rec.index.root_record.root_address).level
        d2 = (state.inodes[ROOT_INO].entries or {})[b"d2"]
        name = b"sample-000777.jpg"
        ino = cold.lookup(d2, name)
        assert ino == (state.inodes[d2].entries or {})[name]
        ops = cold.inode_ops(ino)
        assert ops is not None
        assert ops[0] == state.inodes[ino].op()
        assert counted.reads <= 2 * height, (counted.reads, height)
        counted.reads = 0
        other = cold.lookup(d2, b"sample-001400.jpg")
        assert other is not None
        assert cold.inode_ops(other) is not None
        print(f"height {height}; warm stat: {counted.reads} device reads")
        assert counted.reads <= 2
        assert cold.lookup(d2, b"no-such-name") is None
    finally:
        dev.close()


async def test_a_long_scan_reads_the_leaves_under_an_internal_page_at_once(
        tmp_path: Path) -> None:
    """fsck --no-data and a whole-namespace mount scan the tree in key order; with
    `prefetch` the leaves under each internal page are read in device order,
    several per read: the same entries, far fewer reads than leaves."""
    image = await dirs_of_files(tmp_path, 3, 1200, "s-{:06d}", 100, checkpoint=True)
    dev = EmulatedZonedDevice.open(image, read_only=True)
    try:
        rec = recover(dev)
        assert rec.index is not None
        assert rec.index.root_record is not None
        counted = _ReadCounter(dev)
        plain = NamespaceIndex(counted, rec.log, rec.index.root_record)  # type: ignore[arg-type]
        entries = list(plain.tree.scan())
        page_reads = counted.reads
        counted.reads = 0
        fast = NamespaceIndex(counted, rec.log, rec.index.root_record)  # type: ignore[arg-type]
        assert list(fast.tree.scan(prefetch=True)) == entries
        print(f"{len(entries)} entries: {page_reads} page reads, {counted.reads} with prefetch")
        assert counted.reads * 4 < page_reads
        # A zone reset drops what was read ahead of it (its pages may be rewritten).
        zone = next(iter(fast.store.live))
        fast.store.prefetch(list(fast.store.page_addresses(zone))[:4])
        assert fast.store._prefetched
        fast.store.forget_zone(zone)
        assert not fast.store._prefetched
    finally:
        dev.close()


@pytest.mark.expect_log("zonefs_py.fs.filesystem", "WARNING", "not converted to on-disk format 5")
async def test_a_conversion_that_would_not_fit_in_memory_is_not_started(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The conversion holds its pages until its commit (~2.5 x the index): with
    less memory available the default mount keeps format 4 and says why, and
    format=5 refuses, rather than be killed half way."""
    image = tmp_path / "a.img"
    new_image(image, Geometry(meta_zones=8, disk_version=4))
    async with mounted(image) as fs:
        await populate(fs, random.Random(8), dirs=2, files=10)
    monkeypatch.setattr(after_recovery, "memory_available_bytes", lambda: 1024)
    with pytest.raises(errors.InvalidArgument, match="MiB of memory more, and 0 MiB"):
        async with mounted(image, options=TEST_OPTIONS.replace(convert_format=5)):
            pass
    async with mounted(image, options=TEST_OPTIONS.replace(convert_format=AUTO_FORMAT)) as fs:
        assert fs.sb.disk_version == 4
    monkeypatch.undo()
    assert after_recovery.memory_available_bytes() is not None  # this machine has /proc
    async with mounted(image, options=TEST_OPTIONS.replace(convert_format=AUTO_FORMAT)) as fs:
        assert fs.sb.disk_version == INDEX_DISK_VERSION
