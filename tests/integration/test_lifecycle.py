"""Mount lifecycle: persistence, crash recovery, signals, locking, daemon mode, mount(8),
read-only mounts, ENOSPC, the control interface and `zonefs-py stat`."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import EXIT_DEADLINE_S, Mount, fsync_dir, fusermount_u, make_image, zonefs

pytestmark = pytest.mark.integration


def rand_bytes(n: int, seed: int) -> bytes:
    """Deterministic pseudo-random bytes (seed printed by the assertion on failure)."""
    import random

    return random.Random(seed).randbytes(n)


def daemon_pid(image: Path) -> int:
    """The pid of the daemon holding the device lock of `image`."""
    from zonefs_py.daemon import DeviceLock

    return int(Path(DeviceLock(str(image)).path).read_text().strip())


def wait_gone(pid: int) -> None:
    """Wait (with a deadline) until process `pid` has exited."""
    deadline = time.monotonic() + EXIT_DEADLINE_S
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, f"daemon {pid} still running"
        time.sleep(0.02)


def test_persistence_across_remount(mounted: Mount) -> None:
    root = mounted.path
    (root / "d" / "e").mkdir(parents=True)
    files = {f"d/e/f{i}": rand_bytes(100_000 + i * 4099, seed=i) for i in range(10)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    os.symlink("d/e/f1", root / "link")
    os.link(root / "d/e/f2", root / "hard")
    os.setxattr(root / "d", "user.k", b"v")
    os.chmod(root / "d/e/f3", 0o600)
    os.utime(root / "d/e/f4", ns=(5, 6_000_000_007))
    assert mounted.unmount() == 0
    mounted.start()
    for name, data in files.items():
        assert (root / name).read_bytes() == data, name
    assert os.readlink(root / "link") == "d/e/f1"
    assert (root / "hard").stat().st_nlink == 2
    assert os.getxattr(root / "d", "user.k") == b"v"
    assert (root / "d/e/f3").stat().st_mode & 0o777 == 0o600
    assert (root / "d/e/f4").stat().st_mtime_ns == 6_000_000_007


BURST_WRITER = r"""
import os, sys
path = sys.argv[1]
chunk = os.urandom(1 << 20)
i = 0
with open(path, "wb") as f:
    while True:
        f.write(chunk)
        i += 1
        if i == 4:
            print("writing", flush=True)
