"""The kill-priv rule (DESIGN 4.1a): which set-ID bits a data change, a chown or a
chmod by a given caller clears, at the engine level; the integration test
tests/integration/test_killpriv.py holds the mount to what ext4 does."""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from engine_helpers import CTX, mounted

from zonefs_py.caller import proc_credentials
from zonefs_py.fs.api import ROOT_INO, Ctx, SetAttrRequest, XattrFlags
from zonefs_py.fs.attrs import setid_bits_to_drop
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.model.state import CAPABILITY_XATTR

#: The file's group in these tests, and a caller in it and one outside, neither
#: holding CAP_FSETID; and a caller holding it.
FILE_GID = 50
MEMBER = Ctx(uid=1000, gid=1000, creds=lambda: ((1000, FILE_GID), False))
OUTSIDER = Ctx(uid=1000, gid=1000, creds=lambda: ((1000,), False))
CAPABLE = Ctx(uid=1000, gid=1000, creds=lambda: ((1000,), True))


@pytest.fixture
async def fs(tmp_path: Path) -> AsyncIterator[ZoneFS]:
    async with mounted(tmp_path / "fs.img", create=True) as f:
        yield f


async def setid_file(fs: ZoneFS, mode: int, name: bytes = b"f") -> int:
    """A root-owned file of group FILE_GID with 8 KiB and `mode`."""
    fh, attr = await fs.create(ROOT_INO, name, 0o644, os.O_RDWR, CTX)
    fs.forget([(attr.ino, 1)])
    await fs.write(fh, 0, b"a" * 8192)
    await fs.release(fh)
    await fs.setattr(attr.ino, SetAttrRequest(gid=FILE_GID), CTX)
    await fs.setattr(attr.ino, SetAttrRequest(mode=mode), CTX)
    assert stat.S_IMODE((await fs.getattr(attr.ino)).mode) == mode
    return attr.ino


async def mode_of(fs: ZoneFS, ino: int) -> int:
    return stat.S_IMODE((await fs.getattr(ino)).mode)


# What ext4 leaves after a write by each caller (measured: tests/integration/test_killpriv.py).
DATA_RULE = [
    (0o2666, OUTSIDER, 0o666), (0o2666, MEMBER, 0o2666), (0o2666, CAPABLE, 0o2666),
    (0o2676, OUTSIDER, 0o676), (0o2676, MEMBER, 0o676), (0o2676, CAPABLE, 0o2676),
    (0o4666, OUTSIDER, 0o666), (0o4666, MEMBER, 0o666), (0o4666, CAPABLE, 0o4666),
    (0o6666, OUTSIDER, 0o666), (0o6666, MEMBER, 0o2666), (0o0666, OUTSIDER, 0o666),
]
CALLER_IDS = {id(OUTSIDER): "outsider", id(MEMBER): "member", id(CAPABLE): "capable"}


def case_id(case: tuple[int, Ctx, int]) -> str:
    return f"{case[0]:o}-{CALLER_IDS[id(case[1])]}"


@pytest.mark.parametrize("case", DATA_RULE, ids=case_id)
async def test_truncate_applies_the_data_rule(fs: ZoneFS, case: tuple[int, Ctx, int]) -> None:
    mode, caller, after = case
    ino = await setid_file(fs, mode)
    await fs.setattr(ino, SetAttrRequest(size=100), caller)
    assert await mode_of(fs, ino) == after


@pytest.mark.parametrize("case", DATA_RULE, ids=case_id)
async def test_kernel_notice_applies_the_data_rule(fs: ZoneFS,
                                                   case: tuple[int, Ctx, int]) -> None:
    # The empty SETATTR the kernel sends from file_remove_privs (write, fallocate,
    # copy destination) when its own FUSE rule keeps setgid.
    mode, caller, after = case
    ino = await setid_file(fs, mode)
    attr = await fs.setattr(ino, SetAttrRequest(), caller)
    assert stat.S_IMODE(attr.mode) == after


@pytest.mark.parametrize("case", DATA_RULE, ids=case_id)
async def test_open_truncating_applies_the_data_rule(fs: ZoneFS,
                                                     case: tuple[int, Ctx, int]) -> None:
    mode, caller, after = case
    ino = await setid_file(fs, mode)
    await fs.release(await fs.open(ino, os.O_WRONLY | os.O_TRUNC, caller))
    assert await mode_of(fs, ino) == after
    assert (await fs.getattr(ino)).size == 0


