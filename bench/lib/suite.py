"""Run every workload on every contender, repetitions interleaved, and collect figures.

Each repetition mounts every contender fresh (new backing file, new
filesystem) and runs the selected workloads on it in the order of WORKLOADS,
so repetition k of every contender sees the same history. A failure is
recorded against its workload and contender and the run goes on; only a
contender whose setup fails in the first repetition is dropped for the rest.
"""

from __future__ import annotations

import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import profile, torch_jobs, tree, workloads
from .contenders import Contender
from .util import BenchError, prewarm_memory, summarize
from .workloads import Config, SkipWorkload


@dataclass(frozen=True, slots=True)
class Workload:
    """One row group of the report: how to run it and which figure ranks it."""

    name: str
    title: str
    func: Callable[[Contender, Config], dict[str, object]]
    primary: str
    higher_is_better: bool = True
    #: External programs it runs (bench/lib/tools.py checks them before a run).
    tools: tuple[str, ...] = ()


_FIO = ("fio",)

WORKLOADS: tuple[Workload, ...] = (
    Workload("seq_write", "checkpoint write: fio seq write 1 MiB + fsync", workloads.seq_write,
             "MiB/s", tools=_FIO),
    Workload("seq_read", "checkpoint restore: fio seq read 1 MiB, cold", workloads.seq_read,
             "MiB/s", tools=_FIO),
    Workload("randread_4k_qd1", "dataset: 4 KiB random read QD1", workloads.make_randread(
        "4k", 1), "IOPS", tools=_FIO),
    Workload("randread_4k_qd16", "dataset: 4 KiB random read QD16",
             workloads.make_randread("4k", 16), "IOPS", tools=_FIO),
    Workload("randread_128k_qd1", "dataset: 128 KiB random read QD1",
             workloads.make_randread("128k", 1), "MiB/s", tools=_FIO),
    Workload("randread_128k_qd16", "dataset: 128 KiB random read QD16",
             workloads.make_randread("128k", 16), "MiB/s", tools=_FIO),
    Workload("contention", "contention: 4 KiB QD16 read p99 during checkpoint write",
             workloads.contention, "busy_p99_us", higher_is_better=False, tools=_FIO),
    Workload("contention_paced", "contention: paced 4 KiB reader (half of zonefs-py's QD16 "
             "IOPS), p99 during checkpoint write", workloads.contention_paced, "busy_p99_us",
             higher_is_better=False, tools=_FIO),
    Workload("torch_save", "checkpoint write: torch.save via temp + fsync + rename",
             torch_jobs.torch_save, "MiB/s"),
    Workload("dcp_save", "checkpoint write: torch.distributed.checkpoint save, 2 ranks, "
             "fsynced", torch_jobs.dcp_save, "MiB/s"),
    Workload("torch_load", "checkpoint restore: torch.load, cold", torch_jobs.torch_load,
             "MiB/s"),
    Workload("dataloader_shards", "dataset: DataLoader epoch, shard files",
             torch_jobs.dataloader_shards, "samples/s"),
    Workload("dataloader_files", "dataset: DataLoader epoch, one file per sample",
             torch_jobs.dataloader_files, "samples/s"),
    Workload("meta_create", "metadata: create small files", workloads.meta_create, "ops/s"),
    Workload("meta_stat", "metadata: stat small files, cold", workloads.meta_stat, "ops/s"),
    Workload("meta_unlink", "metadata: unlink small files", workloads.meta_unlink, "ops/s"),
    *(Workload(f"tree_{step}", f"dataset tree: {title}", workloads.make_tree_workload(step),
               "files/s", tools=tree.STEP_TOOLS[step]) for step, title in (
        ("untar", "tar -xf of the tree (+ sync)"), ("cp_a", "cp -a of the tree (+ sync)"),
        ("find_stat", "find | xargs stat, warm"), ("du", "du -s, warm"),
        ("rsync", "rsync -a from local disk (+ sync)"),
        ("rm_rf", "rm -rf of the three copies (+ sync)"))),
)

#: Workloads that read seq.bin; if seq_write is not selected it is laid out untimed.
_READS_SEQ_FILE = {"seq_read", "randread_4k_qd1", "randread_4k_qd16", "randread_128k_qd1",
                   "randread_128k_qd16", "contention", "contention_paced"}
#: Workloads that need the metadata files created by meta_create.
_NEEDS_META = {"meta_stat", "meta_unlink"}


