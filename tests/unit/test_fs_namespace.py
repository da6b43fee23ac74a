"""Namespace operations of ZoneFS; each test ends with fsck of the image (s3ql t3_fs_api)."""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pyfuse3
import pytest
import trio.testing
from engine_helpers import (
    CTX,
    TEST_OPTIONS,
    assert_fsck_clean,
    listdir,
    lookup,
    mounted,
    new_image,
    read_file,
    write_file,
)

from zonefs_py import errors
from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.fs.api import (
    NAME_MAX,
    ROOT_INO,
    XATTR_SIZE_MAX,
    Ctx,
    RenameFlags,
    SetAttrRequest,
    XattrFlags,
)
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.fuse_ops import Operations


@pytest.fixture
async def fs(tmp_path: Path) -> AsyncIterator[ZoneFS]:
    """A fresh filesystem; closed cleanly and fsck'ed at teardown."""
    async with mounted(tmp_path / "fs.img", create=True) as f:
        yield f


async def mkfile(fs: ZoneFS, parent: int, name: bytes, data: bytes = b"") -> int:
    fh, attr = await fs.create(parent, name, 0o644, os.O_WRONLY, CTX)
    fs.forget([(attr.ino, 1)])
    if data:
        await fs.write(fh, 0, data)
    await fs.release(fh)
    return attr.ino


async def mkdir(fs: ZoneFS, parent: int, name: bytes) -> int:
    attr = await fs.mkdir(parent, name, 0o755, CTX)
    fs.forget([(attr.ino, 1)])
    return attr.ino


async def test_create_lookup_getattr(fs: ZoneFS) -> None:
    fh, attr = await fs.create(ROOT_INO, b"f", 0o640, os.O_WRONLY, Ctx(uid=7, gid=8))
    fs.forget([(attr.ino, 1)])
    await fs.write(fh, 0, b"hello")
    await fs.release(fh)
    got = await lookup(fs, ROOT_INO, b"f")
    assert got.ino == attr.ino
    assert stat.S_IMODE(got.mode) == 0o640
    assert stat.S_ISREG(got.mode)
    assert (got.uid, got.gid, got.nlink, got.size) == (7, 8, 1, 5)
    assert (await fs.getattr(attr.ino)).size == 5
    with pytest.raises(errors.NotFound):
        await fs.lookup(ROOT_INO, b"missing")
    with pytest.raises(errors.Exists):
        await fs.create(ROOT_INO, b"f", 0o644, os.O_WRONLY, CTX)
    assert (await lookup(fs, ROOT_INO, b".")).ino == ROOT_INO
    assert (await lookup(fs, ROOT_INO, b"..")).ino == ROOT_INO


async def test_mkdir_rmdir_and_not_empty(fs: ZoneFS) -> None:
    d = await mkdir(fs, ROOT_INO, b"d")
    assert (await fs.getattr(ROOT_INO)).nlink == 3
    assert (await fs.getattr(d)).nlink == 2
    sub = await mkdir(fs, d, b"sub")
    assert (await fs.getattr(d)).nlink == 3
    assert (await lookup(fs, sub, b"..")).ino == d
    with pytest.raises(errors.NotEmpty):
        await fs.rmdir(ROOT_INO, b"d")
    await mkfile(fs, d, b"x")
    with pytest.raises(errors.NotDirectory):
        await fs.rmdir(d, b"x")
    await fs.unlink(d, b"x")
    await fs.rmdir(d, b"sub")
    await fs.rmdir(ROOT_INO, b"d")
    assert (await fs.getattr(ROOT_INO)).nlink == 2
    assert await listdir(fs, ROOT_INO) == []


async def test_unlink_and_is_directory(fs: ZoneFS) -> None:
    await mkfile(fs, ROOT_INO, b"f", b"x")
    await mkdir(fs, ROOT_INO, b"d")
    with pytest.raises(errors.IsDirectory):
        await fs.unlink(ROOT_INO, b"d")
    await fs.unlink(ROOT_INO, b"f")
    with pytest.raises(errors.NotFound):
        await fs.unlink(ROOT_INO, b"f")
    assert await listdir(fs, ROOT_INO) == [b"d"]


