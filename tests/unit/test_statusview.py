"""The views of the status document: the one-screen summary, `--watch` rates, the flags."""

from __future__ import annotations

import argparse
import copy
from typing import Any

import pytest

from zonefs_py import statusview
from zonefs_py.cli import stat as stat_cli
from zonefs_py.fs.latency import Histogram
from zonefs_py.statusview import human_bytes


def _latency(values_ns: list[int]) -> dict[str, Any]:
    h = Histogram()
    for ns in values_ns:
        h.record(ns)
    return h.summary()


def sample_doc() -> dict[str, Any]:
    """A status document as a busy daemon sends it (long paths and errors included)."""
    return {
        "device": {"path": "/dev/disk/by-id/nvme-WDC_ZN540_" + "x" * 40, "kind": "block",
                   "block_size": 4096, "zone_size": 1 << 30, "nr_zones": 3688,
                   "max_open_zones": 14, "max_active_zones": 14, "zone_append": True},
        "filesystem": {"uuid": "d695addc-3bf6-4caf-a4bc-42373ffe29cf", "label": "scratch",
                       "read_only": False, "failsafe": None, "inodes": 123456},
        "zones_by_condition": {"EMPTY": 3000, "FULL": 600, "CLOSED": 80, "IMPLICIT_OPEN": 8},
        "zones_by_role": {"data": 3576, "meta": 110, "superblock": 2},
        "space": {"capacity_bytes": 3576 << 30, "reserve_bytes": 100 << 30,
                  "live_bytes": 600 << 30, "free_bytes": 2800 << 30, "dead_bytes": 70 << 30,
                  "wasted_by_finish_bytes": 0,
                  "dead_zones": {"awaiting_commit": 3, "write_head": 1}},
        "user_bytes_written": 900 << 30, "user_bytes_read": 5 << 40,
        "device_bytes_written": 1000 << 30, "data_bytes_written": 930 << 30,
        "metadata_bytes_written": 20 << 30, "cleaner_bytes_copied": 50 << 30,
        "padding_bytes": 0, "write_amplification": 1.1111,
        "cleaner": {"policy": "cost-benefit", "rate_mb_s": 64.0, "running": True,
                    "low_watermark_zones": 360, "zones_cleaned": 51,
                    "bytes_copied_this_mount": 50 << 30, "background_passes": 51,
                    "foreground_passes": 0, "reserve_zones": 100, "empty_zones": 300},
        "journal": {"commits": 9000, "checkpoints": 12, "meta_zones_free": 80,
                    "meta_zones": 110, "broken": None},
        "latency": {"read": _latency([100_000] * 99 + [30_000_000]),
                    "write": _latency([2_000_000] * 10)},
        "drain": {"paused": False, "queue_files": 4, "queue_bytes": 8 << 30,
                  "lag_seconds": 754.2, "uploading": "/ckpt/step-100.pt",
                  "bytes_drained": 3 << 40, "files_drained": 1500, "files_evicted": 1400,
                  "errors": 2, "auth_error": None,
                  "last_error": "upload of /ckpt/step-99.pt: " + "connection reset " * 8},
        "daemon": {"pid": 4242, "uid": 0, "failsafe": None, "started": 1000.0,
                   "mountpoint": "/mnt/a-long-mount-point-name/for-training/job-" + "y" * 30,
                   "log_file": "/var/log/zonefs-py/" + "z" * 60 + ".log", "journal": False},
        "zone_map": "SSMM" + "D" * 600,
    }


def test_summary_fits_one_screen() -> None:
    doc = sample_doc()
    for variant in (doc, {**doc, "daemon": {**doc["daemon"], "failsafe": "device error " * 9}}):
        lines = statusview.summary_lines(variant, now=5000.0)
        assert len(lines) <= statusview.SUMMARY_LINES, "\n".join(lines)
        assert max(map(len, lines)) <= statusview.SUMMARY_COLUMNS, "\n".join(lines)


