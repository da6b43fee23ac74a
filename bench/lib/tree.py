"""Workloads people run on a dataset of small files (issue 29), and their request census.

The tree is `dataset_layout`'s (3 levels of directories, 10 files a leaf,
200 B - 200 KiB), packed once into a real tar archive by Python's `tarfile`
and unpacked once into a source directory on the local disk (for rsync).
Then, on the contender's mount and in this order:

* `untar`: `tar -C MNT/untar -xf tree.tar`, then sync (+ fsync of the root).
* `cp_a`: `cp -a MNT/untar MNT/cp_a`, then sync.
* `find_stat`: `find MNT/untar -print0 | xargs -0 stat`, warm (after one
  untimed pass: the first pass after untar pays the kernel's attribute
  refreshes).
* `du`: `du -s MNT/untar`, warm.
* `rsync`: `rsync -a SRC/ MNT/rsync/` from the local disk, then sync.
* `rm_rf`: `rm -rf` of all three copies, then sync.

Each gives seconds, files per second and, where the contender counts them
(`Contender.census`), FUSE requests per file by opcode, so that every round
trip has a number next to it.

Caveats: `find`, `du`, `cp`, `tar`, `rsync` are the distribution's; their
own syscall patterns are part of the figure (that is the point). The no-op
server stores no data, so its `cp -a` copies zeros.
"""

from __future__ import annotations

import io
import os
import random
import shutil
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any

from .dataset import dataset_layout

#: Counts in a census that are not requests.
NOT_REQUESTS = {"forgotten_inodes"}


def census_delta(before: dict[str, int] | None, after: dict[str, int] | None
                 ) -> dict[str, int] | None:
    """Requests by opcode between two census readings (None when not counted)."""
    if before is None or after is None:
        return None
    return {k: after.get(k, 0) - before.get(k, 0) for k in after
            if after.get(k, 0) != before.get(k, 0)}


def cpu_delta(before: float | None, after: float | None) -> float | None:
    """Server CPU seconds between two readings (None when there is no server)."""
    if before is None or after is None or after < before:
        return None
    return after - before


def per_file(delta: dict[str, int] | None, files: int,
             cpu_s: float | None = None) -> dict[str, Any]:
    """`requests_per_file` (every request), `per_file` by opcode and, given the server's
    CPU seconds meanwhile, `cpu_us_per_request`, from a census delta."""
    if delta is None or files <= 0:
        return {}
    total = sum(v for k, v in delta.items() if k not in NOT_REQUESTS and ":" not in k)
    out: dict[str, Any] = {
        "requests_per_file": round(total / files, 2),
        "per_file": {k: round(v / files, 2) for k, v in sorted(delta.items())
                     if round(v / files, 2) and k not in NOT_REQUESTS}}
    if cpu_s is not None and total:
        out["cpu_us_per_request"] = round(cpu_s * 1e6 / total, 1)
    return out


def make_source(work_dir: Path, files: int, seed: int = 29) -> tuple[Path, Path, int]:
    """Build (once per size) the tar archive and its unpacked copy on the local disk;
    return (archive, source directory, total bytes)."""
    base = work_dir / f"tree-{files}"
    archive, source = base / "tree.tar", base / "src"
    layout = dataset_layout(files)
    total = sum(size for _, size in layout)
    if archive.exists() and source.is_dir():
        return archive, source, total
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    rng = random.Random(seed)
    pool = rng.randbytes(1 << 20) * 2
    now = int(time.time())
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        made: set[str] = set()
        for rel, size in layout:
            parts = rel.split("/")
            for depth in range(1, len(parts)):
                d = "/".join(parts[:depth])
                if d not in made:
                    made.add(d)
                    info = tarfile.TarInfo(d)
                    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, now
                    tar.addfile(info)
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime = size, 0o644, now
            off = rng.randrange(len(pool) // 2)
            tar.addfile(info, io.BytesIO(pool[off:off + size]))
    source.mkdir()
    subprocess.run(["tar", "-C", str(source), "-xf", str(archive)], check=True)
    return archive, source, total


def sync_root(root: Path) -> None:
    """sync(2), then fsync of the mount root (FUSE does not pass sync(2) on)."""
    os.sync()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sh(cmd: str) -> None:
    subprocess.run(cmd, shell=True, check=True, stdout=subprocess.DEVNULL)


def steps(root: Path, archive: Path, source: Path) -> list[tuple[str, str, int]]:
    """(name, shell command, files it touches as a multiple of the tree) per workload."""
    q = {k: str(v) for k, v in {"root": root, "archive": archive, "src": source}.items()}
    return [
        ("untar", f"mkdir -p {q['root']}/untar && tar -C {q['root']}/untar -xf {q['archive']}",
         1),
        ("cp_a", f"cp -a {q['root']}/untar {q['root']}/cp_a", 1),
        ("find_stat", f"find {q['root']}/untar -print0 | xargs -0 stat > /dev/null", 1),
        ("du", f"du -s {q['root']}/untar", 1),
        ("rsync", f"rsync -a {q['src']}/ {q['root']}/rsync/", 1),
        ("rm_rf", f"rm -rf {q['root']}/untar {q['root']}/cp_a {q['root']}/rsync", 3),
    ]


#: Programs each step runs. make_source unpacks the source tree with tar, a step run
#: alone unpacks the tree it works on first, rm_rf makes the copies it removes.
STEP_TOOLS: dict[str, tuple[str, ...]] = {
    "untar": ("tar", "mkdir"),
    "cp_a": ("tar", "mkdir", "cp"),
    "find_stat": ("tar", "mkdir", "find", "xargs", "stat"),
    "du": ("tar", "mkdir", "du"),
    "rsync": ("tar", "rsync"),
    "rm_rf": ("tar", "mkdir", "cp", "rsync", "rm"),
}

#: Workloads that write and so end with a sync; warm ones get an untimed pass first.
SYNCED = {"untar", "cp_a", "rsync", "rm_rf"}
WARMED = {"find_stat", "du"}


def run_step(contender: Any, name: str, cmd: str, files: int) -> dict[str, Any]:
    """Run one workload on the mounted contender; seconds, files/s and the census."""
    root = Path(contender.root)
    if name in WARMED:
        _sh(cmd)
    before, cpu0 = contender.census(), contender.daemon_cpu_s()
    start = time.perf_counter()
    _sh(cmd)
    if name in SYNCED:
        sync_root(root)
    seconds = time.perf_counter() - start
    fig: dict[str, Any] = {"seconds": round(seconds, 3), "files_per_s": files / seconds}
    fig.update(per_file(census_delta(before, contender.census()), files,
                        cpu_delta(cpu0, contender.daemon_cpu_s())))
    return fig