async def test_hard_links_and_nlink(fs: ZoneFS) -> None:
    ino = await mkfile(fs, ROOT_INO, b"a", b"shared")
    d = await mkdir(fs, ROOT_INO, b"d")
    attr = await fs.link(ino, d, b"b")
    fs.forget([(ino, 1)])
    assert attr.nlink == 2
    await fs.unlink(ROOT_INO, b"a")
    assert (await fs.getattr(ino)).nlink == 1
    assert await read_file(fs, "/d/b") == b"shared"
    with pytest.raises(errors.NotPermitted):
        await fs.link(d, ROOT_INO, b"dirlink")


async def test_symlink_and_readlink(fs: ZoneFS) -> None:
    attr = await fs.symlink(ROOT_INO, b"s", b"../some/where", CTX)
    fs.forget([(attr.ino, 1)])
    assert stat.S_ISLNK(attr.mode)
    assert attr.size == len(b"../some/where")
    assert await fs.readlink(attr.ino) == b"../some/where"
    f = await mkfile(fs, ROOT_INO, b"f")
    with pytest.raises(errors.InvalidArgument):
        await fs.readlink(f)


@pytest.mark.parametrize(("fmt", "rdev"), [(stat.S_IFIFO, 0), (stat.S_IFSOCK, 0),
                                           (stat.S_IFCHR, os.makedev(1, 3))])
async def test_mknod_special_files_keep_rdev(tmp_path: Path, fmt: int, rdev: int) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True) as fs:
        attr = await fs.mknod(ROOT_INO, b"node", fmt | 0o600, rdev, CTX)
        fs.forget([(attr.ino, 1)])
        assert stat.S_IFMT(attr.mode) == fmt
        assert attr.rdev == rdev
    async with mounted(image) as fs:
        again = await lookup(fs, ROOT_INO, b"node")
        assert stat.S_IFMT(again.mode) == fmt
        assert again.rdev == rdev


async def test_rename_over_a_file(fs: ZoneFS) -> None:
    a = await mkfile(fs, ROOT_INO, b"a", b"AAA")
    b = await mkfile(fs, ROOT_INO, b"b", b"BBB")
    await fs.rename(ROOT_INO, b"a", ROOT_INO, b"b", RenameFlags.NONE)
    assert await listdir(fs, ROOT_INO) == [b"b"]
    assert (await lookup(fs, ROOT_INO, b"b")).ino == a
    assert b not in fs.state.inodes  # the replaced file is freed
    assert await read_file(fs, "/b") == b"AAA"


async def test_rename_dir_over_empty_dir_across_directories(fs: ZoneFS) -> None:
    src_parent = await mkdir(fs, ROOT_INO, b"p1")
    dst_parent = await mkdir(fs, ROOT_INO, b"p2")
    moved = await mkdir(fs, src_parent, b"d")
    await mkfile(fs, moved, b"inside", b"x")
    await mkdir(fs, dst_parent, b"empty")
    await fs.rename(src_parent, b"d", dst_parent, b"empty", RenameFlags.NONE)
    assert (await fs.getattr(src_parent)).nlink == 2
    assert (await fs.getattr(dst_parent)).nlink == 3
    assert (await lookup(fs, moved, b"..")).ino == dst_parent
    assert await read_file(fs, "/p2/empty/inside") == b"x"
    await mkdir(fs, src_parent, b"full")
    await mkfile(fs, (await lookup(fs, src_parent, b"full")).ino, b"y")
    with pytest.raises(errors.NotEmpty):
        await fs.rename(dst_parent, b"empty", src_parent, b"full", RenameFlags.NONE)
    await mkfile(fs, ROOT_INO, b"file")
    with pytest.raises(errors.NotDirectory):
        await fs.rename(dst_parent, b"empty", ROOT_INO, b"file", RenameFlags.NONE)
    with pytest.raises(errors.IsDirectory):
        await fs.rename(ROOT_INO, b"file", dst_parent, b"empty", RenameFlags.NONE)


