"""SIGTERM and unmounts end the daemon while a request is stuck (issue 42; DESIGN 4.5).

The daemon's TEST HOOK (ZONEFS_PY_MOUNT_TEST_FAIL=hang, daemon/serve.py)
makes a GETXATTR of one name (a pyfuse3 request) or a FALLOCATE of one length
(a fuseext request) never return. A stop (SIGTERM, or a lazy unmount, since
a plain one is EBUSY while the caller sits in the request) must then end the
daemon within a bound with its clean close: exit 0, data written before it
there after a remount, fsck clean (the fixture's teardown); the stuck caller
gets an error instead of waiting for good.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import Mount

pytestmark = [
    pytest.mark.integration,
    pytest.mark.expect_log("zonefs_py.daemon", "WARNING", "requests still unanswered"),
]

HOOK_ENV = "ZONEFS_PY_MOUNT_TEST_FAIL"
HANG_XATTR = "user.zonefs_test.hang"  # serve.HANG_XATTR
HANG_LENGTH = 12345  # serve.HANG_LENGTH
#: The mount's stop_grace (seconds).
GRACE_S = 1
#: Seconds a stop may take here: the grace, the unmount watch's poll and stuck
#: time, the clean close.
STOP_BOUND_S = 30.0
_libc = ctypes.CDLL(None, use_errno=True)


def stuck_getxattr(path: Path) -> None:
    os.getxattr(path, HANG_XATTR)


def stuck_fallocate(path: Path) -> None:
    """fallocate(2) once (os.posix_fallocate retries on EINTR); raises OSError."""
    fd = os.open(path, os.O_RDWR)
    try:
        if _libc.fallocate(fd, 0, ctypes.c_int64(0), ctypes.c_int64(HANG_LENGTH)) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
    finally:
        os.close(fd)


def start_stuck(call: Callable[[Path], None], path: Path) -> tuple[threading.Thread,
                                                                   list[BaseException | None]]:
    """Run `call(path)` in a thread; its outcome lands in the list (None: returned)."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            call(path)
            out.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            out.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    return worker, out


def wait_for_log(mount: Mount, text: str, deadline_s: float = 30.0) -> None:
    """Poll the daemon's log until it holds `text` (the request reached the hook)."""
    deadline = time.monotonic() + deadline_s
    while text not in mount.log_text():
        if time.monotonic() > deadline:
            pytest.fail(f"{text!r} not in the daemon's log after {deadline_s} s")
        time.sleep(0.02)


def wait_exit_bounded(mount: Mount) -> tuple[int, float]:
    """Wait up to STOP_BOUND_S for the daemon to exit: (status, seconds); on a miss,
    kill it (so the stuck caller returns) and fail."""
    assert mount.proc is not None
    t0 = time.monotonic()
    try:
        rc = mount.proc.wait(timeout=STOP_BOUND_S)
    except subprocess.TimeoutExpired:
        mount.proc.kill()
        mount.wait_exit()
        pytest.fail(f"the daemon still ran {STOP_BOUND_S} s after the stop: killed")
    elapsed = time.monotonic() - t0
    mount.wait_exit()
    return rc, elapsed


@pytest.mark.parametrize("call", [stuck_getxattr, stuck_fallocate],
                         ids=["getxattr", "fallocate"])
@pytest.mark.parametrize("stop", ["sigterm", "lazy_unmount"])
def test_a_stop_ends_the_daemon_while_a_request_is_stuck(
        image: Path, mount_factory: Mount, monkeypatch: pytest.MonkeyPatch,
        call: Callable[[Path], None], stop: str) -> None:
    monkeypatch.setenv(HOOK_ENV, "hang")
    m = mount_factory.start(f"stop_grace={GRACE_S}").path
    data = os.urandom(300_000)
    (m / "kept").write_bytes(data)  # not fsync'ed: the clean close writes it
    (m / "f").write_bytes(b"x")
    worker, outcome = start_stuck(call, m / "f")
    wait_for_log(mount_factory, "never returns")
    if stop == "sigterm":
        assert mount_factory.proc is not None
        mount_factory.proc.send_signal(signal.SIGTERM)
    else:
        subprocess.run(["umount", "-l", str(m)], check=True, timeout=60)
    rc, elapsed = wait_exit_bounded(mount_factory)
    worker.join(STOP_BOUND_S)
    assert not worker.is_alive(), "the stuck caller still waits after the daemon exited"
    assert rc == 0, mount_factory.log_text()
    assert elapsed < STOP_BOUND_S
    assert isinstance(outcome[0], OSError), outcome
    assert "clean shutdown" in mount_factory.log_text()
    mount_factory.start()
    assert (m / "kept").read_bytes() == data


def test_a_lazy_unmount_without_stuck_requests_serves_the_open_files(
        image: Path, mount_factory: Mount) -> None:
    """After `umount -l` the files still open keep working (the kernel's contract);
    closing the last one ends the daemon cleanly."""
    m = mount_factory.start("stop_grace=5").path  # a loaded machine's slow fsync is no stop
    fd = os.open(m / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"before")
        subprocess.run(["umount", "-l", str(m)], check=True, timeout=60)
        wait_for_log(mount_factory, "is no longer in the mount table")  # the watch saw it
        for i in range(4):
            os.pwrite(fd, b"-%d" % i, 6 + 2 * i)
            os.fsync(fd)
        assert mount_factory.proc is not None
        assert mount_factory.proc.poll() is None
        assert os.pread(fd, 100, 0).startswith(b"before-0-1")
    finally:
        os.close(fd)
    rc, _elapsed = wait_exit_bounded(mount_factory)
    assert rc == 0, mount_factory.log_text()
    mount_factory.start()
    assert (m / "f").read_bytes().startswith(b"before-0-1")
