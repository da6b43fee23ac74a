"""Format 5's lazy namespace (issue 32, DESIGN.md 3.15), through the engine.

A mount loads the root, the inodes a RESIDENT op lists and the journal tail;
every other inode, name and zone owner list is read from the index on first
use, and inodes beyond `inode_cache` are evicted. These tests run a few pages
of cache under random creates, renames, unlinks, writes, reads, checkpoints
and the cleaner, and compare with a model; readdir streams a big directory.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import trio
from engine_helpers import (
    CTX,
    TEST_OPTIONS,
    Geometry,
    MiB,
    Model,
    assert_fsck_clean,
    listdir,
    lookup,
    mounted,
    new_image5,
    parent_and_name,
    pattern,
    read_file,
    read_tree,
    resolve,
    write_file,
)

from zonefs_py import errors
from zonefs_py.fs.api import ROOT_INO, RenameFlags
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.journal import nsindex
from zonefs_py.model.lazy import InodeTable, LazyEntries

GEO5 = Geometry(size_bytes=64 * MiB, zone_size_bytes=512 << 10, meta_zones=24)
#: A cache of a few inodes: nearly every use of a cold one faults it in.
TINY_CACHE = TEST_OPTIONS.replace(inode_cache=4, cleaner_rate_mb_s=0.0)


def table(fs: ZoneFS) -> InodeTable:
    assert fs.state.lazy
    assert isinstance(fs.state.inodes, InodeTable)
    return fs.state.inodes


async def test_a_mount_loads_the_root_and_faults_in_the_rest(tmp_path: Path) -> None:
    image = tmp_path / "a.img"
    new_image5(image, GEO5)
    async with mounted(image) as fs:
        for d in range(3):
            await fs.mkdir(ROOT_INO, b"d%d" % d, 0o755, CTX)
            fs.forget([((await lookup(fs, ROOT_INO, b"d%d" % d)).ino, 1)])
            for i in range(40):
                await write_file(fs, f"/d{d}/f{i:03d}", pattern(d * 100 + i, 50 + 97 * i),
                                 fsync=False)
        before = await read_tree(fs)
        count = fs.state.inode_count
    async with mounted(image) as fs:
        t = table(fs)
        # The root only: nothing is open or unlinked, no xattr pins an inode.
        assert len(t) == 1, sorted(t)
        assert fs.state.inode_count == count == 1 + 3 + 120
        assert fs.statfs is not None
        assert await read_tree(fs) == before
        assert t.faults >= count - 1
        assert fs.state.inode_count == count
    # inode_cache=0: loaded whole, and nothing counts as changed (a checkpoint
    # right after would write nothing of the namespace).
    async with mounted(image, options=TEST_OPTIONS.replace(inode_cache=0)) as fs:
        assert not fs.state.lazy
        assert len(fs.state.inodes) == count
        assert fs.state.dirty is not None
        assert len(fs.state.dirty) == 0


async def test_eviction_under_pressure_matches_a_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4-inode cache and 4-page index caches while creates, renames, unlinks,
    writes, reads, checkpoints and the cleaner run: the tree equals a model's,
    before and after a remount, and fsck finds nothing."""
    monkeypatch.setattr(nsindex, "CACHE_PAGES", 4)
    image = tmp_path / "a.img"
    new_image5(image, GEO5)
    rng = random.Random(32)
    model = Model()
    dirs = ["/a", "/b", "/a/c"]
    async with mounted(image, options=TINY_CACHE) as fs:
        for d in dirs:
            parent, name = await parent_and_name(fs, d)
            fs.forget([((await fs.mkdir(parent, name.encode() if isinstance(name, str)
                                        else name, 0o755, CTX)).ino, 1)])
            model.dirs.add(d)
        for step in range(400):
            choice = rng.random()
            files = sorted(model.files)
            if choice < 0.35 or not files:
                path = f"{rng.choice(dirs)}/f{step}"
                data = pattern(step, rng.choice([0, 40, 300, 5000, 20000]))
                await write_file(fs, path, data, fsync=rng.random() < 0.1)
                model.files[path] = data
            elif choice < 0.5:
                src = rng.choice(files)
                dst = f"{rng.choice(dirs)}/r{step}"
                sp, sn = await parent_and_name(fs, src)
                dp, dn = await parent_and_name(fs, dst)
                await fs.rename(sp, sn, dp, dn, RenameFlags.NONE)
                model.rename(src, dst)
            elif choice < 0.62:
                path = rng.choice(files)
                parent, name = await parent_and_name(fs, path)
                await fs.unlink(parent, name)
                del model.files[path]
            elif choice < 0.75:
                path = rng.choice(files)
                old = model.files[path]
                off = rng.randrange(0, len(old) + 1)
                data = pattern(10_000 + step, rng.randrange(1, 3000))
                ino = await resolve(fs, path)
                fh = await fs.open(ino, os.O_WRONLY)
                try:
                    await fs.write(fh, off, data)
                finally:
                    await fs.release(fh)
                model.write(path, off, data)
            elif choice < 0.92:
                path = rng.choice(files)
                assert await read_file(fs, path) == model.files[path], path
            elif choice < 0.97:
                await fs.journal.checkpoint()
            else:
                await fs.cleaner.background_pass()
            fs.state.trim()
            assert len(table(fs)) <= 64, len(table(fs))
        files, got_dirs = await read_tree(fs)
        assert files == model.files
        assert got_dirs == model.dirs
        assert table(fs).evictions > 100
        assert fs.journal.index is not None
        assert fs.journal.index.tree.cache.capacity_pages == 4
        assert fs.state.inode_count == 1 + len(model.dirs) + len(model.files)
    async with mounted(image, options=TINY_CACHE) as fs:
        files, got_dirs = await read_tree(fs)
        assert files == model.files
        assert got_dirs == model.dirs
    assert_fsck_clean(image)


