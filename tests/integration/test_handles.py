"""Export handles cannot open the wrong file (issue 42, DESIGN 4.2a): a handle whose
inode is gone, or whose number a crash lost and a later create took again, is
refused with ESTALE, as ext4 and XFS do; a live file's handle still opens after
remounts. Needs root (open_by_handle_at needs CAP_DAC_READ_SEARCH)."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
from pathlib import Path

import pytest

from .conftest import Mount
from .test_fallocate import name_to_handle, open_by_handle

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0,
                       reason="open_by_handle_at needs CAP_DAC_READ_SEARCH"),
]

#: No timed commit: what the test does not fsync stays uncommitted until SIGKILL.
NO_TIMED_COMMIT = "commit=3600"


def read_by_handle(mount_dir: Path, handle: bytes) -> bytes:
    fd = open_by_handle(mount_dir, handle)
    try:
        return os.read(fd, 100)
    finally:
        os.close(fd)


def assert_stale(mount_dir: Path, handle: bytes) -> None:
    with pytest.raises(OSError) as info:
        os.close(open_by_handle(mount_dir, handle))
    assert info.value.errno == errno.ESTALE


def test_handle_of_a_deleted_file_is_stale_here_and_after_a_remount(
        image: Path, mount_factory: Mount) -> None:
    m = mount_factory.start().path
    # mknod, not open + close: a release still in flight would keep the inode in the
    # kernel's cache a moment longer, and a handle opens what the kernel caches.
    os.mknod(m / "f", 0o644 | stat.S_IFREG)
    handle = name_to_handle(m / "f")
    (m / "f").unlink()
    assert_stale(m, handle)
    assert mount_factory.unmount() == 0
    mount_factory.start()
    assert_stale(m, handle)


def test_number_reused_after_a_crash_gets_a_stale_handle(image: Path,
                                                         mount_factory: Mount) -> None:
    m = mount_factory.start(NO_TIMED_COMMIT).path
    kept = m / "kept"
    fd = os.open(kept, os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, b"kept")
    os.fsync(fd)  # committed
    os.close(fd)
    fd = os.open(m / "lost", os.O_WRONLY | os.O_CREAT, 0o644)  # never committed
    lost_ino = os.fstat(fd).st_ino
    handles = {"kept": name_to_handle(kept), "lost": name_to_handle(m / "lost")}
    mount_factory.signal(signal.SIGKILL)  # the crash: "lost" goes with it
    with contextlib.suppress(OSError):  # ENOTCONN: the connection died with the daemon
        os.close(fd)
    mount_factory.start(NO_TIMED_COMMIT)
    assert not (m / "lost").exists(), "the create was committed: the test proves nothing"
    (m / "again").write_bytes(b"again")
    assert (m / "again").stat().st_ino == lost_ino, "the number was not handed out again"
    assert_stale(m, handles["lost"])
    assert read_by_handle(m, handles["kept"]) == b"kept"
    handles["again"] = name_to_handle(m / "again")
    os.sync()
    assert mount_factory.unmount() == 0
    mount_factory.start()  # across a clean remount too (the kernel's cache is gone)
    assert_stale(m, handles["lost"])
    assert read_by_handle(m, handles["kept"]) == b"kept"
    assert read_by_handle(m, handles["again"]) == b"again"