def log(message: str) -> None:
    """Print a timestamped progress line to stderr."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _numeric_delta(before: dict[str, Any] | None, after: dict[str, Any] | None
                   ) -> dict[str, float]:
    """Return after - before for top-level numeric counters.

    A counter that went backwards was rebuilt by a remount inside the workload
    (cold reads remount zonefs-py); its delta is unknown and left out (n/a).
    """
    if not after or not before:
        return {}
    delta: dict[str, float] = {}
    for key, value in after.items():
        prev = before.get(key)
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (value, prev)):
            continue
        if value >= prev:
            delta[key] = value - prev
    user = delta.get("user_bytes_written")
    device = delta.get("device_bytes_written")
    if user and device is not None:
        delta["workload_write_amplification"] = device / user
    return delta


def _run_one(workload: Workload, contender: Contender, cfg: Config) -> dict[str, object]:
    """Run one workload once; return its figures or {"_skipped"|"_error": reason}."""
    reason = contender.unsupported.get(workload.name)
    if reason:
        return {"_skipped": reason}
    prewarm_memory(cfg.prewarm_gib)
    stats_before = contender.fs_stats() if cfg.zonefs_stats else None
    cpu_before = contender.daemon_cpu_s()
    started = time.perf_counter()
    try:
        with _profiled(workload, contender, cfg) as graphs:
            figures = workload.func(contender, cfg)
        if graphs:
            figures["_profiles"] = [str(g) for g in graphs]
    except SkipWorkload as exc:
        return {"_skipped": str(exc)}
    except (BenchError, OSError, RuntimeError, ValueError, subprocess.SubprocessError) as exc:
        # (a tree_* step's shell command failing is a CalledProcessError: this
        # workload's error, not the end of the run)
        log(f"  {workload.name} on {contender.key} FAILED: {exc}")
        return {"_error": f"{type(exc).__name__}: {exc}"[:500],
                "_traceback": traceback.format_exc(limit=4)[-1500:]}
    figures["_seconds"] = time.perf_counter() - started
    cpu_after = contender.daemon_cpu_s()
    if cpu_before is not None and cpu_after is not None:
        _add_cpu_figures(figures, cpu_after - cpu_before)
    if stats_before is not None:
        stats_after = contender.fs_stats()
        figures["_fs_stats"] = {"after": stats_after,
                                "delta": _numeric_delta(stats_before, stats_after)}
        share = c_read_share(stats_before, stats_after)
        if share is not None:
            figures["c_read_share"] = share
    return figures


def c_read_share(before: dict[str, Any] | None, after: dict[str, Any] | None
                 ) -> float | None:
    """READs zonefs-py's data plane answered in C over every READ it got during the
    workload (the census's READ count includes the C ones); after a remount inside
    the workload (cold reads) the counters start again: the READs since it. None
    without the data plane or without READs."""
    if not after:
        return None
    dp1, req1 = after.get("dataplane") or {}, after.get("requests") or {}
    dp0 = (before or {}).get("dataplane") or {}
    req0 = (before or {}).get("requests") or {}
    if "reads_c" not in dp1:
        return None
    c_reads, reads = dp1["reads_c"], req1.get("READ", 0)
    c0, r0 = dp0.get("reads_c"), req0.get("READ", 0)
    # the same mount (no counter went back, the Python READs neither): deltas
    if c0 is not None and c0 <= c_reads and r0 <= reads and r0 - c0 <= reads - c_reads:
        c_reads -= dp0["reads_c"]
        reads -= req0.get("READ", 0)
    if reads <= 0 or not 0 <= c_reads <= reads:
        return None
    return c_reads / reads


#: The contenders `--profile` records: the subject and the ceiling it is judged by.
PROFILED = ("ceiling", "zonefs", "zonefs-b")


def _profiled(workload: Workload, contender: Contender, cfg: Config
              ) -> AbstractContextManager[list[Path]]:
    """py-spy recordings of the contender's servers during the workload (`--profile`)."""
    pid_of = getattr(contender, "daemon_pid", None)
    if not cfg.profile_dir or contender.key not in PROFILED or pid_of is None:
        return nullcontext([])
    out = Path(cfg.profile_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{workload.name}-{contender.key}"
    if contender.key == "ceiling":
        return profile.recording(pid_of, stem)
    return _both(profile.recording(pid_of, stem), profile.perf_recording(pid_of, stem))


@contextmanager
def _both(spy: AbstractContextManager[list[Path]],
          perf: AbstractContextManager[list[Path]]) -> Iterator[list[Path]]:
    """py-spy of the daemon and perf of its dispatcher thread, one list of files."""
    files: list[Path] = []
    with spy as graphs, perf as reports:
        yield files
    files += graphs + reports


def _add_cpu_figures(figures: dict[str, object], cpu_s: float) -> None:
    """Add the FUSE daemon's CPU seconds over the workload, per GiB moved and per
    application I/O request (fio I/Os, samples, files) where the workload counted them."""
    figures["daemon_cpu_s"] = cpu_s
    io_bytes = figures.get("_io_bytes")
    if isinstance(io_bytes, int) and io_bytes > 0:
        figures["daemon_cpu_s/GiB"] = cpu_s / (io_bytes / (1 << 30))
    requests = figures.get("_io_requests")
    if isinstance(requests, int) and requests > 0:
        figures["daemon_cpu_us/req"] = cpu_s / requests * 1e6


def _calibrate(contenders: list[Contender], cfg: Config, size: int) -> None:
    """Set cfg.paced_read_iops from zonefs-py's 4 KiB QD16 random reads (own fresh mount)."""
    zonefs = next((c for c in contenders if c.key == "zonefs"), None)
    if zonefs is None or zonefs.unavailable_reason() is not None:
        log("contention_paced: no zonefs-py contender to calibrate the read rate on")
        return
    log("contention_paced: calibrating the read rate on zonefs-py (randread_4k_qd16 / 2)")
    try:
        with zonefs.mounted(size):
            _lay_out_seq_file(zonefs, cfg)
            zonefs.make_cold()
            cfg.paced_read_iops = workloads.calibrate_paced_rate(zonefs, cfg)
    except (BenchError, OSError) as exc:
        log(f"contention_paced: calibration failed: {exc}")
        return
    log(f"contention_paced: {cfg.paced_read_iops} reads/s for every contender")


def _lay_out_seq_file(contender: Contender, cfg: Config) -> None:
    try:
        workloads.seq_write(contender, cfg)
    except BenchError as exc:
        log(f"  laying out seq.bin on {contender.key} failed: {exc}")


def run_suite(contenders: list[Contender], cfg: Config, selected: list[Workload]
              ) -> dict[str, Any]:
    """Run `selected` workloads on the available `contenders`; return the raw results."""
    status: dict[str, dict[str, Any]] = {}
    for contender in contenders:
        reason = contender.unavailable_reason()
        status[contender.key] = {"label": contender.label, "available": reason is None,
                                 "reason": reason}
        if reason:
            log(f"{contender.key}: unavailable: {reason}")
    reps: dict[str, dict[str, list[dict[str, object]]]] = {
        w.name: {c.key: [] for c in contenders} for w in selected}
    names = {w.name for w in selected}
    size = cfg.backing_bytes()
    interrupted = False
    try:
        if "contention_paced" in names and not cfg.paced_read_iops:
            _calibrate(contenders, cfg, size)
        _run_reps(contenders, cfg, selected, status, reps, names, size)
    except KeyboardInterrupt:
        # Mounts and loop devices are already torn down by the context managers.
        log("interrupted: reporting the repetitions finished so far")
        interrupted = True
    return {"contenders": status, "workloads": _summarise(selected, reps),
            "interrupted": interrupted}


def _run_reps(contenders: list[Contender], cfg: Config, selected: list[Workload],
              status: dict[str, dict[str, Any]],
              reps: dict[str, dict[str, list[dict[str, object]]]], names: set[str],
              size: int) -> None:
    """Run the repetitions, appending each workload's figures to `reps`."""
    for rep in range(cfg.reps):
        for contender in contenders:
            if not status[contender.key]["available"]:
                continue
            log(f"rep {rep + 1}/{cfg.reps}: {contender.key}: setting up "
                f"{size >> 30} GiB backing store")
            try:
                with contender.mounted(size):
                    if names & _READS_SEQ_FILE and "seq_write" not in names:
                        _lay_out_seq_file(contender, cfg)
                    if names & _NEEDS_META and "meta_create" not in names:
                        workloads.meta_create(contender, cfg)
                    for workload in selected:
                        log(f"rep {rep + 1}: {contender.key}: {workload.name}")
                        figures = _run_one(workload, contender, cfg)
                        reps[workload.name][contender.key].append(figures)
            except (BenchError, OSError) as exc:
                log(f"rep {rep + 1}: {contender.key}: setup/teardown failed: {exc}")
                if rep == 0 and not any(reps[w.name][contender.key] for w in selected):
                    status[contender.key].update(available=False, reason=str(exc)[:500])
                else:
                    status[contender.key].setdefault("errors", []).append(str(exc)[:500])


def _summarise(selected: list[Workload], reps: dict[str, dict[str, list[dict[str, object]]]]
               ) -> dict[str, Any]:
    """Reduce per-repetition figures to median/min/max per metric."""
    out: dict[str, Any] = {}
    for workload in selected:
        per_contender: dict[str, Any] = {}
        for key, runs in reps[workload.name].items():
            entry: dict[str, Any] = {"reps": runs}
            ok = [r for r in runs if "_error" not in r and "_skipped" not in r]
            metrics = sorted({m for r in ok for m, v in r.items()
                              if not m.startswith("_") and isinstance(v, float)})
            entry["summary"] = {m: summarize([float(r[m]) for r in ok if m in r])  # type: ignore[arg-type]
                                for m in metrics}
            skipped = {str(r["_skipped"]) for r in runs if "_skipped" in r}
            errors = [str(r["_error"]) for r in runs if "_error" in r]
            if skipped:
                entry["skipped"] = "; ".join(sorted(skipped))
            if errors:
                entry["errors"] = errors
            per_contender[key] = entry
        out[workload.name] = {"title": workload.title, "primary": workload.primary,
                              "higher_is_better": workload.higher_is_better,
                              "results": per_contender}
    return out
