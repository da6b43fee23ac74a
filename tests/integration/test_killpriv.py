"""Kill-priv through the mount (issue 42, DESIGN 4.1a): a second user's write,
truncate, fallocate (every mode), copy_file_range into a file and open with
O_TRUNC clear set-user-ID and set-group-ID as ext4 does.

The rule (Linux's setattr_should_drop_suidgid): setuid always goes; setgid goes
when the group may execute, or when the writer is not in the file's group; a
writer holding CAP_FSETID (root) keeps both. `kernel_rule` below is that rule;
ext4 on Linux 6.18 gave exactly its answers for every case here (a one-off
comparison on a loop device, the same probe run on both).

Needs root (to make the user and to give the files away); skips otherwise. One
mount serves the module; every test prepares its own files.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import Mount, make_image, zonefs

pytestmark = pytest.mark.integration

USER = "zonefs-it-killpriv"
SETID_MODES = (0o2666, 0o2676, 0o4666, 0o6666, 0o6676, 0o4676)

#: What the second user does to file P (argv[2]); SRC (argv[3]) is a readable file.
CHILD = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
op, path, src = sys.argv[1], sys.argv[2], sys.argv[3]
def fallocate(fd, mode, off, length):
    if libc.fallocate(fd, mode, off, length) != 0:
        raise OSError(ctypes.get_errno(), "fallocate")
if op == "open_trunc":
    os.close(os.open(path, os.O_WRONLY | os.O_TRUNC))
    sys.exit()
fd = os.open(path, os.O_RDWR)
if op == "write":
    os.pwrite(fd, b"x" * 100, 10)
elif op == "truncate":
    os.ftruncate(fd, 5000)
elif op == "fallocate":
    fallocate(fd, 0, 8192, 8192)
elif op == "fallocate_keep_size":
    fallocate(fd, 0x01, 8192, 8192)
elif op == "zero_range":
    fallocate(fd, 0x10, 0, 4096)
elif op == "punch_hole":
    fallocate(fd, 0x01 | 0x02, 0, 4096)
elif op == "copy_destination":
    s = os.open(src, os.O_RDONLY)
    assert os.copy_file_range(s, fd, 4096, 0, 0) == 4096
os.close(fd)
"""
OPS = ("write", "truncate", "fallocate", "fallocate_keep_size", "zero_range", "punch_hole",
       "copy_destination", "open_trunc")


def kernel_rule(mode: int, in_group: bool) -> int:
    """The mode a data change by a user without CAP_FSETID leaves."""
    mode &= ~0o4000
    if mode & 0o2000 and (mode & 0o010 or not in_group):
        mode &= ~0o2000
    return mode


@pytest.fixture(scope="module")
def user() -> Iterator[pwd.struct_passwd]:
    if os.geteuid() != 0:
        pytest.skip("creating a test user needs root (the suite does not run as root)")
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed")
    created = False
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--user-group", "--shell",
                        "/usr/sbin/nologin", USER], check=True, timeout=60)
        created = True
    try:
        pw = pwd.getpwnam(USER)
        try:
            subprocess.run([sys.executable, "-c", "pass"], user=pw.pw_uid, group=pw.pw_gid,
                           extra_groups=[], check=True, timeout=60, cwd="/",
                           capture_output=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            pytest.skip(f"{sys.executable} cannot run as another user ({exc})")
        yield pw
    finally:
        if created:
            subprocess.run(["userdel", USER], check=False, timeout=60)


@pytest.fixture(scope="module")
def mnt(user: pwd.struct_passwd) -> Iterator[Path]:
    """One mount with allow_other for the module; unmounted and fsck'ed after."""
    base = Path(tempfile.mkdtemp(prefix="zonefs-it-", dir=os.environ.get("ZONEFS_IT_DIR")))
    base.chmod(0o755)
    (base / "mnt").mkdir(mode=0o755)
    m = Mount(make_image(base), base / "mnt", base / "daemon.log")
    try:
        m.start("allow_other")
        m.path.chmod(0o777)
        yield m.path
        assert m.unmount() == 0
        assert " WARNING " not in m.log_text()
        assert " ERROR " not in m.log_text()
        zonefs("fsck", str(m.image))
    finally:
        m.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def run_as(user: pwd.struct_passwd, *args: str) -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], user=user.pw_uid,
                          group=user.pw_gid, extra_groups=[], capture_output=True, text=True,
                          timeout=120, cwd="/", stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("in_group", [False, True], ids=["outsider", "member"])
@pytest.mark.parametrize("op", OPS)
def test_second_users_data_change_clears_setid_as_ext4(mnt: Path, user: pwd.struct_passwd,
                                                       op: str, in_group: bool) -> None:
    src = mnt / f"src-{op}-{in_group}"
    src.write_bytes(b"s" * 8192)
    got, want = {}, {}
    for mode in SETID_MODES:
        path = mnt / f"{op}-{in_group}-{mode:o}"
        path.write_bytes(b"a" * 8192)
        os.chown(path, 0, user.pw_gid if in_group else 0)
        path.chmod(mode)
        run_as(user, op, str(path), str(src))
        got[f"{mode:o}"] = f"{path.stat().st_mode & 0o7777:o}"
        want[f"{mode:o}"] = f"{kernel_rule(mode, in_group):o}"
    assert got == want


def test_root_keeps_setid_bits(mnt: Path) -> None:
    # Root holds CAP_FSETID: a write, a truncate and an O_TRUNC leave the bits.
    path = mnt / "root-keeps"
    path.write_bytes(b"a" * 8192)
    path.chmod(0o6676)
    with open(path, "r+b") as f:
        f.write(b"x")
        f.truncate(100)
    os.close(os.open(path, os.O_WRONLY | os.O_TRUNC))
    assert path.stat().st_mode & 0o7777 == 0o6676


def test_chown_by_root_keeps_setgid_without_group_execute(mnt: Path) -> None:
    # chown_common: setuid goes whoever chowns; setgid by the data rule (root keeps it).
    for mode, after in ((0o2666, 0o2666), (0o6666, 0o2666), (0o2676, 0o676)):
        path = mnt / f"chown-{mode:o}"
        path.write_bytes(b"a")
        path.chmod(mode)
        os.chown(path, 1, 1)
        assert path.stat().st_mode & 0o7777 == after, f"{mode:o}"
