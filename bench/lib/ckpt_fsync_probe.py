"""One contender of bench/checkpoint_fsync: fsync latency while checkpoints of a
big namespace are written, through the engine API (no FUSE).

Run as `python3 ckpt_fsync_probe.py --files N --image PATH --out JSON` with
PYTHONPATH naming the zonefs-py source tree to measure (so an older checkout
can be the peer in the same run). Prints nothing but errors; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import trio

from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.fs.api import ROOT_INO, Ctx
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.fs.mkfs import make_filesystem
from zonefs_py.fs.options import FsOptions

MiB = 1 << 20
GiB = 1 << 30
CTX = Ctx()


def summary(lat: list[float]) -> dict[str, float | int]:
    if not lat:
        return {"n": 0}
    s = sorted(lat)

    def q(p: float) -> float:
        return round(s[min(len(s) - 1, int(p * len(s)))] * 1e3, 2)

    return {"n": len(s), "p50_ms": q(0.50), "p99_ms": q(0.99), "max_ms": round(s[-1] * 1e3, 2)}


async def main(files: int, image: Path, checkpoints: int, interval: float) -> dict[str, object]:
    dev = EmulatedZonedDevice.create(image, size_bytes=16 * GiB, zone_size_bytes=256 * MiB,
                                     overwrite=True)
    make_filesystem(dev, meta_zones=8)
    dev.close()
    dev = EmulatedZonedDevice.open(image)
    out: dict[str, object] = {"files": files}
    try:
        # commit= long: only the probe's fsyncs and the checkpoints write the log.
        options = FsOptions(commit_interval_s=3600.0, cleaner_rate_mb_s=0.0)
        async with ZoneFS.mount(dev, options) as fs:
            t0 = time.monotonic()
            for d in range(files // 1000 + 1):
                dino = (await fs.mkdir(ROOT_INO, b"d%05d" % d, 0o755, CTX)).ino
                for i in range(min(1000, files - d * 1000)):
                    fh, attr = await fs.create(dino, b"f%04d" % i, 0o644, os.O_WRONLY, CTX)
                    await fs.release(fh)
                    fs.forget([(attr.ino, 1)])
                await fs.journal.commit()
            out["build_s"] = round(time.monotonic() - t0, 1)
            t0 = time.monotonic()
            await fs.journal.checkpoint()
            out["first_checkpoint_s"] = round(time.monotonic() - t0, 2)
            probe_fh, _ = await fs.create(ROOT_INO, b"probe", 0o644, os.O_RDWR, CTX)
            block = os.urandom(4096)
            quiet: list[float] = []
            during: list[float] = []
            phase: list[list[float] | None] = [quiet]
            ckpt_s: list[float] = []

            async def probe() -> None:
                n = 0
                while (into := phase[0]) is not None:
                    t = time.monotonic()
                    await fs.write(probe_fh, 0, block[n % 8:] + block[:n % 8])
                    await fs.fsync(probe_fh, False)
                    into.append(time.monotonic() - t)
                    n += 1
                    await trio.sleep(interval)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(fs.serve_background)
                nursery.start_soon(probe)
                await trio.sleep(5)
                phase[0] = during
                for _ in range(checkpoints):
                    t = time.monotonic()
                    await fs.journal.checkpoint()
                    ckpt_s.append(round(time.monotonic() - t, 2))
                    await trio.sleep(0.5)
                phase[0] = None
                await fs.close()
            out["probe_quiet"] = summary(quiet)
            out["probe_during_checkpoints"] = summary(during)
            out["checkpoint_s"] = ckpt_s
            out["checkpoint_bytes"] = fs.journal.last_checkpoint_bytes
            out["commits_during_checkpoints"] = getattr(fs.journal, "commits_during_checkpoints",
                                                        None)
            out["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    finally:
        dev.close()
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, required=True)
    ap.add_argument("--image", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--checkpoints", type=int, default=3)
    ap.add_argument("--interval", type=float, default=0.02)
    a = ap.parse_args()
    try:
        result = trio.run(main, a.files, a.image, a.checkpoints, a.interval)
    finally:
        a.image.unlink(missing_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