async def test_open_truncating_an_empty_file_still_clears(fs: ZoneFS) -> None:
    ino = await setid_file(fs, 0o4666)
    await fs.setattr(ino, SetAttrRequest(size=0), CAPABLE)
    await fs.release(await fs.open(ino, os.O_WRONLY | os.O_TRUNC, OUTSIDER))
    assert await mode_of(fs, ino) == 0o666


async def test_open_truncating_removes_file_capabilities(fs: ZoneFS) -> None:
    ino = await setid_file(fs, 0o755)
    await fs.setxattr(ino, CAPABILITY_XATTR, b"\x01\x00\x00\x02" + bytes(16),
                      XattrFlags.NONE, CTX)
    await fs.release(await fs.open(ino, os.O_RDWR | os.O_TRUNC, CTX))
    assert CAPABILITY_XATTR not in await fs.listxattr(ino)
    assert not fs.capability_xattrs_present()


async def test_open_without_truncate_changes_nothing(fs: ZoneFS) -> None:
    ino = await setid_file(fs, 0o6676)
    await fs.release(await fs.open(ino, os.O_RDWR, OUTSIDER))
    assert await mode_of(fs, ino) == 0o6676


@pytest.mark.parametrize(("caller", "after"), [(CTX, 0o2666), (OUTSIDER, 0o666)],
                         ids=["root", "outsider"])
async def test_chown_keeps_setgid_for_a_caller_in_the_group(fs: ZoneFS, caller: Ctx,
                                                            after: int) -> None:
    ino = await setid_file(fs, 0o6666)
    await fs.setattr(ino, SetAttrRequest(uid=7), caller)
    assert await mode_of(fs, ino) == after  # setuid goes whoever chowns


async def test_chmod_by_an_outsider_cannot_keep_setgid(fs: ZoneFS) -> None:
    # Linux's setattr_prepare; also the mode the kernel sends after a write to a
    # setuid+setgid file (it clears setuid and leaves setgid to us).
    ino = await setid_file(fs, 0o6666)
    await fs.setattr(ino, SetAttrRequest(mode=0o2666), OUTSIDER)
    assert await mode_of(fs, ino) == 0o666
    await fs.setattr(ino, SetAttrRequest(mode=0o2666), MEMBER)
    assert await mode_of(fs, ino) == 0o2666


async def test_times_only_setattr_leaves_the_mode(fs: ZoneFS) -> None:
    ino = await setid_file(fs, 0o6676)
    await fs.setattr(ino, SetAttrRequest(mtime_ns=10**18), OUTSIDER)
    assert await mode_of(fs, ino) == 0o6676


async def test_directories_keep_setgid_on_a_kernel_notice(fs: ZoneFS) -> None:
    attr = await fs.mkdir(ROOT_INO, b"d", 0o2777, CTX)
    fs.forget([(attr.ino, 1)])
    await fs.setattr(attr.ino, SetAttrRequest(), OUTSIDER)
    assert await mode_of(fs, attr.ino) == 0o2777


async def test_credentials_are_read_only_for_setid_files(fs: ZoneFS) -> None:
    calls: list[int] = []

    def creds() -> tuple[tuple[int, ...], bool]:
        calls.append(1)
        return (1000,), False

    caller = Ctx(uid=1000, gid=1000, creds=creds)
    plain = await setid_file(fs, 0o666, b"plain")
    await fs.setattr(plain, SetAttrRequest(size=1), caller)
    await fs.release(await fs.open(plain, os.O_RDWR | os.O_TRUNC, caller))
    assert calls == []
    inode = fs.inode(await setid_file(fs, 0o2666, b"sgid"))
    assert setid_bits_to_drop(inode, caller) == stat.S_ISGID
    assert calls == [1]


def test_proc_credentials_of_this_process() -> None:
    groups, capable = proc_credentials(os.getpid(), os.getuid(), os.getgid())
    assert set(os.getgroups()) | {os.getgid()} == set(groups)
    assert capable == (os.geteuid() == 0)  # the suite runs as root or as a plain user


def test_proc_credentials_without_a_process() -> None:
    assert proc_credentials(0, 0, 5) == ((5,), True)
    assert proc_credentials(0, 1000, 5) == ((5,), False)
    assert proc_credentials(2**22 + 12345, 1000, 5) == ((5,), False)  # beyond pid_max
