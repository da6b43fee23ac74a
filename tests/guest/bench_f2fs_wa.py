#!/usr/bin/env python3
"""Write amplification of F2FS and zonefs-py on the same NVMe ZNS namespace (guest, root).

Both filesystems run the same two workloads on QEMU's zoned namespace (serial
zonefs0: 64 x 16 MiB zones, 12 MiB capacity, max open / active 14), each on a
fresh mkfs:
  * rotation -- checkpoint rotation: N files of S MiB, each written to a temp
    name, fsynced, renamed over `ckpt-<i>`; the oldest is deleted so that 3 stay;
  * hotcold  -- fill to 80% of the smaller capacity with 4 MiB "cold" files,
    then rewrite the "hot" ones (1 in 8) in place, whole, fsync after each,
    until as many bytes were rewritten as the fill wrote (and once more for
    zonefs-py at 80% of its own capacity);
  * hotrand  -- the same fill, then random 256 KiB overwrites of the hot files
    (fsync each) for as many bytes: hot zones die piecemeal, cleaning runs.
Write amplification = bytes the devices wrote / bytes the workload wrote, from
the devices' own counters, sampled after mkfs+mount and after unmount:
  * the namespace: NVMe SMART "Data Units Written" (Get Log Page 02h through
    the admin passthrough ioctl; units of 512,000 bytes) -- it counts Zone
    Appends sent through /dev/ngXnY, which /sys/block/<dev>/stat does not;
  * F2FS's metadata device (a 4 KiB-sector loop device on tmpfs, as F2FS needs
    conventional space): /sys/block/loopN/stat sectors written.
zonefs-py runs with its defaults (zone append on; cleaner on). Throughput in
the TCG guest is emulated; only WA is comparable.

usage (from the checkout root, on the host):
  tests/guest/run -- .venv/bin/python tests/guest/bench_f2fs_wa.py --out PREFIX
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import platform
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.guest.conftest import nvme_namespace, reset_all_zones  # noqa: E402

MiB = 1 << 20
NVME_IOCTL_ADMIN_CMD = 0xC0484E41  # _IOWR('N', 0x41, struct nvme_passthru_cmd), 72 bytes
ZONEFS = [sys.executable, "-m", "zonefs_py.cli.main"]


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def smart_bytes_written(ctrl_dev: str) -> int:
    """NVMe SMART / Health log: Data Units Written x 512,000 bytes."""
    buf = ctypes.create_string_buffer(512)
    cmd = bytearray(struct.pack("<BBHIIIQQII6III", 0x02, 0, 0, 0xFFFFFFFF, 0, 0, 0,
                                ctypes.addressof(buf), 0, 512, (127 << 16) | 0x02,
                                0, 0, 0, 0, 0, 0, 0))
    fd = os.open(ctrl_dev, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, NVME_IOCTL_ADMIN_CMD, cmd)
    finally:
        os.close(fd)
    units = int.from_bytes(buf.raw[48:64], "little")
    return units * 512_000


def sectors_written(block_name: str) -> int:
    return int(Path(f"/sys/block/{block_name}/stat").read_text().split()[6]) * 512


class Counters:
    def __init__(self, ctrl_dev: str, nvme_name: str, loop_name: str | None) -> None:
        self.ctrl_dev, self.nvme_name, self.loop_name = ctrl_dev, nvme_name, loop_name

    def sample(self) -> dict[str, int]:
        out = {"nvme_smart": smart_bytes_written(self.ctrl_dev),
               "nvme_blockstat": sectors_written(self.nvme_name)}
        if self.loop_name:
            out["loop_blockstat"] = sectors_written(self.loop_name)
        return out


def write_file(path: str, size: int, seed: int, *, offset: int = 0,
               create: bool = True) -> None:
    flags = os.O_WRONLY | (os.O_CREAT | os.O_TRUNC if create else 0)
    fd = os.open(path, flags, 0o644)
    try:
        block = (bytes([seed & 0xFF]) + os.urandom(4095)) * 256  # 1 MiB
        for pos in range(0, size, MiB):
            os.pwrite(fd, block, offset + pos)
        os.fsync(fd)
    finally:
        os.close(fd)


def rotation(mnt: str, nr: int, size: int) -> int:
    written = 0
    for i in range(nr):
        tmp = f"{mnt}/ckpt-{i}.tmp"
        write_file(tmp, size, i)
        os.rename(tmp, f"{mnt}/ckpt-{i}")
        dfd = os.open(mnt, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)
        written += size
        if i >= 3:
            os.unlink(f"{mnt}/ckpt-{i - 3}")
    return written


def hotcold(mnt: str, fill_bytes: int) -> int:
    size = 4 * MiB
    nr = fill_bytes // size
    for i in range(nr):
        write_file(f"{mnt}/f{i:04d}", size, i)
    written = nr * size
    hot = [i for i in range(nr) if i % 8 == 0]
    rewritten, k = 0, 0
    while rewritten < nr * size:
        i = hot[k % len(hot)]
        write_file(f"{mnt}/f{i:04d}", size, 1000 + k, create=False)
        rewritten += size
        k += 1
    return written + rewritten


def hotrand(mnt: str, fill_bytes: int, seed: int = 5) -> int:
    """hotcold's fill, then random 256 KiB overwrites of the hot files (fsync each)
    until as many bytes were rewritten as the fill wrote: hot zones die piecemeal."""
    import random

    rng = random.Random(seed)
    size, piece = 4 * MiB, 256 << 10
    nr = fill_bytes // size
    for i in range(nr):
        write_file(f"{mnt}/f{i:04d}", size, i)
    hot = [i for i in range(nr) if i % 8 == 0]
    rewritten = 0
    block = os.urandom(piece)
    while rewritten < nr * size:
        i = rng.choice(hot)
        fd = os.open(f"{mnt}/f{i:04d}", os.O_WRONLY)
        try:
            os.pwrite(fd, block, rng.randrange(size // piece) * piece)
            os.fsync(fd)
        finally:
            os.close(fd)
        rewritten += piece
    return nr * size + rewritten


def run_f2fs(nvme: str, work: Callable[[str], int], meta_mb: int) -> dict[str, Any]:
    img = "/tmp/f2fs-meta.img"
    Path(img).write_bytes(b"")
    os.truncate(img, meta_mb * MiB)
    loop = sh("losetup", "-f", "--show", "-b", "4096", img).strip()
    mnt = "/tmp/f2fs-mnt"
    os.makedirs(mnt, exist_ok=True)
    try:
        sh("mkfs.f2fs", "-f", "-m", "-c", nvme, loop)
        sh("mount", "-t", "f2fs", loop, mnt)
        cnt = Counters(ctrl_of(nvme), Path(nvme).name, Path(loop).name)
        before = cnt.sample()
        usable = os.statvfs(mnt)
        t0 = time.monotonic()
        user = work(mnt)
        sh("umount", mnt)
        after = cnt.sample()
        dt = time.monotonic() - t0
    finally:
        subprocess.run(["umount", mnt], capture_output=True, check=False)
        subprocess.run(["losetup", "-d", loop], capture_output=True, check=False)
        Path(img).unlink(missing_ok=True)
    dev = {k: after[k] - before[k] for k in after}
    device = dev["nvme_smart"] + dev["loop_blockstat"]
    return {"fs": "f2fs", "user_bytes": user, "device_bytes": device, "counters": dev,
            "wa": device / user, "seconds": dt,
            "usable_bytes": usable.f_blocks * usable.f_frsize}


def f2fs_capacity(nvme: str, meta_mb: int) -> int:
    """Bytes of 4 MiB files a fresh F2FS takes before ENOSPC (statvfs over-reports on a
    zoned device whose zone capacity is below the zone size, and F2FS reserves
    whole zones for its cleaner)."""
    taken = 0

    def fill(mnt: str) -> int:
        nonlocal taken
        try:
            for i in range(100_000):
                write_file(f"{mnt}/probe{i:05d}", 4 * MiB, i)
                taken += 4 * MiB
        except OSError:
            pass
        return max(taken, 1)

    run_f2fs(nvme, fill, meta_mb)
    return taken


def run_zonefs(nvme: str, work: Callable[[str], int]) -> dict[str, Any]:
    reset_all_zones(nvme)
    sh(*ZONEFS, "mkfs", "--force", nvme)
    mnt = "/tmp/zonefs-mnt"
    os.makedirs(mnt, exist_ok=True)
    cnt = Counters(ctrl_of(nvme), Path(nvme).name, None)
    before = cnt.sample()
    sh(*ZONEFS, "mount", nvme, mnt, "--log-file", "/tmp/zonefs-wa.log")
    try:
        stat = json.loads(sh(*ZONEFS, "stat", "--json", mnt))
        t0 = time.monotonic()
        user = work(mnt)
        stat = json.loads(sh(*ZONEFS, "stat", "--json", mnt))
    finally:
        sh("fusermount3", "-u", mnt)
    for _ in range(600):  # the daemon closes the device after the unmount
        try:
            os.close(os.open(nvme, os.O_RDONLY | os.O_EXCL))
            break
        except OSError:
            time.sleep(0.1)
    after = cnt.sample()
    dt = time.monotonic() - t0
    dev = {k: after[k] - before[k] for k in after}
    return {"fs": "zonefs-py", "user_bytes": user, "device_bytes": dev["nvme_smart"],
            "counters": dev, "wa": dev["nvme_smart"] / user, "seconds": dt,
            "zone_append": stat["device"]["zone_append"],
            "own_wa": stat.get("write_amplification"),
            "usable_bytes": stat["space"]["capacity_bytes"] - stat["space"]["reserve_bytes"]}


def ctrl_of(nvme: str) -> str:
    return "/dev/" + Path(os.path.realpath(f"/sys/block/{Path(nvme).name}/device")).name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rotations", type=int, default=20)
    ap.add_argument("--ckpt-mb", type=int, default=32)
    ap.add_argument("--meta-mb", type=int, default=64)
    ap.add_argument("--fill-mb", type=int, default=0, help="0: 80%% of the smaller fs")
    ap.add_argument("--out")
    args = ap.parse_args()
    nvme = nvme_namespace("zonefs0", 1)
    if nvme is None:
        sys.exit("bench_f2fs_wa: run through tests/guest/run (needs the NVMe namespace)")
    subprocess.run(["modprobe", "-a", "f2fs", "loop"], check=False)
    results: list[dict[str, Any]] = []
    rot = lambda mnt: rotation(mnt, args.rotations, args.ckpt_mb * MiB)  # noqa: E731
    for _name, fn in (("f2fs", lambda w: run_f2fs(nvme, w, args.meta_mb)),
                     ("zonefs-py", lambda w: run_zonefs(nvme, w))):
        r = fn(rot)
        r["workload"] = "rotation"
        print(json.dumps(r), flush=True)
        results.append(r)
    f2fs_cap = f2fs_capacity(nvme, args.meta_mb)
    zonefs_cap = int(results[1]["usable_bytes"])
    print(f"capacity for 4 MiB files: f2fs {f2fs_cap >> 20} MiB, zonefs-py {zonefs_cap >> 20} MiB",
          flush=True)
    q = 4 * MiB
    fill = args.fill_mb * MiB or int(min(f2fs_cap, zonefs_cap) * 0.8) // q * q
    own = int(zonefs_cap * 0.8) // q * q
    for _name, fn, nbytes in (("f2fs", lambda w: run_f2fs(nvme, w, args.meta_mb), fill),
                              ("zonefs-py", lambda w: run_zonefs(nvme, w), fill),
                              ("zonefs-py", lambda w: run_zonefs(nvme, w), own)):
        for wname, wfn in (("hotcold", hotcold), ("hotrand", hotrand)):
            r = fn(lambda mnt, n=nbytes, w=wfn: w(mnt, n))
            r["workload"] = wname
            r["fill_bytes"] = nbytes
            r["capacity_bytes"] = f2fs_cap if r["fs"] == "f2fs" else zonefs_cap
            print(json.dumps(r), flush=True)
            results.append(r)
    lines = [
        f"# F2FS vs zonefs-py write amplification, NVMe ZNS (guest, {platform.release()})",
        "",
        f"{nvme}: QEMU zoned namespace, 64 x 16 MiB zones, 12 MiB capacity, max open/active "
        f"14; F2FS metadata on a {args.meta_mb} MiB loop device. rotation: "
        f"{args.rotations} x {args.ckpt_mb} MiB temp+fsync+rename, keep 3. hotcold: fill "
        "with 4 MiB files to 80% of the smaller capacity (and, last row, to 80% of "
        "zonefs-py's own), rewrite 1 file in 8 in place, whole, until as many bytes again; "
        "hotrand: the same fill, then random 256 KiB overwrites (fsync each) of those hot "
        "files for as many bytes again. "
        "Capacity: what a fresh F2FS took in 4 MiB files before ENOSPC "
        f"({f2fs_cap >> 20} MiB); zonefs-py's capacity minus its cleaner reserve "
        f"({zonefs_cap >> 20} MiB). WA = device bytes (NVMe SMART data units written, "
        "+ loop device sectors for F2FS) / workload bytes. Produced by "
        "tests/guest/bench_f2fs_wa.py.",
        "",
        "| workload | filesystem | fill | workload MiB | device MiB | WA |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        fill_txt = "-"
        if "fill_bytes" in r:
            fb, cap = int(r["fill_bytes"]), int(r["capacity_bytes"])
            fill_txt = f"{fb >> 20} MiB ({100 * fb / cap:.0f}% of its capacity)"
        lines.append(f"| {r['workload']} | {r['fs']} | {fill_txt} | "
                     f"{int(r['user_bytes']) >> 20} | "
                     f"{int(r['device_bytes']) / MiB:.0f} | {float(r['wa']):.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out + ".md").write_text(text)
        Path(args.out + ".json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