"""


def test_recovery_after_kill9_keeps_fsynced_data(mounted: Mount) -> None:
    root = mounted.path
    (root / "durable").mkdir()
    files = {f"durable/f{i}": rand_bytes(700_000 + i * 4096, seed=100 + i) for i in range(8)}
    for name, data in files.items():
        with open(root / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    fsync_dir(root / "durable")
    writer = subprocess.Popen([sys.executable, "-c", BURST_WRITER, str(root / "burst")],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "writing"
        mounted.signal(signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait(timeout=60)
        if writer.stdout:
            writer.stdout.close()
    assert not os.path.ismount(root)
    mounted.start()
    for name, data in files.items():
        assert (root / name).read_bytes() == data, name
    # The burst file may hold any prefix of what was written, but it must be readable.
    if (root / "burst").exists():
        (root / "burst").read_bytes()
    assert "recovered" in mounted.log_text()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_unmounts_cleanly(mounted: Mount, signum: int) -> None:
    data = rand_bytes(3 << 20, seed=7)
    (mounted.path / "f").write_bytes(data)  # buffered, no fsync: close() must write it
    assert mounted.signal(signum) == 0
    assert not os.path.ismount(mounted.path)
    assert "clean shutdown" in mounted.log_text()
    mounted.start()
    assert (mounted.path / "f").read_bytes() == data


def test_umount_command_unmounts_cleanly(mounted: Mount) -> None:
    (mounted.path / "f").write_bytes(b"via umount")
    subprocess.run(["umount", str(mounted.path)], check=True, timeout=60)
    assert mounted.wait_exit() == 0
    assert "clean shutdown" in mounted.log_text()


def test_second_mount_of_same_device_is_refused(mounted: Mount, workdir: Path) -> None:
    other = workdir / "mnt2"
    other.mkdir()
    proc = zonefs("mount", "-f", str(mounted.image), str(other), check=False, timeout=60)
    assert proc.returncode == 1
    assert "already mounted" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not os.path.ismount(other)
    assert os.path.ismount(mounted.path)


def test_daemon_mode_returns_once_mounted(image: Path, mount_factory: Mount) -> None:
    mount_factory.started = True  # the teardown fscks the image
    proc = zonefs("mount", str(image), str(mount_factory.path), "--log-file",
                  str(mount_factory.log), timeout=120)
    assert proc.returncode == 0
    pid = daemon_pid(image)
    try:
        assert os.path.ismount(mount_factory.path)
        (mount_factory.path / "f").write_bytes(b"daemon")
        assert (mount_factory.path / "f").read_bytes() == b"daemon"
    finally:
        fusermount_u(mount_factory.path)
        wait_gone(pid)
    assert "clean shutdown" in mount_factory.log.read_text()


def test_daemon_mode_reports_one_line_error(workdir: Path) -> None:
    bogus = workdir / "not-an-image"
    bogus.write_bytes(b"\0" * 65536)
    mnt = workdir / "m"
    mnt.mkdir()
    proc = zonefs("mount", str(bogus), str(mnt), check=False, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.startswith("zonefs-py: ")
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not os.path.ismount(mnt)


def test_unknown_option_is_rejected(image: Path, workdir: Path) -> None:
    mnt = workdir / "m"
    mnt.mkdir()
    proc = zonefs("mount", "-f", str(image), str(mnt), "-o", "bogus_opt=1", check=False)
    assert proc.returncode == 1
    assert "unknown mount option 'bogus_opt'" in proc.stderr


def test_engine_options_are_accepted(image: Path, mount_factory: Mount) -> None:
    m = mount_factory.start("commit=1,checkpoint_mb=8,io_threads=4,cleaner_rate=10,"
                            "cleaner_policy=greedy,max_tasks=8,writeback_cache=off")
    (m.path / "f").write_bytes(b"x" * 100_000)
    assert (m.path / "f").read_bytes() == b"x" * 100_000
    assert "writeback_cache=False, max_tasks=8, min_tasks=8" in m.log_text()


def _fuse_conn(mountpoint: Path) -> Path:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(mountpoint):
            return Path("/sys/fs/fuse/connections") / fields[2].split(":")[1]
    raise AssertionError(f"{mountpoint} is not mounted")


def _wait_knobs(conn: Path, limit: str, threshold: str, m: Mount) -> None:
    """The daemon writes the two knobs one after the other, after INIT: poll
    until both hold (CI once read the threshold between the two writes)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            seen = ((conn / "max_background").read_text().strip(),
                    (conn / "congestion_threshold").read_text().strip())
        except FileNotFoundError:
            seen = ("", "")
        if seen == (limit, threshold):
            return
        assert time.monotonic() < deadline, (seen, m.log_text())
        time.sleep(0.05)


@pytest.mark.skipif(os.geteuid() != 0, reason="fusectl and bdi knobs need root")
def test_connection_is_tuned_after_init(image: Path, mount_factory: Mount) -> None:
    """Readahead 4 MiB and 64 background requests: O_DIRECT readers must not
    hold every background slot and starve a buffered writer's writeback."""
    m = mount_factory.start("io_uring=on,sqpoll_ms=0")
    (m.path / "f").write_bytes(b"y" * 4096)  # the tuning runs after INIT
    conn = _fuse_conn(m.path)
    _wait_knobs(conn, "64", "48", m)
    m.unmount()
    m.start("max_background=20,readahead_kb=1024")
    (m.path / "f").read_bytes()
    conn = _fuse_conn(m.path)
    _wait_knobs(conn, "20", "15", m)


def test_read_only_mount(image: Path, mount_factory: Mount) -> None:
    m = mount_factory.start()
    (m.path / "f").write_bytes(b"before ro")
    assert m.unmount() == 0
    m.start("ro")
    assert (m.path / "f").read_bytes() == b"before ro"
    with pytest.raises(OSError) as info:
        (m.path / "g").write_bytes(b"x")
    assert info.value.errno == errno.EROFS
    assert os.statvfs(m.path).f_flag & os.ST_RDONLY


