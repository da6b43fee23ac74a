#!/usr/bin/env python3
"""Zone append at QD 8 to one zone vs serialised writes at the write pointer (guest only).

Same NVMe namespace, same run, alternating repetitions; each repetition
fills one zone (its whole capacity) with 128 KiB appends through
BlockZonedDevice:
  * zone append QD8  -- `ZoneAppendAppender.append_many`, 8 NVMe Zone Appends
    in flight on one io_uring (the device picks the addresses);
  * zone append QD1  -- one Zone Append at a time (isolates the queue depth);
  * WP writes        -- `zone_append=off`: O_DIRECT pwrite at the cached write
    pointer under the zone lock (one in flight per zone, what null_blk gets).
Throughput in the TCG guest is emulated: only the ratios mean anything.

usage (from the checkout root, on the host):
  tests/guest/run -- .venv/bin/python tests/guest/bench_zappend.py [--reps 3] [--out PREFIX]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.guest.conftest import nvme_namespace, reset_all_zones  # noqa: E402
from zonefs_py.device.blockdev import BlockZonedDevice  # noqa: E402
from zonefs_py.device.zappend import ZoneAppendAppender  # noqa: E402

IO = 128 << 10


def fill_zone(path: str, mode: str, zone_idx: int) -> tuple[float, int]:
    """Fill one zone with 128 KiB appends; return (seconds, bytes)."""
    reset_all_zones(path)
    with BlockZonedDevice.open(path, zone_append="off" if mode == "wp" else "on") as dev:
        cap = dev.report_zones(zone_idx, 1)[0].capacity_bytes
        n = cap // IO
        bufs = [memoryview(bytes([i & 0xFF]) * IO) for i in range(n)]
        t0 = time.perf_counter()
        if mode == "zappend-qd8":
            appender = dev.appender
            assert isinstance(appender, ZoneAppendAppender)
            for k in range(0, n, 8):
                appender.append_many(dev, zone_idx, bufs[k:k + 8])
        else:
            for b in bufs:
                dev.append(zone_idx, b)
        dev.flush()
        dt = time.perf_counter() - t0
        assert dev.report_zones(zone_idx, 1)[0].wp_bytes > 0
        return dt, n * IO


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", help="write PREFIX.json and PREFIX.md")
    args = ap.parse_args()
    path = nvme_namespace("zonefs0", 1)
    if path is None:
        sys.exit("bench_zappend: run through tests/guest/run (needs the NVMe namespace)")
    modes = ("zappend-qd8", "zappend-qd1", "wp")
    runs: dict[str, list[float]] = {m: [] for m in modes}
    nbytes = 0
    for rep in range(args.reps):
        for mode in modes:
            dt, nbytes = fill_zone(path, mode, 3 + rep)
            runs[mode].append(nbytes / dt / (1 << 20))
            print(f"rep {rep} {mode:<12} {runs[mode][-1]:8.1f} MiB/s", flush=True)
    med = {m: statistics.median(v) for m, v in runs.items()}
    lines = [
        f"# Zone append vs writes at the write pointer (guest, {platform.release()})",
        "",
        f"QEMU NVMe ZNS namespace {path} (16 MiB zones, 12 MiB capacity, zasl=5), TCG guest:",
        "absolute figures are emulated; compare the ratios. Each repetition fills one zone",
        f"({nbytes >> 20} MiB in 128 KiB appends, then flush); {args.reps} repetitions,",
        "modes alternating. Produced by tests/guest/bench_zappend.py.",
        "",
        "| mode | median MiB/s | runs | vs WP writes |",
        "|---|---|---|---|",
    ]
    for m in modes:
        runs_txt = ", ".join(f"{v:.1f}" for v in runs[m])
        lines.append(f"| {m} | {med[m]:.1f} | {runs_txt} | {med[m] / med['wp']:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out + ".md").write_text(text)
        Path(args.out + ".json").write_text(json.dumps(
            {"kernel": platform.release(), "io_bytes": IO, "zone_bytes": nbytes,
             "mib_s": runs, "median_mib_s": med}, indent=1) + "\n")


if __name__ == "__main__":
    main()
