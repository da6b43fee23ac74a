"""Turn raw suite results into ratios, target verdicts, the JSON and the markdown report.

Ratios are ratios of medians of the workload's primary figure. For latency
figures (lower is better) the ratio is still contender / reference, so a
value below 1 is good there; the table says so.
"""

from __future__ import annotations

import math
from typing import Any

#: References every contender is compared with, in column order.
REFERENCES = ("ceiling", "peer", "ext4", "ext4plain", "physical")
#: zonefs-py contenders the targets are evaluated for (host emulator, guest null_blk).
TARGET_SUBJECTS = ("zonefs", "zonefs-guest")


def median(results: dict[str, Any], workload: str, contender: str,
           metric: str | None = None) -> float | None:
    """Return the median of `metric` (default: the workload's primary), or None."""
    wl = results["workloads"].get(workload)
    if wl is None:
        return None
    entry = wl["results"].get(contender)
    if not entry:
        return None
    summary = entry["summary"].get(metric or wl["primary"])
    if not summary or summary["n"] == 0 or math.isnan(summary["median"]):
        return None
    return float(summary["median"])


def add_ratios(results: dict[str, Any]) -> None:
    """Store, per workload and contender, the primary median divided by each reference's."""
    for name, wl in results["workloads"].items():
        for key, entry in wl["results"].items():
            mine = median(results, name, key)
            ratios: dict[str, float | None] = {}
            for ref in REFERENCES:
                theirs = median(results, name, ref)
                ratios[ref] = mine / theirs if mine is not None and theirs else None
            entry["ratios"] = ratios


def evaluate_targets(results: dict[str, Any]) -> None:
    """Evaluate the issue's targets for each zonefs-py contender present in the results."""
    targets: dict[str, list[dict[str, Any]]] = {}
    for subject in TARGET_SUBJECTS:
        if subject not in results["contenders"]:
            continue

        # Issue 27's targets: small I/O against the ceiling, large against ext4 on
        # loop (the ceiling allocates a fresh 1 MiB per request: slow on this VM).
        rows = [_cpu_row(results, subject, wl) for wl in CPU_TARGET_WORKLOADS]
        rows += [_ratio_to(results, subject, wl, refs, factor) for wl, refs, factor in (
            ("randread_4k_qd16", ("ceiling",), 0.7),
            ("randread_128k_qd16", ("ceiling", "ext4"), 0.7))]
        rows.append(_paced_row(results, subject))
        rows += [_ratio_to(results, subject, wl, refs, factor) for wl, refs, factor in (
            ("torch_load", ("ext4",), 1.0),
            ("dataloader_shards", ("ext4",), 1.0),
            ("dataloader_files", ("ceiling",), 0.8),
            ("seq_write", ("ext4",), 0.95),
            ("seq_read", ("ext4",), 0.95),
            ("torch_save", ("ext4",), 0.95),
            ("dcp_save", ("ext4",), 1.5))]
        ratio = median(results, "contention", subject, "p99_ratio")
        writer = median(results, "contention", subject, "writer_MiB/s")
        rows.append({"target": "contention (closed-loop QD16 reader) read p99 ≤ 2 × alone",
                     "value": ratio, "met": None if ratio is None else ratio <= 2.0,
                     "detail": "not measured" if ratio is None else
                     f"{ratio:.2f}x alone; writer {_fmt(writer)} MiB/s"})
        rows += _metadata_rows(results, subject)
        targets[subject] = rows
    results["targets"] = targets


def _metadata_rows(results: dict[str, Any], subject: str) -> list[dict[str, Any]]:
    """Issue 29's targets: metadata rates against the ceiling, requests per file."""
    rows = [_ratio_to(results, subject, wl, ("ceiling",), factor) for wl, factor in (
        ("meta_create", 0.8), ("meta_stat", 0.8), ("meta_unlink", 0.8),
        ("tree_untar", 0.8), ("tree_cp_a", 0.8), ("tree_rm_rf", 0.8),
        ("tree_find_stat", 1.0))]
    target = "meta_create: requests per created file ≤ ceiling's + 1"
    mine = median(results, "meta_create", subject, "req/file")
    theirs = median(results, "meta_create", "ceiling", "req/file")
    if mine is None or theirs is None:
        rows.append({"target": target, "value": None, "met": None, "detail": "not measured"})
    else:
        rows.append({"target": target, "value": mine, "met": mine <= theirs + 1,
                     "detail": f"{mine:.2f} vs {theirs:.2f}"})
    return rows


#: Workloads whose daemon CPU per request must stay within 1.5x the ceiling's.
CPU_TARGET_WORKLOADS = ("randread_4k_qd1", "randread_4k_qd16", "randread_128k_qd1",
                        "randread_128k_qd16", "dataloader_shards")


