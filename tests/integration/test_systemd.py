"""Running under systemd: sd_notify readiness and stopping, the watchdog, journald logging,
SIGTERM's clean shutdown, the unit `zonefs-py systemd-unit` writes, tidy /run state."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import (
    EXIT_DEADLINE_S,
    MOUNT_DEADLINE_S,
    Mount,
    daemon_mount,
    daemon_unmount,
    fusermount_u,
    zonefs,
)

pytestmark = pytest.mark.integration


class NotifySocket:
    """A datagram socket bound where NOTIFY_SOCKET points, as systemd's would be."""

    def __init__(self, address: str) -> None:
        self.env_value = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.messages: list[dict[str, str]] = []

    def receive(self, key: str, timeout_s: float = MOUNT_DEADLINE_S) -> dict[str, str]:
        """Wait for a datagram with `key` in it; return it (all received are kept)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"no {key} from the daemon in {timeout_s} s; got {self.messages}")
            self.sock.settimeout(left)
            try:
                blob = self.sock.recv(4096)
            except TimeoutError:
                continue
            msg = dict(line.split("=", 1) for line in blob.decode().split("\n") if line)
            self.messages.append(msg)
            if key in msg:
                return msg


@pytest.fixture
def notify(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NotifySocket]:
    ns = NotifySocket(str(workdir / "notify.sock"))
    monkeypatch.setenv("NOTIFY_SOCKET", ns.env_value)
    yield ns
    ns.sock.close()


def test_ready_only_once_statfs_works_and_stopping_at_unmount(
        image: Path, mount_factory: Mount, notify: NotifySocket) -> None:
    m = mount_factory.start(wait=False)
    ready = notify.receive("READY")
    # The daemon tells READY=1 only after its own statfs of the mount was answered:
    # at this moment the mount serves (no polling).
    st = os.statvfs(m.path)
    assert st.f_bsize == 4096 and st.f_blocks > 0  # noqa: PT018
    assert os.path.ismount(m.path)
    doc = json.loads(zonefs("stat", str(m.path), "--json").stdout)
    assert ready["READY"] == "1"
    assert "MAINPID" not in ready  # -f: the process systemd started is the daemon
    assert ready["STATUS"].startswith(f"serving {m.path}: "), ready
    earlier = notify.messages[:-1]
    assert earlier, "a STATUS= while loading comes before READY=1"
    assert all("READY" not in msg for msg in earlier)
    assert any(msg.get("STATUS", "").startswith("loading ") for msg in earlier), earlier
    assert m.proc is not None
    assert doc["daemon"]["pid"] == m.proc.pid
    (m.path / "f").write_bytes(b"x" * 100_000)
    fusermount_u(m.path, check=True)
    stopping = notify.receive("STOPPING", timeout_s=EXIT_DEADLINE_S)
    assert stopping["STOPPING"] == "1"
    assert "unmounting" in stopping["STATUS"]
    assert m.wait_exit() == 0


def test_daemonizing_mount_notifies_with_its_pid(image: Path, workdir: Path,
                                                 notify: NotifySocket) -> None:
    """Without -f, READY=1 comes from the daemon before `mount` exits 0, naming MAINPID."""
    mnt = workdir / "mnt"
    mnt.mkdir()
    daemon_mount(image, mnt, log=workdir / "daemon.log")
    try:
        ready: dict[str, str] = {}
        while "READY" not in ready:  # already queued: sent before the mount command returned
            blob = notify.sock.recv(4096, socket.MSG_DONTWAIT)
            ready = dict(line.split("=", 1) for line in blob.decode().split("\n") if line)
            notify.messages.append(ready)
        pid = json.loads(zonefs("stat", str(mnt), "--json").stdout)["daemon"]["pid"]
        assert ready["MAINPID"] == str(pid)
    finally:
        daemon_unmount(image, mnt)
    assert any("STOPPING" in msg for msg in notify.messages) or \
        notify.receive("STOPPING", timeout_s=10)


def test_abstract_socket_and_watchdog(image: Path, mount_factory: Mount, workdir: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    ns = NotifySocket(f"@zonefs-it-{os.getpid()}-{time.monotonic_ns()}")
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", ns.env_value)
        monkeypatch.setenv("WATCHDOG_USEC", "200000")  # ping every 0.1 s
        m = mount_factory.start(wait=False)
        ns.receive("READY")
        t0 = time.monotonic()
        for _ in range(3):
            ns.receive("WATCHDOG", timeout_s=10)
        assert time.monotonic() - t0 < 10
        m.unmount()
    finally:
        ns.sock.close()


def test_watchdog_pid_of_another_process_is_not_ours(
        image: Path, mount_factory: Mount, notify: NotifySocket,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "100000")
    monkeypatch.setenv("WATCHDOG_PID", "1")
    m = mount_factory.start(wait=False)
    notify.receive("READY")
    notify.sock.settimeout(0.2)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            blob = notify.sock.recv(4096)
        except TimeoutError:
            continue
        assert b"WATCHDOG" not in blob
    m.unmount()


def test_sigterm_leaves_a_clean_image(image: Path, mount_factory: Mount) -> None:
    m = mount_factory.start()
    data = os.urandom(5 << 20)
    (m.path / "ckpt").write_bytes(data)  # buffered, never fsync'ed
    assert m.signal(signal.SIGTERM) == 0
    assert "clean shutdown" in m.log_text()
    fsck = zonefs("fsck", str(m.image), check=False)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    m.start()
    lines = [ln for ln in m.log_text().splitlines() if "recovered" in ln]
    assert lines[-1].endswith("journal replayed after the checkpoint: 0 bytes)"), lines[-1]
    assert "torn tail: False" in lines[-1]
    assert (m.path / "ckpt").read_bytes() == data


def test_sigterm_while_closing_does_not_stop_the_close(image: Path, mount_factory: Mount) -> None:
    """`umount` then SIGTERM (systemd stopping an fstab mount unit): the close goes on."""
    m = mount_factory.start()
    with open(m.path / "big", "wb") as f:
        for _ in range(100):
            f.write(os.urandom(1 << 20))
    fusermount_u(m.path, check=True)
    assert m.proc is not None
    for _ in range(2):
        m.proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
    assert m.wait_exit() == 0, m.log_text()
    assert "clean shutdown" in m.log_text()


def test_journal_stream_logs_without_timestamps(image: Path, workdir: Path) -> None:
    """With $JOURNAL_STREAM naming its stderr, `-f` logs `<prio>logger: message` lines."""
    mnt = workdir / "mnt"
    mnt.mkdir()
    err_path = workdir / "stderr"
    from .conftest import ZONEFS, env

    with open(err_path, "wb") as err:
        st = os.fstat(err.fileno())
        proc = subprocess.Popen([*ZONEFS, "mount", "-f", str(image), str(mnt)],
                                env={**env(), "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"},
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err)
    try:
        deadline = time.monotonic() + MOUNT_DEADLINE_S
        while b"is serving" not in err_path.read_bytes():
            assert proc.poll() is None, err_path.read_text()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        doc = json.loads(zonefs("stat", str(mnt), "--json").stdout)
        assert doc["daemon"]["journal"] is True
        assert "the systemd journal" in zonefs("stat", str(mnt)).stdout
    finally:
        fusermount_u(mnt)
        assert proc.wait(timeout=EXIT_DEADLINE_S) == 0
    lines = err_path.read_text().splitlines()
    assert lines
    for line in lines:
        assert re.match(r"<[2-7]>[\w.]+: ", line), line
    assert any(line.startswith("<6>zonefs_py.daemon: ") and "is serving" in line
               for line in lines)


# -- the unit --------------------------------------------------------------------------------

def test_unit_for_device_and_mountpoint(workdir: Path) -> None:
    proc = zonefs("systemd-unit", "/dev/nvme0n2", "/mnt/zoned", "-o", "commit=5",
                  "-o", "drain_endpoint=http://127.0.0.1:8333")
    unit = proc.stdout
    assert "Type=notify" in unit
    assert re.search(r"^ExecStart=\S+ -m zonefs_py\.cli\.main mount -f /dev/nvme0n2 "
                     r"/mnt/zoned -o commit=5,drain_endpoint=http://127\.0\.0\.1:8333$",
                     unit, re.M), unit
    assert "BindsTo=dev-nvme0n2.device" in unit
    assert "network-online.target" in unit  # a drain to a store needs the network
    assert re.search(r"^ExecStopPost=-/usr/bin/fusermount3 -u -z /mnt/zoned$", unit, re.M)
    # --write puts it where systemd looks, named after the mount point.
    out = workdir / "units"
    out.mkdir()
    zonefs("systemd-unit", "/dev/nvme0n2", "/mnt/zoned", "--write", str(out))
    assert (out / "zonefs-py-mnt-zoned.service").read_text() == \
        zonefs("systemd-unit", "/dev/nvme0n2", "/mnt/zoned").stdout
    if shutil.which("systemd-analyze"):
        img = workdir / "dev.img"
        img.write_bytes(b"")
        (out / "t.service").write_text(zonefs("systemd-unit", str(img), str(workdir)).stdout)
        check = subprocess.run(["systemd-analyze", "verify", str(out / "t.service")],
                               capture_output=True, text=True, timeout=60)
        problems = [ln for ln in check.stderr.splitlines() if "t.service" in ln]
        assert not problems, check.stderr


def test_template_unit_is_shipped() -> None:
    from .conftest import REPO

    text = (REPO / "systemd" / "zonefs-py@.service").read_text()
    assert "Type=notify" in text
    assert "ExecStart=/usr/bin/env zonefs-py mount -f %I ${MOUNTPOINT}" in text
    assert "EnvironmentFile=/etc/zonefs-py/%i.conf" in text


# -- tidy state ------------------------------------------------------------------------------

def _entries(image: Path) -> list[Path]:
    from zonefs_py.daemon.runstate import DeviceLock

    base = Path(DeviceLock(str(image)).path[:-len(".lock")])
    return [p for p in (base.with_suffix(".lock"), base.with_suffix(".json")) if p.exists()]


def test_unmount_removes_run_entries(image: Path, workdir: Path) -> None:
    mnt = workdir / "mnt"
    mnt.mkdir()
    daemon_mount(image, mnt, log=workdir / "daemon.log")
    try:
        assert len(_entries(image)) == 2  # lock and state record while mounted
    finally:
        daemon_unmount(image, mnt)
    assert _entries(image) == []
    st = zonefs("stat", str(mnt), check=False)
    assert st.returncode == 1 and "last daemon" not in st.stderr  # noqa: PT018


def test_stale_entries_are_swept_by_stat_and_mount(image: Path, workdir: Path) -> None:
    from zonefs_py.daemon.runstate import lock_dir

    run = Path(lock_dir())
    run.mkdir(parents=True, exist_ok=True)
    tag = f"file-0-{os.getpid()}{time.monotonic_ns()}"
    dead = 2 ** 22 + 1  # above the default pid_max of 4194304: never alive
    stale = {
        f"{tag}1.lock": "",
        f"{tag}2.json": json.dumps({"pid": dead, "state": "stopped", "device": str(image)}),
        f"{tag}3.json": json.dumps({"pid": dead, "state": "failed", "last_error": "x",
                                    "device": str(workdir / "deleted.img")}),
        f"{tag}4.json.{dead}.tmp": "{",
    }
    kept = {f"{tag}5.json": json.dumps({"pid": os.getpid(), "state": "serving",
                                        "device": str(image)})}
    for name, text in {**stale, **kept}.items():
        (run / name).write_text(text)
    try:
        held = run / f"{tag}6.lock"
        fd = os.open(held, os.O_RDWR | os.O_CREAT)
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            zonefs("stat", str(workdir), check=False)
            left = set(os.listdir(run))
            assert not set(stale) & left, set(stale) & left
            assert set(kept) <= left
            assert held.name in left  # a live holder's lock stays
        finally:
            os.close(fd)
        # The next mount sweeps too: the lock nobody holds now goes.
        mnt = workdir / "mnt"
        mnt.mkdir()
        daemon_mount(image, mnt, log=workdir / "daemon.log")
        daemon_unmount(image, mnt)
        assert not held.exists()
    finally:
        for name in (*stale, *kept, f"{tag}6.lock"):
            (run / name).unlink(missing_ok=True)


def test_failed_daemon_record_stays_for_stat(image: Path, workdir: Path) -> None:
    mnt = workdir / "mnt"
    mnt.mkdir()
    proc = daemon_mount(image, mnt, log=workdir / "daemon.log",
                        extra_env={"ZONEFS_PY_MOUNT_TEST_FAIL": "tune"}, check=False)
    assert proc.returncode == 1
    daemon_unmount(image, mnt)
    for _ in range(2):  # not swept: it says why the mount failed
        st = zonefs("stat", str(mnt), check=False)
        assert "injected failure" in st.stderr, st.stderr
    assert [p.suffix for p in _entries(image)] == [".json"]  # the lock file went
