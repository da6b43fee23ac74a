"""Install the way users do: a fresh virtualenv, `pip install` of this checkout with
whatever pip resolves today, then mount from it (daemonized) and use the mount.

This is the test that fails when a dependency's newest release breaks us
(trio 0.35 rejected `to_thread.run_sync(cancellable=)` while the machine's
system trio 0.22 hid it). Slow: it builds the native extension and pyfuse3.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import REPO, fusermount_u, in_mount_table, wait_daemon_gone

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def run(*args: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    proc = subprocess.run(list(args), cwd=cwd, env=environment, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
    return proc


def test_fresh_venv_install_then_mount(workdir: Path) -> None:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout (its tracked files are what gets installed)")
    src = workdir / "src"
    src.mkdir()
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.split(b"\0")
    for name in filter(None, files):
        target = src / os.fsdecode(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / os.fsdecode(name), target)
    base_py = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3"
    venv = workdir / "venv"
    run(base_py, "-m", "venv", str(venv), cwd=workdir)
    run(str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", str(src),
        cwd=workdir)
    versions = run(str(venv / "bin" / "pip"), "list", "--format=freeze", cwd=workdir).stdout
    print("resolved:", " ".join(line for line in versions.split()
                                if line.split("==")[0].lower() in
                                ("cffi", "pyfuse3", "trio", "xxhash", "prometheus-client",
                                 "prometheus_client")))
    zonefs = str(venv / "bin" / "zonefs-py")
    image, mnt, log = workdir / "z.img", workdir / "mnt", workdir / "daemon.log"
    mnt.mkdir()
    run(zonefs, "emu", "create", str(image), "--size", "512M", "--zone-size", "16M", cwd=workdir)
    run(zonefs, "mkfs", str(image), cwd=workdir)
    run(zonefs, "mount", str(image), str(mnt), "--log-file", str(log), cwd=workdir)
    try:
        assert os.path.ismount(mnt), log.read_text()
        (mnt / "hello").write_bytes(b"x" * 100_000)
        assert (mnt / "hello").read_bytes() == b"x" * 100_000
        doc = json.loads(run(zonefs, "stat", str(mnt), "--json", cwd=workdir).stdout)
        assert doc["user_bytes_written"] >= 100_000
    finally:
        if in_mount_table(mnt):
            fusermount_u(mnt)
        wait_daemon_gone(image)
    run(zonefs, "fsck", str(image), cwd=workdir)
