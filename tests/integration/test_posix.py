"""POSIX behaviour through a real FUSE mount: one behaviour per test, each on its own mount."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import Mount, fsync_dir

pytestmark = pytest.mark.integration

AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_libc = ctypes.CDLL(None, use_errno=True)


def renameat2(old: Path, new: Path, flags: int) -> None:
    """renameat2(2) through ctypes; raises OSError."""
    if _libc.renameat2(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(old))


def pattern(n: int, seed: int = 1) -> bytes:
    """Deterministic, non-repeating-looking bytes."""
    block = bytes((i * 131 + seed * 17) % 251 for i in range(4096))
    return (block * (n // 4096 + 1))[:n]


def test_create_write_read(mounted: Mount) -> None:
    data = pattern(3 * 1024 * 1024 + 123)
    path = mounted.path / "file"
    path.write_bytes(data)
    assert path.read_bytes() == data
    assert path.stat().st_size == len(data)


def test_overwrite_middle(mounted: Mount) -> None:
    path = mounted.path / "file"
    path.write_bytes(pattern(1 << 20))
    with open(path, "r+b") as f:
        f.seek(5000)
        f.write(b"X" * 10000)
    expected = bytearray(pattern(1 << 20))
    expected[5000:15000] = b"X" * 10000
    assert path.read_bytes() == bytes(expected)


def test_append(mounted: Mount) -> None:
    path = mounted.path / "log"
    for i in range(50):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(fd, b"line %d\n" % i)
        os.close(fd)
    assert path.read_bytes() == b"".join(b"line %d\n" % i for i in range(50))


def test_o_trunc(mounted: Mount) -> None:
    path = mounted.path / "file"
    path.write_bytes(pattern(200000))
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    assert os.fstat(fd).st_size == 0
    os.write(fd, b"short")
    os.close(fd)
    assert path.read_bytes() == b"short"


def test_sparse_hole_reads_zeros(mounted: Mount) -> None:
    path = mounted.path / "sparse"
    with open(path, "wb") as f:
        f.seek(10 << 20)
        f.write(b"end")
    with open(path, "rb") as f:
        assert f.read(1 << 20) == bytes(1 << 20)
        f.seek(10 << 20)
        assert f.read() == b"end"


def test_truncate_extend_and_shrink(mounted: Mount) -> None:
    path = mounted.path / "file"
    path.write_bytes(pattern(100000))
    os.truncate(path, 50000)
    assert path.read_bytes() == pattern(100000)[:50000]
    os.truncate(path, 80000)
    assert path.read_bytes() == pattern(100000)[:50000] + bytes(30000)


def test_rename_over_existing(mounted: Mount) -> None:
    a, b = mounted.path / "a", mounted.path / "b"
    a.write_bytes(b"new")
    b.write_bytes(b"old")
    os.rename(a, b)
    assert not a.exists()
    assert b.read_bytes() == b"new"
    assert sorted(os.listdir(mounted.path)) == ["b"]


def test_rename_noreplace(mounted: Mount) -> None:
    a, b = mounted.path / "a", mounted.path / "b"
    a.write_bytes(b"A")
    b.write_bytes(b"B")
    with pytest.raises(OSError) as info:
        renameat2(a, b, RENAME_NOREPLACE)
    assert info.value.errno == errno.EEXIST
    renameat2(a, mounted.path / "c", RENAME_NOREPLACE)
    assert (mounted.path / "c").read_bytes() == b"A"


def test_rename_exchange(mounted: Mount) -> None:
    (mounted.path / "d").mkdir()
    a, b = mounted.path / "a", mounted.path / "d" / "b"
    a.write_bytes(b"A")
    b.write_bytes(b"B")
    renameat2(a, b, RENAME_EXCHANGE)
    assert a.read_bytes() == b"B"
    assert b.read_bytes() == b"A"


def test_rename_directory_into_itself_is_einval(mounted: Mount) -> None:
    (mounted.path / "d" / "sub").mkdir(parents=True)
    with pytest.raises(OSError) as info:
        os.rename(mounted.path / "d", mounted.path / "d" / "sub" / "x")
    assert info.value.errno == errno.EINVAL


def test_unlink_while_open(mounted: Mount) -> None:
    path = mounted.path / "tmp"
    data = pattern(300000)
    path.write_bytes(data)
    with open(path, "r+b") as f:
        os.unlink(path)
        assert not path.exists()
        assert f.read() == data
        f.write(b"more")
        f.flush()
        os.fsync(f.fileno())
        assert os.fstat(f.fileno()).st_nlink == 0
        f.seek(0)
        assert f.read() == data + b"more"
    assert os.listdir(mounted.path) == []


def test_hard_links_and_nlink(mounted: Mount) -> None:
    a = mounted.path / "a"
    a.write_bytes(b"shared")
    (mounted.path / "d").mkdir()
    os.link(a, mounted.path / "d" / "b")
    os.link(a, mounted.path / "c")
    assert a.stat().st_nlink == 3
    assert a.stat().st_ino == (mounted.path / "d" / "b").stat().st_ino
    with open(mounted.path / "c", "ab") as f:
        f.write(b"!")
    assert (mounted.path / "d" / "b").read_bytes() == b"shared!"
    os.unlink(a)
    assert (mounted.path / "c").stat().st_nlink == 2


def test_directory_nlink(mounted: Mount) -> None:
    root_links = mounted.path.stat().st_nlink
    (mounted.path / "d").mkdir()
    (mounted.path / "d" / "e").mkdir()
    assert (mounted.path / "d").stat().st_nlink == 3
    assert mounted.path.stat().st_nlink == root_links + 1


def test_symlink(mounted: Mount) -> None:
    (mounted.path / "target").write_bytes(b"via link")
    os.symlink("target", mounted.path / "link")
    os.symlink("/nonexistent/" + "x" * 200, mounted.path / "dangling")
    assert os.readlink(mounted.path / "link") == "target"
    assert (mounted.path / "link").read_bytes() == b"via link"
    assert stat.S_ISLNK(os.lstat(mounted.path / "link").st_mode)
    assert os.readlink(mounted.path / "dangling") == "/nonexistent/" + "x" * 200
    assert not (mounted.path / "dangling").exists()


def test_chmod(mounted: Mount) -> None:
    path = mounted.path / "f"
    path.write_bytes(b"")
    os.chmod(path, 0o4751)
    assert stat.S_IMODE(path.stat().st_mode) == 0o4751
    assert stat.S_ISREG(path.stat().st_mode)


def test_chown(mounted: Mount) -> None:
    path = mounted.path / "f"
    path.write_bytes(b"")
    os.chown(path, 1234, 5678)
    st = path.stat()
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    os.chown(path, -1, 42)
    assert (path.stat().st_uid, path.stat().st_gid) == (1234, 42)


def test_utimens(mounted: Mount) -> None:
    path = mounted.path / "f"
    path.write_bytes(b"x")
    os.utime(path, ns=(1_000_000_123, 2_000_000_456))
    st = path.stat()
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_123, 2_000_000_456)
    # UTIME_NOW for both (utime with no times).
    os.utime(path)
    assert path.stat().st_mtime_ns > 2_000_000_456
    # UTIME_OMIT for atime: only mtime changes.
    before = path.stat()
    libc_timespec = ctypes.c_long * 4
    UTIME_OMIT = (1 << 30) - 2
    times = libc_timespec(0, UTIME_OMIT, 3, 7)
    assert _libc.utimensat(AT_FDCWD, os.fsencode(path), times, 0) == 0
    after = path.stat()
    assert after.st_atime_ns == before.st_atime_ns
    assert after.st_mtime_ns == 3_000_000_007


@pytest.mark.parametrize("cache", ["on", "off"])
def test_times_set_before_close_survive_remount(image: Path, mount_factory: Mount,
                                                cache: str) -> None:
    """cp -p and tar set a file's times on the open file before close: the data
    written back at close must not stamp its own write time over them, neither
    with the writeback cache (the WRITEs arrive after the SETATTR) nor without
    (the engine still buffers them). Plain writes still move mtime."""
    mount_factory.start(f"writeback_cache={cache}")
    sizes = {"inline": 100, "block": 100_000, "chunks": 3 << 20}
    for name, size in sizes.items():
        fd = os.open(mount_factory.path / name, os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            os.write(fd, pattern(size))
            os.utime(fd, ns=(1_000_000_007, 2_000_000_009))
        finally:
            os.close(fd)
    before = time.time_ns()
    (mount_factory.path / "plain").write_bytes(pattern(100_000))
    subprocess.run(["cp", "-p", str(mount_factory.path / "block"),
                    str(mount_factory.path / "copied")], check=True)
    assert mount_factory.unmount() == 0
    mount_factory.start(f"writeback_cache={cache}")
    for name in [*sizes, "copied"]:
        st = (mount_factory.path / name).stat()
        assert st.st_mtime_ns == 2_000_000_009, name
        assert (mount_factory.path / name).read_bytes() == pattern(sizes.get(name, 100_000))
    assert (mount_factory.path / "plain").stat().st_mtime_ns >= before - 1_000_000_000


def test_ctime_changes_on_chmod(mounted: Mount) -> None:
    path = mounted.path / "f"
    path.write_bytes(b"x")
    os.utime(path, ns=(1, 1))
    t0 = time.time_ns()
    os.chmod(path, 0o600)
    ctime = path.stat().st_ctime_ns
    # The clock behind ctime may be coarse (jiffies): allow 50 ms.
    assert t0 - 50_000_000 <= ctime <= time.time_ns() + 50_000_000
    assert path.stat().st_mtime_ns == 1


def test_xattrs(mounted: Mount) -> None:
    path = mounted.path / "f"
    path.write_bytes(b"")
    os.setxattr(path, "user.a", b"1")
    os.setxattr(path, "user.big", b"v" * 4000)
    assert os.getxattr(path, "user.a") == b"1"
    assert sorted(os.listxattr(path)) == ["user.a", "user.big"]
    with pytest.raises(OSError) as info:
        os.setxattr(path, "user.a", b"2", os.XATTR_CREATE)
    assert info.value.errno == errno.EEXIST
    with pytest.raises(OSError) as info:
        os.setxattr(path, "user.none", b"2", os.XATTR_REPLACE)
    assert info.value.errno == errno.ENODATA
    os.setxattr(path, "user.a", b"22", os.XATTR_REPLACE)
    assert os.getxattr(path, "user.a") == b"22"
    os.removexattr(path, "user.a")
    with pytest.raises(OSError) as info:
        os.getxattr(path, "user.a")
    assert info.value.errno == errno.ENODATA
    assert os.listxattr(path) == ["user.big"]


def test_xattr_on_directory(mounted: Mount) -> None:
    d = mounted.path / "d"
    d.mkdir()
    os.setxattr(d, "user.dir", b"yes")
    assert os.getxattr(d, "user.dir") == b"yes"


def test_name_of_255_bytes(mounted: Mount) -> None:
    name = "n" * 255
    (mounted.path / name).write_bytes(b"ok")
    assert os.listdir(mounted.path) == [name]
    assert (mounted.path / name).read_bytes() == b"ok"


def test_non_utf8_name(mounted: Mount) -> None:
    name = b"caf\xe9-\xff\xfe"
    path = os.path.join(os.fsencode(mounted.path), name)
    with open(path, "wb") as f:
        f.write(b"latin1")
    assert os.listdir(os.fsencode(mounted.path)) == [name]
    with open(path, "rb") as f:
        assert f.read() == b"latin1"


def test_readdir_many_entries(mounted: Mount) -> None:
    d = mounted.path / "many"
    d.mkdir()
    names = {f"entry-{i:05d}-" + "p" * 40 for i in range(1500)}
    for name in names:
        (d / name).write_bytes(b"")
    assert set(os.listdir(d)) == names
    for i, name in enumerate(sorted(names)):
        if i % 2:
            (d / name).unlink()
    assert len(os.listdir(d)) == 750


@pytest.mark.parametrize(("case", "code"), [
    ("enoent", errno.ENOENT), ("eexist", errno.EEXIST), ("enotempty", errno.ENOTEMPTY),
    ("eisdir", errno.EISDIR), ("enotdir", errno.ENOTDIR), ("enametoolong", errno.ENAMETOOLONG),
])
def test_error_codes(mounted: Mount, case: str, code: int) -> None:
    root = mounted.path
    (root / "dir").mkdir()
    (root / "dir" / "child").write_bytes(b"")
    (root / "file").write_bytes(b"")
    actions = {
        "enoent": lambda: os.open(root / "missing", os.O_RDONLY),
        "eexist": lambda: os.mkdir(root / "dir"),
        "enotempty": lambda: os.rmdir(root / "dir"),
        "eisdir": lambda: os.open(root / "dir", os.O_WRONLY),
        "enotdir": lambda: os.listdir(root / "file"),
        "enametoolong": lambda: os.open(root / ("x" * 256), os.O_WRONLY | os.O_CREAT),
    }
    with pytest.raises(OSError) as info:
        actions[case]()
    assert info.value.errno == code


def test_unlink_directory_is_eisdir_or_eperm(mounted: Mount) -> None:
    (mounted.path / "d").mkdir()
    with pytest.raises(OSError) as info:
        os.unlink(mounted.path / "d")
    # POSIX allows EPERM; Linux filesystems answer EISDIR.
    assert info.value.errno in (errno.EISDIR, errno.EPERM)


def test_statfs(mounted: Mount) -> None:
    st = os.statvfs(mounted.path)
    assert st.f_bsize > 0
    assert st.f_frsize > 0
    assert 0 < st.f_blocks * st.f_frsize <= 512 << 20
    assert st.f_bavail <= st.f_bfree <= st.f_blocks
    assert st.f_namemax == 255
    before = st.f_bfree
    with open(mounted.path / "f", "wb") as f:
        f.write(pattern(64 << 20))
        f.flush()
        os.fsync(f.fileno())
    after = os.statvfs(mounted.path).f_bfree
    assert (before - after) * st.f_frsize >= 32 << 20


def test_mmap_shared_write_and_msync(mounted: Mount) -> None:
    import mmap

    path = mounted.path / "mapped"
    path.write_bytes(bytes(1 << 20))
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 1 << 20) as m:
        m[4096:8192] = b"M" * 4096
        m[-3:] = b"end"
        m.flush()
    data = path.read_bytes()
    assert data[4096:8192] == b"M" * 4096
    assert data[-3:] == b"end"
    assert data[:4096] == bytes(4096)


def test_fsync_directory(image: Path, mount_factory: Mount) -> None:
    """fsync of a directory makes its entries durable: they survive a SIGKILL.

    commit=3600: no timer commit happens during the test, so without the
    directory's fsync the new names would live only in the killed daemon.
    """
    m = mount_factory.start("commit=3600")
    (m.path / "d").mkdir()
    fsync_dir(m.path)  # d's own name is an entry of the root
    (m.path / "d" / "f").write_bytes(b"")  # an empty file: only metadata to lose
    fsync_dir(m.path / "d")  # the only thing that makes f's name durable
    m.signal(signal.SIGKILL)
    m.start()
    assert (m.path / "d").is_dir()
    assert (m.path / "d" / "f").exists()


def test_mknod_fifo(mounted: Mount) -> None:
    os.mkfifo(mounted.path / "fifo", 0o600)
    assert stat.S_ISFIFO(os.lstat(mounted.path / "fifo").st_mode)


NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]


def as_nobody(*cmd: str) -> subprocess.CompletedProcess[str]:
    """Run a command as uid/gid 65534 (nobody/nogroup)."""
    return subprocess.run([*NOBODY, *cmd], capture_output=True, text=True, timeout=60)


def test_permissions_as_nonroot(image: Path, mount_factory: Mount) -> None:
    m = mount_factory.start("allow_other")
    root = m.path
    (root / "secret").write_bytes(b"s")
    os.chmod(root / "secret", 0o600)
    (root / "public").write_bytes(b"p")
    os.chmod(root / "public", 0o644)
    (root / "theirs").mkdir()
    os.chown(root / "theirs", 65534, 65534)

    assert as_nobody("cat", str(root / "public")).stdout == "p"
    denied = as_nobody("cat", str(root / "secret"))
    assert denied.returncode != 0
    assert "Permission denied" in denied.stderr
    write = as_nobody("sh", "-c", f"echo x >> {root / 'public'}")
    assert write.returncode != 0
    assert "Permission denied" in write.stderr
    create = as_nobody("touch", str(root / "new"))
    assert create.returncode != 0
    assert "Permission denied" in create.stderr
    chmod = as_nobody("chmod", "777", str(root / "public"))
    assert chmod.returncode != 0
    assert "Operation not permitted" in chmod.stderr

    mine = as_nobody("sh", "-c", f"echo hi > {root / 'theirs' / 'f'} && chmod 600 "
                                 f"{root / 'theirs' / 'f'}")
    assert mine.returncode == 0, mine.stderr
    st = (root / "theirs" / "f").stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (65534, 65534, 0o600)
    assert (root / "public").read_bytes() == b"p"


def test_sticky_directory_protects_others_files(image: Path, mount_factory: Mount) -> None:
    m = mount_factory.start("allow_other")
    tmp = m.path / "tmp"
    tmp.mkdir()
    os.chmod(tmp, 0o1777)
    (tmp / "roots").write_bytes(b"")
    result = as_nobody("rm", "-f", str(tmp / "roots"))
    assert result.returncode != 0
    assert (tmp / "roots").exists()