async def test_rename_noreplace(fs: ZoneFS) -> None:
    await mkfile(fs, ROOT_INO, b"a", b"A")
    await mkfile(fs, ROOT_INO, b"b", b"B")
    with pytest.raises(errors.Exists):
        await fs.rename(ROOT_INO, b"a", ROOT_INO, b"b", RenameFlags.NOREPLACE)
    await fs.rename(ROOT_INO, b"a", ROOT_INO, b"c", RenameFlags.NOREPLACE)
    assert sorted(await listdir(fs, ROOT_INO)) == [b"b", b"c"]


async def test_rename_exchange_file_and_dir_across_directories(fs: ZoneFS) -> None:
    p1 = await mkdir(fs, ROOT_INO, b"p1")
    p2 = await mkdir(fs, ROOT_INO, b"p2")
    f = await mkfile(fs, p1, b"f", b"file")
    d = await mkdir(fs, p2, b"d")
    await fs.rename(p1, b"f", p2, b"d", RenameFlags.EXCHANGE)
    assert (await lookup(fs, p1, b"f")).ino == d
    assert (await lookup(fs, p2, b"d")).ino == f
    assert (await fs.getattr(p1)).nlink == 3  # gained the directory
    assert (await fs.getattr(p2)).nlink == 2
    assert (await lookup(fs, d, b"..")).ino == p1
    with pytest.raises(errors.NotFound):
        await fs.rename(p1, b"f", p2, b"nothing", RenameFlags.EXCHANGE)
    with pytest.raises(errors.InvalidArgument):
        await fs.rename(p1, b"f", p2, b"d", RenameFlags.EXCHANGE | RenameFlags.NOREPLACE)


async def test_rename_exchange_two_dirs(fs: ZoneFS) -> None:
    a = await mkdir(fs, ROOT_INO, b"a")
    b = await mkdir(fs, ROOT_INO, b"b")
    await mkfile(fs, a, b"in_a")
    await fs.rename(ROOT_INO, b"a", ROOT_INO, b"b", RenameFlags.EXCHANGE)
    assert (await lookup(fs, ROOT_INO, b"a")).ino == b
    assert await listdir(fs, (await lookup(fs, ROOT_INO, b"b")).ino) == [b"in_a"]
    assert (await fs.getattr(ROOT_INO)).nlink == 4


async def test_rename_dir_into_its_own_subtree_refused(fs: ZoneFS) -> None:
    a = await mkdir(fs, ROOT_INO, b"a")
    b = await mkdir(fs, a, b"b")
    c = await mkdir(fs, b, b"c")
    with pytest.raises(errors.LoopDetected):
        await fs.rename(ROOT_INO, b"a", c, b"a2", RenameFlags.NONE)
    with pytest.raises(errors.LoopDetected):
        await fs.rename(ROOT_INO, b"a", b, b"x", RenameFlags.NONE)
    x = await mkdir(fs, ROOT_INO, b"x")
    with pytest.raises(errors.LoopDetected):
        await fs.rename(b, b"c", ROOT_INO, b"a", RenameFlags.EXCHANGE)
    assert x in fs.state.inodes