def test_enospc_when_full(workdir: Path, mount_factory: Mount) -> None:
    make_image(workdir, size="128M", zone_size="8M")
    m = mount_factory.start()
    chunk = rand_bytes(1 << 20, seed=3)
    written = 0

    def fill() -> None:
        nonlocal written
        with open(m.path / "big", "wb") as f:
            while written < 256 << 20:
                f.write(chunk)
                written += len(chunk)
                if written % (8 << 20) == 0:
                    f.flush()
                    os.fsync(f.fileno())

    with pytest.raises(OSError) as info:
        fill()
    assert info.value.errno == errno.ENOSPC
    assert written <= 128 << 20
    os.unlink(m.path / "big")
    fsync_dir(m.path)


def test_stat_cli(mounted: Mount) -> None:
    (mounted.path / "f").write_bytes(rand_bytes(2 << 20, seed=1))
    os.sync()
    human = zonefs("stat", "--all", str(mounted.path)).stdout
    assert "Zones by condition" in human
    assert "Space" in human
    assert "write_amplification" in human
    summary = zonefs("stat", str(mounted.path)).stdout
    assert "write amplification" in summary
    assert "Zones by condition" not in summary
    doc = json.loads(zonefs("stat", "--json", str(mounted.path)).stdout)
    assert mounted.proc is not None
    assert doc["daemon"]["pid"] == mounted.proc.pid
    assert doc["daemon"]["failsafe"] is None
    assert doc["user_bytes_written"] >= 2 << 20
    # "auto" leaves the emulator's out-of-order append model off (it fragments files).
    assert doc["device"]["zone_append"] is False


@pytest.mark.parametrize("mode", ["on", "off"])
def test_zone_append_option(image: Path, mount_factory: Mount, mode: str) -> None:
    m = mount_factory.start(f"zone_append={mode}")
    data = rand_bytes(3 << 20, seed=7)
    (m.path / "f").write_bytes(data)
    doc = json.loads(zonefs("stat", "--json", str(m.path)).stdout)
    assert doc["device"]["zone_append"] is (mode == "on")
    assert (m.path / "f").read_bytes() == data


def test_stat_cli_refuses_other_mounts(workdir: Path) -> None:
    proc = zonefs("stat", str(workdir), check=False)
    assert proc.returncode == 1
    assert "not a mount point" in proc.stderr


def test_status_xattr_is_root_only(image: Path, mount_factory: Mount) -> None:
    m = mount_factory.start("allow_other")
    probe = ("import os,sys\ntry:\n os.getxattr(sys.argv[1],'trusted.zonefs.status')\n"
             "except OSError as e:\n print(e.errno)")
    result = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                             "/usr/bin/python3", "-c", probe, str(m.path)],
                            capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() in (str(errno.ENODATA), str(errno.EPERM)), result.stderr


def test_control_sync(mounted: Mount) -> None:
    (mounted.path / "f").write_bytes(b"x" * 50_000)
    os.setxattr(mounted.path, "trusted.zonefs.ctl", b"sync")
    doc = json.loads(os.getxattr(mounted.path, "trusted.zonefs.status"))
    assert doc["journal"]["pending_bytes"] == 0


def test_control_checkpoint(mounted: Mount) -> None:
    (mounted.path / "f").write_bytes(b"y" * 70_000)
    before = json.loads(os.getxattr(mounted.path, "trusted.zonefs.status"))["journal"]
    os.setxattr(mounted.path, "trusted.zonefs.ctl", b"checkpoint")
    after = json.loads(os.getxattr(mounted.path, "trusted.zonefs.status"))["journal"]
    assert after["checkpoints"] == before["checkpoints"] + 1
    assert after["pending_bytes"] == 0
    assert after["bytes_since_checkpoint"] == 0


def test_control_unknown_command_is_einval(mounted: Mount) -> None:
    with pytest.raises(OSError) as info:
        os.setxattr(mounted.path, "trusted.zonefs.ctl", b"explode")
    assert info.value.errno == errno.EINVAL