def test_summary_figures_are_the_documents() -> None:
    doc = sample_doc()
    text = " ".join(" ".join(statusview.summary_lines(doc, now=1000.0 + 3 * 3600 + 125))
                    .split())  # unwrapped
    space = doc["space"]
    for figure in (
        f"{human_bytes(space['capacity_bytes'])} for data: "
        f"{human_bytes(space['live_bytes'])} used (16.8%), "
        f"{human_bytes(space['free_bytes'])} free, {human_bytes(space['reserve_bytes'])} "
        "reserve",
        "write amplification 1.111 since mkfs",
        f"user {human_bytes(doc['user_bytes_written'])}",
        "3688: data 3576, meta 110, superblock 2 | empty 3000, full 600, closed 80, "
        "implicit_open 8",
        "cleaning, cost-benefit at 64.0 MB/s; 300 empty zones (cleans below 360)",
        "queue 4 files (8.0 GiB), lag 12m 34s",
        "1500 files drained (3.0 TiB)",
        "last error drain: upload of /ckpt/step-99.pt",
        "pid 4242, up 3h 2m",
        "read p50 115 us, p99 115 us (100 reads)",
        f"log {doc['daemon']['log_file']}",
        f"({doc['device']['kind']}, {human_bytes(3688 << 30)}: 3688 zones of 1.0 GiB",
    ):
        assert figure in text, (figure, text)


def test_summary_says_failsafe_and_journal_logging() -> None:
    doc = sample_doc()
    doc["daemon"].update(failsafe="device write failed", log_file=None, journal=True)
    text = "\n".join(statusview.summary_lines(doc))
    assert "READ-ONLY failsafe: device write failed" in text
    assert "the systemd journal" in text
    assert "zonefs-py on /mnt/" in text


def test_interval_figures() -> None:
    prev = sample_doc()
    cur = copy.deepcopy(prev)
    cur["user_bytes_written"] += 200 << 20
    cur["device_bytes_written"] += 210 << 20
    cur["user_bytes_read"] += 100 << 20
    cur["cleaner_bytes_copied"] += 10 << 20
    cur["drain"]["bytes_drained"] += 40 << 20
    cur["space"]["free_bytes"] -= 200 << 20
    cur["latency"]["read"] = _latency([100_000] * 99 + [30_000_000] + [50_000] * 1000
                                      + [4_000_000] * 20)
    cur["latency"]["write"] = _latency([2_000_000] * 210)
    f = statusview.interval_figures(prev, cur, 2.0)
    assert f["write_mib_s"] == 100.0
    assert f["read_mib_s"] == 50.0
    assert f["read_iops"] == 510.0
    assert f["write_iops"] == 100.0
    assert f["write_amplification"] == 1.05
    assert f["cleaner_mib_s"] == 5.0
    assert f["drain_mib_s"] == 20.0
    assert f["drain_queue_files"] == 4
    assert f["free_bytes"] == cur["space"]["free_bytes"]
    # 1020 new reads: 1000 at 50 us, 20 at 4 ms: the p99 is a 4 ms read (its bucket's edge).
    assert 4000 <= f["read_p99_us"] <= 4000 * 1.19
    # Without the log-linear buckets (an older daemon): the Prometheus bucket's bound.
    for doc in (prev, cur):
        del doc["latency"]["read"]["histogram"]["log_linear"]
    assert statusview.interval_figures(prev, cur, 2.0)["read_p99_us"] == 5000.0
    idle = statusview.interval_figures(cur, cur, 1.0)
    assert idle["read_p99_us"] is None and idle["write_amplification"] is None  # noqa: PT018
    line = statusview.watch_line({**idle, "time": "12:00:00"})
    assert len(line) == len(statusview.watch_header()) <= 100
    assert line.split()[:4] == ["12:00:00", "0.0", "0", "-"]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    stat_cli.register(sub)
    return parser.parse_args(["stat", "/mnt", *argv])


@pytest.mark.parametrize(("argv", "problem"), [
    (("--count", "3"), "--count needs --watch"),
    (("--watch", "0"), "positive"),
    (("--watch", "--format", "prometheus"), "--watch prints rates"),
    (("--all", "--json"), "--all is a text listing"),
    (("--json", "--format", "prometheus"), "exclude each other"),
    (("--zone-map", "/no/such/dir/z.png"), "no such directory"),
])
def test_flag_errors(argv: tuple[str, ...], problem: str) -> None:
    assert problem in (stat_cli.check_flags(_args(*argv)) or "")


