"""Tenants through a real mount (issue 45): declare with `zonefs-py tenant`, fill one to its
cap (ENOSPC for it while the other still writes), EXDEV across the boundary, the figures in
`stat --json` and `tenant list`, remount, fsck (the fixture's teardown).
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import threading
import time
from pathlib import Path

import pytest

from .conftest import Mount, zonefs

pytestmark = pytest.mark.integration

MiB = 1 << 20


def _fill_until_enospc(directory: Path, size: int, most: int) -> int:
    """Write files of `size` bytes (each fsynced) until ENOSPC; return how many fit."""
    block = os.urandom(MiB)
    for n in range(most):
        try:
            with open(directory / f"f{n}", "wb") as f:
                for _ in range(size // MiB):
                    f.write(block)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            (directory / f"f{n}").unlink()
            return n
    pytest.fail(f"{directory}: no ENOSPC after {most} files")


def test_declare_fill_enospc_of_one_tenant_remount(image: Path, mount_factory: Mount) -> None:
    m = mount_factory.start()
    a, b = m.path / "ckpt", m.path / "data"
    a.mkdir()
    b.mkdir()
    zonefs("tenant", "add", str(a), "--min-zones", "1", "--max-zones", "2")
    zonefs("tenant", "add", str(b), "--min-zones", "2")
    again = zonefs("tenant", "add", str(a), check=False)
    assert again.returncode == 1
    assert "tenant already" in again.stderr
    (m.path / "plain").mkdir()
    (m.path / "plain" / "x").write_bytes(b"y" * 10000)
    refused = zonefs("tenant", "add", str(m.path / "plain"), check=False)
    assert refused.returncode == 1
    assert "shared zones" in refused.stderr
    fit = _fill_until_enospc(a, 4 * MiB, 64)
    doc = json.loads(zonefs("stat", str(m.path), "--json").stdout)
    ta = doc["tenants"]["ckpt"]
    assert ta["declared"]
    assert ta["zones_owned"] <= 3  # its cap, and one more its cleaner may take
    assert 1 <= fit <= 8  # 2 zones of 16 MiB hold at most 8 files of 4 MiB
    # The other tenant still writes.
    (b / "shard-0001.tar").write_bytes(os.urandom(8 * MiB))
    with pytest.raises(OSError) as info:
        os.rename(b / "shard-0001.tar", a / "moved.tar")
    assert info.value.errno == errno.EXDEV
    listing = json.loads(zonefs("tenant", "list", str(m.path), "--json").stdout)
    assert set(listing) == {"ckpt", "data"}
    zones_a, zones_b = set(listing["ckpt"]["zones"]), set(listing["data"]["zones"])
    assert zones_a
    assert zones_b
    assert not zones_a & zones_b
    assert "ckpt" in zonefs("tenant", "list", str(m.path)).stdout
    assert m.unmount() == 0
    m.start()
    listing = json.loads(zonefs("tenant", "list", str(m.path), "--json").stdout)
    assert set(listing["ckpt"]["zones"]) == zones_a
    assert set(listing["data"]["zones"]) >= zones_b
    zonefs("tenant", "set", str(a), "--max-zones", "4", "--active-zones", "2")
    (a / "after-raise").write_bytes(os.urandom(4 * MiB))
    zonefs("tenant", "remove", str(b))
    listing = json.loads(zonefs("tenant", "list", str(m.path), "--json").stdout)
    assert set(listing) == {"ckpt"}
    assert listing["ckpt"]["zones_max"] == 4
    assert listing["ckpt"]["active_zones_max"] == 2
    assert m.unmount() == 0


def _write_for(directory: Path, seconds: float | None, total: int | None,
               stop: threading.Event | None = None) -> tuple[int, float]:
    """Write 1 MiB at a time (fsync each, so the bytes reach the device now) into files
    of 8 MiB rewritten in turn, for `seconds`, or `total` bytes, or until `stop`;
    return (bytes, seconds taken)."""
    block = os.urandom(MiB)
    done = 0
    t0 = time.monotonic()
    n = 0
    while True:
        with open(directory / f"f{n % 3}", "wb") as f:
            for _ in range(8):
                f.write(block)
                f.flush()
                os.fsync(f.fileno())
                done += MiB
                took = time.monotonic() - t0
                if ((seconds is not None and took >= seconds)
                        or (total is not None and done >= total)
                        or (stop is not None and stop.is_set())):
                    return done, took
        n += 1


def test_a_write_cap_holds_while_another_tenant_writes_and_lifts_alone(
        image: Path, mount_factory: Mount) -> None:
    """Tenant `ckpt` capped at 4 MB/s: while `data` writes, its rate stays near the cap
    (at most 2x, loosely: a shared machine); once `data` is idle it writes at the
    device's speed (over 2x the cap). The policy survives a remount."""
    m = mount_factory.start()
    a, b = m.path / "ckpt", m.path / "data"
    a.mkdir()
    b.mkdir()
    zonefs("tenant", "add", str(a), "--write-mbps", "4")
    zonefs("tenant", "add", str(b), "--read-share", "50")
    both = zonefs("tenant", "set", str(a), "--write-mbps", "4", "--write-share", "3",
                  check=False)
    assert both.returncode == 2
    assert "not allowed with" in both.stderr
    stop = threading.Event()
    other: list[tuple[int, float]] = []
    writer = threading.Thread(target=lambda: other.append(_write_for(b, None, None, stop)))
    writer.start()
    try:
        time.sleep(0.5)  # `data` is busy first
        capped, took = _write_for(a, 3.0, None)
    finally:
        stop.set()
        writer.join()
    capped_rate = capped / took
    assert 0.5e6 < capped_rate <= 2 * 4e6, f"capped at {capped_rate / 1e6:.1f} MB/s"
    assert other[0][0] > capped  # the other tenant was not held
    doc = json.loads(zonefs("stat", str(m.path), "--json").stdout)
    t = doc["tenants"]["ckpt"]
    assert t["write_cap_mb_s"] == 4.0
    assert t["write_cap_bytes_per_s"] == 4_000_000
    assert t["throttled_seconds"] > 1.0
    assert doc["tenants"]["data"]["read_share_pct"] == 50
    assert "4 MB/s" in zonefs("tenant", "list", str(m.path)).stdout
    time.sleep(0.5)  # `data` idle now
    alone, took = _write_for(a, None, 48 * MiB)
    alone_rate = alone / took
    print(f"capped {capped_rate / 1e6:.1f} MB/s, alone {alone_rate / 1e6:.1f} MB/s")
    assert alone_rate > 2 * 4e6, f"alone at {alone_rate / 1e6:.1f} MB/s"
    assert m.unmount() == 0
    m.start()
    listing = json.loads(zonefs("tenant", "list", str(m.path), "--json").stdout)
    assert listing["ckpt"]["write_cap_mb_s"] == 4.0
    assert listing["data"]["read_share_pct"] == 50
    zonefs("tenant", "set", str(a), "--write-mbps", "0")
    listing = json.loads(zonefs("tenant", "list", str(m.path), "--json").stdout)
    assert listing["ckpt"]["write_cap_mb_s"] is None
    assert m.unmount() == 0


