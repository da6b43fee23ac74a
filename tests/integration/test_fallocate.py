"""fallocate(2), instant copies and file handles through a real mount (issue 28).

fallocate and copy_file_range go through `zonefs_py.fuseext` (pyfuse3 does
not pass them on); handles through FUSE's export support ("." lookups by
node id).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import random
import struct
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import Mount, make_image, zonefs

pytestmark = pytest.mark.integration

KEEP_SIZE, PUNCH_HOLE, COLLAPSE, ZERO_RANGE, INSERT, UNSHARE = 1, 2, 8, 0x10, 0x20, 0x40
AT_FDCWD = -100
MiB = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """fallocate(2) with any mode (os.posix_fallocate has none); raises OSError."""
    if _libc.fallocate(fd, mode, ctypes.c_int64(offset), ctypes.c_int64(length)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def name_to_handle(path: Path) -> bytes:
    """name_to_handle_at(2): the file handle as raw `struct file_handle` bytes."""
    room = 128
    buf = ctypes.create_string_buffer(8 + room)
    struct.pack_into("<Ii", buf, 0, room, 0)
    mount_id = ctypes.c_int()
    if _libc.name_to_handle_at(AT_FDCWD, os.fsencode(path), buf, ctypes.byref(mount_id), 0):
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(path))
    return buf.raw


def open_by_handle(mount_dir: Path, handle: bytes) -> int:
    """open_by_handle_at(2) read-only (needs CAP_DAC_READ_SEARCH); returns an fd."""
    mfd = os.open(mount_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = _libc.open_by_handle_at(mfd, ctypes.create_string_buffer(handle, len(handle)),
                                     os.O_RDONLY)
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        return fd
    finally:
        os.close(mfd)


def pattern(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def fill_and_fsync(fd: int, mib: int) -> None:
    """Write `mib` MiB to fd and fsync it (ENOSPC may come from either)."""
    for i in range(mib):
        os.write(fd, pattern(MiB, i))
    os.fsync(fd)


def apply_model(model: bytearray, mode: int, off: int, n: int) -> bytearray:
    """What fallocate(mode, off, n) makes of a file's bytes."""
    end = off + n
    if mode & (PUNCH_HOLE | ZERO_RANGE):
        lo, hi = min(off, len(model)), min(end, len(model))
        model[lo:hi] = bytes(hi - lo)
    if not mode & KEEP_SIZE and end > len(model):
        model += bytes(end - len(model))
    return model


def test_each_mode_against_a_model_survives_a_remount(image: Path,
                                                      mount_factory: Mount) -> None:
    mount_factory.start()
    path = mount_factory.path / "f"
    model = bytearray(pattern(3 * MiB + 777, 1))
    path.write_bytes(bytes(model))
    steps = [(PUNCH_HOLE | KEEP_SIZE, 5000, MiB), (0, 3 * MiB, 2 * MiB),
             (ZERO_RANGE | KEEP_SIZE, 100, 9000), (ZERO_RANGE, 5 * MiB - 10, MiB),
             (KEEP_SIZE, 8 * MiB, MiB), (PUNCH_HOLE | KEEP_SIZE, 4 * MiB, 10 * MiB)]
    fd = os.open(path, os.O_RDWR)
    try:
        for mode, off, n in steps:
            fallocate(fd, mode, off, n)
            apply_model(model, mode, off, n)
            assert os.fstat(fd).st_size == len(model), (mode, off, n)
            assert os.pread(fd, len(model) + 4096, 0) == bytes(model), (mode, off, n)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert mount_factory.unmount() == 0
    mount_factory.start()
    assert path.read_bytes() == bytes(model)


def test_mode_0_shows_in_df_and_st_blocks_and_punch_gives_it_back(mounted: Mount) -> None:
    path = mounted.path / "big"
    before = os.statvfs(mounted.path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, 64 * MiB)
        st = os.fstat(fd)
        assert st.st_size == 64 * MiB
        assert st.st_blocks * 512 >= 64 * MiB
        after = os.statvfs(mounted.path)
        assert (before.f_bfree - after.f_bfree) * after.f_frsize >= 64 * MiB
        assert os.pread(fd, 4096, 10 * MiB) == bytes(4096)
        fallocate(fd, PUNCH_HOLE | KEEP_SIZE, 0, 64 * MiB)
        assert os.fstat(fd).st_blocks == 0
        again = os.statvfs(mounted.path)
        assert again.f_bfree == before.f_bfree
    finally:
        os.close(fd)


