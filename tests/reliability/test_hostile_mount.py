"""Hostile input through a real mount: long and non-UTF-8 names, deep trees, huge
directories, xattr limits, offsets near 2**63, rename storms, unprivileged callers.

Every test ends with the fixture's unmount and `zonefs-py fsck` (exit 0).
"""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mounts import Mount, make_image

pytestmark = pytest.mark.integration

ALLOWED_RENAME_ERRNOS = {errno.EINVAL, errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST,
                         errno.EISDIR, errno.ENOTDIR, errno.EBUSY}


def remount(m: Mount) -> None:
    rc = m.unmount()
    assert rc == 0, m.log_text()[-3000:]
    m.start()


def test_names_of_255_bytes_and_longer(mounted: Mount) -> None:
    ascii_name = "a" * 255
    utf8_name = "é" * 127 + "x"  # 255 bytes in UTF-8
    assert len(utf8_name.encode()) == 255
    for name in (ascii_name, utf8_name):
        (mounted.path / name).write_bytes(name.encode())
    with pytest.raises(OSError) as info:
        (mounted.path / ("b" * 256)).write_bytes(b"x")
    assert info.value.errno == errno.ENAMETOOLONG
    with pytest.raises(OSError) as info:
        os.mkdir(mounted.path / ("é" * 128))
    assert info.value.errno == errno.ENAMETOOLONG
    remount(mounted)
    assert sorted(os.listdir(mounted.path)) == sorted([ascii_name, utf8_name])
    assert (mounted.path / utf8_name).read_bytes() == utf8_name.encode()


def test_non_utf8_names(mounted: Mount) -> None:
    root = os.fsencode(mounted.path)
    names = [b"\xff\xfe", b"latin1-\xe9t\xe9", b"\x80" * 255, b"ctl-\x01\x1f\x7f", b"nl\nname"]
    for i, name in enumerate(names):
        fd = os.open(root + b"/" + name, os.O_CREAT | os.O_WRONLY, 0o644)
        os.write(fd, bytes([i]) * 100)
        os.close(fd)
    os.mkdir(root + b"/dir-\xc3\x28")
    os.rename(root + b"/\xff\xfe", root + b"/dir-\xc3\x28/\xfe\xff")
    remount(mounted)
    listed = set(os.listdir(root))
    assert listed == {*names[1:], b"dir-\xc3\x28"}
    assert os.listdir(root + b"/dir-\xc3\x28") == [b"\xfe\xff"]
    with open(root + b"/dir-\xc3\x28/\xfe\xff", "rb") as f:
        assert f.read() == bytes([0]) * 100