async def test_readdir_streams_a_big_directory_changed_while_listed(tmp_path: Path) -> None:
    """A directory's names come from the tree a batch at a time, merged with the
    names changed since the checkpoint, in name order: every name not changed
    meanwhile shows exactly once, none removed before the listing shows."""
    image = tmp_path / "a.img"
    new_image5(image, GEO5)
    async with mounted(image, options=TEST_OPTIONS.replace(inode_cache=16)) as fs:
        dino = (await fs.mkdir(ROOT_INO, b"big", 0o755, CTX)).ino
        for i in range(2500):
            fh, attr = await fs.create(dino, b"n%05d" % i, 0o644, os.O_WRONLY, CTX)
            fs.forget([(attr.ino, 1)])
            await fs.release(fh)
        await fs.journal.checkpoint()
        for i in range(0, 2500, 7):
            await fs.unlink(dino, b"n%05d" % i)
        for i in range(100):
            fh, attr = await fs.create(dino, b"m%05d" % i, 0o644, os.O_WRONLY, CTX)
            fs.forget([(attr.ino, 1)])
            await fs.release(fh)
        d = fs.state.inodes[dino]
        assert isinstance(d.entries, LazyEntries)
        want = sorted([b"n%05d" % i for i in range(2500) if i % 7]
                      + [b"m%05d" % i for i in range(100)])
        assert await listdir(fs, dino) == want
        # Listed while names come and go: the untouched ones show once each.
        dh = await fs.opendir(dino)
        seen: list[bytes] = []
        offset = 0
        turn = 0
        while True:
            entries = await fs.readdir(dh, offset)
            if not entries:
                break
            seen += [e.name for e in entries if e.name not in (b".", b"..")]
            offset = entries[-1].next_offset
            turn += 1
            if (turn * 3 + 1) % 7:
                await fs.unlink(dino, b"n%05d" % (turn * 3 + 1))
            fh, attr = await fs.create(dino, b"a%05d" % turn, 0o644, os.O_WRONLY, CTX)
            fs.forget([(attr.ino, 1)])
            await fs.release(fh)
        await fs.releasedir(dh)
        assert len(seen) == len(set(seen))
        untouched = {n for n in want if n.startswith(b"m")
                     or int(n[1:]) % 3 != 1 or int(n[1:]) > turn * 3 + 1}
        assert untouched <= set(seen)
        fs.forget([(dino, 1)])
        # Emptiness and rmdir of a directory whose names are in the tree only.
        sub = (await fs.mkdir(ROOT_INO, b"sub", 0o755, CTX)).ino
        fh, attr = await fs.create(sub, b"x", 0o644, os.O_WRONLY, CTX)
        fs.forget([(attr.ino, 1), (sub, 1)])
        await fs.release(fh)
        await fs.journal.checkpoint()
        with pytest.raises(errors.NotEmpty):
            await fs.rmdir(ROOT_INO, b"sub")
        await fs.unlink(sub, b"x")
        await fs.rmdir(ROOT_INO, b"sub")


async def test_open_unlinked_and_xattr_pinned_inodes_are_loaded_at_mount(
        tmp_path: Path) -> None:
    """Inodes a mount must see at once (an open-unlinked file left by a crash, a
    quota directory) are listed by the checkpoint's RESIDENT ops and loaded."""
    image = tmp_path / "a.img"
    new_image5(image, GEO5)
    async with mounted(image) as fs:
        q = (await fs.mkdir(ROOT_INO, b"q", 0o755, CTX)).ino
        from zonefs_py.fs.api import XattrFlags
        await fs.setxattr(q, b"user.zonefs.quota", b"1000000", XattrFlags.NONE, CTX)
        fs.forget([(q, 1)])
        for i in range(20):
            await write_file(fs, f"/q/f{i}", pattern(i, 3000), fsync=False)
        await fs.journal.checkpoint()
    async with mounted(image) as fs:
        t = table(fs)
        assert q in dict(t.items())  # loaded by the mount (RESIDENT), no fault
        tenants = fs.quota.tenant_report()
        assert tenants["q"]["quota_bytes"] == 1000000
        assert tenants["q"]["bytes_stored"] == 20 * 4096