@pytest.mark.expect_log("zonefs_py.fs.filesystem", "ERROR", "requested through trusted.zonefs.ctl")
def test_control_failsafe_makes_mount_read_only(mounted: Mount) -> None:
    (mounted.path / "f").write_bytes(b"kept")
    os.setxattr(mounted.path, "trusted.zonefs.ctl", b"sync")
    os.setxattr(mounted.path, "trusted.zonefs.ctl", b"failsafe")
    with pytest.raises(OSError) as info:
        os.mkdir(mounted.path / "d")
    assert info.value.errno == errno.EROFS
    assert (mounted.path / "f").read_bytes() == b"kept"
    doc = json.loads(os.getxattr(mounted.path, "trusted.zonefs.status"))
    assert doc["filesystem"]["failsafe"]
    # A remount clears the failsafe.
    mounted.unmount()
    mounted.start()
    os.mkdir(mounted.path / "d")
    assert (mounted.path / "f").read_bytes() == b"kept"


HELPER = Path("/sbin/mount.fuse.zonefs-py")


@pytest.fixture
def mount_helper() -> Iterator[Path]:
    """Install the mount(8) helper for the test (root only); remove it if we created it."""
    if os.geteuid() != 0:
        pytest.skip("installing /sbin/mount.fuse.zonefs-py needs root")
    existed = HELPER.exists()
    old = HELPER.read_bytes() if existed else None
    zonefs("mount", "--install-helper", "/sbin")
    yield HELPER
    if old is None:
        HELPER.unlink(missing_ok=True)
    else:
        HELPER.write_bytes(old)


def _wait_helper_daemon_gone(image: Path, mnt: Path) -> None:
    pid = daemon_pid(image)
    if os.path.ismount(mnt):
        subprocess.run(["umount", str(mnt)], check=True, timeout=60)
    wait_gone(pid)


def test_mount_t_fuse_zonefs(image: Path, mount_factory: Mount, mount_helper: object,
                             workdir: Path) -> None:
    mount_factory.started = True
    mnt = mount_factory.path
    log = workdir / "helper.log"
    subprocess.run(["mount", "-t", "fuse.zonefs-py", str(image), str(mnt),
                    "-o", f"noatime,commit=2,log_file={log}"], check=True, timeout=120)
    try:
        assert os.path.ismount(mnt)
        fstype = next(line.split()[2] for line in Path("/proc/mounts").read_text().splitlines()
                      if line.split()[1] == str(mnt))
        assert fstype == "fuse.zonefs-py"
        (mnt / "f").write_bytes(b"via mount -t")
    finally:
        _wait_helper_daemon_gone(image, mnt)
    assert "clean shutdown" in log.read_text()


def test_fstab_line(image: Path, mount_factory: Mount, mount_helper: object,
                    workdir: Path) -> None:
    mount_factory.started = True
    mnt = mount_factory.path
    fstab = workdir / "fstab"
    fstab.write_text(f"{image} {mnt} fuse.zonefs-py "
                     "defaults,noauto,_netdev,nofail,x-systemd.automount,commit=3 0 0\n")
    subprocess.run(["mount", "--fstab", str(fstab), str(mnt)], check=True, timeout=120)
    try:
        assert os.path.ismount(mnt)
        (mnt / "f").write_bytes(b"via fstab")
        assert (mnt / "f").read_bytes() == b"via fstab"
    finally:
        _wait_helper_daemon_gone(image, mnt)


def drop_kernel_caches() -> None:
    """Make the kernel forget unused inodes (and so send FORGET for them)."""
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("2\n")


def test_readdirplus_lookup_counts_are_released(mounted: Mount) -> None:
    if not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        pytest.skip("cannot write /proc/sys/vm/drop_caches here")
    d = mounted.path / "d"
    d.mkdir()
    for i in range(300):
        (d / f"f{i}").write_bytes(b"x")
    drop_kernel_caches()
    assert len(os.listdir(d)) == 300  # READDIRPLUS hands the kernel 300 references
    for i in range(300):
        os.unlink(d / f"f{i}")
    os.rmdir(d)
    drop_kernel_caches()
    doc = json.loads(os.getxattr(mounted.path, "trusted.zonefs.status"))
    # Every reference was forgotten, so the unlinked inodes are gone: only the root is left.
    assert doc["filesystem"]["inodes"] == 1


def test_stale_mount_after_kill9_is_explained(mounted: Mount) -> None:
    assert mounted.proc is not None
    mounted.proc.kill()
    mounted.wait_exit()
    proc = zonefs("mount", "-f", str(mounted.image), str(mounted.path), check=False)
    assert proc.returncode == 1
    assert "stale FUSE mount" in proc.stderr
    assert "fusermount3 -u" in proc.stderr