def test_writes_into_a_reservation_never_get_enospc(mounted: Mount) -> None:
    st = os.statvfs(mounted.path)
    room = (st.f_bavail * st.f_frsize - 8 * MiB) // MiB * MiB
    fd = os.open(mounted.path / "reserved", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fallocate(fd, KEEP_SIZE, 0, room)
        with pytest.raises(OSError) as exc:
            fallocate(fd, KEEP_SIZE, room, 64 * MiB)
        assert exc.value.errno == errno.ENOSPC
        other = os.open(mounted.path / "other", os.O_WRONLY | os.O_CREAT, 0o644)
        with pytest.raises(OSError) as exc:
            fill_and_fsync(other, 64)
        assert exc.value.errno == errno.ENOSPC
        os.close(other)
        os.unlink(mounted.path / "other")
        chunk = pattern(MiB, 99)
        for off in range(0, room, MiB):
            os.pwrite(fd, chunk, off)
        os.fsync(fd)
        assert os.pread(fd, MiB, room - MiB) == chunk
    finally:
        os.close(fd)


def test_unsupported_modes_are_eopnotsupp(mounted: Mount) -> None:
    path = mounted.path / "f"
    path.write_bytes(pattern(MiB, 3))
    fd = os.open(path, os.O_RDWR)
    try:
        for mode in (COLLAPSE, INSERT, UNSHARE):
            with pytest.raises(OSError) as exc:
                fallocate(fd, mode, 0, 4096)
            assert exc.value.errno == errno.EOPNOTSUPP, mode
        fallocate(fd, PUNCH_HOLE | KEEP_SIZE, 0, 4096)  # still served afterwards
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(4096) + pattern(MiB, 3)[4096:]


@pytest.mark.skipif(os.geteuid() != 0, reason="open_by_handle_at needs CAP_DAC_READ_SEARCH")
def test_file_handles_with_one_and_two_links_survive_a_remount(image: Path,
                                                               mount_factory: Mount) -> None:
    mount_factory.start()
    m = mount_factory.path
    (m / "d").mkdir()
    (m / "one").write_bytes(b"one")
    (m / "d" / "two").write_bytes(b"two")
    os.link(m / "d" / "two", m / "two-again")
    handles = {name: name_to_handle(m / name) for name in ("one", "d/two", "two-again", "d")}
    for rnd in range(2):
        for name, want in (("one", b"one"), ("d/two", b"two"), ("two-again", b"two")):
            fd = open_by_handle(m, handles[name])
            try:
                assert os.read(fd, 10) == want, (rnd, name)
            finally:
                os.close(fd)
        fd = open_by_handle(m, handles["d"])  # a directory: its ".." is looked up
        try:
            assert os.listdir(fd) == ["two"]
        finally:
            os.close(fd)
        assert mount_factory.unmount() == 0
        mount_factory.start()  # the kernel's inode cache is gone now


def _device_bytes(mount: Mount) -> int:
    os.sync()
    proc = zonefs("stat", str(mount.path), "--json")
    return int(json.loads(proc.stdout)["device_bytes_written"])


def test_cp_of_2_gib_shares_extents(workdir: Path, mount_factory: Mount) -> None:
    """coreutils cp (copy_file_range) of 2 GiB writes under 1 MiB to the device; both
    files stay exact after half of each is overwritten; deleting the source frees
    nothing until the copy goes too."""
    make_image(workdir, size="6G", zone_size="64M")
    m = mount_factory.start().path
    chunk = pattern(MiB, 7)
    with open(m / "ckpt", "wb") as f:
        for i in range(2048):
            f.write(chunk[i % 7:] + chunk[:i % 7])
    used0 = os.statvfs(m)
    before = _device_bytes(mount_factory)
    subprocess.run(["cp", str(m / "ckpt"), str(m / "copy")], check=True)
    assert _device_bytes(mount_factory) - before < MiB
    used1 = os.statvfs(m)
    assert abs(used1.f_bfree - used0.f_bfree) * used1.f_frsize < 8 * MiB
    half = pattern(MiB, 8)
    with open(m / "ckpt", "r+b") as f:
        for i in range(0, 1024, 64):
            f.seek(i * MiB)
            f.write(half)
    with open(m / "copy", "r+b") as f:
        for i in range(1024, 2048, 64):
            f.seek(i * MiB)
            f.write(half)
    for name, lo, hi in (("ckpt", 0, 1024), ("copy", 1024, 2048)):
        with open(m / name, "rb") as f:
            for i in range(2048):
                want = half if lo <= i < hi and i % 64 == 0 else chunk[i % 7:] + chunk[:i % 7]
                assert f.read(MiB) == want, (name, i)
    free0 = os.statvfs(m).f_bfree
    os.unlink(m / "ckpt")
    os.sync()
    # What the source alone held (the 16 MiB it overwrote) comes back; the rest stays.
    freed = (os.statvfs(m).f_bfree - free0) * used1.f_frsize
    assert freed <= 64 * MiB, freed
    os.unlink(m / "copy")
    os.sync()
    # The blocks are freed when the inode is: at the kernel's FORGET (and the RELEASE
    # of the last read), which it sends without waiting for them, so a few ms later.
    deadline = time.monotonic() + 10
    while (os.statvfs(m).f_bfree - free0) * used1.f_frsize < 2000 * MiB \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (os.statvfs(m).f_bfree - free0) * used1.f_frsize >= 2000 * MiB
