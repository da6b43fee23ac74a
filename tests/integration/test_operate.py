"""Operating a mount: a failed mount says so, logs land in a file, stat finds them,
Prometheus metrics (CLI, HTTP endpoint, textfile) and zone-map pictures."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from .conftest import (
    ZONEFS,
    daemon_mount,
    daemon_unmount,
    env,
    in_mount_table,
    wait_daemon_gone,
    zonefs,
)

pytestmark = pytest.mark.integration

TEST_HOOK = "ZONEFS_PY_MOUNT_TEST_FAIL"


@pytest.fixture
def mnt(workdir: Path) -> Path:
    path = workdir / "mnt"
    path.mkdir()
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("point", ["init", "tune"])
def test_failed_mount_exits_nonzero_and_logs_traceback(image: Path, mnt: Path, workdir: Path,
                                                       point: str) -> None:
    log = workdir / "daemon.log"
    proc = daemon_mount(image, mnt, log=log, extra_env={TEST_HOOK: point}, check=False)
    try:
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "injected failure" in proc.stderr, proc.stderr
        assert str(log) in proc.stderr, proc.stderr
        assert not in_mount_table(mnt), "a failed mount must not stay mounted"
        text = log.read_text()
        assert "Traceback (most recent call last)" in text, text
        assert "injected failure" in text
        # stat on the mount point that failed: names the daemon's last error and its log.
        st = zonefs("stat", str(mnt), check=False)
        assert st.returncode == 1
        assert "injected failure" in st.stderr, st.stderr
        assert str(log) in st.stderr, st.stderr
    finally:
        daemon_unmount(image, mnt)
    # Nothing was damaged: the next mount works.
    daemon_mount(image, mnt, log=log)
    daemon_unmount(image, mnt)


def test_stat_after_the_daemon_died(image: Path, mnt: Path, workdir: Path) -> None:
    import signal

    log = workdir / "daemon.log"
    daemon_mount(image, mnt, log=log)
    try:
        pid = json.loads(zonefs("stat", str(mnt), "--json").stdout)["daemon"]["pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while os.path.exists(f"/proc/{pid}"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(OSError) as err:
            os.statvfs(mnt)
        assert err.value.errno == 107  # ENOTCONN, as any FUSE mount whose daemon died
        st = zonefs("stat", str(mnt), check=False)
        assert st.returncode == 1
        assert "daemon is gone (ENOTCONN)" in st.stderr, st.stderr
        assert f"pid {pid} (exited while serving, without shutting down" in st.stderr
        assert str(log) in st.stderr
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], timeout=60)
        wait_daemon_gone(image)


def test_mount_error_before_forking_is_on_stderr(image: Path, mnt: Path, workdir: Path) -> None:
    proc = daemon_mount(image, mnt, log=workdir / "no-such-dir" / "sub" / "x.log",
                        check=False)  # the directory is created
    assert proc.returncode == 0, proc.stderr
    daemon_unmount(image, mnt)
    blocker = workdir / "file"
    blocker.write_text("")
    proc = daemon_mount(image, mnt, log=blocker / "x.log", check=False)
    assert proc.returncode == 1, proc.stderr
    assert "cannot open the log file" in proc.stderr
    assert not in_mount_table(mnt)


def test_default_log_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from zonefs_py.daemon.daemonize import default_log_file

    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert default_log_file("/dev/nvme0n2") == "/var/log/zonefs-py/nvme0n2.log"
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_log_file("/x/z.img") == str(tmp_path / "zonefs-py" / "z.img.log")
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", "/home/u")
    assert default_log_file("/x/z.img") == "/home/u/.local/state/zonefs-py/z.img.log"


# -- Prometheus ------------------------------------------------------------------------------

def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of a text exposition, keyed by (name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def write_files(mnt: Path, count: int, size: int, prefix: str = "f") -> None:
    for i in range(count):
        (mnt / f"{prefix}{i:04d}").write_bytes(os.urandom(size))


def test_stat_prometheus_equals_json(image: Path, mnt: Path, workdir: Path) -> None:
    daemon_mount(image, mnt, "commit=3600", log=workdir / "daemon.log")
    try:
        (mnt / "checkpoints").mkdir()
        write_files(mnt / "checkpoints", 3, 1 << 20)
        write_files(mnt, 5, 300_000)
        for i in range(3):
            (mnt / f"f{i:04d}").read_bytes()
        os.sync()
        doc = json.loads(zonefs("stat", str(mnt), "--json").stdout)
        samples = parse(zonefs("stat", str(mnt), "--format", "prometheus").stdout)
    finally:
        daemon_unmount(image, mnt)
    expect = {
        ("zonefs_capacity_bytes", ()): doc["space"]["capacity_bytes"],
        ("zonefs_used_bytes", ()): doc["space"]["live_bytes"],
        ("zonefs_free_bytes", ()): doc["space"]["free_bytes"],
        ("zonefs_reserve_bytes", ()): doc["space"]["reserve_bytes"],
        ("zonefs_user_written_bytes_total", ()): doc["user_bytes_written"],
        ("zonefs_data_written_bytes_total", ()): doc["data_bytes_written"],
        ("zonefs_metadata_written_bytes_total", ()): doc["metadata_bytes_written"],
        ("zonefs_cleaner_written_bytes_total", ()): doc["cleaner_bytes_copied"],
        ("zonefs_write_amplification_ratio", ()): doc["write_amplification"],
        ("zonefs_journal_commits_total", ()): doc["journal"]["commits"],
        ("zonefs_journal_checkpoints_total", ()): doc["journal"]["checkpoints"],
        ("zonefs_failsafe", ()): 0,
        ("zonefs_zone_resets", (("stat", "max"),)): doc["wear"]["max"],
        ("zonefs_write_latency_seconds_count", ()): doc["latency"]["write"]["count"],
        ("zonefs_read_latency_seconds_count", ()): doc["latency"]["read"]["count"],
    }
    for cond, n in doc["zones_by_condition"].items():
        expect[("zonefs_zones", (("condition", cond.lower()),))] = n
    for role, n in doc["zones_by_role"].items():
        expect[("zonefs_zones_by_role", (("role", role),))] = n
    for name, s in doc["streams"].items():
        expect[("zonefs_stream_written_bytes_total", (("stream", name),))] = \
            s["device_bytes_written"]
        expect[("zonefs_stream_live_bytes", (("stream", name),))] = s["live_bytes"]
    for name, t in doc["tenants"].items():
        expect[("zonefs_tenant_written_bytes_total", (("tenant", name),))] = t["bytes_written"]
    assert "checkpoint" in doc["streams"]
    assert "checkpoints" in doc["tenants"]
    for key, value in expect.items():
        assert key in samples, f"{key} missing from the exposition"
        assert samples[key] == pytest.approx(value), key
    assert doc["latency"]["write"]["count"] > 0
    # Histogram buckets are cumulative and end at the count.
    les = sorted((float(dict(k[1])["le"]), v) for k, v in samples.items()
                 if k[0] == "zonefs_write_latency_seconds_bucket")
    assert [v for _, v in les] == sorted(v for _, v in les)
    assert les[-1] == (float("inf"), doc["latency"]["write"]["count"])


def test_metrics_http_endpoint_scraped_during_writes(image: Path, mnt: Path,
                                                     workdir: Path) -> None:
    import socket

    with socket.socket() as s:  # a free port on loopback
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemon_mount(image, mnt, f"metrics={port}", log=workdir / "daemon.log")
    try:
        doc = json.loads(zonefs("stat", str(mnt), "--json").stdout)
        assert doc["daemon"]["metrics"] == f"http://127.0.0.1:{port}/metrics"
        stop = threading.Event()

        def burst() -> None:
            i = 0
            while not stop.is_set() and i < 400:
                (mnt / f"burst{i % 40}").write_bytes(os.urandom(256 << 10))
                i += 1

        writer = threading.Thread(target=burst)
        writer.start()
        written = []
        try:
            for _ in range(8):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                conn.request("GET", "/metrics")
                resp = conn.getresponse()
                assert resp.status == 200
                samples = parse(resp.read().decode())
                conn.close()
                written.append(samples[("zonefs_user_written_bytes_total", ())])
                time.sleep(0.1)
        finally:
            stop.set()
            writer.join()
        assert written == sorted(written), written
        assert written[-1] > written[0], written
    finally:
        daemon_unmount(image, mnt)


def test_metrics_textfile_rewritten_atomically(image: Path, mnt: Path, workdir: Path) -> None:
    textdir = workdir / "textfile"
    textdir.mkdir()
    daemon_mount(image, mnt, f"metrics_textfile={textdir},metrics_interval=0.2",
                 log=workdir / "daemon.log")
    target = textdir / "zonefs_dev_img.prom"
    try:
        deadline = time.monotonic() + 30
        while not target.exists():
            assert time.monotonic() < deadline, "no textfile written"
            time.sleep(0.05)
        inodes, values = set(), []
        for i in range(30):
            (mnt / f"t{i}").write_bytes(os.urandom(64 << 10))
            # Every read sees a whole file (never a partial one) and no temp file lingers
            # under a name node_exporter would read (*.prom).
            text = target.read_text()
            assert text.rstrip().endswith(("}", "0", "1", "2", "3", "4", "5", "6", "7", "8",
                                           "9", "NaN", "Inf")), text[-200:]
            values.append(parse(text)[("zonefs_user_written_bytes_total", ())])
            inodes.add(target.stat().st_ino)
            assert [p.name for p in textdir.glob("*.prom")] == [target.name]
            time.sleep(0.05)
        assert len(inodes) > 1, "the file was never replaced (rename)"
        assert values == sorted(values)
        assert values[-1] > values[0]
    finally:
        daemon_unmount(image, mnt)


def test_bad_metrics_option(image: Path, mnt: Path) -> None:
    proc = daemon_mount(image, mnt, "metrics=127.0.0.1:notaport", check=False)
    assert proc.returncode == 1
    assert "metrics" in proc.stderr
    assert not in_mount_table(mnt)


# -- zone map ---------------------------------------------------------------------------------

def _stat_png(mnt: Path, path: Path) -> dict:
    proc = zonefs("stat", str(mnt), "--zone-map", str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "\x1b[" not in proc.stdout, "no colour when stdout is not a terminal"
    return json.loads(zonefs("stat", str(mnt), "--json").stdout)


def test_zone_map_png_and_grid(image: Path, mnt: Path, workdir: Path) -> None:
    pytest.importorskip("matplotlib", reason="the [plot] extra is not installed")
    daemon_mount(image, mnt, log=workdir / "daemon.log")
    try:
        (mnt / "checkpoints").mkdir()
        (mnt / "checkpoints" / "step-0.pt").write_bytes(os.urandom(20 << 20))
        os.sync()
        doc = _stat_png(mnt, workdir / "z.png")
        text = zonefs("stat", "--all", str(mnt)).stdout
    finally:
        daemon_unmount(image, mnt)
    assert "c" in doc["zone_streams"]
    grid = text.split("Zone map\n", 1)[1].splitlines()[0].strip()
    assert grid == doc["zone_map"][:64]  # not a terminal: the plain map


@pytest.mark.slow
def test_zone_map_pictures(image: Path, mnt: Path, workdir: Path) -> None:
    """Fresh, half-full and cleaned (ZONEFS_ZONEMAP_DIR=DIR keeps the PNGs to look at)."""
    pytest.importorskip("matplotlib", reason="the [plot] extra is not installed")
    out = Path(os.environ.get("ZONEFS_ZONEMAP_DIR") or workdir)
    daemon_mount(image, mnt, "cleaner_rate=1000", log=workdir / "daemon.log")
    try:
        fresh = _stat_png(mnt, out / "zonemap-fresh.png")
        assert set(fresh["zone_streams"]) <= {"-"}
        (mnt / "checkpoints").mkdir()
        (mnt / "dataset").mkdir()
        for i in range(6):
            (mnt / "checkpoints" / f"step-{i}.pt").write_bytes(os.urandom(12 << 20))
        for i in range(600):
            (mnt / "dataset" / f"shard-{i:04d}").write_bytes(os.urandom(200 << 10))
        os.sync()
        half = _stat_png(mnt, out / "zonemap-half.png")
        assert {"c", "d"} <= set(half["zone_streams"]), half["zone_streams"]
        # Make dead space spread over zones, then run short of empty zones: the cleaner runs.
        for i in range(0, 600, 2):
            (mnt / "dataset" / f"shard-{i:04d}").unlink()
        for i in range(4):
            (mnt / "checkpoints" / f"step-{i}.pt").unlink()
        deadline = time.monotonic() + 120
        n = 0
        while True:
            doc = json.loads(zonefs("stat", str(mnt), "--json").stdout)
            if doc["cleaner"]["zones_cleaned"] > 0:
                break
            assert time.monotonic() < deadline, doc["cleaner"]
            for _ in range(8):  # a zone's worth (16 MiB) between looks
                (mnt / "dataset" / f"more-{n:04d}").write_bytes(os.urandom(2 << 20))
                n += 1
        os.sync()
        cleaned = _stat_png(mnt, out / "zonemap-cleaned.png")
        assert "k" in cleaned["zone_streams"], "the cleaner's zones are drawn"
    finally:
        daemon_unmount(image, mnt)


def test_zone_map_without_matplotlib(image: Path, mnt: Path, workdir: Path) -> None:
    daemon_mount(image, mnt, log=workdir / "daemon.log")
    try:
        blocker = workdir / "nompl"
        blocker.mkdir()
        (blocker / "matplotlib.py").write_text("raise ImportError('hidden by the test')\n")
        e = env()
        e["PYTHONPATH"] = f"{blocker}{os.pathsep}{e['PYTHONPATH']}"
        proc = subprocess.run([*ZONEFS, "stat", str(mnt), "--zone-map", str(workdir / "z.png")],
                              env=e, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2
        assert "zonefs-py[plot]" in proc.stderr, proc.stderr
        assert proc.stdout == "", "a flag error comes before any output"
    finally:
        daemon_unmount(image, mnt)


def test_terminal_grid_is_coloured_only_on_a_tty() -> None:
    from zonefs_py import zonemap

    doc = {"zone_map": "SSMm..dDx", "zone_streams": "------cdl", "zone_live": "------5X0"}
    plain = zonemap.grid(doc, colour=False)
    assert plain == ["SSMm..dDx"]
    coloured = "".join(zonemap.grid(doc, colour=True))
    assert "\x1b[33md" in coloured
    assert "\x1b[32mD" in coloured

    class Tty:
        def isatty(self) -> bool:
            return True

    assert zonemap.use_colour(Tty()) == ("NO_COLOR" not in os.environ)
    with open(os.devnull) as devnull:
        assert not zonemap.use_colour(devnull)


def test_progress_only_on_a_tty(image: Path, mnt: Path, workdir: Path) -> None:
    import shlex

    if shutil.which("script") is None:
        pytest.skip("script(1) (util-linux) is needed to give the command a terminal")
    quiet = zonefs("fsck", str(image))
    assert "replaying" not in quiet.stderr + quiet.stdout
    cmd = " ".join(shlex.quote(a) for a in [*ZONEFS, "fsck", str(image)])
    on_tty = subprocess.run(["script", "-qec", cmd, "/dev/null"], env=env(), text=True,
                            capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
    assert on_tty.returncode == 0, on_tty.stdout
    assert "replaying the log: " in on_tty.stdout and "100%|" in on_tty.stdout  # noqa: PT018
    cmd = " ".join(shlex.quote(a) for a in [*ZONEFS, "mount", str(image), str(mnt),
                                             "--log-file", str(workdir / "daemon.log")])
    on_tty = subprocess.run(["script", "-qec", cmd, "/dev/null"], env=env(), text=True,
                            capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
    try:
        assert "mount: replaying the metadata log: " in on_tty.stdout, on_tty.stdout
    finally:
        daemon_unmount(image, mnt)
    # mkfs: its zone resets, on a terminal only.
    other = workdir / "other.img"
    zonefs("emu", "create", str(other), "--size", "256M", "--zone-size", "16M")
    quiet = zonefs("mkfs", str(other))
    assert "resetting zones" not in quiet.stderr + quiet.stdout
    cmd = " ".join(shlex.quote(a) for a in [*ZONEFS, "mkfs", "--force", str(other)])
    on_tty = subprocess.run(["script", "-qec", cmd, "/dev/null"], env=env(), text=True,
                            capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
    assert on_tty.returncode == 0, on_tty.stdout
    assert "resetting zones: 100%|" in on_tty.stdout, on_tty.stdout
