"""Sequential WRITEs taken in C (issue 44, DESIGN 4.11), through the mount.

A file written sequentially in whole blocks gets a C write stream after its
first streaming WRITE: later WRITEs are answered by the dispatcher and their
bytes reach the engine as 4 MiB records. Each test checks the bytes (through
the page cache and with O_DIRECT, which always reaches the daemon) after
mixing what users do beside a writer: reads, stat, truncate, fallocate,
overwrites, O_DIRECT writes, fsync, close, a second writer of the same file,
unmount and remount; the teardown runs fsck.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import random
import signal
import threading
from pathlib import Path

import pytest

from . import fsx
from .conftest import Mount, zonefs

BS = 4096
MiB = 1 << 20


def _writes(m: Mount) -> dict[str, object]:
    doc = json.loads(zonefs("stat", "--json", str(m.path)).stdout)
    return doc["dataplane"].get("writes") or {}


def _odirect_read(path: Path, offset: int, length: int) -> bytes:
    buf = mmap.mmap(-1, max(length, BS))
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        n = os.preadv(fd, [memoryview(buf)[:length]], offset)
        return bytes(buf[:n])
    finally:
        os.close(fd)
        buf.close()


@pytest.fixture(params=["writeback_cache=off", "writeback_cache=on"])
def cw(request: pytest.FixtureRequest, image: Path, mount_factory: Mount) -> Mount:
    """A mount with C writes, with and without the kernel's writeback cache. Without
    it every write(2) is a WRITE at once, so a sequential writer's second WRITE is
    C's (asserted); with it the kernel writes back when it chooses (all of a small
    file at its fsync, several WRITEs at once), so a test's files may be served
    by Python only, and the bytes are what is checked."""
    m = mount_factory.start(request.param)
    m.c_writes_expected = request.param == "writeback_cache=off"  # type: ignore[attr-defined]
    return m


def _check_c_took(m: Mount) -> None:
    if getattr(m, "c_writes_expected", False):
        st = _writes(m)
        assert st["writes_c"] > 0, st
        assert st["records"] > 0, st


def _write_seq(path: Path, data: bytes, step: int = MiB, fsync: bool = True) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for off in range(0, len(data), step):
            os.pwrite(fd, data[off:off + step], off)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _drop_caches() -> None:
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def test_a_sequential_writer_goes_through_c_and_its_bytes_stay(cw: Mount) -> None:
    mounted = cw
    data = random.Random(1).randbytes(48 * MiB + 3 * BS + 17)
    f = mounted.path / "ckpt.pt"
    _write_seq(f, data)
    _check_c_took(mounted)
    assert _writes(mounted)["caps_probes_c"] > 0  # the probe before each write(2)
    assert f.stat().st_size == len(data)
    _drop_caches()
    assert f.read_bytes() == data
    assert _odirect_read(f, 40 * MiB, MiB) == data[40 * MiB:41 * MiB]
    assert mounted.unmount() == 0
    mounted.start()
    assert (mounted.path / "ckpt.pt").read_bytes() == data


def test_a_large_file_through_the_writeback_cache(mounted: Mount) -> None:
    """Past the kernel's dirty limit for the mount, writeback runs while the writer
    writes: C takes most of its WRITEs (not asserted: the kernel decides)."""
    data = random.Random(6).randbytes(160 * MiB)
    _write_seq(mounted.path / "big", data, step=4 * MiB)
    _drop_caches()
    assert (mounted.path / "big").read_bytes() == data


def test_off_switch_takes_no_write_in_c(image: Path, mount_factory: Mount) -> None:
    m = mount_factory.start("c_writes=off")
    data = random.Random(2).randbytes(16 * MiB)
    _write_seq(m.path / "f", data)
    assert _writes(m) == {}
    assert (m.path / "f").read_bytes() == data


def test_readers_stat_and_overwrites_beside_a_streaming_writer(cw: Mount) -> None:
    """O_DIRECT reads of what was written so far, stat, and a second handle that
    overwrites blocks behind the writer: every read matches the model."""
    rng = random.Random(3)
    f = cw.path / "shard"
    model = bytearray()
    fd = os.open(f, os.O_RDWR | os.O_CREAT, 0o644)
    fd2 = os.open(f, os.O_RDWR)
    try:
        for i in range(40):
            chunk = rng.randbytes(MiB)
            os.pwrite(fd, chunk, len(model))
            model += chunk
            if i % 5 == 4:
                off = rng.randrange(0, len(model) - 3 * BS) // BS * BS
                patch = rng.randbytes(rng.choice([BS, 3 * BS, 100]))
                os.pwrite(fd2, patch, off)
                model[off:off + len(patch)] = patch
            if i % 3 == 2:
                off = rng.randrange(0, len(model) - BS) // BS * BS
                n = min(len(model) - off, rng.choice([BS, 64 * 1024, MiB]))
                os.fsync(fd)  # O_DIRECT reads see what was written back
                assert _odirect_read(f, off, n) == bytes(model[off:off + n]), (i, off, n)
            assert os.fstat(fd).st_size == len(model)
        os.fsync(fd)
    finally:
        os.close(fd)
        os.close(fd2)
    _drop_caches()
    assert f.read_bytes() == bytes(model)
    _check_c_took(cw)


@pytest.mark.parametrize("change", ["truncate", "fallocate_punch", "ftruncate_grow",
                                    "o_direct_write"])
def test_a_change_in_the_middle_of_a_stream_lands_in_order(cw: Mount, change: str) -> None:
    rng = random.Random(len(change))
    f = cw.path / "f"
    model = bytearray(rng.randbytes(24 * MiB))
    fd = os.open(f, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        for off in range(0, len(model), MiB):
            os.pwrite(fd, model[off:off + MiB], off)
        if change == "truncate":
            os.ftruncate(fd, 10 * MiB + 123)
            del model[10 * MiB + 123:]
        elif change == "fallocate_punch":
            mode = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            assert libc.fallocate(fd, mode, ctypes.c_long(4 * MiB),
                                  ctypes.c_long(2 * MiB)) == 0
            model[4 * MiB:6 * MiB] = bytes(2 * MiB)
        elif change == "ftruncate_grow":
            os.ftruncate(fd, len(model) + 5 * MiB)
            model += bytes(5 * MiB)
        else:
            buf = mmap.mmap(-1, MiB)
            buf.write(rng.randbytes(MiB))
            dfd = os.open(f, os.O_WRONLY | os.O_DIRECT)
            try:
                os.pwritev(dfd, [buf], 3 * MiB)
            finally:
                os.close(dfd)
            model[3 * MiB:4 * MiB] = bytes(buf)
            buf.close()
        # The writer goes on after the change.
        tail = rng.randbytes(8 * MiB)
        os.pwrite(fd, tail, len(model))
        model += tail
        os.fsync(fd)
    finally:
        os.close(fd)
    _drop_caches()
    assert f.read_bytes() == bytes(model)
    assert _odirect_read(f, 0, MiB) == bytes(model[:MiB])
    _check_c_took(cw)


def test_many_files_at_once_like_a_sharded_save(cw: Mount) -> None:
    mounted = cw
    """Four writers of four shards each, in threads, then fsync and close (more do not
    fit the test's 512 MiB image of 16 MiB zones, C writes or not)."""
    shards = {f"rank{r}/shard{s}": random.Random(r * 10 + s).randbytes(5 * MiB + r * BS)
              for r in range(4) for s in range(4)}
    for r in range(4):
        (mounted.path / f"rank{r}").mkdir()

    def rank(r: int) -> None:
        for s in range(4):
            _write_seq(mounted.path / f"rank{r}/shard{s}", shards[f"rank{r}/shard{s}"])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _drop_caches()
    for name, data in shards.items():
        assert (mounted.path / name).read_bytes() == data, name
    _check_c_took(mounted)
    assert mounted.unmount() == 0
    mounted.start()
    for name, data in shards.items():
        assert (mounted.path / name).read_bytes() == data, name


def test_unmount_right_after_writes_keeps_every_byte(cw: Mount) -> None:
    mounted = cw
    """No fsync, no close before the unmount's writeback: the staged records are
    taken at the session's end and written out with the rest."""
    data = random.Random(5).randbytes(30 * MiB)
    fd = os.open(mounted.path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    for off in range(0, len(data), MiB):
        os.pwrite(fd, data[off:off + MiB], off)
    os.close(fd)
    _check_c_took(mounted)
    assert mounted.unmount() == 0
    mounted.start()
    assert (mounted.path / "f").read_bytes() == data


@pytest.mark.parametrize("seed", [4411, 4412])
def test_fsx_with_sequential_writers(cw: Mount, tmp_path: Path, seed: int) -> None:
    """fsx's every operation and its sequential writers (`--streams`), on files of up
    to 16 MiB: C streams start and end among truncates, copies, mmap stores,
    O_DIRECT and AIO, against the model. One process here (twice the operations): a
    two-worker pool forked from pytest hung in a CI run with a worker gone (fsx.run
    now spawns its workers and fails on a dead one); test_fsx's two-process runs and
    `fsx.py --procs 2 --streams` (TESTING 5.11) are the concurrent ones."""
    d = cw.path / f"fsx-{seed}"
    d.mkdir()
    ops = 1200 * int(os.environ.get("ZONEFS_STRESS_SCALE", "1"))
    errors = fsx.run(d, seed, ops, 1, max_size=16 << 20, log_dir=tmp_path,
                     use_falloc=True, use_more=True, use_streams=True)
    assert not errors, errors
    _check_c_took(cw)


def test_sigkill_keeps_what_was_fsynced_before_it(image: Path, mount_factory: Mount) -> None:
    """Writers whose WRITEs C takes (no writeback cache: each write(2) is one), fsynced
    up to a point and going on after it; the daemon is killed mid-stream. After
    recovery every fsynced byte is there; what followed may be any prefix."""
    m = mount_factory.start("writeback_cache=off")
    rng = random.Random(9)
    synced: dict[str, bytes] = {}
    fds = {}
    for i in range(3):
        name = f"f{i}"
        data = rng.randbytes((6 + i) * MiB)
        fd = os.open(m.path / name, os.O_WRONLY | os.O_CREAT, 0o644)
        fds[name] = fd
        for off in range(0, len(data), MiB):
            os.pwrite(fd, data[off:off + MiB], off)
        os.fsync(fd)
        synced[name] = data
        for k in range(4):  # more after the fsync: not durable yet
            os.pwrite(fd, rng.randbytes(MiB), len(data) + k * MiB)
    assert _writes(m)["writes_c"] > 0
    m.signal(signal.SIGKILL)
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    m.start()
    for name, data in synced.items():
        got = (m.path / name).read_bytes()
        assert got[:len(data)] == data, name


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_clean_stop_mid_stream_writes_every_answered_byte(
        image: Path, mount_factory: Mount, signum: int) -> None:
    """SIGTERM while a writer's WRITEs are staged in C and its file is still open:
    the daemon stops cleanly and every byte write(2) returned for is stored."""
    m = mount_factory.start("writeback_cache=off")
    data = random.Random(10).randbytes(20 * MiB)
    fd = os.open(m.path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for off in range(0, len(data), MiB):
            os.pwrite(fd, data[off:off + MiB], off)
        assert _writes(m)["writes_c"] > 0
        assert m.signal(signum) == 0
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    m.start()
    assert (m.path / "f").read_bytes() == data