def test_good_flags() -> None:
    for argv in ((), ("--all",), ("--json",), ("--watch",), ("--watch", "2", "--count", "3"),
                 ("--watch", "--json"), ("--format", "prometheus")):
        assert stat_cli.check_flags(_args(*argv)) is None, argv
    assert _args("--watch").watch == 1.0


def test_watch_repeats_the_header_every_screenful(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import os

    doc = sample_doc()
    monkeypatch.setattr(stat_cli, "read_status", lambda _mnt: doc)
    monkeypatch.setattr(stat_cli.time, "sleep", lambda _s: None)
    monkeypatch.setattr(stat_cli.shutil, "get_terminal_size",
                        lambda _fallback=None: os.terminal_size((100, 7)))
    assert stat_cli.watch("/mnt", doc, 1.0, 12) == 0
    lines = capsys.readouterr().out.splitlines()
    headers = [i for i, line in enumerate(lines) if line.split()[0] == "time"]
    assert headers == [0, 6, 12]  # 5 rows a screen of 7 lines (a header, a prompt)
    assert len(lines) == 15


def _tenant(zones: int, cap: int | None) -> dict[str, Any]:
    return {"declared": True, "tenant_id": zones, "zones_owned": zones, "zones_reserved": 2,
            "zones_max": cap, "bytes_stored": zones << 30,
            "device_bytes_written_users": 900 << 30, "device_bytes_written_cleaner": 5 << 30,
            "write_amplification": 1.0056, "zone_resets": 1234,
            "wear": {"max": 17, "mean": 3.25}}


def test_summary_lists_declared_tenants_one_line_each() -> None:
    doc = sample_doc()
    doc["tenants"] = {"plain-top": {"bytes_written": 5, "declared": False},
                      "ckpt": _tenant(12, 40), "data/shards": _tenant(30, None)}
    lines = statusview.summary_lines(doc, now=5000.0)
    assert len(lines) <= statusview.SUMMARY_LINES
    assert max(map(len, lines)) <= statusview.SUMMARY_COLUMNS
    at = next(i for i, line in enumerate(lines) if line.startswith("  tenants"))
    for word in ("own/min/max", "stored", "by users", "by cleaner", "WA", "resets", "wear"):
        assert word in lines[at]
    # The most zones first; undeclared top-level directories are not tenants here.
    assert lines[at + 1].split() == ["data/shards", "30/2/-", "30.0", "GiB", "900.0", "GiB",
                                     "5.0", "GiB", "1.01", "1234", "17/3.2"]
    assert lines[at + 2].split()[:2] == ["ckpt", "12/2/40"]
    assert lines[at + 3].startswith("  cleaner")
    assert "plain-top" not in "\n".join(lines)


def test_summary_cuts_many_tenants_and_still_fits_one_screen() -> None:
    doc = sample_doc()
    doc["tenants"] = {f"jobs/team-{i:03d}/ckpt-{i:03d}": _tenant(i + 1, 50) for i in range(40)}
    for variant in (doc, {**doc, "daemon": {**doc["daemon"], "failsafe": "device error " * 9}}):
        lines = statusview.summary_lines(variant, now=5000.0)
        assert len(lines) <= statusview.SUMMARY_LINES, "\n".join(lines)
        assert max(map(len, lines)) <= statusview.SUMMARY_COLUMNS, "\n".join(lines)
        shown = [line for line in lines if "/50 " in line]
        assert 1 <= len(shown) <= statusview.TENANTS_SHOWN
        assert f"+{40 - len(shown)} more (zonefs-py tenant list)" in "\n".join(lines)
        assert "jobs/te~9/ckpt-039" in shown[0]  # the most zones; a long path cut inside


def test_tenant_lines_without_room_say_how_many() -> None:
    doc = {"tenants": {"a": _tenant(1, None), "b": _tenant(2, None)}}
    assert statusview.tenant_lines(doc, room=2) == [
        "  tenants     2 declared (zonefs-py tenant list)"]
    assert statusview.tenant_lines(doc, room=0) == []
    assert statusview.tenant_lines({"tenants": {}}) == []
    assert len(statusview.tenant_lines(doc, room=3)) == 3