def _read_until(path: Path, stop: threading.Event) -> int:
    """Read `path` (O_DIRECT: every read reaches the daemon) over and over until `stop`."""
    size = path.stat().st_size
    buf = mmap.mmap(-1, MiB)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    done = 0
    try:
        while not stop.is_set():
            for off in range(0, size, MiB):
                done += os.preadv(fd, [buf], off)
    finally:
        os.close(fd)
        buf.close()
    return done


def test_a_read_share_holds_other_writers_back_while_its_tenant_reads(
        image: Path, mount_factory: Mount) -> None:
    """Tenant `data` has a 90% read share of a device fixed at 40 MB/s: while it reads
    (served in C), the other tenant's writes get at most ~4 MB/s (2x, loosely); once
    it stops reading they run free."""
    m = mount_factory.start("c_reads=on", "device_write_mb=40")
    a, b = m.path / "ckpt", m.path / "data"
    a.mkdir()
    b.mkdir()
    zonefs("tenant", "add", str(a))
    zonefs("tenant", "add", str(b), "--read-share", "90")
    shard = b / "shard"
    shard.write_bytes(os.urandom(4 * MiB))
    fd = os.open(shard, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    stop = threading.Event()
    reads: list[int] = []
    reader = threading.Thread(target=lambda: reads.append(_read_until(shard, stop)))
    reader.start()
    try:
        time.sleep(0.5)  # `data` is reading first
        held, took = _write_for(a, 3.0, None)
    finally:
        stop.set()
        reader.join()
    held_rate = held / took
    assert 0.5e6 < held_rate <= 2 * 4e6, f"held at {held_rate / 1e6:.1f} MB/s"
    assert reads[0] > 8 * MiB
    doc = json.loads(zonefs("stat", str(m.path), "--json").stdout)
    assert doc["tenants"]["ckpt"]["throttled_seconds"] > 1.0
    assert doc["tenants"]["data"]["bytes_read"] >= reads[0] // 2
    assert doc["tenant_bandwidth"]["device_write_bytes_per_s"] == 40_000_000
    time.sleep(0.5)  # `data` idle now
    free, took = _write_for(a, None, 48 * MiB)
    free_rate = free / took
    print(f"held {held_rate / 1e6:.1f} MB/s, free {free_rate / 1e6:.1f} MB/s")
    assert free_rate > 2 * 4e6, f"free at {free_rate / 1e6:.1f} MB/s"
    assert m.unmount() == 0
