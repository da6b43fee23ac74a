"""An ordinary user makes, mounts, writes, stats and unmounts their own filesystem.

The user is created by the test (and removed after) so this needs root; it
skips, saying so, otherwise. FUSE lets a user mount through the setuid
fusermount3; mkfs makes the root directory theirs, as mke2fs does.
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import REPO, ZONEFS, daemon_mount, daemon_unmount, in_mount_table

pytestmark = pytest.mark.integration

USER = "zonefs-it-user"


@pytest.fixture(scope="module")
def user() -> Iterator[pwd.struct_passwd]:
    if os.geteuid() != 0:
        pytest.skip("creating a test user needs root (the suite does not run as root)")
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed")
    created = False
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                        "/usr/sbin/nologin", USER], check=True, timeout=60)
        created = True
    try:
        pw = pwd.getpwnam(USER)
        try:
            subprocess.run([sys.executable, "-c", "import zonefs_py"], user=pw.pw_uid,
                           group=pw.pw_gid, extra_groups=[], check=True, timeout=60,
                           env={"PYTHONPATH": str(REPO)}, cwd="/", capture_output=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            pytest.skip(f"{sys.executable} cannot run as another user ({exc}); a pyenv "
                        "under /root is not reachable, .ci/install's venv (Debian's "
                        "python3) is")
        yield pw
    finally:
        if created:
            subprocess.run(["userdel", USER], check=False, timeout=60)


def as_user(pw: pwd.struct_passwd, home: Path, *args: str,
            check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `args` as the test user with HOME=home and this checkout importable."""
    environment = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
                   "PYTHONPATH": str(REPO), "LANG": "C.UTF-8"}
    proc = subprocess.run(list(args), env=environment, cwd=home, user=pw.pw_uid,
                          group=pw.pw_gid, extra_groups=[], capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        pytest.fail(f"{args} as {USER} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
    return proc


def test_user_makes_mounts_writes_stats_unmounts(user: pwd.struct_passwd,
                                                 workdir: Path) -> None:
    home = workdir / "home"
    home.mkdir()
    os.chown(home, user.pw_uid, user.pw_gid)
    image, mnt = home / "z.img", home / "mnt"
    z = list(ZONEFS)
    as_user(user, home, "mkdir", str(mnt))
    as_user(user, home, *z, "emu", "create", str(image), "--size", "512M",
            "--zone-size", "16M")
    as_user(user, home, *z, "mkfs", str(image))
    proc = as_user(user, home, *z, "mount", str(image), str(mnt))
    try:
        # Without allow_other only the user may look at the mount (root included).
        assert in_mount_table(mnt), proc.stderr
        owner = as_user(user, home, "stat", "-c", "%u:%g", str(mnt)).stdout.strip()
        assert owner == f"{user.pw_uid}:{user.pw_gid}"
        as_user(user, home, "sh", "-c", f"echo hello > {mnt}/hello && mkdir {mnt}/d")
        doc = json.loads(as_user(user, home, *z, "stat", str(mnt), "--json").stdout)
        assert doc["daemon"]["uid"] == user.pw_uid
        log = home / ".local" / "state" / "zonefs-py" / "z.img.log"
        assert doc["daemon"]["log_file"] == str(log)
        assert doc["user_bytes_written"] >= 6
        text = as_user(user, home, *z, "stat", "--all", str(mnt)).stdout
        assert "Zone map" in text
        assert "write amplification" in as_user(user, home, *z, "stat", str(mnt)).stdout
        prom = as_user(user, home, *z, "stat", str(mnt), "--format", "prometheus").stdout
        assert "zonefs_user_written_bytes_total" in prom
        # Commands stay root-only (the kernel keeps trusted.* for CAP_SYS_ADMIN).
        ctl = as_user(user, home, "python3", "-c",
                      f"import os; os.setxattr({str(mnt)!r}, 'trusted.zonefs.ctl', b'sync')",
                      check=False)
        assert ctl.returncode != 0
        pid = doc["daemon"]["pid"]
        as_user(user, home, "fusermount3", "-u", str(mnt))
        deadline = time.monotonic() + 120
        while os.path.exists(f"/proc/{pid}"):
            assert time.monotonic() < deadline, "the user's daemon did not exit"
            time.sleep(0.05)
        assert "clean shutdown" in log.read_text()
    finally:
        if in_mount_table(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], timeout=60)
    as_user(user, home, *z, "fsck", str(image))


def test_other_users_cannot_read_the_status(user: pwd.struct_passwd, image: Path,
                                            workdir: Path) -> None:
    mnt = workdir / "mnt"
    mnt.mkdir()
    mnt.chmod(0o755)
    daemon_mount(image, mnt, "allow_other", log=workdir / "daemon.log")
    try:
        probe = as_user(user, workdir, "python3", "-c",
                        "import os, sys\n"
                        "try:\n"
                        f"    os.getxattr({str(mnt)!r}, 'user.zonefs.status')\n"
                        "except OSError as e:\n"
                        "    sys.exit(e.errno)\n", check=False)
        assert probe.returncode == errno.EPERM, probe.stderr
        assert os.getxattr(mnt, "user.zonefs.status").startswith(b"{")  # root may
    finally:
        daemon_unmount(image, mnt)
