"""copy_file_range(2) within one file through a real mount (issue 42).

Every same-file copy used to hang its caller (in D state) for good: the
daemon's copy waited for its own request (DESIGN 3.13). Each call here runs
in a thread with a deadline; a call that misses it aborts the FUSE connection
(which ends the stuck request) and fails the test instead of hanging the
suite. Which path a copy took is told by the data bytes the daemon appended:
none for a shared-extent copy, the copy's bytes for the daemon's own copy.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from .conftest import Mount, zonefs

pytestmark = pytest.mark.integration

KiB = 1 << 10
MiB = 1 << 20
BS = 4096
#: Seconds one copy may take (they take milliseconds).
DEADLINE_S = 20.0
#: The file copied within: 1 MiB and a partial block.
SIZE = MiB + 1234
T = TypeVar("T")


def bounded(mount_dir: Path, fn: Callable[[], T], deadline_s: float = DEADLINE_S) -> T:
    """Return fn() run in a thread; if it misses the deadline, abort the mount's FUSE
    connection (the kernel then ends the stuck request) and fail."""
    conn = os.minor(os.stat(mount_dir).st_dev)
    out: list[tuple[bool, object]] = []

    def run() -> None:
        try:
            out.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            out.append((False, exc))

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(deadline_s)
    if worker.is_alive():
        Path(f"/sys/fs/fuse/connections/{conn}/abort").write_text("1")
        worker.join(30)
        pytest.fail(f"no answer after {deadline_s} s; FUSE connection {conn} aborted")
    ok, value = out[0]
    if not ok:
        assert isinstance(value, BaseException)
        raise value
    return value  # type: ignore[return-value]


def data_bytes_written(mount: Mount) -> int:
    """Data bytes the daemon appended since the mount (after everything is synced)."""
    os.sync()
    return int(json.loads(zonefs("stat", str(mount.path), "--json").stdout)
               ["data_bytes_written"])


def copy_within(fd: int, model: bytearray, off_in: int, off_out: int, length: int,
                mount_dir: Path) -> int:
    """copy_file_range(fd, fd) with a deadline; apply the same copy to `model`."""
    got = bounded(mount_dir, lambda: os.copy_file_range(fd, fd, length, off_in, off_out))
    chunk = bytes(model[off_in:off_in + got])
    if off_out + got > len(model):
        model += bytes(off_out + got - len(model))
    model[off_out:off_out + got] = chunk
    return got


def file_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_the_reproducer_of_the_issue_returns_with_the_bytes(mounted: Mount) -> None:
    path = mounted.path / "f"
    data = os.urandom(MiB)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDWR)
    try:
        assert bounded(mounted.path, lambda: os.copy_file_range(fd, fd, 65536, 0, MiB)) \
            == 65536
    finally:
        os.close(fd)
    assert file_bytes(path) == data + data[:65536]


#: (name, off_in, off_out, length, shared): copies within a file of SIZE bytes.
CASES = [
    ("aligned-forwards", 0, 512 * KiB, 64 * KiB, True),
    ("aligned-backwards", 512 * KiB, 0, 64 * KiB, True),
    ("aligned-past-eof", 0, 2 * MiB, 128 * KiB, True),
    ("aligned-tail-past-eof", 768 * KiB, 3 * MiB, MiB, True),  # the partial last block
    ("aligned-partial-block-mid-file", 0, 64 * KiB, 3 * BS + 5, False),
    ("unaligned-forwards", 1000, 600 * KiB + 3, 50 * KiB, False),
    ("unaligned-backwards", 700 * KiB + 5, 17, 40 * KiB, False),
    ("unaligned-past-eof", 3, SIZE + 999, 10 * KiB, False),
]


@pytest.mark.parametrize(("name", "off_in", "off_out", "length", "shared"), CASES,
                         ids=[c[0] for c in CASES])
def test_copy_within_one_file_stored(mounted: Mount, name: str, off_in: int, off_out: int,
                                     length: int, shared: bool) -> None:
    """Data fsync'ed first: the copy is answered at once, with the model's bytes, by
    the path its alignment selects."""
    path = mounted.path / "f"
    model = bytearray(random.Random(name).randbytes(SIZE))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, model)
        os.fsync(fd)
        before = data_bytes_written(mounted)
        want = min(length, SIZE - off_in)
        assert copy_within(fd, model, off_in, off_out, length, mounted.path) == want
        appended = data_bytes_written(mounted) - before
    finally:
        os.close(fd)
    if shared:
        assert appended == 0, "an aligned copy shares extents"
    else:
        assert appended >= want, "an unaligned copy is written by the daemon"
    assert file_bytes(path) == bytes(model)


@pytest.mark.parametrize("where", ["page_cache", "daemon_buffer"])
def test_copies_of_data_not_yet_stored(mounted: Mount, where: str) -> None:
    """Writes still in the kernel's page cache (no fsync), or in the daemon's buffer
    (O_DIRECT, no fsync), just before each copy: every copy sees them."""
    path = mounted.path / "f"
    rng = random.Random(where)
    model = bytearray()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    dfd = os.open(path, os.O_RDWR | os.O_DIRECT) if where == "daemon_buffer" else fd
    buf = mmap.mmap(-1, 256 * KiB)  # page-aligned, for O_DIRECT
    try:
        for i, (_name, off_in, off_out, length, _shared) in enumerate(CASES):
            # Fresh bytes over the whole source range (and more), never fsync'ed.
            lo = off_in // (256 * KiB) * (256 * KiB)
            while lo < off_in + length and lo < max(len(model), SIZE):
                chunk = rng.randbytes(256 * KiB)
                buf[:] = chunk
                assert os.pwrite(dfd, buf, lo) == len(chunk)
                if lo + len(chunk) > len(model):
                    model += bytes(lo + len(chunk) - len(model))
                model[lo:lo + len(chunk)] = chunk
                lo += len(chunk)
            want = min(length, len(model) - off_in)
            assert copy_within(fd, model, off_in, off_out, length, mounted.path) == want, i
            assert os.pread(fd, len(model) + BS, 0) == bytes(model), i
    finally:
        buf.close()
        if dfd != fd:
            os.close(dfd)
        os.close(fd)
    assert mounted.unmount() == 0
    mounted.start()
    assert file_bytes(path) == bytes(model)


@pytest.mark.parametrize(("off_in", "off_out", "length"),
                         [(0, 4 * BS, 8 * BS), (4 * BS, 0, 8 * BS), (1000, 3000, 5000),
                          (0, 0, BS)])
def test_overlapping_ranges_of_one_file_are_einval(mounted: Mount, off_in: int, off_out: int,
                                                   length: int) -> None:
    path = mounted.path / "f"
    data = os.urandom(256 * KiB)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(OSError) as exc:
            bounded(mounted.path, lambda: os.copy_file_range(fd, fd, length, off_in, off_out))
    finally:
        os.close(fd)
    assert exc.value.errno == errno.EINVAL
    assert file_bytes(path) == data
