"""Fixtures for the integration tests: real images, real FUSE mounts in a subprocess.

Every test gets a fresh emulator image (`zonefs-py emu create` + `mkfs`) under
a world-traversable temporary directory (so the non-root tests can reach it),
a `Mount` that runs `zonefs-py mount -f` in a subprocess, and a teardown that
always unmounts, waits for the daemon to exit cleanly and runs
`zonefs-py fsck IMAGE` expecting exit 0.

The tests skip (saying why) when /dev/fuse or fusermount3 is missing, or when
the engine is not importable yet.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from crashlib import TEST_DISK_VERSION

REPO = Path(__file__).resolve().parents[2]
#: The CLI under test; ZONEFS_IT_CLI (a shell-quoted command) overrides it.
ZONEFS = (shlex.split(os.environ["ZONEFS_IT_CLI"]) if os.environ.get("ZONEFS_IT_CLI")
          else [sys.executable, "-m", "zonefs_py.cli.main"])
#: Seconds a mount may take to appear (load + recovery) and a daemon to exit.
MOUNT_DEADLINE_S = 60.0
EXIT_DEADLINE_S = 120.0
IMAGE_SIZE = "512M"
ZONE_SIZE = "16M"


def env() -> dict[str, str]:
    """Environment for subprocesses: the checkout first on PYTHONPATH."""
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    return e


def zonefs(*args: str, check: bool = True,
           timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run the `zonefs-py` CLI of this checkout and capture its output."""
    proc = subprocess.run([*ZONEFS, *args], env=env(), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"zonefs-py {' '.join(args)} exited {proc.returncode}:\n"
                    f"{proc.stdout}{proc.stderr}")
    return proc


def _why_unavailable() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed"
    for module in ("zonefs_py.fs.filesystem", "zonefs_py.fs.mkfs", "zonefs_py.device"):
        try:
            if importlib.util.find_spec(module) is None:
                return f"the engine is not there yet ({module} missing)"
        except ImportError as exc:
            return f"the engine is not importable yet ({exc})"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every integration test, saying why, when mounting cannot work here."""
    reason = _why_unavailable()
    if reason is None:
        return
    for item in items:
        if "integration" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


def fsck_exists() -> bool:
    """True once the fsck subcommand is implemented."""
    return importlib.util.find_spec("zonefs_py.cli.fsck") is not None


class Mount:
    """A zonefs-py daemon in the foreground, in a subprocess."""

    def __init__(self, image: Path, mountpoint: Path, log: Path) -> None:
        self.image = image
        self.path = mountpoint
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        #: True once a daemon was started on the image (the teardown then runs fsck).
        self.started = False

    def start(self, *options: str, wait: bool = True) -> Mount:
        """Start `zonefs-py mount -f` and wait (with a deadline) for the mount to appear."""
        assert self.proc is None, "already mounted"
        self.started = True
        cmd = [*ZONEFS, "mount", "-f", str(self.image), str(self.path),
               "--log-file", str(self.log), "--log-level", "INFO"]
        for opt in keep_test_format(options):
            cmd += ["-o", opt]
        self.proc = subprocess.Popen(cmd, env=env(), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if wait:
            self.wait_mounted()
        return self

    def wait_mounted(self) -> None:
        """Poll os.path.ismount until the deadline; fail with the log if the daemon died."""
        assert self.proc is not None
        deadline = time.monotonic() + MOUNT_DEADLINE_S
        while not os.path.ismount(self.path):
            rc = self.proc.poll()
            if rc is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                self.proc = None
                pytest.fail(f"mount daemon exited {rc} before mounting: {err}\n{self.log_text()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{self.path} not mounted after {MOUNT_DEADLINE_S}s\n"
                            f"{self.log_text()}")
            time.sleep(0.02)

    def log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else "(no log)"

    def wait_exit(self) -> int:
        """Wait for the daemon to exit; return its status."""
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout=EXIT_DEADLINE_S)
        finally:
            if self.proc.stderr:
                self.proc.stderr.close()
        self.proc = None
        return rc

    def unmount(self) -> int:
        """`fusermount3 -u`, then wait for the daemon's clean exit; return its status."""
        fusermount_u(self.path, check=True)
        return self.wait_exit()

    def signal(self, signum: int) -> int:
        """Send `signum` to the daemon and wait for it to exit; return its status."""
        assert self.proc is not None
        self.proc.send_signal(signum)
        if signum == signal.SIGKILL:
            self.proc.wait(timeout=EXIT_DEADLINE_S)
            # The kernel keeps a dead connection mounted until it is unmounted.
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], timeout=60)
        return self.wait_exit()

    def cleanup(self) -> None:
        """Teardown: unmount whatever state we are in, never leave a mount behind."""
        if self.proc is not None:
            if os.path.ismount(self.path):
                fusermount_u(self.path)
            try:
                self.wait_exit()
            except subprocess.TimeoutExpired:
                assert self.proc is not None
                self.proc.kill()
                self.wait_exit()
        if in_mount_table(self.path):  # also a dead connection, where ismount() is False
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], timeout=60)


