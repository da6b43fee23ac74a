"""sd_notify from the daemon's side: addresses, the watchdog's interval, the run loop."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import trio

from zonefs_py.daemon import sdnotify
from zonefs_py.daemon.sdnotify import Notifier


def _bound(tmp_path: Path) -> tuple[socket.socket, str]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "n.sock")
    sock.bind(path)
    sock.settimeout(5)
    return sock, path


def test_not_under_systemd_does_nothing() -> None:
    n = Notifier({})
    assert not n.enabled
    assert n.send("READY=1") is False
    assert n.watchdog_interval_s is None


def test_environment_is_read_then_removed(tmp_path: Path) -> None:
    sock, path = _bound(tmp_path)
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid()),
           "OTHER": "kept"}
    n = Notifier(env)
    assert env == {"OTHER": "kept"}  # children (fusermount3) do not talk to systemd
    assert n.watchdog_interval_s == 1.5
    assert n.send("READY=1", "STATUS=serving")
    assert sock.recv(100) == b"READY=1\nSTATUS=serving"
    assert n.status("two\nlines  folded")
    assert sock.recv(100) == b"STATUS=two lines folded"
    n.close()
    sock.close()


def test_abstract_address() -> None:
    name = f"zonefs-unit-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    n = Notifier({"NOTIFY_SOCKET": "@" + name})
    assert n.send("READY=1")
    assert sock.recv(100) == b"READY=1"
    n.close()
    sock.close()


@pytest.mark.parametrize(("env", "interval"), [
    ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}, None),  # another process's
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "junk"}, None),
    ({"WATCHDOG_USEC": "200000"}, 0.1),
])
def test_watchdog_interval(env: dict[str, str], interval: float | None) -> None:
    assert Notifier({"NOTIFY_SOCKET": "/nonexistent", **env}).watchdog_interval_s == interval


@pytest.mark.expect_log("zonefs_py.daemon", "WARNING", "cannot notify systemd")
def test_unreachable_socket_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    n = Notifier({"NOTIFY_SOCKET": "/nonexistent/sock"})
    assert n.send("READY=1") is False
    assert n.send("STATUS=x") is False
    n.close()
    assert len([r for r in caplog.records if "cannot notify systemd" in r.message]) == 1
    caplog.clear()  # the warning is the behaviour under test


@pytest.mark.expect_log("zonefs_py.daemon", "WARNING", "is not a unix socket address")
def test_vsock_address_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    assert not Notifier({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled
    assert "not a unix socket address" in caplog.text
    caplog.clear()


async def test_run_pings_and_refreshes_status(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    sock, path = _bound(tmp_path)
    monkeypatch.setattr(sdnotify, "STATUS_REFRESH_S", 0.2)
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000"})
    serving = trio.Event()
    got: list[bytes] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(n.run, serving, lambda: "serving /mnt")
        await trio.sleep(0.2)
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            sock.recv(100)  # nothing before the mount serves
        sock.setblocking(True)
        serving.set()
        while not any(b"STATUS=serving /mnt" in m for m in got):
            got.append(await trio.to_thread.run_sync(sock.recv, 100))
        nursery.cancel_scope.cancel()
    assert b"WATCHDOG=1" in got[0]
    n.close()
    sock.close()