async def test_a_cold_stat_reads_at_most_three_pages(tmp_path: Path) -> None:
    """Issue 32's target: once the mount pinned the index's internal pages (in the
    background), a cold lookup + getattr of a random file reads its name's leaf
    and its record's leaf: at most 3 device reads (2 here)."""
    image = tmp_path / "a.img"
    new_image5(image, Geometry(size_bytes=256 * MiB, zone_size_bytes=1 * MiB, meta_zones=32))
    async with mounted(image) as fs:
        dino = (await fs.mkdir(ROOT_INO, b"data", 0o755, CTX)).ino
        for i in range(8000):
            fh, attr = await fs.create(dino, b"sample-%06d.jpg" % i, 0o644, os.O_WRONLY, CTX)
            fs.forget([(attr.ino, 1)])
            await fs.release(fh)
        fs.forget([(dino, 1)])
    async with mounted(image) as fs:
        t = table(fs)
        reader = t.reader
        with trio.fail_after(30):
            while not reader.cache.pinned:  # type: ignore[attr-defined]
                await trio.sleep(0.05)
        index = fs.journal.index
        assert index is not None
        assert index.root_record is not None
        height = 1 + index.tree.load_page(index.root_record.root_address).level
        assert height >= 3, height
        dino = (await fs.lookup(ROOT_INO, b"data")).ino
        rng = random.Random(7)
        worst = 0
        for i in rng.sample(range(8000), 20):
            before = reader.device_reads  # type: ignore[attr-defined]
            attr = await fs.lookup(dino, b"sample-%06d.jpg" % i)
            await fs.getattr(attr.ino)
            fs.forget([(attr.ino, 1)])
            worst = max(worst, reader.device_reads - before)  # type: ignore[attr-defined]
        assert worst <= 3, worst
        fs.forget([(dino, 1)])


async def test_trim_waits_while_every_inode_must_stay(tmp_path: Path) -> None:
    """More inodes changed since the last checkpoint than the cache holds: a trim
    that can evict nothing does not look again at every FORGET (creates fell to
    330/s), only once the table grew or a checkpoint published them."""
    image = tmp_path / "a.img"
    new_image5(image, GEO5)
    async with mounted(image, options=TEST_OPTIONS.replace(inode_cache=50)) as fs:
        t = table(fs)
        for i in range(300):
            fh, attr = await fs.create(ROOT_INO, b"f%d" % i, 0o644, os.O_WRONLY, CTX)
            fs.forget([(attr.ino, 1)])
            await fs.release(fh)
        assert len(t) > 300  # every one changed: none evictable
        assert fs.state.trim() == 0
        assert t._next_trim_at > len(t)
        await fs.journal.checkpoint()  # publishes them: evictable, and trimmed
        assert len(t) <= 50


@pytest.mark.expect_log("zonefs_py", "ERROR", "")
async def test_a_zone_owner_list_that_cannot_be_read_fails_the_write_not_the_mount(
        tmp_path: Path) -> None:
    """An EXTENT applied on a lazy mount reads its zone's owner list from the index
    if it is not in memory. CI's slow crash stress met a power cut there: the
    read's IOFailure left `State.apply` half done and ended the mount's task
    group. Now the owners are read before anything changes, and the write
    pipeline takes a failed read as the chunk's error: the file's fsync gets
    EIO, the State is as it was, the mount goes on."""
    image = tmp_path / "a.img"
    new_image5(image, GEO5)
    async with mounted(image) as fs:
        await write_file(fs, "/a", pattern(1, 300_000))
    async with mounted(image, options=TINY_CACHE, fsck_after=False) as fs:
        ino = await resolve(fs, "/a")
        inode = fs.state.inodes[ino]
        extents = list(inode.extents or ())
        zone = extents[0].dev // fs.state.zone_size
        live = dict(fs.state.zone_live_blocks)
        owners = fs.state.zone_owners
        assert dict.get(owners, zone) is None  # cold: in the index only

        def unreadable(zone: int) -> list[int]:
            raise errors.IOFailure(f"owners of zone {zone}: simulated read error")

        reader = owners.reader
        real = reader.zone_owners
        reader.zone_owners = unreadable
        try:
            op = (nsindex.OpType.EXTENT, ino, 1000, 1, extents[0].dev, bytes(4))
            with pytest.raises(errors.IOFailure):
                fs.state.apply(op)
            assert list(inode.extents or ()) == extents
            assert fs.state.zone_live_blocks == live
            with pytest.raises(errors.IOFailure):
                await write_file(fs, "/b", pattern(2, 200_000))
        finally:
            reader.zone_owners = real
        assert fs.failsafe is None
        await write_file(fs, "/c", pattern(3, 200_000))
        assert await read_file(fs, "/c") == pattern(3, 200_000)
        assert await read_file(fs, "/a") == pattern(1, 300_000)