async def test_long_and_non_utf8_names(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    long_name = b"n" * NAME_MAX
    odd = b"\xff\xfe caf\xe9 \x01"
    async with mounted(image, create=True) as fs:
        await mkfile(fs, ROOT_INO, long_name, b"L")
        await mkfile(fs, ROOT_INO, odd, b"O")
        with pytest.raises(errors.NameTooLong):
            await fs.create(ROOT_INO, b"n" * (NAME_MAX + 1), 0o644, os.O_WRONLY, CTX)
        with pytest.raises(errors.NameTooLong):
            await fs.lookup(ROOT_INO, b"n" * (NAME_MAX + 1))
        with pytest.raises(errors.NameTooLong):
            await fs.mkdir(ROOT_INO, b"d" * (NAME_MAX + 1), 0o755, CTX)
        for bad in (b"a/b", b"a\0b", b""):
            with pytest.raises(errors.InvalidArgument):
                await fs.create(ROOT_INO, bad, 0o644, os.O_WRONLY, CTX)
    async with mounted(image) as fs:
        assert sorted(await listdir(fs, ROOT_INO)) == sorted([long_name, odd])


async def test_xattrs(fs: ZoneFS) -> None:
    f = await mkfile(fs, ROOT_INO, b"f")
    for name in (b"user.a", b"trusted.b", b"security.c"):
        await fs.setxattr(f, name, b"v-" + name, XattrFlags.NONE, CTX)
    assert sorted(await fs.listxattr(f)) == [b"security.c", b"trusted.b", b"user.a"]
    assert await fs.getxattr(f, b"user.a") == b"v-user.a"
    with pytest.raises(errors.Exists):
        await fs.setxattr(f, b"user.a", b"x", XattrFlags.CREATE, CTX)
    with pytest.raises(errors.NoAttribute):
        await fs.setxattr(f, b"user.new", b"x", XattrFlags.REPLACE, CTX)
    await fs.setxattr(f, b"user.a", b"replaced", XattrFlags.REPLACE, CTX)
    assert await fs.getxattr(f, b"user.a") == b"replaced"
    await fs.setxattr(f, b"user.big", b"z" * XATTR_SIZE_MAX, XattrFlags.NONE, CTX)
    with pytest.raises(errors.ValueTooLarge):
        await fs.setxattr(f, b"user.big", b"z" * (XATTR_SIZE_MAX + 1), XattrFlags.NONE, CTX)
    await fs.removexattr(f, b"trusted.b", CTX)
    with pytest.raises(errors.NoAttribute):
        await fs.getxattr(f, b"trusted.b")
    with pytest.raises(errors.NoAttribute):
        await fs.removexattr(f, b"trusted.b", CTX)
    with pytest.raises(errors.NotSupported):
        await fs.setxattr(f, b"os2.x", b"1", XattrFlags.NONE, CTX)


async def test_xattr_check_and_set_never_yield(fs: ZoneFS) -> None:
    """pyfuse3 emulates XATTR_CREATE/REPLACE as getxattr, then setxattr, in one
    task; neither handler may reach a trio checkpoint, so no other request runs
    between the check and the set (two racing creates cannot both succeed)."""
    ops = Operations(fs)
    rctx = SimpleNamespace(uid=0, gid=0, pid=os.getpid(), umask=0o022)
    f = await mkfile(fs, ROOT_INO, b"f")
    with trio.testing.assert_no_checkpoints():
        with pytest.raises(pyfuse3.FUSEError):
            await ops.getxattr(f, b"user.new", rctx)  # type: ignore[arg-type]
        await ops.setxattr(f, b"user.new", b"1", rctx)  # type: ignore[arg-type]
        assert await ops.getxattr(f, b"user.new", rctx) == b"1"  # type: ignore[arg-type]
        await ops.setxattr(f, b"user.new", b"2", rctx)  # type: ignore[arg-type]


async def test_xattrs_persist(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True) as fs:
        f = await mkfile(fs, ROOT_INO, b"f")
        await fs.setxattr(f, b"user.k", b"\x00\xffbinary", XattrFlags.NONE, CTX)
        await fs.setxattr(f, b"user.gone", b"1", XattrFlags.NONE, CTX)
        await fs.removexattr(f, b"user.gone", CTX)
    async with mounted(image) as fs:
        f = (await lookup(fs, ROOT_INO, b"f")).ino
        assert await fs.listxattr(f) == [b"user.k"]
        assert await fs.getxattr(f, b"user.k") == b"\x00\xffbinary"


async def test_readdir_offsets_stable_while_entries_change(fs: ZoneFS) -> None:
    names = [f"e{i:03d}".encode() for i in range(40)]
    for n in names:
        await mkfile(fs, ROOT_INO, n)
    dh = await fs.opendir(ROOT_INO)
    first = await fs.readdir(dh, 0)
    half = [e for e in first if e.name in names][:20]
    resume = half[-1].next_offset
    seen = [e.name for e in half]
    removed = [n for n in names if n not in seen][::3]
    for n in removed:
        await fs.unlink(ROOT_INO, n)
    await mkfile(fs, ROOT_INO, b"added-later")
    rest = [e.name for e in await fs.readdir(dh, resume)]
    await fs.releasedir(dh)
    assert not set(rest) & set(seen), "an entry came back twice"
    assert not set(rest) & set(removed), "a removed entry was returned"
    assert set(seen) | set(rest) | set(removed) >= set(names)
    assert b"added-later" in await listdir(fs, ROOT_INO)


async def test_unlink_open_file_keeps_data_until_release(fs: ZoneFS) -> None:
    fh, attr = await fs.create(ROOT_INO, b"tmp", 0o600, os.O_RDWR, CTX)
    fs.forget([(attr.ino, 1)])
    await fs.write(fh, 0, b"still here" * 1000)
    await fs.fsync(fh, False)
    await fs.unlink(ROOT_INO, b"tmp")
    assert await listdir(fs, ROOT_INO) == []
    assert await fs.read(fh, 0, 10) == b"still here"
    assert (await fs.getattr(attr.ino)).nlink == 0
    await fs.write(fh, 0, b"STILL")
    assert await fs.read(fh, 0, 10) == b"STILL here"
    await fs.release(fh)
    assert attr.ino not in fs.state.inodes
    assert sum(fs.state.zone_live_blocks.values()) == 0


async def test_orphan_held_by_lookup_is_freed_on_clean_unmount(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True) as fs:
        fh, attr = await fs.create(ROOT_INO, b"f", 0o600, os.O_RDWR, CTX)  # lookup kept
        await fs.write(fh, 0, b"x" * 9000)
        await fs.release(fh)
        await fs.unlink(ROOT_INO, b"f")
        assert attr.ino in fs.state.inodes  # the kernel still holds it
    # `mounted` ran fsck: no INV-11 orphan left behind by the clean unmount.


async def test_setattr_mode_owner_times_size(fs: ZoneFS) -> None:
    f = await mkfile(fs, ROOT_INO, b"f", b"0123456789")
    attr = await fs.setattr(f, SetAttrRequest(mode=0o4755), CTX)
    assert stat.S_IMODE(attr.mode) == 0o4755
    assert stat.S_ISREG(attr.mode)
    attr = await fs.setattr(f, SetAttrRequest(uid=5, gid=6), CTX)
    assert (attr.uid, attr.gid) == (5, 6)
    assert not attr.mode & stat.S_ISUID  # chown clears set-user-ID
    attr = await fs.setattr(f, SetAttrRequest(atime_ns=10**18, mtime_ns=2 * 10**18), CTX)
    assert (attr.atime_ns, attr.mtime_ns) == (10**18, 2 * 10**18)
    attr = await fs.setattr(f, SetAttrRequest(size=4), CTX)
    assert attr.size == 4
    assert await read_file(fs, "/f") == b"0123"
    d = await mkdir(fs, ROOT_INO, b"d")
    with pytest.raises(errors.IsDirectory):
        await fs.setattr(d, SetAttrRequest(size=0), CTX)


async def test_statfs_figures(fs: ZoneFS) -> None:
    before = await fs.statfs()
    assert before.block_size == 4096
    assert before.name_max == NAME_MAX
    assert 0 < before.free_blocks <= before.total_blocks
    assert before.total_blocks * 4096 <= fs.alloc.total_capacity() - fs.sb.reserve_bytes
    await write_file(fs, "/big", b"b" * (3 << 20))
    after = await fs.statfs()
    assert after.free_blocks <= before.free_blocks - (3 << 20) // 4096
    if fs.journal.zone_lender is None:
        assert after.free_inodes == before.free_inodes - 1
    else:
        # Format 6: `df -i` counts the empty data zones the index may borrow as
        # room for files (DESIGN.md 3.14), so the data written lowers it too.
        assert after.free_inodes < before.free_inodes


async def test_everything_persists_across_clean_close_and_load(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True) as fs:
        d = await mkdir(fs, ROOT_INO, b"dir")
        await mkfile(fs, d, b"file", b"content" * 500)
        ino = (await lookup(fs, d, b"file")).ino
        await fs.link(ino, ROOT_INO, b"hard")
        fs.forget([(ino, 1)])
        s = await fs.symlink(ROOT_INO, b"sym", b"dir/file", CTX)
        fs.forget([(s.ino, 1)])
        await fs.setattr(ino, SetAttrRequest(mode=0o600, mtime_ns=123456789), CTX)
        before = await fs.getattr(ino)
    async with mounted(image) as fs:
        assert sorted(await listdir(fs, ROOT_INO)) == [b"dir", b"hard", b"sym"]
        assert await read_file(fs, "/dir/file") == b"content" * 500
        assert await read_file(fs, "/hard") == b"content" * 500
        after = await fs.getattr(ino)
        assert (after.mode, after.nlink, after.mtime_ns, after.size) == (
            before.mode, 2, 123456789, before.size)
        assert await fs.readlink((await lookup(fs, ROOT_INO, b"sym")).ino) == b"dir/file"


async def test_load_of_a_blank_device_is_not_a_filesystem(tmp_path: Path) -> None:
    dev = EmulatedZonedDevice.create(tmp_path / "blank.img", size_bytes=64 << 20,
                                     zone_size_bytes=2 << 20)
    try:
        with pytest.raises(errors.NotAFilesystem, match="mkfs"):
            await ZoneFS.load(dev, TEST_OPTIONS)
    finally:
        dev.close()


async def test_fsck_of_a_fresh_image_is_clean(tmp_path: Path) -> None:
    new_image(tmp_path / "fs.img")
    assert_fsck_clean(tmp_path / "fs.img")
    async with mounted(tmp_path / "fs.img") as fs:
        await write_file(fs, "/x", b"x")


async def test_capability_xattrs_are_tracked_across_remounts(tmp_path: Path) -> None:
    """The adapter answers the kernel's security.capability probe itself only while
    `capability_xattrs_present()` is False (issue 29): it must turn True with the
    first capability, stay True after a remount (journal replay and checkpoint),
    and the namespaces it reports must be exactly those the engine stores."""
    img = tmp_path / "fs.img"
    async with mounted(img, create=True) as fs:
        assert not fs.capability_xattrs_present()
        f = await mkfile(fs, ROOT_INO, b"tool")
        await fs.setxattr(f, b"user.other", b"1", XattrFlags.NONE, CTX)
        assert not fs.capability_xattrs_present()
        await fs.setxattr(f, b"security.capability", b"\x01" * 20, XattrFlags.NONE, CTX)
        assert fs.capability_xattrs_present()
        await fs.sync()
    async with mounted(img) as fs:  # from the journal
        assert fs.capability_xattrs_present()
        await fs.checkpoint()
    async with mounted(img) as fs:  # from the checkpoint
        assert fs.capability_xattrs_present()
        f = (await fs.lookup(ROOT_INO, b"tool")).ino
        await fs.removexattr(f, b"security.capability", CTX)
        assert not fs.capability_xattrs_present()
        for ns in fs.xattr_namespaces():
            await fs.setxattr(f, ns + b"x", b"v", XattrFlags.NONE, CTX)
        with pytest.raises(errors.NotSupported):
            await fs.setxattr(f, b"system.posix_acl_access", b"v", XattrFlags.NONE, CTX)
