#!/usr/bin/env python3
"""Print how the kernel's zoned null_blk answers edge-case requests (run as root in the guest).

Uses only the standard library (raw ioctls through fcntl, O_DIRECT through
mmap-aligned buffers) so that its findings do not depend on zonefs-py's own
code. The output is a Markdown table for docs/kernel-zoned-behaviour.md.

usage (from the checkout root, on the host):
  GUEST_MEM=2G tests/guest/qemu-run -- .venv/bin/python tests/guest/observe_kernel.py
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import platform
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

HELPER = str(Path(__file__).resolve().parents[2] / "mount_helpers" / "nullblk")
BLKREPORTZONE = 0xC0101282
BLKRESETZONE = 0x40101283
BLKOPENZONE = 0x40101286
BLKCLOSEZONE = 0x40101287
BLKFINISHZONE = 0x40101288
COND = {0: "NOT_WP", 1: "EMPTY", 2: "IMP_OPEN", 3: "EXP_OPEN", 4: "CLOSED",
        0xD: "READONLY", 0xE: "FULL", 0xF: "OFFLINE"}
MB = 1 << 20
ROWS: list[tuple[str, str]] = []


def make(name: str, **kw: int) -> str:
    """Create /dev/NAME through mount_helpers/nullblk and return its path."""
    cmd = [sys.executable, HELPER, "create", name, "--memory-backed"]
    for key, val in kw.items():
        cmd += [f"--{key.replace('_', '-')}", str(val)]
    subprocess.run(cmd, check=True)
    return f"/dev/{name}"


def report(fd: int, zone: int, zsz: int) -> tuple[int, int, int, str]:
    """Return (start, len, wp, cond) of one zone in bytes (wp relative to zone start)."""
    buf = bytearray(16 + 64)
    struct.pack_into("<QII", buf, 0, zone * zsz // 512, 1, 0)
    fcntl.ioctl(fd, BLKREPORTZONE, buf)
    start, length, wp, _typ, cond, _n, _r, cap = struct.unpack_from("<QQQBBBB4xQ", buf, 16)
    return start * 512, cap * 512, wp * 512 - start * 512, COND.get(cond, hex(cond))


def mgmt(fd: int, op: int, zone: int, zsz: int, nzones: int = 1) -> None:
    fcntl.ioctl(fd, op, struct.pack("<QQ", zone * zsz // 512, nzones * zsz // 512))


def buf(n: int, fill: int = 0xAB) -> mmap.mmap:
    m = mmap.mmap(-1, max(n, 4096))
    m.write(bytes([fill]) * n)
    return m


def pw(fd: int, off: int, n: int) -> int:
    m = buf(n)
    return os.pwritev(fd, [memoryview(m)[:n]], off)


def pr(fd: int, off: int, n: int) -> bytes:
    m = buf(n, 0x55)
    got = os.preadv(fd, [memoryview(m)[:n]], off)
    return bytes(m[:got])


def obs(what: str, fn: Callable[[], object]) -> None:
    """Run fn and record its result or errno."""
    try:
        res = fn()
        out = f"ok -> {res!r}" if res is not None else "ok"
    except OSError as exc:
        out = f"{errno.errorcode.get(exc.errno or 0, exc.errno)} ({exc.strerror})"
    ROWS.append((what, out))
    print(f"| {what} | {out} |", flush=True)


def sysfs(name: str) -> str:
    q = Path("/sys/block") / name / "queue"
    keys = ("zoned", "logical_block_size", "chunk_sectors", "nr_zones", "max_open_zones",
            "max_active_zones", "zone_append_max_bytes", "max_sectors_kb")
    return ", ".join(f"{k}={(q / k).read_text().strip()}" for k in keys if (q / k).exists())


def main() -> None:
    zsz = 4 * MB
    dev = make("obs0", size_mb=64, zone_size_mb=4, zone_capacity_mb=3, conventional=2,
               max_open=2, max_active=3, block_size=4096)
    print(f"kernel {platform.release()}; {dev}: 16 x 4 MiB zones, cap 3 MiB, 2 conv, "
          "max_open 2, max_active 3, lbs 4096, memory-backed")
    print(f"sysfs: {sysfs('obs0')}")
    print("| request | result |\n|---|---|")
    fd = os.open(dev, os.O_RDWR | os.O_DIRECT | os.O_EXCL)
    z = 2  # first sequential zone
    zs = z * zsz
    obs("report seq zone 2 (start, cap, wp-rel, cond)", lambda: report(fd, z, zsz))
    obs("report conv zone 0", lambda: report(fd, 0, zsz))
    obs("write 4K at WP of EMPTY zone", lambda: pw(fd, zs, 4096))
    obs("  -> zone state", lambda: report(fd, z, zsz))
    obs("write 4K ahead of WP (wp+4K)", lambda: pw(fd, zs + 8192, 4096))
    obs("write 4K behind WP (zone start)", lambda: pw(fd, zs, 4096))
    obs("write 512 B at WP (lbs 4096)", lambda: pw(fd, zs + 4096, 512))
    obs("write 4K at WP+512 (unaligned offset)", lambda: pw(fd, zs + 4096 + 512, 4096))
    obs("read 8K from zone start (4K written, 4K past WP)", lambda: pr(fd, zs, 8192)[4090:4100])
    obs("read 4K entirely past WP", lambda: pr(fd, zs + 1 * MB, 4096)[:4])
    obs("read 4K past capacity (cap..size)", lambda: pr(fd, zs + 3 * MB, 4096)[:4])
    obs("read 8K across zone boundary", lambda: len(pr(fd, zs + zsz - 4096, 8192)))
    obs("write 1M at WP", lambda: pw(fd, zs + 4096, MB))
    obs("  -> zone state", lambda: report(fd, z, zsz))
    obs("write up to capacity (cap - wp)", lambda: pw(fd, zs + 4096 + MB, 2 * MB - 4096))
    obs("  -> zone state after reaching capacity", lambda: report(fd, z, zsz))
    obs("write 4K to FULL zone at cap", lambda: pw(fd, zs + 3 * MB, 4096))
    mgmt(fd, BLKRESETZONE, z, zsz)
    obs("write crossing capacity (wp=cap-4K, 8K)", lambda: (
        pw(fd, zs, 3 * MB - 4096), pw(fd, zs + 3 * MB - 4096, 8192)))
    obs("  -> zone state", lambda: report(fd, z, zsz))
    mgmt(fd, BLKRESETZONE, z, zsz)
    obs("reset -> zone state", lambda: report(fd, z, zsz))
    obs("finish EMPTY zone", lambda: mgmt(fd, BLKFINISHZONE, z, zsz))
    obs("  -> zone state", lambda: report(fd, z, zsz))
    obs("open FULL zone", lambda: mgmt(fd, BLKOPENZONE, z, zsz))
    obs("close FULL zone", lambda: mgmt(fd, BLKCLOSEZONE, z, zsz))
    obs("finish FULL zone", lambda: mgmt(fd, BLKFINISHZONE, z, zsz))
    obs("reset FULL zone -> state", lambda: (mgmt(fd, BLKRESETZONE, z, zsz),
                                             report(fd, z, zsz))[1])
    obs("close EMPTY zone -> state", lambda: (mgmt(fd, BLKCLOSEZONE, z, zsz),
                                              report(fd, z, zsz))[1])
    obs("reset EMPTY zone", lambda: mgmt(fd, BLKRESETZONE, z, zsz))
    obs("open EMPTY zone -> state", lambda: (mgmt(fd, BLKOPENZONE, z, zsz),
                                             report(fd, z, zsz))[1])
    obs("open EXP_OPEN zone again", lambda: mgmt(fd, BLKOPENZONE, z, zsz))
    obs("close EXP_OPEN zone with wp=start -> state", lambda: (
        mgmt(fd, BLKCLOSEZONE, z, zsz), report(fd, z, zsz))[1])
    obs("write 4K then close (IMP_OPEN) -> state", lambda: (
        pw(fd, zs, 4096), mgmt(fd, BLKCLOSEZONE, z, zsz), report(fd, z, zsz))[2])
    obs("close CLOSED zone -> state", lambda: (
        mgmt(fd, BLKCLOSEZONE, z, zsz), report(fd, z, zsz))[1])
    obs("write to CLOSED zone at WP -> state", lambda: (
        pw(fd, zs + 4096, 4096), report(fd, z, zsz))[1])
    obs("finish IMP_OPEN zone -> state", lambda: (
        mgmt(fd, BLKFINISHZONE, z, zsz), report(fd, z, zsz))[1])
    mgmt(fd, BLKRESETZONE, 2, zsz, 14)
    obs("reset conventional zone 0", lambda: mgmt(fd, BLKRESETZONE, 0, zsz))
    obs("open conventional zone 0", lambda: mgmt(fd, BLKOPENZONE, 0, zsz))
    obs("finish conventional zone 0", lambda: mgmt(fd, BLKFINISHZONE, 0, zsz))
    obs("write 4K at conv zone offset 1M (random)", lambda: pw(fd, 1 * MB, 4096))
    obs("reset with range not zone aligned (start+4K)", lambda: fcntl.ioctl(
        fd, BLKRESETZONE, struct.pack("<QQ", (zs + 4096) // 512, zsz // 512)))
    obs("reset with len not multiple of zone size", lambda: fcntl.ioctl(
        fd, BLKRESETZONE, struct.pack("<QQ", zs // 512, zsz // 1024)))
    obs("reset range past device end", lambda: mgmt(fd, BLKRESETZONE, 15, zsz, 2))
    obs("reset all seq zones (2..15)", lambda: mgmt(fd, BLKRESETZONE, 2, zsz, 14))
    # open limit (max_open 2)
    obs("explicit open zones 2,3", lambda: (mgmt(fd, BLKOPENZONE, 2, zsz),
                                            mgmt(fd, BLKOPENZONE, 3, zsz)))
    obs("explicit open 3rd zone (max_open 2)", lambda: mgmt(fd, BLKOPENZONE, 4, zsz))
    obs("write to 3rd EMPTY zone with 2 EXP_OPEN", lambda: pw(fd, 4 * zsz, 4096))
    mgmt(fd, BLKRESETZONE, 2, zsz, 14)
    obs("write to zones 2,3 (2 IMP_OPEN)", lambda: (pw(fd, 2 * zsz, 4096),
                                                   pw(fd, 3 * zsz, 4096)))
    obs("write to 3rd EMPTY zone with 2 IMP_OPEN -> states 2,3,4", lambda: (
        pw(fd, 4 * zsz, 4096), [report(fd, i, zsz)[3] for i in (2, 3, 4)])[1])
    obs("explicit open 4th zone -> states 2..5", lambda: (
        mgmt(fd, BLKOPENZONE, 5, zsz), [report(fd, i, zsz)[3] for i in (2, 3, 4, 5)])[1])
    obs("write to 5th zone (3 active: max_active 3)", lambda: pw(fd, 6 * zsz, 4096))
    obs("explicit open 5th zone (active limit)", lambda: mgmt(fd, BLKOPENZONE, 6, zsz))
    obs("finish EMPTY zone at active limit", lambda: mgmt(fd, BLKFINISHZONE, 7, zsz))
    def states() -> list[str]:
        return [f"{i}:{report(fd, i, zsz)[3]}" for i in range(2, 8)]

    obs("  -> states", states)
    obs("finish CLOSED zone 2", lambda: mgmt(fd, BLKFINISHZONE, 2, zsz))
    obs("  -> states", states)
    obs("write to EMPTY zone 6 (2 IMP_OPEN, 0 CLOSED)", lambda: pw(fd, 6 * zsz, 4096))
    obs("  -> states", states)
    obs("close IMP_OPEN zone 3", lambda: mgmt(fd, BLKCLOSEZONE, 3, zsz))
    obs("write to EMPTY zone 6 (1 IMP_OPEN, 1 CLOSED)", lambda: pw(fd, 6 * zsz, 4096))
    obs("  -> states", states)
    obs("write to CLOSED zone 3 at WP (2 IMP_OPEN, max_open 2)",
        lambda: pw(fd, 3 * zsz + 4096, 4096))
    obs("  -> states", states)
    obs("explicit open CLOSED zone (2 IMP_OPEN)", lambda: mgmt(fd, BLKOPENZONE, 4, zsz))
    obs("  -> states", states)
    mgmt(fd, BLKRESETZONE, 2, zsz, 14)
    obs("write 8K across zone boundary (conv 1 -> seq 2)", lambda: pw(fd, 2 * zsz - 4096, 8192))
    obs("write 8K across two seq zones (wp of z2 at cap? no: z2 at wp=end-4K invalid)",
        lambda: pw(fd, 3 * zsz - 4096, 8192))
    os.close(fd)
    fd = os.open(dev, os.O_RDONLY | os.O_DIRECT)
    obs("write on O_RDONLY fd", lambda: pw(fd, 2 * zsz, 4096))
    obs("reset zone on O_RDONLY fd", lambda: mgmt(fd, BLKRESETZONE, 2, zsz))
    obs("report on O_RDONLY fd", lambda: report(fd, 2, zsz))
    obs("fdatasync on O_RDONLY fd", lambda: os.fdatasync(fd))
    os.close(fd)
    fd = os.open(dev, os.O_RDWR | os.O_DIRECT)
    fx = os.open(dev, os.O_RDWR | os.O_EXCL)
    obs("O_EXCL open while another fd is O_EXCL",
        lambda: os.close(os.open(dev, os.O_RDWR | os.O_DIRECT | os.O_EXCL)))
    obs("plain open while another fd is O_EXCL",
        lambda: os.close(os.open(dev, os.O_RDWR | os.O_DIRECT)))
    os.close(fx)
    os.close(fd)
    subprocess.run([sys.executable, HELPER, "destroy", "obs0"], check=True)
    # a 512-byte-sector device, no limits, capacity == size
    dev = make("obs1", size_mb=16, zone_size_mb=4, block_size=512)
    print(f"{dev}: sysfs: {sysfs('obs1')}")
    fd = os.open(dev, os.O_RDWR | os.O_DIRECT)
    obs("lbs 512: write 512 B at WP", lambda: pw(fd, 0, 512))
    obs("lbs 512: report zone 0", lambda: report(fd, 0, zsz))
    obs("lbs 512: write 4K, zone start (behind WP)", lambda: pw(fd, 0, 4096))
    obs("lbs 512: no limits, write 4 zones -> states", lambda: (
        [pw(fd, i * zsz, 4096) for i in (1, 2, 3)], [report(fd, i, zsz)[3] for i in range(4)])[1])
    os.close(fd)
    subprocess.run([sys.executable, HELPER, "destroy", "obs1"], check=True)


if __name__ == "__main__":
    main()