def _cpu_row(results: dict[str, Any], subject: str, workload: str) -> dict[str, Any]:
    """Daemon CPU per request of `workload` ≤ 1.5 × the ceiling's."""
    target = f"{workload}: daemon us/req ≤ 1.5 × ceiling's"
    mine = median(results, workload, subject, "daemon_cpu_us/req")
    ceiling = median(results, workload, "ceiling", "daemon_cpu_us/req")
    if mine is None or not ceiling:
        return {"target": target, "value": None, "met": None, "detail": "not measured"}
    ratio = mine / ceiling
    return {"target": target, "value": ratio, "met": ratio <= 1.5,
            "detail": f"{mine:.0f} us vs {ceiling:.0f} us: {ratio:.2f}x"}


def _paced_row(results: dict[str, Any], subject: str) -> dict[str, Any]:
    """contention_paced: p99 during the write ≤ 2 × alone and ≤ 5 ms, and the writer
    ≥ 0.7 × zonefs-py's own seq_write; met only when both halves are."""
    target = ("contention_paced: read p99 ≤ 2 × alone and ≤ 5 ms; writer ≥ 0.7 × "
              "zonefs-py seq_write")
    ratio = median(results, "contention_paced", subject, "p99_ratio")
    busy = median(results, "contention_paced", subject, "busy_p99_us")
    writer = median(results, "contention_paced", subject, "writer_MiB/s")
    seq = median(results, "seq_write", subject)
    if ratio is None or busy is None or writer is None:
        return {"target": target, "value": None, "met": None, "detail": "not measured"}
    achieved = median(results, "contention_paced", subject, "busy_achieved")
    latency_ok = ratio <= 2.0 and busy <= 5000
    writer_ratio = writer / seq if seq else None
    detail = (f"p99 {ratio:.2f}x alone, {busy / 1000:.2f} ms; writer {writer:.0f} MiB/s = "
              f"{'n/a' if writer_ratio is None else f'{writer_ratio:.2f}'} of seq_write; "
              f"reader achieved {_fmt(achieved)} of its rate")
    met = latency_ok and writer_ratio is not None and writer_ratio >= 0.7
    return {"target": target, "value": ratio, "met": met, "detail": detail}


def _ratio_to(results: dict[str, Any], subject: str, workload: str, refs: tuple[str, ...],
              factor: float) -> dict[str, Any]:
    """`workload` ≥ factor × the lowest median among `refs` (those measured)."""
    target = f"{workload} ≥ {factor} × " + (f"min({', '.join(refs)})" if len(refs) > 1
                                             else refs[0])
    mine = median(results, workload, subject)
    options = [(v, ref) for ref in refs if (v := median(results, workload, ref)) is not None]
    if mine is None or not options:
        return {"target": target, "value": None, "met": None, "detail": "not measured"}
    limit, ref = min(options)
    ratio = mine / limit
    return {"target": target, "value": ratio, "met": ratio >= factor,
            "detail": f"{ratio:.2f} of {ref}"}


