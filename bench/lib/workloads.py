"""Workloads: fio jobs, torch checkpoints, DataLoader epochs and metadata storms.

Each workload is a function `(contender, config) -> dict[str, object]` that
returns the figures of one repetition. Scalar figures are floats named with
their unit ("MiB/s", "p99_us"); keys starting with "_" carry attachments that
are not summarised (latency CDFs, zonefs-py counters). A workload that cannot
run on a contender raises `SkipWorkload` with the reason.

Caveats:
- Sequential writes are buffered with end_fsync=1 on filesystems (how
  checkpoint writers work) and O_DIRECT on the physical limit.
- Random reads use libaio with O_DIRECT everywhere, so QD16 really is QD16.
- Cold reads drop the kernel caches; zonefs-py is also remounted.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from . import tree
from .contenders import Contender
from .util import BenchError

MiB = 1 << 20
GiB = 1 << 30
#: Percentiles fio reports in the JSON (besides the full json+ histogram).
PERCENTILES = "50:90:99:99.9"


class SkipWorkload(Exception):
    """The workload does not apply to this contender or machine; the message says why."""


@dataclass(slots=True)
class Config:
    """Sizes and counts of one benchmark run (full or --quick)."""

    quick: bool
    reps: int
    seq_bytes: int
    contention_write_bytes: int
    randread_runtime_s: int
    torch_bytes: int
    samples: int
    sample_bytes: int
    shards: int
    meta_files: int
    meta_dirs: int
    #: Files of the dataset tree of the tree_* workloads (bench/lib/tree.py).
    tree_files: int = 20_000
    zonefs_stats: bool = True
    #: contention_paced's read rate: half of zonefs-py's randread_4k_qd16 IOPS in this
    #: run (calibrated at its start) or --paced-iops; 0 = not known.
    paced_read_iops: int = 0
    #: `--profile DIR`: py-spy flame graphs of the FUSE servers per workload (bench/lib/profile.py).
    profile_dir: str = ""
    #: `--prewarm-gib N`: fresh memory touched right before each workload
    #: (bench/lib/util.py `prewarm_memory`); 0 = none.
    prewarm_gib: float = 0.0

    @classmethod
    def full(cls) -> Config:
        """Return the sizes the issue asks for."""
        return cls(quick=False, reps=3, seq_bytes=2 * GiB, contention_write_bytes=2 * GiB,
                   randread_runtime_s=15, torch_bytes=1 * GiB, samples=10_000,
                   sample_bytes=32 << 10, shards=10, meta_files=100_000, meta_dirs=100,
                   tree_files=20_000)

    @classmethod
    def smoke(cls) -> Config:
        """Return the --quick sizes: checks that the suite works, not the numbers."""
        return cls(quick=True, reps=1, seq_bytes=128 * MiB, contention_write_bytes=128 * MiB,
                   randread_runtime_s=2, torch_bytes=64 * MiB, samples=1_000,
                   sample_bytes=32 << 10, shards=10, meta_files=2_000, meta_dirs=10,
                   tree_files=300)

    def backing_bytes(self) -> int:
        """Return the backing store size: every workload's data, 1.5x, plus 1 GiB for cleaning."""
        data = (self.seq_bytes + self.contention_write_bytes + self.torch_bytes
                + 2 * self.samples * self.sample_bytes + self.meta_files * 4096
                + 3 * self.tree_files * 12 * 1024)
        total = int(data * 1.5) + GiB
        return -(-total // GiB) * GiB

    def as_dict(self) -> dict[str, object]:
        """Return the configuration for the JSON report."""
        return asdict(self)


# -- fio -------------------------------------------------------------------

def run_fio(jobs: list[dict[str, str]], global_opts: dict[str, str] | None = None,
            timeout_s: float = 7200.0) -> dict[str, dict[str, object]]:
    """Run fio jobs (each a dict with "name") and return fio's JSON per job name.

    Raises BenchError when fio fails or a job reports an error.
    """
    cmd = ["fio", "--output-format=json+"]
    cmd += [f"--{k}={v}" for k, v in (global_opts or {}).items()]
    for job in jobs:
        cmd.append(f"--name={job['name']}")
        cmd += [f"--{k}={v}" for k, v in job.items() if k != "name"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"fio timed out after {timeout_s:.0f}s") from exc
    out = proc.stdout
    # fio may print warnings before the JSON document.
    start = out.find("{")
    try:
        data = json.loads(out[start:]) if start >= 0 else None
    except json.JSONDecodeError:
        data = None
    if proc.returncode != 0 or data is None:
        tail = " / ".join((proc.stderr.strip() or out.strip()).splitlines()[-3:])
        raise BenchError(f"fio exit {proc.returncode}: {tail}")
    result: dict[str, dict[str, object]] = {}
    for job in data["jobs"]:
        if job.get("error"):
            raise BenchError(f"fio job {job['jobname']}: error {job['error']}: "
                             f"{proc.stderr.strip()[-200:]}")
        result[job["jobname"]] = job
    return result


def _percentile_us(side: dict[str, object], pct: str) -> float:
    percentiles = side["clat_ns"].get("percentile", {})  # type: ignore[attr-defined]
    return float(percentiles.get(pct, float("nan"))) / 1000.0


def _cdf(side: dict[str, object], max_points: int = 150) -> list[list[float]]:
    """Return [[latency_us, cumulative_fraction], ...] from fio's json+ clat histogram."""
    bins = side["clat_ns"].get("bins") or {}  # type: ignore[attr-defined]
    points = sorted((int(ns), int(count)) for ns, count in bins.items())
    total = sum(count for _, count in points)
    if total == 0:
        return []
    cdf: list[list[float]] = []
    seen = 0
    step = max(1, len(points) // max_points)
    for idx, (ns, count) in enumerate(points):
        seen += count
        if idx % step == 0 or idx == len(points) - 1 or seen / total > 0.99:
            cdf.append([ns / 1000.0, seen / total])
    return cdf


def _read_figures(job: dict[str, object]) -> dict[str, float]:
    read = job["read"]
    return {
        "IOPS": float(read["iops"]),  # type: ignore[index]
        "MiB/s": float(read["bw_bytes"]) / MiB,  # type: ignore[index]
        "p50_us": _percentile_us(read, "50.000000"),  # type: ignore[arg-type]
        "p99_us": _percentile_us(read, "99.000000"),  # type: ignore[arg-type]
        "p99.9_us": _percentile_us(read, "99.900000"),  # type: ignore[arg-type]
    }


def _count_io(figures: dict[str, object], *jobs: dict[str, object]) -> None:
    """Add the jobs' bytes and I/O requests (both directions) to `_io_bytes`/`_io_requests`
    (the suite turns them into daemon CPU per GiB and per request)."""
    for job in jobs:
        for side in ("read", "write"):
            io = job[side]
            figures["_io_bytes"] = int(figures.get("_io_bytes", 0)) + int(io["io_bytes"])  # type: ignore[index,call-overload]
            figures["_io_requests"] = (int(figures.get("_io_requests", 0))  # type: ignore[call-overload]
                                       + int(io["total_ios"]))  # type: ignore[index]


def _cold(contender: Contender, figures: dict[str, object]) -> None:
    if not contender.make_cold():
        figures["_warning"] = "caches could not be dropped (not root?)"


def seq_write(contender: Contender, cfg: Config) -> dict[str, object]:
    """Write the checkpoint-sized file sequentially in 1 MiB blocks, then fsync."""
    job = {"name": "seq_write", "rw": "write", "bs": "1M", "end_fsync": "1",
           **contender.fio_target("seq.bin", cfg.seq_bytes)}
    if contender.fio_direct_writes():
        job["direct"] = "1"
    result = run_fio([job])["seq_write"]
    figures: dict[str, object] = {"MiB/s": float(result["write"]["bw_bytes"]) / MiB}  # type: ignore[index]
    _count_io(figures, result)
    return figures


def seq_read(contender: Contender, cfg: Config) -> dict[str, object]:
    """Read the checkpoint back sequentially in 1 MiB blocks from cold caches."""
    figures: dict[str, object] = {}
    _cold(contender, figures)
    job = {"name": "seq_read", "rw": "read", "bs": "1M",
           **contender.fio_target("seq.bin", cfg.seq_bytes)}
    result = run_fio([job])["seq_read"]
    figures["MiB/s"] = float(result["read"]["bw_bytes"]) / MiB  # type: ignore[index]
    _count_io(figures, result)
    return figures


def _randread_job(contender: Contender, cfg: Config, bs: str, qd: int,
                  runtime_s: int) -> dict[str, str]:
    return {"name": "randread", "rw": "randread", "bs": bs, "ioengine": "libaio",
            "iodepth": str(qd), "direct": "1", "time_based": "1",
            "runtime": str(runtime_s), "percentile_list": PERCENTILES,
            **contender.fio_target("seq.bin", cfg.seq_bytes)}


def make_randread(bs: str, qd: int) -> Callable[[Contender, Config], dict[str, object]]:
    """Return the random-read workload for one block size and queue depth."""
    def randread(contender: Contender, cfg: Config) -> dict[str, object]:
        figures: dict[str, object] = {}
        _cold(contender, figures)
        job = _randread_job(contender, cfg, bs, qd, cfg.randread_runtime_s)
        result = run_fio([job])["randread"]
        figures.update(_read_figures(result))
        _count_io(figures, result)
        return figures
    randread.__doc__ = f"Read {bs} blocks at random offsets, libaio QD{qd}, O_DIRECT."
    return randread


def contention(contender: Contender, cfg: Config) -> dict[str, object]:
    """Random 4 KiB QD16 reads alone, then while a checkpoint writer writes at full speed.

    The reader runs until the writer has written and fsynced its file (fio's
    exitall); the figures compare the read latency percentiles of both runs.
    The busy reader is bounded (30x the alone run, at least 120 s): a filesystem
    whose writeback is starved by the reads (seen with zonefs-py before it raised
    FUSE's max_background: the reader's async O_DIRECT requests held all 12
    background slots, the writer waited in balance_dirty_pages) would otherwise
    hang the suite. `_writer_completed` (in the JSON)
    says whether the writer finished within that bound.
    """
    return _contend(contender, cfg, None)


def contention_paced(contender: Contender, cfg: Config) -> dict[str, object]:
    """`contention` with an open-loop reader: 4 KiB reads at a fixed rate (fio rate_iops,
    Poisson arrivals, up to 16 in flight), the same rate for every contender.

    The rate (`cfg.paced_read_iops`) is half of zonefs-py's own randread_4k_qd16
    IOPS measured at the start of the run, so every contender can sustain it
    alone; a dataloader reads at the rate the GPUs consume, not flat out.
    Adds `rate_IOPS` (the target) and `alone_`/`busy_achieved` (achieved / target).
    """
    if not cfg.paced_read_iops:
        raise SkipWorkload("no paced read rate: zonefs-py's randread_4k_qd16 was not "
                           "calibrated in this run (pass --paced-iops N)")
    figures = _contend(contender, cfg, cfg.paced_read_iops)
    figures["rate_IOPS"] = float(cfg.paced_read_iops)
    for prefix in ("alone_", "busy_"):
        figures[prefix + "achieved"] = (figures[prefix + "IOPS"]  # type: ignore[operator]
                                        / cfg.paced_read_iops)
    return figures


def _contend(contender: Contender, cfg: Config, rate_iops: int | None) -> dict[str, object]:
    figures: dict[str, object] = {}
    _cold(contender, figures)
    reader = _randread_job(contender, cfg, "4k", 16, cfg.randread_runtime_s)
    if rate_iops:
        reader.update(rate_iops=str(rate_iops), rate_process="poisson")
    alone = run_fio([reader])["randread"]
    writer = {"name": "writer", "rw": "write", "bs": "1M", "end_fsync": "1",
              **contender.fio_target("contend.bin", cfg.contention_write_bytes)}
    if contender.fio_direct_writes():
        writer["direct"] = "1"
    cap_s = max(120, 30 * int(cfg.randread_runtime_s))
    busy_reader = {**reader, "runtime": str(cap_s)}
    busy = run_fio([busy_reader, writer], {"exitall": "1"})
    written = int(busy["writer"]["write"]["io_bytes"])  # type: ignore[index]
    figures["_writer_completed"] = written >= cfg.contention_write_bytes
    if not figures["_writer_completed"]:
        figures["_writer_note"] = (f"writer starved: {written / MiB:.0f} of "
                                  f"{cfg.contention_write_bytes / MiB:.0f} MiB written before "
                                  f"the reader stopped after {cap_s} s")
    for prefix, job in (("alone_", alone), ("busy_", busy["randread"])):
        for key, value in _read_figures(job).items():
            figures[prefix + key] = value
    figures["p99_ratio"] = figures["busy_p99_us"] / figures["alone_p99_us"]  # type: ignore[operator]
    figures["writer_MiB/s"] = float(busy["writer"]["write"]["bw_bytes"]) / MiB  # type: ignore[index]
    figures["_cdf_alone"] = _cdf(alone["read"])  # type: ignore[arg-type]
    figures["_cdf_busy"] = _cdf(busy["randread"]["read"])  # type: ignore[arg-type]
    _count_io(figures, alone, busy["randread"], busy["writer"])
    return figures


def calibrate_paced_rate(contender: Contender, cfg: Config) -> int:
    """Return half of the contender's 4 KiB QD16 random-read IOPS (a short fio run)."""
    job = _randread_job(contender, cfg, "4k", 16, cfg.randread_runtime_s)
    iops = float(run_fio([job])["randread"]["read"]["iops"])  # type: ignore[index]
    return max(1, int(iops / 2))


# -- metadata --------------------------------------------------------------

def _meta_paths(contender: Contender, cfg: Config) -> list[Path]:
    base = contender.root / "meta"
    per_dir = -(-cfg.meta_files // cfg.meta_dirs)
    return [base / f"d{idx // per_dir:04d}" / f"f{idx:07d}" for idx in range(cfg.meta_files)]


def _require_fs(contender: Contender) -> None:
    if not contender.is_filesystem:
        raise SkipWorkload("no filesystem: raw backing file")


def _census_figures(contender: Contender, before: dict[str, int] | None,
                    files: int) -> dict[str, object]:
    """`req/file` from the request census, where the contender counts requests."""
    got = tree.per_file(tree.census_delta(before, contender.census()), files)
    return {"req/file": float(got["requests_per_file"])} if got else {}


def make_tree_workload(step: str) -> Callable[[Contender, Config], dict[str, object]]:
    """A tree_* workload: one of bench/lib/tree.py's tools on the dataset tree (issue 29).

    The steps share one tree per mount, in the suite's order; a step whose input is
    missing (e.g. find_stat run alone) unpacks the tree first, untimed."""
    def run(contender: Contender, cfg: Config) -> dict[str, object]:
        _require_fs(contender)
        archive, source, _ = tree.make_source(contender.work_dir.parent / "tree-src",
                                              cfg.tree_files)
        root = contender.root / "tree"
        root.mkdir(exist_ok=True)
        by_name = {name: (cmd, mult) for name, cmd, mult in tree.steps(root, archive, source)}
        if step not in ("untar", "rsync") and not (root / "untar").exists():
            subprocess.run(by_name["untar"][0], shell=True, check=True)
        if step == "rm_rf":
            for name in ("cp_a", "rsync"):
                if not (root / name).exists():
                    subprocess.run(by_name[name][0], shell=True, check=True)
        cmd, mult = by_name[step]
        fig = tree.run_step(_CensusView(contender, root), step, cmd, cfg.tree_files * mult)
        out: dict[str, object] = {"files/s": float(fig["files_per_s"])}
        if "requests_per_file" in fig:
            out["req/file"] = float(fig["requests_per_file"])
        if "cpu_us_per_request" in fig:
            out["daemon_cpu_us/fuse_req"] = float(fig["cpu_us_per_request"])
        return out
    return run


class _CensusView:
    """A contender seen by tree.run_step: its census and CPU, a root of our choosing."""

    def __init__(self, contender: Contender, root: Path) -> None:
        self._c = contender
        self.root = root

    def census(self) -> dict[str, int] | None:
        return self._c.census()

    def daemon_cpu_s(self) -> float | None:
        return self._c.daemon_cpu_s()


def meta_create(contender: Contender, cfg: Config) -> dict[str, object]:
    """Create the small files (256 bytes each) in meta_dirs directories."""
    _require_fs(contender)
    paths = _meta_paths(contender, cfg)
    census0 = contender.census()
    payload = b"m" * 256
    start = time.perf_counter()
    made_dirs: set[Path] = set()
    for path in paths:
        if path.parent not in made_dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
            made_dirs.add(path.parent)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, payload)
        finally:
            os.close(fd)
    os.sync()
    return {"ops/s": len(paths) / (time.perf_counter() - start), "_io_requests": len(paths),
            **_census_figures(contender, census0, len(paths))}


def meta_stat(contender: Contender, cfg: Config) -> dict[str, object]:
    """Stat every small file once, from cold caches."""
    _require_fs(contender)
    figures: dict[str, object] = {}
    _cold(contender, figures)
    paths = _meta_paths(contender, cfg)
    start = time.perf_counter()
    for path in paths:
        os.stat(path)
    figures["ops/s"] = len(paths) / (time.perf_counter() - start)
    figures["_io_requests"] = len(paths)
    return figures


def meta_unlink(contender: Contender, cfg: Config) -> dict[str, object]:
    """Unlink every small file, then sync."""
    _require_fs(contender)
    paths = _meta_paths(contender, cfg)
    start = time.perf_counter()
    for path in paths:
        os.unlink(path)
    os.sync()
    return {"ops/s": len(paths) / (time.perf_counter() - start), "_io_requests": len(paths)}
