"""PNG plots of a report: throughput bars per workload and contention latency CDFs.

matplotlib is imported lazily with the Agg backend; without it `make_plots`
returns no files and the report says the plots were skipped.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

#: One colour per contender, stable across plots.
COLOURS = {"physical": "#7f7f7f", "ceiling": "#1f77b4", "peer": "#ff7f0e", "ext4": "#2ca02c",
           "zonefs": "#d62728", "zonefs-guest": "#9467bd", "zonefs-b": "#8c564b"}
SHORT = {"physical": "physical", "ceiling": "FUSE ceiling", "peer": "FUSE peer",
         "ext4": "ext4/loop", "zonefs": "zonefs-py", "zonefs-guest": "zonefs-py (guest)",
         "zonefs-b": "zonefs-py (B)"}


#: Percentile range and ticks of the CDF plots (logit scale cannot show 0 or 1).
_Y_MIN, _Y_MAX = 0.01, 0.9999
_Y_TICKS = (0.1, 0.5, 0.9, 0.99, 0.999)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(results: dict[str, Any], path: Path) -> bool:
    """Draw one bar chart per workload (median, min–max whiskers); return False if empty."""
    plt = _pyplot()
    names = [n for n, wl in results["workloads"].items() if wl["higher_is_better"]]
    if not names:
        return False
    keys = list(results["contenders"])
    ncols = min(4, len(names))
    nrows = math.ceil(len(names) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        wl = results["workloads"][name]
        for idx, key in enumerate(keys):
            summary = wl["results"].get(key, {}).get("summary", {}).get(wl["primary"])
            if not summary:
                available = results["contenders"][key]["available"]
                ax.text(idx, 0.02, "n/a" if available else "unavailable", rotation=90,
                        ha="center", va="bottom", fontsize=7, color="#555",
                        transform=ax.get_xaxis_transform())
                continue
            med = summary["median"]
            err = [[med - summary["min"]], [summary["max"] - med]]
            ax.bar(idx, med, color=COLOURS.get(key, "#333"), yerr=err, capsize=3)
            # Label above the max whisker so it never collides with the error bar.
            ax.text(idx, summary["max"], f"{med:,.0f}" if med >= 10 else f"{med:.2f}",
                    ha="center", va="bottom", fontsize=7)
        ax.set_title(f"{name} ({wl['primary']})", fontsize=9)
        ax.set_ylabel(wl["primary"], fontsize=8)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([SHORT.get(k, k) for k in keys], rotation=30, ha="right",
                           fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
        ax.margins(y=0.15)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    mode = "quick" if results["config"]["quick"] else "full"
    fig.suptitle(f"zonefs-py benchmark ({mode}), {results['date']} on "
                 f"{results['machine']['host']}: median of {results['config']['reps']}, "
                 "whiskers min–max, higher is better", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def plot_contention(results: dict[str, Any], path: Path) -> bool:
    """Draw read latency CDFs alone vs during a checkpoint write; return False if no data."""
    plt = _pyplot()
    wl = results["workloads"].get("contention")
    if not wl:
        return False
    series = []
    for key, entry in wl["results"].items():
        runs = [r for r in entry["reps"] if r.get("_cdf_alone") and r.get("_cdf_busy")]
        if runs:
            series.append((key, runs[-1]))
    if not series:
        return False
    ncols = min(3, len(series))
    nrows = math.ceil(len(series) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows), squeeze=False)
    for ax, (key, run) in zip(axes.flat, series, strict=False):
        for label, cdf_key, style in (("reads alone", "_cdf_alone", "--"),
                                      ("during checkpoint write", "_cdf_busy", "-")):
            xs = [p[0] for p in run[cdf_key]]
            ys = [min(max(p[1], _Y_MIN), _Y_MAX) for p in run[cdf_key]]
            ax.step(xs, ys, style, where="post", color=COLOURS.get(key, "#333"), label=label)
        ax.set_xscale("log")
        # Logit scale: the tail (p99, p99.9) gets as much room as the median.
        ax.set_yscale("logit")
        ax.set_ylim(_Y_MIN, _Y_MAX)
        ax.set_yticks(_Y_TICKS, [f"p{t * 100:g}" for t in _Y_TICKS])
        ax.minorticks_off()
        for tick in (0.99, 0.999):
            ax.axhline(tick, color="#999", linewidth=0.6)
        ax.set_title(f"{SHORT.get(key, key)}: p99 {run['alone_p99_us']:,.0f} → "
                     f"{run['busy_p99_us']:,.0f} µs", fontsize=9)
        ax.set_xlabel("read completion latency (µs, log)", fontsize=8)
        ax.set_ylabel("percentile of reads", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    for ax in list(axes.flat)[len(series):]:
        ax.axis("off")
    fig.suptitle("4 KiB random reads QD16: latency CDF alone vs while a checkpoint writer "
                 "writes at full speed (last repetition)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def make_plots(results: dict[str, Any], out_dir: Path, stem: str) -> tuple[list[str], str | None]:
    """Write the PNGs next to the report; return their file names and a skip reason."""
    try:
        _pyplot()
    except ImportError as exc:
        return [], f"matplotlib not installed ({exc}): no plots"
    files = []
    for suffix, func in (("throughput", plot_throughput), ("contention", plot_contention)):
        path = out_dir / f"{stem}-{suffix}.png"
        if func(results, path):
            files.append(path.name)
    return files, None