def _cpu_table(results: dict[str, Any]) -> list[str]:
    """Daemon CPU per GiB and per request, for each FUSE contender that was measured."""
    keys = [k for k in ("ceiling", "peer", *TARGET_SUBJECTS, "zonefs-b")
            if k in results["contenders"]]
    header = ["workload"] + [f"{k} s/GiB" for k in keys] + [f"{k} µs/req" for k in keys]
    lines = ["## Daemon CPU (FUSE server process, user + system, medians)", "",
             "From /proc/PID/stat around each workload (mount-time recovery excluded); per "
             "GiB read + written and per application request (fio I/O, sample, file).", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    any_row = False
    for name in results["workloads"]:
        cells = [_fmt(median(results, name, k, "daemon_cpu_s/GiB")) for k in keys]
        cells += [_fmt(median(results, name, k, "daemon_cpu_us/req")) for k in keys]
        if any(c != "n/a" for c in cells):
            any_row = True
            lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return [*lines, ""] if any_row else []


# -- markdown --------------------------------------------------------------

def _fmt(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "n/a"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _fmt_summary(summary: dict[str, Any] | None) -> str:
    if not summary:
        return "n/a"
    if summary["n"] == 1:
        return _fmt(summary["median"])
    return f"{_fmt(summary['median'])} [{_fmt(summary['min'])}–{_fmt(summary['max'])}]"


def _fmt_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _verdict(met: bool | None) -> str:
    return "n/a" if met is None else ("✅ yes" if met else "❌ no")


#: Column order of secondary figures; anything else follows alphabetically.
_METRIC_ORDER = ("IOPS", "MiB/s", "samples/s", "ops/s", "seconds", "p50_us", "p99_us",
                 "p99.9_us", "alone_p50_us", "alone_p99_us", "alone_p99.9_us", "busy_p50_us",
                 "busy_p99_us", "busy_p99.9_us", "p99_ratio", "busy_IOPS", "writer_MiB/s",
                 "rate_IOPS", "alone_achieved", "busy_achieved", "daemon_cpu_s",
                 "daemon_cpu_s/GiB", "daemon_cpu_us/req")
#: Figures left out of the tables (still in the JSON).
_HIDDEN = {"alone_IOPS", "alone_MiB/s", "busy_MiB/s"}


def _metric_rank(metric: str) -> tuple[int, str]:
    return (_METRIC_ORDER.index(metric) if metric in _METRIC_ORDER else 99, metric)


def _status_cell(entry: dict[str, Any] | None, status: dict[str, Any]) -> str | None:
    if not status.get("available"):
        return "unavailable (see Contenders)"
    if entry is None:
        return "not run"
    if entry.get("skipped") and not entry["summary"]:
        return f"skipped: {entry['skipped']}"
    if entry.get("errors") and not entry["summary"]:
        return f"failed: {entry['errors'][0]}"
    return None


def _workload_table(results: dict[str, Any], name: str, wl: dict[str, Any]) -> list[str]:
    direction = "higher is better" if wl["higher_is_better"] else "lower is better"
    others = {m for entry in wl["results"].values() for m in entry["summary"]}
    others -= _HIDDEN | {wl["primary"]}
    metrics = [wl["primary"], *sorted(others, key=_metric_rank)]
    lines = [f"### {wl['title']} (`{name}`)", "",
             f"Primary figure: **{wl['primary']}** ({direction}); ratios are of medians.", ""]
    header = ["contender", *metrics, *(f"×{ref}" for ref in REFERENCES)]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, status in results["contenders"].items():
        entry = wl["results"].get(key)
        problem = _status_cell(entry, status)
        if problem is not None:
            cells = [problem] + [""] * (len(header) - 2)
        else:
            assert entry is not None
            cells = [_fmt_summary(entry["summary"].get(m)) for m in metrics]
            cells += [_fmt_ratio(entry.get("ratios", {}).get(ref)) for ref in REFERENCES]
        lines.append(f"| {status['label']} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def _summary_table(results: dict[str, Any]) -> list[str]:
    """One row per workload: every contender's primary median, then zonefs-py's ratios."""
    keys = [k for k, st in results["contenders"].items() if st["available"]]
    subject = next((k for k in TARGET_SUBJECTS if k in keys), None)
    header = ["workload", "figure", *keys]
    if subject:
        header += [f"{subject} ×{ref}" for ref in ("ceiling", "peer", "ext4")]
    lines = ["## Summary (medians; details and min–max below)", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, wl in results["workloads"].items():
        unit = wl["primary"] + ("" if wl["higher_is_better"] else " ↓")
        cells = [f"`{name}`", unit] + [_fmt(median(results, name, k)) for k in keys]
        if subject:
            ratios = wl["results"].get(subject, {}).get("ratios", {})
            cells += [_fmt_ratio(ratios.get(ref)) for ref in ("ceiling", "peer", "ext4")]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, "", "↓ lower is better.", ""]


def _fs_stats_table(results: dict[str, Any], subject: str) -> list[str]:
    keys = ("user_bytes_written", "device_bytes_written", "workload_write_amplification",
            "cleaner_bytes_copied")
    lines = [f"### zonefs-py counters per workload (`{subject}`, from `zonefs-py stat --json`, "
             "last repetition, deltas over the workload)", "",
             "| workload | user MiB | device MiB | write amplification | cleaner MiB copied "
             "| cumulative WA (stat) |", "|---|---|---|---|---|---|"]
    any_row = False
    for name, wl in results["workloads"].items():
        entry = wl["results"].get(subject)
        runs = [r for r in (entry or {}).get("reps", []) if "_fs_stats" in r]
        if not runs:
            continue
        any_row = True
        stats = runs[-1]["_fs_stats"]
        delta, after = stats.get("delta") or {}, stats.get("after") or {}
        cells = []
        for key in keys:
            value = delta.get(key)
            if value is None:
                cells.append("n/a")
            elif key.endswith("amplification"):
                cells.append(f"{value:.2f}")
            else:
                cells.append(f"{value / (1 << 20):,.1f}")
        wa = after.get("write_amplification")
        cells.append(f"{wa:.2f}" if isinstance(wa, int | float) else
                     ("n/a: " + str(after.get("error"))[:80] if "error" in after else "n/a"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return [*lines, ""] if any_row else []


def _load_line(results: dict[str, Any]) -> str:
    """Describe the machine's load around the run; warn when something else was busy."""
    load = results.get("loadavg")
    if not load:
        return "- **Load:** not recorded"
    cores = results["machine"]["cores"] or 1
    before, after = load["before"][0], load["after"][0]
    line = f"- **Load average (1 min):** {before:.2f} before, {after:.2f} after the run"
    if before > 0.5 * cores:
        line += (" — ⚠️ the machine was busy before the run started: other processes "
                 "shared the CPU and disk, so treat the figures as noisy")
    return line


def render_markdown(results: dict[str, Any], plot_files: list[str]) -> str:
    """Render the whole report as markdown."""
    m = results["machine"]
    cfg = results["config"]
    lines = [f"# zonefs-py benchmark: {results['date']} on {m['host']}", "",
             f"- **Mode:** {'--quick (smoke check: sizes too small for the numbers to mean much)' if cfg['quick'] else 'full'}; "  # noqa: E501
             f"{cfg['reps']} repetition(s) per figure (median [min–max] shown when > 1); "
             f"run took {results['duration_s'] / 60:.1f} min",
             f"- **Machine:** {m['cores']} cores ({m['cpu_model']}), "
             f"{m['memory_bytes'] / (1 << 30):.1f} GiB RAM, kernel {m['kernel']}, {m['os']}",
             _load_line(results),
             f"- **Backing store:** files under `{m['backing_store']['dir']}` "
             f"({m['backing_store']['fstype']} on {m['backing_store']['device']}); "
             f"{cfg['backing_bytes'] / (1 << 30):.0f} GiB per contender",
             f"- **Software:** Python {m['python']}, {m['fio']}, torch: "
             f"{results.get('torch') or 'not installed — torch workloads skipped'}, "
             f"zonefs-py commit {m['git_commit']}",
             f"- **Sizes:** seq {cfg['seq_bytes'] >> 20} MiB, contention writer "
             f"{cfg['contention_write_bytes'] >> 20} MiB, random reads "
             f"{cfg['randread_runtime_s']} s each, "
             f"torch state dict {cfg['torch_bytes'] >> 20} MiB, "
             f"{cfg['samples']:,} samples × {cfg['sample_bytes'] >> 10} KiB, "
             f"{cfg['meta_files']:,} small files", ""]
    lines += ["## Contenders", ""]
    for key, status in results["contenders"].items():
        state = "ok" if status["available"] else f"**unavailable: {status['reason']}**"
        lines.append(f"- `{key}`: {status['label']} — {state}")
    lines.append("")
    lines += ["## Targets", ""]
    if not results["targets"]:
        lines += ["No zonefs-py contender in this run: targets not evaluated.", ""]
    for subject, rows in results["targets"].items():
        label = results["contenders"][subject]["label"]
        lines += [f"**{label}**", "", "| target | measured | target met? |", "|---|---|---|"]
        for row in rows:
            lines.append(f"| {row['target']} | {row['detail']} | {_verdict(row['met'])} |")
        lines.append("")
    lines += _summary_table(results)
    lines += _cpu_table(results)
    lines += ["## Results", "",
              "×ceiling / ×peer / ×ext4 / ×ext4plain / ×physical: this contender's median "
              "over the reference's median for the primary figure (ext4: on a direct-I/O "
              "loop device, ext4plain: on a buffered one). `c_read_share`: READs answered "
              "in C by zonefs-py's data plane over all READs it got (since the remount "
              "where the workload remounts).", ""]
    for name, wl in results["workloads"].items():
        lines += _workload_table(results, name, wl)
    for subject in TARGET_SUBJECTS:
        if subject in results["contenders"]:
            lines += _fs_stats_table(results, subject)
    if plot_files:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plot_files] + [""]
    notes = _notes(results)
    if notes:
        lines += ["## Notes, skips and errors", "", *notes, ""]
    return "\n".join(lines)


def _notes(results: dict[str, Any]) -> list[str]:
    notes = list(results.get("notes", []))
    for name, wl in results["workloads"].items():
        for key, entry in wl["results"].items():
            for err in entry.get("errors", []):
                notes.append(f"- `{name}` on `{key}` failed: {err}")
            warnings = {r["_warning"] for r in entry["reps"] if "_warning" in r}
            # A writer starved by the reads (the contention run's bound hit) makes
            # the busy-read figures look good for the wrong reason: say so.
            warnings |= {"⚠️ " + r["_writer_note"] for r in entry["reps"]
                         if "_writer_note" in r}
            for warning in sorted(warnings):
                notes.append(f"- `{name}` on `{key}`: {warning}")
    return notes