def fusermount_u(path: Path, check: bool = False) -> int:
    """`fusermount3 -u path`, retried for up to 5 s while it says EBUSY; return its status.

    Right after some requests (seen after mkfifo + lstat, newest pyfuse3 and
    kernel 6.1) the kernel refuses the unmount with EBUSY although no process
    has a file or cwd there, and accepts it 0.1 s later. Without the retry the
    daemon keeps serving and the test waits out EXIT_DEADLINE_S.
    """
    deadline = time.monotonic() + 5
    while True:
        proc = subprocess.run(["fusermount3", "-u", str(path)], capture_output=True, text=True,
                              timeout=60)
        if proc.returncode == 0 or "busy" not in proc.stderr or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if check and proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, proc.stdout, proc.stderr)
    return proc.returncode


def in_mount_table(path: Path) -> bool:
    """True if `path` is a mount point in /proc/self/mounts (alive or not)."""
    target = str(path).replace(" ", "\\040")
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == target for line in f)


def make_image(directory: Path, size: str = IMAGE_SIZE, zone_size: str = ZONE_SIZE,
               meta_zones: int | None = None) -> Path:
    """Create and format an emulator image."""
    image = directory / "dev.img"
    zonefs("emu", "create", str(image), "--size", size, "--zone-size", zone_size)
    more = [] if meta_zones is None else ["--meta-zones", str(meta_zones)]
    zonefs("mkfs", str(image), "--format", str(TEST_DISK_VERSION), *more)
    return image


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A world-traversable temporary directory (tmp_path is 0700 under /tmp/pytest-of-root)."""
    base = Path(tempfile.mkdtemp(prefix="zonefs-it-", dir=os.environ.get("ZONEFS_IT_DIR")))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def template_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One freshly formatted 512 MiB image per session, copied for each test."""
    if _why_unavailable() is not None:
        pytest.skip(_why_unavailable() or "")
    return make_image(tmp_path_factory.mktemp("template"))


@pytest.fixture
def image(workdir: Path, template_image: Path) -> Path:
    """A freshly formatted 512 MiB image with 16 MiB zones (a sparse copy of the template)."""
    target = workdir / "dev.img"
    subprocess.run(["cp", "--sparse=always", str(template_image), str(target)], check=True)
    return target


@pytest.fixture
def mount_factory(workdir: Path, request: pytest.FixtureRequest) -> Iterator[Mount]:
    """An unstarted Mount of `workdir/dev.img` (the test makes the image); always cleaned up,
    then fsck'ed. The daemon's WARNING+ records count as the test's (tests/conftest.py)."""
    mnt = workdir / "mnt"
    mnt.mkdir()
    mnt.chmod(0o755)
    m = Mount(workdir / "dev.img", mnt, workdir / "daemon.log")
    try:
        yield m
    finally:
        m.cleanup()
        request.getfixturevalue("_fail_on_unexpected_log").add_daemon_log(m.log)
    if m.started and m.image.exists() and fsck_exists():
        proc = zonefs("fsck", str(m.image), check=False)
        assert proc.returncode == 0, f"fsck after the test:\n{proc.stdout}{proc.stderr}"


@pytest.fixture
def mounted(image: Path, mount_factory: Mount) -> Mount:
    """The image, mounted with default options."""
    return mount_factory.start()


def fsync_dir(path: Path) -> None:
    """fsync a directory (makes its entries durable, as checkpointers do after rename)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def keep_test_format(options: tuple[str, ...]) -> tuple[str, ...]:
    """The mount options, with format=4 added on a format 4 run (ZONEFS_TEST_FORMAT=4):
    a mount converts a format 4 image to 5 by default, and that run tests format 4."""
    if TEST_DISK_VERSION == 4 and not any(o.startswith("format=") for o in options):
        return (*options, "format=4")
    return options


# -- the daemonized path (what users run: `zonefs-py mount` without -f) ----------------------

def daemon_mount(image: Path, mountpoint: Path, *options: str, log: Path | None = None,
                 extra_env: dict[str, str] | None = None,
                 check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `zonefs-py mount` (it daemonizes and returns once the mount serves)."""
    cmd = [*ZONEFS, "mount", str(image), str(mountpoint)]
    if log is not None:
        cmd += ["--log-file", str(log)]
    for opt in keep_test_format(options):
        cmd += ["-o", opt]
    proc = subprocess.run(cmd, env={**env(), **(extra_env or {})}, capture_output=True,
                          text=True, timeout=MOUNT_DEADLINE_S * 2, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        pytest.fail(f"zonefs-py mount exited {proc.returncode}:\n{proc.stdout}{proc.stderr}\n"
                    + (log.read_text() if log is not None and log.exists() else "(no log)"))
    return proc


def wait_daemon_gone(image: Path) -> None:
    """Wait (with a deadline) until no daemon holds `image`'s device lock."""
    import fcntl

    from zonefs_py.daemon.runstate import DeviceLock

    path = DeviceLock(str(image)).path
    deadline = time.monotonic() + EXIT_DEADLINE_S
    while True:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                pytest.fail(f"the daemon of {image} still runs {EXIT_DEADLINE_S}s after unmount")
        finally:
            os.close(fd)
        time.sleep(0.05)


def daemon_unmount(image: Path, mountpoint: Path) -> None:
    """Unmount a daemonized mount and wait for its daemon to finish closing the fs."""
    if os.path.ismount(mountpoint) or in_mount_table(mountpoint):
        fusermount_u(mountpoint, check=True)
    wait_daemon_gone(image)
