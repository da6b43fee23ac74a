"""The smoke set, on the path users take: `zonefs-py mount` daemonizes, a checkpoint is
saved (write + fsync + rename), the filesystem is remounted and read back, fsck passes.

`.ci/floor-smoke` runs this file on the lowest dependency versions setup.py
declares; the default suite runs it on the newest.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from .conftest import daemon_mount, daemon_unmount, fsync_dir, zonefs

pytestmark = [pytest.mark.integration, pytest.mark.smoke]


def test_mount_checkpoint_remount_fsck(image: Path, workdir: Path) -> None:
    mnt = workdir / "mnt"
    mnt.mkdir()
    log = workdir / "daemon.log"
    blob = os.urandom(1 << 20) * 3 + b"tail"
    proc = daemon_mount(image, mnt, log=log)
    try:
        # Returned 0: serving already, no waiting needed.
        assert os.path.ismount(mnt), proc.stderr
        (mnt / "ckpt").mkdir()
        tmp, final = mnt / "ckpt" / "step-1.pt.tmp", mnt / "ckpt" / "step-1.pt"
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final)
        fsync_dir(mnt / "ckpt")
        doc = json.loads(zonefs("stat", str(mnt), "--json").stdout)
        assert doc["daemon"]["log_file"] == str(log)
        assert doc["user_bytes_written"] >= len(blob)
    finally:
        daemon_unmount(image, mnt)
    assert "is serving" in log.read_text()
    daemon_mount(image, mnt, log=log)
    try:
        assert (mnt / "ckpt" / "step-1.pt").read_bytes() == blob
        assert not (mnt / "ckpt" / "step-1.pt.tmp").exists()
    finally:
        daemon_unmount(image, mnt)
    proc = zonefs("fsck", str(image), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
