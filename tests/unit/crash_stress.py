"""Randomised crash stress at the engine level: concurrent workers, the daemon's
background task, checkpoints every few KiB of journal, a power cut at a random
device write, then fsck and a remount that must show every acknowledged byte.

The sweeps of test_crash.py cut at *every* write of short, sequential
scenarios; this runs what the mounted daemon runs (tasks racing for the log,
checkpoints started by the background task while fsyncs go on, the cleaner)
and cuts once per run at a random point, many runs. One run:

    python tests/unit/crash_stress.py --runs 200 --seed 1

A failing run prints its seed and cut point and keeps the crashed image.
`test_crash_stress.py` runs a few in the default suite and more in the slow one.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import stat
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests/: crashlib
from crashlib import findings_text, power_was_cut  # noqa: E402
from engine_helpers import (  # noqa: E402
    CTX,
    CountingDevice,
    Geometry,
    MiB,
    fsck,
    lookup,
    new_image,
    read_tree,
    write_file,
)
from test_crash import Tracker, _show  # noqa: E402

from zonefs_py import errors  # noqa: E402
from zonefs_py.device.emulated import EmulatedZonedDevice  # noqa: E402
from zonefs_py.fs.api import ROOT_INO, RenameFlags, SetAttrRequest  # noqa: E402
from zonefs_py.fs.filesystem import ZoneFS  # noqa: E402
from zonefs_py.fs.options import FsOptions  # noqa: E402
from zonefs_py.journal import journal as journal_mod  # noqa: E402

GEO = Geometry(size_bytes=96 * MiB, zone_size_bytes=2 * MiB)
#: The daemon's background task runs: commits every 20 ms, a checkpoint every 16 KiB
#: of journal (so most commits meet one being written).
OPTIONS = FsOptions(commit_interval_s=0.02, checkpoint_journal_bytes=16 << 10)
STEPS = 25

class Paths(Tracker):
    """test_crash's Tracker (versions of each path, the last acknowledged one),
    for workers that race: `mark` a version before a change others may follow
    with their own, `ack_version` it once the change is durable, and
    `problems` reports instead of asserting, letting a path that was not
    fsync'ed hold any subset of its newest writes."""

    def mark(self, path: str) -> int:
        return len(self.versions[path]) - 1

    def ack_version(self, path: str, upto: int) -> None:
        self.acked[path] = max(self.acked[path], upto)

    def problems(self, files: dict[str, bytes]) -> list[str]:
        bad = [f"{path} exists but was never created" for path in files
               if path not in self.versions]
        for path, hist in self.versions.items():
            actual = files.get(path)
            allowed = hist[self.acked[path]:]
            if actual in allowed:
                continue
            if len(allowed) > 1 and isinstance(actual, bytes) and any(
                    isinstance(v, bytes) and _subset(actual, v) for v in allowed):
                continue  # not fsync'ed: any subset of the newest writes
            bad.append(f"{path}: holds {_show(actual)}, allowed "
                       f"{[_show(v) for v in allowed]} (acked {self.acked[path]} of "
                       f"{len(hist) - 1})")
        return bad


def _subset(actual: bytes, v: bytes) -> bool:
    if len(actual) > len(v):
        return False
    return all(a == b or a == 0 for a, b in zip(actual, v, strict=False))


async def _fsyncdir(fs: ZoneFS, ino: int) -> None:
    dh = await fs.opendir(ino)
    try:
        await fs.fsyncdir(dh, False)
    finally:
        await fs.releasedir(dh)


Worker = Callable[[ZoneFS, Paths, random.Random, int], Awaitable[None]]


async def ckpt_worker(fs: ZoneFS, t: Paths, rng: random.Random, d: int) -> None:
    """torch.save-style: temp + fsync + rename + fsync(dir), old steps deleted."""
    for step in range(STEPS):
        name = "latest.pt" if rng.random() < 0.5 else f"step_{step}.pt"
        data = rng.randbytes(rng.choice([3000, 16 << 10, 200 << 10, 600 << 10]))
        tmp, dst = "/ckpt/" + name + ".tmp", "/ckpt/" + name
        t.expect(tmp, b"")
        t.expect(tmp, data)
        await write_file(fs, tmp, data, fsync=True, chunk=128 << 10)
        t.ack(tmp)
        t.expect(dst, data)
        t.expect(tmp, None)
        m_dst, m_tmp = t.mark(dst), t.mark(tmp)
        await fs.rename(d, (name + ".tmp").encode(), d, name.encode(), RenameFlags.NONE)
        await _fsyncdir(fs, d)
        t.ack_version(dst, m_dst)
        t.ack_version(tmp, m_tmp)
        old = f"step_{step - 2}.pt"
        if f"/ckpt/{old}" in t.versions and t.versions[f"/ckpt/{old}"][-1] is not None:
            t.expect(f"/ckpt/{old}", None)
            m = t.mark(f"/ckpt/{old}")
            await fs.unlink(d, old.encode())
            await _fsyncdir(fs, d)
            t.ack_version(f"/ckpt/{old}", m)


