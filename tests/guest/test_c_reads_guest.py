"""C reads (issue 43's dispatcher) and C writes (issue 44's write streams) through a real
FUSE mount on real zoned devices.

On the emulator the dispatcher reads an image file; here it reads a zoned
null_blk device and QEMU's NVMe ZNS namespace through the kernel's zoned block
layer: mkfs and `zonefs-py mount` of the device, a file spanning sealed zones
written and synced, O_DIRECT reads (the first READ goes to Python, which
publishes the file's map; the others are answered in C from io_uring or, at
queue depth 1, pread), every byte compared; then a remount (no summary cached:
the sealed zones' checksums are warmed) and the same reads; fsck after.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.guest.conftest import (
    NVME_MAIN,
    NVME_SKIP,
    NullBlkFactory,
    nvme_namespace,
    reset_all_zones,
)

pytestmark = pytest.mark.guest

MiB = 1 << 20
CHUNK = 128 * 1024
ZONEFS = [sys.executable, "-m", "zonefs_py.cli.main"]


def _cli(*args: str, timeout: float = 600) -> str:
    done = subprocess.run([*ZONEFS, *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"zonefs-py {' '.join(args)}: {done.stderr[-2000:]}"
    return done.stdout


class Daemon:
    """`zonefs-py mount -f DEV MNT` in a subprocess, waited for until mounted."""

    def __init__(self, dev: str, mnt: Path, log: Path, *options: str) -> None:
        mnt.mkdir(exist_ok=True)
        self.mnt = mnt
        self.log = log
        opts = [arg for opt in options for arg in ("-o", opt)]
        with open(log.with_suffix(".stderr"), "wb") as err:
            self.proc = subprocess.Popen([*ZONEFS, "mount", "-f", dev, str(mnt), "--log-file",
                                          str(log), *opts], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 300  # the guest runs 20-100x slower
        while not os.path.ismount(mnt):
            assert self.proc.poll() is None, f"mount exited: {self._log()}"
            assert time.monotonic() < deadline, f"not mounted: {self._log()}"
            time.sleep(0.1)

    def _log(self) -> str:
        return self.log.read_text()[-3000:] if self.log.exists() else "(no log)"

    def dataplane(self) -> dict[str, Any]:
        doc = json.loads(_cli("stat", str(self.mnt), "--json"))
        dp: dict[str, Any] = doc["dataplane"]
        return dp

    def stop(self) -> None:
        subprocess.run(["fusermount3", "-u", str(self.mnt)], check=True, timeout=120)
        assert self.proc.wait(timeout=300) == 0, self._log()


def _odirect_reads(path: Path, data: bytes) -> None:
    """Read all of `path` with O_DIRECT in CHUNK pieces, in a shuffled order; compare."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, CHUNK)
    try:
        offsets = list(range(0, len(data), CHUNK))
        random.Random(7).shuffle(offsets)
        for off in offsets:
            n = os.preadv(fd, [buf], off)
            want = data[off:off + CHUNK]
            assert n == len(want), f"short read at {off}"
            assert buf[:n] == want, f"bytes differ at {off}"
    finally:
        buf.close()
        os.close(fd)


def _c_reads_on(dev: str, tmp_path: Path) -> None:
    _cli("mkfs", dev, "--force")
    data = random.Random(43).randbytes(26 * MiB + 12345)  # three zones, two sealed
    d = Daemon(dev, tmp_path / "mnt", tmp_path / "daemon.log")
    try:
        with open(d.mnt / "f", "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _odirect_reads(d.mnt / "f", data)
        dp = d.dataplane()
        assert dp["running"] is True, dp
        assert dp["io"] == "io_uring", dp
        assert dp["reads_c"] >= len(data) // CHUNK // 2, dp
    finally:
        d.stop()
    d = Daemon(dev, tmp_path / "mnt", tmp_path / "daemon2.log")  # cold: nothing cached
    try:
        _odirect_reads(d.mnt / "f", data)
        dp = d.dataplane()
        assert dp["reads_c"] >= len(data) // CHUNK // 2, dp
        assert dp["reads_python"]["checksum_mismatch"] == 0, dp
        assert dp["reads_python"]["device_error"] == 0, dp
    finally:
        d.stop()
    _cli("fsck", dev, "--quiet")  # exit 0: clean


def test_c_reads_on_nullblk(nullblk_factory: NullBlkFactory, tmp_path: Path) -> None:
    dev = nullblk_factory.create_raw(nr_zones=32, zone_size_mb=8)
    _c_reads_on(dev, tmp_path)


def test_c_reads_on_nvme_zns(tmp_path: Path) -> None:
    dev = nvme_namespace(*NVME_MAIN)
    if dev is None:
        pytest.skip(NVME_SKIP)
    reset_all_zones(dev)
    _c_reads_on(dev, tmp_path)


def _c_writes_on(dev: str, tmp_path: Path) -> None:
    """A sequential writer without the writeback cache (each write(2) one WRITE, so the
    dispatcher takes all but the first of them), fsync, O_DIRECT reads, remount,
    fsck: the staged records go through the pipeline to the zoned device (zone
    append on NVMe ZNS)."""
    _cli("mkfs", dev, "--force")
    data = random.Random(44).randbytes(26 * MiB + 3 * 4096)
    d = Daemon(dev, tmp_path / "mnt", tmp_path / "daemon.log", "writeback_cache=off")
    try:
        fd = os.open(d.mnt / "f", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            for off in range(0, len(data), MiB):
                os.pwrite(fd, data[off:off + MiB], off)
            os.fsync(fd)
        finally:
            os.close(fd)
        writes = d.dataplane()["writes"]
        assert writes["writes_c"] >= len(data) // MiB // 2, writes
        _odirect_reads(d.mnt / "f", data)
    finally:
        d.stop()
    d = Daemon(dev, tmp_path / "mnt", tmp_path / "daemon2.log")
    try:
        _odirect_reads(d.mnt / "f", data)
    finally:
        d.stop()
    _cli("fsck", dev, "--quiet")


def test_c_writes_on_nullblk(nullblk_factory: NullBlkFactory, tmp_path: Path) -> None:
    dev = nullblk_factory.create_raw(nr_zones=32, zone_size_mb=8)
    _c_writes_on(dev, tmp_path)


def test_c_writes_on_nvme_zns(tmp_path: Path) -> None:
    dev = nvme_namespace(*NVME_MAIN)
    if dev is None:
        pytest.skip(NVME_SKIP)
    reset_all_zones(dev)
    _c_writes_on(dev, tmp_path)