def test_deep_tree_of_1000_levels(mounted: Mount) -> None:
    depth = 1000
    fds = [os.open(mounted.path, os.O_RDONLY | os.O_DIRECTORY)]
    try:
        for i in range(depth):
            os.mkdir(f"d{i}", dir_fd=fds[-1])
            fds.append(os.open(f"d{i}", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fds[-1]))
        fd = os.open("bottom", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fds[-1])
        os.write(fd, b"deep")
        os.close(fd)
    finally:
        for fd in fds:
            os.close(fd)
    remount(mounted)
    fd = os.open(mounted.path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(depth):
            nfd = os.open(f"d{i}", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        bottom = os.open("bottom", os.O_RDONLY, dir_fd=fd)
        assert os.read(bottom, 10) == b"deep"
        os.close(bottom)
        # Move the bottom directory to the top: a rename across 999 levels.
        os.rename(f"/proc/self/fd/{fd}/bottom", mounted.path / "bottom")
    finally:
        os.close(fd)
    # Moving the top directory under its own descendant must be refused (no loop).
    deep = mounted.path / "d0" / "d1" / "d2"
    with pytest.raises(OSError) as info:
        os.rename(mounted.path / "d0", deep / "d0")
    assert info.value.errno == errno.EINVAL
    assert (mounted.path / "bottom").read_bytes() == b"deep"


def _many_entries(m: Mount, count: int) -> None:
    d = m.path / "big"
    d.mkdir()
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(count):
            os.close(os.open(f"entry-{i:07d}", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=dfd))
        os.fsync(dfd)
    finally:
        os.close(dfd)
    names = os.listdir(d)
    assert len(names) == count
    remount(m)
    t0 = time.monotonic()
    with os.scandir(m.path / "big") as it:
        assert sum(1 for _ in it) == count
    print(f"{count} entries: listed after remount in {time.monotonic() - t0:.1f}s")
    assert (m.path / "big" / f"entry-{count - 1:07d}").exists()
    os.unlink(m.path / "big" / "entry-0000000")
    assert len(os.listdir(m.path / "big")) == count - 1


def test_10000_entries_in_one_directory(mounted: Mount) -> None:
    _many_entries(mounted, 10_000)


@pytest.mark.slow
def test_100000_entries_in_one_directory(workdir: Path, mount_factory: Mount) -> None:
    # 8 meta zones: format 5's six of 16 MiB hold ~60,000 files (DESIGN 3.14).
    make_image(workdir, meta_zones=8)
    _many_entries(mount_factory.start(), 100_000)


def test_xattrs_at_and_beyond_their_limits(mounted: Mount) -> None:
    f = mounted.path / "x"
    f.write_bytes(b"x")
    big = random.Random(1).randbytes(65536)
    os.setxattr(f, "user.big", big)
    assert os.getxattr(f, "user.big") == big
    with pytest.raises(OSError) as info:
        os.setxattr(f, "user.bigger", big + b"!")
    assert info.value.errno == errno.E2BIG
    long_name = "user." + "n" * 250  # 255 bytes
    os.setxattr(f, long_name, b"v")
    with pytest.raises(OSError) as info:
        os.setxattr(f, long_name + "n", b"v")
    assert info.value.errno == errno.ERANGE
    # Many attributes: each set either works or fails with ENOSPC/E2BIG, never anything else.
    stored, refused = 0, []
    for i in range(200):
        try:
            os.setxattr(f, f"user.many{i}", bytes(4000))
            stored += 1
        except OSError as exc:
            refused.append(exc.errno)
    assert set(refused) <= {errno.ENOSPC, errno.E2BIG}, refused
    try:
        names: list[str] | None = os.listxattr(f)
        listed_errno = 0
    except OSError as exc:
        names, listed_errno = None, exc.errno
    assert listed_errno in (0, errno.E2BIG)  # E2BIG: the list itself beyond 64 KiB
    if names is not None:
        assert len([n for n in names if n.startswith("user.many")]) == stored
    remount(mounted)
    assert os.getxattr(f, "user.big") == big
    assert os.getxattr(f, long_name) == b"v"
    print(f"xattrs: 64 KiB value ok, 64 KiB + 1 E2BIG, {stored} x 4000-byte attrs stored")


@pytest.mark.parametrize("offset", [1 << 40, (1 << 62) + 12345, (1 << 63) - 4097, (1 << 63) - 2])
def test_huge_sparse_offsets(mounted: Mount, offset: int) -> None:
    f = mounted.path / "sparse"
    fd = os.open(f, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        assert os.pwrite(fd, b"Z", offset) == 1
        os.fsync(fd)
        assert os.fstat(fd).st_size == offset + 1
        assert os.pread(fd, 1, offset) == b"Z"
        assert os.pread(fd, 4096, offset // 2) == bytes(4096)
        with pytest.raises(OSError) as info:
            os.pwrite(fd, b"too far", (1 << 63) - 1)
        assert info.value.errno in (errno.EFBIG, errno.EINVAL)  # EINVAL: the kernel's, on overflow
    finally:
        os.close(fd)
    remount(mounted)
    fd = os.open(f, os.O_RDWR)
    try:
        assert os.fstat(fd).st_size == offset + 1
        assert os.pread(fd, 1, offset) == b"Z"
        os.ftruncate(fd, 10)
        assert os.pread(fd, 100, 0) == bytes(10)
    finally:
        os.close(fd)


def test_concurrent_rename_storm_across_directories(mounted: Mount) -> None:
    """8 threads move 24 nested directories into each other for 10 s: no deadlock, no loop."""
    root = mounted.path / "storm"
    dirs = [f"d{i}" for i in range(24)]
    root.mkdir()
    for d in dirs:
        (root / d).mkdir()
        (root / d / "file").write_bytes(d.encode())
    stop = time.monotonic() + 10
    errors_seen: list[BaseException] = []
    renames = [0]

    def find(name: str) -> Path | None:
        for dirpath, dirnames, _files in os.walk(root):
            if name in dirnames:
                return Path(dirpath) / name
        return None

    def storm(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while time.monotonic() < stop:
                src, dst = find(rng.choice(dirs)), rng.choice([root, find(rng.choice(dirs))])
                if src is None or dst is None:
                    continue
                try:
                    os.rename(src, dst / src.name)
                    renames[0] += 1
                except OSError as exc:
                    if exc.errno not in ALLOWED_RENAME_ERRNOS:
                        raise
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors_seen.append(exc)

    threads = [threading.Thread(target=storm, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "rename storm deadlocked"
    assert not errors_seen, errors_seen
    # Every directory is reachable exactly once from the root, each still holding its file.
    seen: dict[str, int] = {}
    for dirpath, dirnames, _files in os.walk(root):
        for d in dirnames:
            seen[d] = seen.get(d, 0) + 1
            assert (Path(dirpath) / d / "file").read_bytes() == d.encode()
    assert seen == dict.fromkeys(dirs, 1)
    print(f"rename storm: {renames[0]} renames by 8 threads in 10 s")
    remount(mounted)
    assert sum(len(dn) for _p, dn, _f in os.walk(root)) == len(dirs)


def _as_nobody(code: str, *args: str) -> str:
    result = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                             sys.executable, "-c", code, *args],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


PROBE = """
import errno, os, sys
def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
root, secret, shared = sys.argv[1:4]
print(attempt(lambda: os.getxattr(root, "trusted.zonefs.status")))
print(attempt(lambda: os.setxattr(root, "trusted.zonefs.ctl", b"failsafe")))
print(attempt(lambda: os.setxattr(root, "trusted.zonefs.ctl", b"sync")))
print(attempt(lambda: open(secret, "rb").read()))
print(attempt(lambda: open(secret, "ab").write(b"x")))
print(attempt(lambda: os.unlink(os.path.join(root, "rootdir", "f"))))
print(attempt(lambda: os.chmod(shared, 0o777)))
print(attempt(lambda: os.chown(shared, 65534, 65534)))
print(attempt(lambda: os.setxattr(shared, "user.evil", b"x")))
print(attempt(lambda: os.rename(shared, os.path.join(root, "stolen"))))
"""


def test_unprivileged_user_cannot_reach_root_controls_or_files(image: Path,
                                                               mount_factory: Mount) -> None:
    m = mount_factory.start("allow_other")
    os.chmod(m.path, 0o755)
    secret = m.path / "secret"
    secret.write_bytes(b"root only")
    os.chmod(secret, 0o600)
    (m.path / "rootdir").mkdir(mode=0o755)
    (m.path / "rootdir" / "f").write_bytes(b"f")
    shared = m.path / "shared"
    shared.write_bytes(b"readable")
    os.chmod(shared, 0o644)
    out = _as_nobody(PROBE, str(m.path), str(secret), str(shared)).split()
    assert out[0] in ("ENODATA", "EPERM")  # trusted.* is invisible to non-root
    assert out[1:3] == ["EPERM", "EPERM"]
    assert out[3:] == ["EACCES", "EACCES", "EACCES", "EPERM", "EPERM", "EACCES", "EACCES"]
    # Nothing changed: not failsafe, files intact.
    (m.path / "after").write_bytes(b"still writable")
    assert secret.read_bytes() == b"root only"
    assert os.stat(shared).st_mode & 0o777 == 0o644