async def data_worker(fs: ZoneFS, t: Paths, rng: random.Random, d: int) -> None:
    """Shards rewritten (O_TRUNC) in 64 KiB writes, mostly fsync'ed; some deleted."""
    for _ in range(STEPS):
        name = f"shard_{rng.randrange(4):02d}.bin"
        path = "/data/" + name
        if path in t.versions and t.versions[path][-1] is not None and rng.random() < 0.2:
            t.expect(path, None)
            m = t.mark(path)
            await fs.unlink(d, name.encode())
            if rng.random() < 0.5:
                await _fsyncdir(fs, d)
                t.ack_version(path, m)
            continue
        data = rng.randbytes(rng.randrange(1, 12) * (32 << 10) + rng.randrange(4096))
        t.expect(path, b"")
        t.expect(path, data)
        m = t.mark(path)
        sync = rng.random() < 0.8
        await write_file(fs, path, data, fsync=sync, chunk=64 << 10)
        if sync:
            t.ack_version(path, m)


async def log_worker(fs: ZoneFS, t: Paths, rng: random.Random, d: int) -> None:
    """An append-only log, fsync'ed now and then, truncated when it grows."""
    path = "/log/train.log"
    fh, attr = await fs.create(d, b"train.log", 0o644, os.O_WRONLY, CTX)
    fs.forget([(attr.ino, 1)])
    t.expect(path, b"")
    cur = b""
    try:
        for i in range(STEPS * 2):
            if len(cur) > (64 << 10):
                cur = b""
                t.expect(path, cur)
                await fs.setattr(attr.ino, SetAttrRequest(size=0), CTX)
                continue
            line = b"step %d " % i + rng.randbytes(rng.randrange(0, 3000)).hex().encode() + b"\n"
            await fs.write(fh, len(cur), line)
            cur += line
            t.expect(path, cur)
            if rng.random() < 0.3:
                m = t.mark(path)
                await fs.fsync(fh, False)
                t.ack_version(path, m)
    finally:
        await fs.release(fh)


async def churn_worker(fs: ZoneFS, t: Paths, rng: random.Random, d: int) -> None:
    """Small files (inline and not): create, overwrite, unlink, rename, truncate."""
    names = [f"f{i}" for i in range(12)]
    for _ in range(STEPS * 2):
        name = rng.choice(names)
        path = "/churn/" + name
        cur = t.versions.get(path, [None])[-1]
        r = rng.random()
        if r < 0.4 or cur is None:
            data = rng.randbytes(rng.choice([rng.randrange(1, 2000), rng.randrange(1, 20000)]))
            t.expect(path, b"")
            t.expect(path, data)
            m = t.mark(path)
            sync = rng.random() < 0.5
            await write_file(fs, path, data, fsync=sync, chunk=8192)
            if sync:
                t.ack_version(path, m)
        elif r < 0.6:
            t.expect(path, None)
            m = t.mark(path)
            await fs.unlink(d, name.encode())
            if rng.random() < 0.3:
                await _fsyncdir(fs, d)
                t.ack_version(path, m)
        elif r < 0.8:
            other = rng.choice(names)
            if other == name:
                continue
            dst = "/churn/" + other
            t.expect(dst, cur)
            t.expect(path, None)
            m = t.mark(path)
            await fs.rename(d, name.encode(), d, other.encode(), RenameFlags.NONE)
            if rng.random() < 0.3:
                await _fsyncdir(fs, d)
                t.ack_version(path, m)  # dst's content is durable only if it was fsync'ed
        else:
            size = rng.randrange(0, 2 * len(cur) + 1)
            new = cur[:size] + bytes(max(0, size - len(cur)))
            t.expect(path, new)
            m = t.mark(path)
            ino = (await lookup(fs, d, name.encode())).ino
            await fs.setattr(ino, SetAttrRequest(size=size), CTX)
            if rng.random() < 0.5:
                fh = await fs.open(ino, os.O_WRONLY)
                try:
                    await fs.fsync(fh, False)
                finally:
                    await fs.release(fh)
                t.ack_version(path, m)


WORKERS: dict[str, Worker] = {"ckpt": ckpt_worker, "data": data_worker,
                              "log": log_worker, "churn": churn_worker}


@dataclass
class Outcome:
    writes: int
    cut: bool
    paths: Paths
    checkpoints: int
    inside: int


