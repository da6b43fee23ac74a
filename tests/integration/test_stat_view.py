"""`zonefs-py stat` for people: one screen by default, `--watch` rates, flag errors first."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from zonefs_py.statusview import human_bytes

from .conftest import ZONEFS, Mount, env, zonefs

pytestmark = pytest.mark.integration


def _quiet_doc(mnt: Path) -> dict:
    """The status once nothing changes between two reads (after a sync)."""
    os.sync()
    for _ in range(50):
        a = json.loads(zonefs("stat", str(mnt), "--json").stdout)
        b = json.loads(zonefs("stat", str(mnt), "--json").stdout)
        if a["space"] == b["space"] and a["user_bytes_written"] == b["user_bytes_written"]:
            return b
        time.sleep(0.2)
    pytest.fail("the status kept changing")


def test_default_is_one_screen_of_the_jsons_figures(mounted: Mount) -> None:
    for i in range(20):
        (mounted.path / f"f{i}").write_bytes(os.urandom(1 << 20))
    (mounted.path / "f0").read_bytes()
    doc = _quiet_doc(mounted.path)
    out = zonefs("stat", str(mounted.path)).stdout
    lines = out.splitlines()
    assert len(lines) <= 30, out
    assert max(map(len, lines)) <= 100, out
    flat = " ".join(out.split())
    space = doc["space"]
    for figure in (
        f"{human_bytes(space['capacity_bytes'])} for data: {human_bytes(space['live_bytes'])} "
        "used",
        f"{human_bytes(space['free_bytes'])} free, {human_bytes(space['reserve_bytes'])} reserve",
        f"write amplification {doc['write_amplification']:.3f} since mkfs",
        f"user {human_bytes(doc['user_bytes_written'])}, device "
        f"{human_bytes(doc['device_bytes_written'])}",
        f"zones {sum(doc['zones_by_role'].values())}: ",
        f"{doc['cleaner']['empty_zones']} empty zones",
        f"queue {doc['drain']['queue_files']} files",
        f"pid {doc['daemon']['pid']}",
        f"log {mounted.log}",
        "health ok",
        f"{doc['device']['path']} (emulated",
    ):
        assert figure in flat, (figure, out)
    for name, count in doc["zones_by_condition"].items():
        assert f"{name.lower()} {count}" in flat
    everything = zonefs("stat", "--all", str(mounted.path)).stdout
    assert "Zones by condition" in everything and "Zone map" in everything  # noqa: PT018
    assert len(everything.splitlines()) > 30


def _watch_rows(text: str) -> list[dict[str, str]]:
    """The rows of `--watch` output by column title (one word per cell)."""
    lines = text.splitlines()
    titles = [t.replace("_", " ") for t in lines[0].replace(" MiB/s", "_MiB/s")
              .replace(" IOPS", "_IOPS").replace(" p99", "_p99").replace(" queue", "_queue")
              .split()]
    return [dict(zip(titles, line.split(), strict=True)) for line in lines[1:]]


def test_watch_shows_the_write_rate(mounted: Mount) -> None:
    stop = threading.Event()

    def writer() -> None:
        with open(mounted.path / "stream", "wb") as f:
            while not stop.is_set():
                f.write(os.urandom(1 << 20))
                f.flush()
                os.fsync(f.fileno())
                time.sleep(0.02)

    t = threading.Thread(target=writer)
    t.start()
    try:
        proc = zonefs("stat", str(mounted.path), "--watch", "1", "--count", "3", timeout=60)
    finally:
        stop.set()
        t.join()
    rows = _watch_rows(proc.stdout)
    assert len(rows) == 3, proc.stdout
    assert max(float(r["wr MiB/s"]) for r in rows) > 0, proc.stdout
    assert max(float(r["wr IOPS"]) for r in rows) > 0, proc.stdout
    assert all(len(line) <= 100 for line in proc.stdout.splitlines())
    # Idle again: --watch's free space and rates are the document's.
    doc = _quiet_doc(mounted.path)
    line = json.loads(zonefs("stat", str(mounted.path), "--watch", "0.2", "--count", "1",
                             "--json").stdout)
    assert line["free_bytes"] == doc["space"]["free_bytes"]
    assert line["write_mib_s"] == 0.0
    assert line["drain_queue_files"] == doc["drain"]["queue_files"]
    text = zonefs("stat", str(mounted.path), "--watch", "0.2", "--count", "1").stdout
    assert _watch_rows(text)[0]["free"] == human_bytes(doc["space"]["free_bytes"]).replace(" ", "")


def test_watch_stops_cleanly_on_ctrl_c(mounted: Mount) -> None:
    # SIGINT at its default in the child: a shell without job control starts
    # background commands with it ignored, and a Python started so never raises
    # KeyboardInterrupt (the local CI run, started with `&`, met exactly that).
    proc = subprocess.Popen([*ZONEFS, "stat", str(mounted.path), "--watch", "0.2"], env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout is not None
    header = proc.stdout.readline()
    assert header.split()[0] == "time"
    assert proc.stdout.readline().strip()
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        # Never leave it running: its pipes and the process would be reported as
        # unraisable warnings in whichever later test the garbage collector runs in.
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"stat --watch still ran 60 s after SIGINT: {err[-2000:]}")
    assert proc.returncode == 0, err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [("--count", "3"), ("--watch", "0"), ("--all", "--json"),
                                  ("--watch", "--format", "prometheus")])
def test_flag_errors_come_before_any_output(mounted: Mount, argv: tuple[str, ...]) -> None:
    proc = zonefs("stat", str(mounted.path), *argv, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.startswith("zonefs-py stat: ")
