"""fio with xxhash verification against a real mount: seq write 1 MiB, randwrite 4 KiB,
randread of the sequential file, and a mixed random read/write job, for each I/O engine."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import Mount

pytestmark = pytest.mark.integration

JOB_FILE = Path(__file__).with_name("fio_verify.fio")


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
@pytest.mark.parametrize("engine", ["psync", "libaio", "mmap"])
def test_fio_verify(mounted: Mount, engine: str) -> None:
    env = dict(os.environ, ZONEFS_DIR=str(mounted.path), ENGINE=engine, SEQ_SIZE="64m")
    proc = subprocess.run(["fio", "--output-format=normal", str(JOB_FILE)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "verify:" not in proc.stderr
    for job in ("seqwrite", "randwrite", "randread", "mixed"):
        assert f"{job}: (groupid=" in proc.stdout
    assert proc.stdout.count(" err= 0:") == 4
