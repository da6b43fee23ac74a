"""Tenants through a real mount (issue 45): declare with `zonefs-py tenant`, fill one to its
cap (ENOSPC for it while the other still writes), EXDEV across the boundary, the figures in
`stat --json` and `tenant list`, remount, fsck (the fixture's teardown).
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import random
import subprocess
import threading
import time
from pathlib import Path

import pytest

from .conftest import ZONEFS, Mount, env, zonefs

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
    # A cap above the write gate's refusal threshold at the kernel's default dirty
    # limit (about 60 MiB here). With 2 zones the first write was refused in 2 of 35
    # runs by a race of two dirty-limit changes, since fixed (DESIGN 3.9a, caveats);
    # a tenant whose room stays below the threshold is still refused at write(2).
    zonefs("tenant", "add", str(a), "--min-zones", "1", "--max-zones", "6")
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
    assert ta["zones_owned"] <= 7  # its cap, and one more its cleaner may take
    assert 1 <= fit <= 24  # 6 zones of 16 MiB hold at most 24 files of 4 MiB
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
    zonefs("tenant", "set", str(a), "--max-zones", "8", "--active-zones", "2")
    (a / "after-raise").write_bytes(os.urandom(4 * MiB))
    zonefs("tenant", "remove", str(b))
    listing = json.loads(zonefs("tenant", "list", str(m.path), "--json").stdout)
    assert set(listing) == {"ckpt"}
    assert listing["ckpt"]["zones_max"] == 8
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
    # Loose bounds: on a loaded 2-vCPU machine the reader and the writer both starve
    # at times (the full suite once failed here beside other load).
    assert 0.1e6 < held_rate <= 2 * 4e6, f"held at {held_rate / 1e6:.1f} MB/s"
    assert reads[0] > MiB
    doc = json.loads(zonefs("stat", str(m.path), "--json").stdout)
    assert doc["tenants"]["ckpt"]["throttled_seconds"] > 0.3
    assert doc["tenants"]["data"]["bytes_read"] >= reads[0] // 4
    assert doc["tenant_bandwidth"]["device_write_bytes_per_s"] == 40_000_000
    time.sleep(0.5)  # `data` idle now
    free, took = _write_for(a, None, 48 * MiB)
    free_rate = free / took
    print(f"held {held_rate / 1e6:.1f} MB/s, free {free_rate / 1e6:.1f} MB/s")
    assert free_rate > 2 * 4e6, f"free at {free_rate / 1e6:.1f} MB/s"
    assert m.unmount() == 0


def _tenant_status(m: Mount) -> dict[str, object]:
    return dict(json.loads(zonefs("stat", str(m.path), "--json").stdout))


def _block(seed: int, i: int) -> bytes:
    return random.Random(seed * 1_000_003 + i).randbytes(MiB)


def _digest(seed: int, nbytes: int) -> str:
    h = hashlib.sha256()
    for i in range(nbytes // MiB):
        h.update(_block(seed, i))
    return h.hexdigest()


def _digest_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_tenant_at_its_cap_gets_enospc_from_write_while_another_writes(
        image: Path, mount_factory: Mount) -> None:
    """Under the writeback cache, the writer of a tenant at its cap gets ENOSPC from
    write(2) itself (not only at fsync or close), the writer of another tenant goes
    on, and every byte write(2) acknowledged is stored (remount; fsck at teardown)."""
    m = mount_factory.start()
    a, b = m.path / "capped", m.path / "free"
    a.mkdir()
    b.mkdir()
    zonefs("tenant", "add", str(a), "--max-zones", "3")  # 3 zones of 16 MiB
    zonefs("tenant", "add", str(b))
    assert _tenant_status(m)["write_gate"]["enabled"]
    fa = os.open(a / "big", os.O_CREAT | os.O_WRONLY, 0o644)
    fb = os.open(b / "big", os.O_CREAT | os.O_WRONLY, 0o644)
    written_a = written_b = 0
    error: OSError | None = None
    try:
        for i in range(96):
            if error is None:
                try:
                    n = os.write(fa, _block(1, i))
                    assert n == MiB
                    written_a += n
                except OSError as exc:
                    error = exc
            written_b += os.write(fb, _block(2, i))
        doc = _tenant_status(m)
        gate = doc["write_gate"]
        print(f"tenant wrote {written_a / MiB} MiB, the other {written_b / MiB} MiB; "
              f"gate {gate}; tenants {doc['tenants']}")
        assert error is not None
        assert error.errno == errno.ENOSPC
        tid = doc["tenants"]["capped"]["tenant_id"]
        assert gate["closed_tenants"] == [tid]
        assert not gate["closed"]  # the device gate: the other tenant keeps the cache
        assert 48 * MiB - int(gate["full_refuse_below_bytes"]) - 2 * MiB <= written_a
        assert written_a <= 48 * MiB
        assert written_b == 96 * MiB
        os.fsync(fa)  # nothing write(2) acknowledged was refused at writeback
        os.fsync(fb)
    finally:
        os.close(fa)  # raises if a writeback failed
        os.close(fb)
    assert (a / "big").stat().st_size == written_a
    assert m.unmount() == 0
    m.start()
    assert (a / "big").stat().st_size == written_a
    assert _digest_file(a / "big") == _digest(1, written_a)
    assert _digest_file(b / "big") == _digest(2, written_b)


def test_zone_map_by_tenant(image: Path, mount_factory: Mount) -> None:
    """`stat --all --by-tenant` prints each tenant's zones as its character, and
    `--zone-map F.png --by-tenant` draws them (with the [plot] extra)."""
    m = mount_factory.start()
    a, b = m.path / "ckpt", m.path / "data"
    a.mkdir()
    b.mkdir()
    zonefs("tenant", "add", str(a))
    zonefs("tenant", "add", str(b))
    (a / "x").write_bytes(os.urandom(20 * MiB))
    (b / "y").write_bytes(os.urandom(4 * MiB))
    (m.path / "shared").write_bytes(os.urandom(4 * MiB))
    os.sync()
    doc = _tenant_status(m)
    legend = doc["zone_tenant_legend"]
    assert sorted(legend.values()) == ["ckpt", "data"]
    char = {v: k for k, v in legend.items()}
    owners = doc["zone_tenants"]
    assert {i for i, ch in enumerate(owners) if ch == char["ckpt"]} == set(
        doc["tenants"]["ckpt"]["zones"])
    assert {i for i, ch in enumerate(owners) if ch == char["data"]} == set(
        doc["tenants"]["data"]["zones"])
    text = zonefs("stat", "--all", "--by-tenant", str(m.path)).stdout
    grid = "".join(line.strip() for line in
                   text.split("Zone map\n", 1)[1].split("\n  (", 1)[0].splitlines())
    assert grid.count(char["ckpt"]) >= 2
    assert grid.count(char["data"]) >= 1
    assert f"zones by tenant: {char['ckpt']} ckpt" in text
    refused = zonefs("stat", "--by-tenant", str(m.path), check=False)
    assert refused.returncode == 2
    assert "--by-tenant" in refused.stderr
    pytest.importorskip("matplotlib", reason="the [plot] extra is not installed")
    png = m.path.parent / "tenants.png"
    zonefs("stat", str(m.path), "--zone-map", str(png), "--by-tenant")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _as(uid: int, *args: str) -> subprocess.CompletedProcess[str]:
    """Run zonefs-py as `uid` (no such user needed), in no supplementary group."""
    return subprocess.run([*ZONEFS, *args], user=uid, group=uid, extra_groups=[], env=env(),
                          cwd="/", capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def test_users_root_allows_run_tenant_commands(image: Path, mount_factory: Mount) -> None:
    """`-o tenant_admins=UID`: that user declares, changes and removes tenants on
    directories it can write; another user is refused with the daemon's reason."""
    allowed, other = 4242, 4243
    m = mount_factory.start("allow_other", f"tenant_admins={allowed}")
    mine, theirs, roots = m.path / "mine", m.path / "theirs", m.path / "roots"
    for d, uid in ((mine, allowed), (theirs, other), (roots, 0)):
        d.mkdir()
        os.chown(d, uid, uid)
    # A cap well above the kernel's dirty limit for the mount: a tenant whose free
    # room is below it is refused at write(2) from its first write when the limit
    # cannot be lowered (the full suite once met that here, DESIGN 3.9a caveats).
    ok = _as(allowed, "tenant", "add", str(mine), "--max-zones", "12")
    assert ok.returncode == 0, ok.stderr
    ok = _as(allowed, "tenant", "set", str(mine), "--active-zones", "2")
    assert ok.returncode == 0, ok.stderr
    listing = json.loads(zonefs("tenant", "list", str(m.path), "--json").stdout)
    assert (listing["mine"]["zones_max"], listing["mine"]["active_zones_max"]) == (12, 2)
    refused = _as(other, "tenant", "add", str(theirs))
    assert refused.returncode == 1
    assert "Operation not permitted" in refused.stderr
    assert f"uid {other} may not declare or change tenants" in refused.stderr
    assert "tenant_admins=" in refused.stderr
    denied = _as(allowed, "tenant", "add", str(roots))  # it may not write that directory
    assert denied.returncode == 1
    assert "Permission denied" in denied.stderr
    (mine / "f").write_bytes(b"x" * 100000)
    ok = _as(allowed, "tenant", "remove", str(mine))
    assert ok.returncode == 0, ok.stderr
    listing = json.loads(zonefs("tenant", "list", str(m.path), "--json").stdout)
    assert listing == {}
    assert (mine / "f").read_bytes() == b"x" * 100000


def test_room_made_in_a_full_tenant_lets_its_write_pass(image: Path,
                                                        mount_factory: Mount) -> None:
    """Once a tenant's writer got ENOSPC from write(2), truncating a file of that
    tenant gives the space back at once: the next write(2) passes."""
    m = mount_factory.start()
    a = m.path / "capped"
    a.mkdir()
    zonefs("tenant", "add", str(a), "--max-zones", "2")
    fd = os.open(a / "big", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        written = 0
        error: OSError | None = None
        for i in range(64):
            try:
                written += os.write(fd, _block(3, i))
            except OSError as exc:
                error = exc
                break
        assert error is not None
        assert error.errno == errno.ENOSPC
        assert _tenant_status(m)["write_gate"]["closed_tenants"]
        os.fsync(fd)
        os.ftruncate(fd, 0)
        assert os.pwrite(fd, _block(4, 0), 0) == MiB
        os.fsync(fd)
    finally:
        os.close(fd)
    assert (a / "big").read_bytes() == _block(4, 0)
    assert written > 16 * MiB