async def run_workload(image: Path, seed: int, cut_after: int | None, mode: str) -> Outcome:
    rng = random.Random(seed)
    drop = cut_after is not None and mode == "drop"
    dev = EmulatedZonedDevice.open(image, volatile_cache=True,
                                   cut_after_writes=cut_after if drop else None)
    cdev = CountingDevice(dev, cut_after=None if drop else cut_after, mode=mode,
                          rng=random.Random(seed ^ 0x5A5A))
    t = Paths()
    checkpoints = inside = 0
    try:
        async with ZoneFS.mount(cdev, OPTIONS, close=False) as fs:  # type: ignore[arg-type]
            try:
                dirs = {}
                for name in WORKERS:
                    dirs[name] = (await fs.mkdir(ROOT_INO, name.encode(), stat.S_IFDIR | 0o755,
                                                 CTX)).ino
                await fs.sync()

                async def one(name: str, wrng: random.Random) -> None:
                    try:
                        await WORKERS[name](fs, t, wrng, dirs[name])
                    except (OSError, errors.ZoneFSError):
                        if not cdev.cut and not power_was_cut(dev):
                            raise

                async def background() -> None:
                    try:
                        await fs.serve_background()
                    except (OSError, errors.ZoneFSError):
                        if not cdev.cut and not power_was_cut(dev):
                            raise

                async with trio.open_nursery() as outer:
                    outer.start_soon(background)
                    async with trio.open_nursery() as nursery:
                        for name in WORKERS:
                            nursery.start_soon(one, name, random.Random(rng.random()))
                    outer.cancel_scope.cancel()
                checkpoints = fs.journal.checkpoints_written
                inside = getattr(fs.journal, "commits_during_checkpoints", 0)
                if not (cdev.cut or power_was_cut(dev)):
                    await fs.close()
            except (OSError, errors.ZoneFSError):
                if cut_after is None or cdev.writes < cut_after:
                    raise
    finally:
        dev.close()
    return Outcome(cdev.writes, cut_after is not None and cdev.writes >= cut_after, t,
                   checkpoints, inside)


async def verify(image: Path, t: Paths) -> list[str]:
    report = fsck(image)
    if not report.clean:
        return [f"fsck before remount: {findings_text(report)}"]
    dev = EmulatedZonedDevice.open(image)
    try:
        async with ZoneFS.mount(dev, FsOptions(commit_interval_s=3600.0)) as fs:
            files, _dirs = await read_tree(fs)
            bad = t.problems(files)
    finally:
        dev.close()
    if bad:
        return bad
    report = fsck(image)
    return [] if report.clean else [f"fsck after remount: {findings_text(report)}"]


def stress_knobs() -> Callable[[], None]:
    """Checkpoints of many tiny records, one per hold of the log, one inode per
    encoding slice: commits land between them. Returns the undo."""
    saved = (journal_mod.RECORD_PAYLOAD_TARGET, journal_mod.CHECKPOINT_SLICE_INODES,
             getattr(journal_mod, "CHECKPOINT_WRITE_BYTES", None))
    journal_mod.RECORD_PAYLOAD_TARGET = 2048
    journal_mod.CHECKPOINT_SLICE_INODES = 2
    if saved[2] is not None:
        journal_mod.CHECKPOINT_WRITE_BYTES = 4096

    def undo() -> None:
        journal_mod.RECORD_PAYLOAD_TARGET, journal_mod.CHECKPOINT_SLICE_INODES = saved[:2]
        if saved[2] is not None:
            journal_mod.CHECKPOINT_WRITE_BYTES = saved[2]
    return undo


async def one_run(workdir: Path, seed: int, mode: str) -> tuple[list[str], Outcome, Outcome]:
    """Count the writes of a run without a cut, then cut a second run at a random one."""
    rng = random.Random(seed)
    image = workdir / f"s{seed}.img"
    image.unlink(missing_ok=True)
    new_image(image, GEO)
    full = await run_workload(image, seed, None, mode)
    image.unlink()
    cut = rng.randrange(1, max(2, full.writes))
    new_image(image, GEO)
    run = await run_workload(image, seed, cut, mode)
    crashed = workdir / f"s{seed}.crashed.img"
    # As the crash left it (the remount below writes to the image).
    await trio.run_process(["cp", "--sparse=always", str(image), str(crashed)])
    problems = await verify(image, run.paths)
    if problems:
        dest = Path("/var/tmp") / f"zonefs-stress-failed-{seed}-{mode}-{cut}.img"
        crashed.replace(dest)
        problems.insert(0, f"seed {seed} mode {mode} cut after write {cut} of ~{full.writes} "
                           f"(image as the crash left it: {dest})")
    crashed.unlink(missing_ok=True)
    image.unlink()
    return problems, full, run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workdir", default="/var/tmp/zonefs-stress")
    args = ap.parse_args()
    logging.disable(logging.CRITICAL)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    undo = stress_knobs()
    failures = 0
    start = time.monotonic()
    try:
        for i in range(args.runs):
            seed = args.seed + i
            mode = ("drop", "tear")[seed % 2]
            problems, full, run = trio.run(one_run, work, seed, mode)
            status = "FAIL" if problems else "ok"
            print(f"seed {seed} {mode}: {status} cut at {run.writes} of {full.writes} writes; "
                  f"uncut run: {full.checkpoints} checkpoints, {full.inside} commits inside "
                  f"them ({time.monotonic() - start:.0f}s)", flush=True)
            for p in problems[:20]:
                print("   ", p, flush=True)
            failures += bool(problems)
    finally:
        undo()
    print(f"{failures} of {args.runs} runs failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
