#!/usr/bin/env python3
"""Compare io_uring batches with Python threads and sequential calls for native I/O.

usage: bench_batch.py PATH [--zone-size-mb Z] [--zones N] [--io-kb K] [--ios-per-zone M]

PATH is a regular file (host) or a zoned block device (guest; it is written
and reset). Prints MiB/s for reads and writes spread over N zones, each zone
written sequentially (one in-flight write per zone) and zones in parallel.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from zonefs_py.device import native


def timed(label: str, nbytes: int, fn: Callable[[], object]) -> None:
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    print(f"{label:<38} {nbytes / dt / (1 << 20):9.1f} MiB/s  ({dt * 1000:.1f} ms)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--zone-size-mb", type=int, default=4)
    ap.add_argument("--zones", type=int, default=8)
    ap.add_argument("--io-kb", type=int, default=128)
    ap.add_argument("--ios-per-zone", type=int, default=16)
    args = ap.parse_args()
    zsz = args.zone_size_mb << 20
    io = args.io_kb << 10
    fd = native.open_path(args.path)
    zoned = native.is_zoned_block_device(args.path)
    bs = native.block_geometry(fd, args.path).logical_block_size if zoned else 4096
    pool = native.BufferPool(nr_bufs=32, buf_size=max(io, 4096))
    ring = native.IoRing.create(64)
    print(f"{args.path}: zoned={zoned} io_uring={'yes' if ring else 'no'} "
          f"{args.zones} zones x {args.ios_per_zone} x {args.io_kb} KiB")
    data = bytes(range(256)) * (io // 256)
    per_zone = [[(z * zsz + i * io, data) for i in range(args.ios_per_zone)]
                for z in range(args.zones)]
    writes = [w for zone in per_zone for w in zone]
    total = len(writes) * io

    def reset() -> None:
        if zoned:
            native.zone_mgmt(fd, "reset", 0, args.zones * zsz)

    def zone_writer(zone: list[tuple[int, bytes]]) -> None:
        for off, buf in zone:
            native.pwrite(fd, off, buf, block_size=bs, pool=pool)

    reset()
    timed("write sequential (1 thread)", total, lambda: [zone_writer(z) for z in per_zone])
    reset()
    with ThreadPoolExecutor(args.zones) as ex:
        timed(f"write threads ({args.zones}, one per zone)", total,
              lambda: list(ex.map(zone_writer, per_zone)))
    reset()
    if ring:
        timed("write io_uring batch (zone groups)", total, lambda: native.pwrite_batch(
            fd, writes, block_size=bs, pool=pool, ring=ring, zone_size_bytes=zsz))
    spans = [(off, io) for off, _d in writes]
    timed("read sequential (1 thread)", total,
          lambda: [native.pread(fd, o, n, block_size=bs, pool=pool) for o, n in spans])
    with ThreadPoolExecutor(8) as ex:
        timed("read threads (8)", total, lambda: list(ex.map(
            lambda s: native.pread(fd, s[0], s[1], block_size=bs, pool=pool), spans)))
    if ring:
        timed("read io_uring batch", total,
              lambda: native.pread_batch(fd, spans, block_size=bs, pool=pool, ring=ring))
    reset()
    native.close_fd(fd)


if __name__ == "__main__":
    main()
