"""Crash torture through real mounts (see torture_lib.py for the cycle and the model).

The default suite runs a short smoke (10 cycles, about 20 s); the slow suite
runs the 50-cycle CI run; `tests/torture/run --seed N --cycles 1000` is the
long run (docs/DESIGN.md section 5).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from torture_lib import PathModel, run_torture

pytestmark = pytest.mark.integration

SEED = int(os.environ.get("ZONEFS_TORTURE_SEED", "20261130"))


def _skip_reason() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed"
    return None


@pytest.fixture
def workdir() -> Iterator[Path]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    base = Path(tempfile.mkdtemp(prefix="zonefs-torture-", dir="/var/tmp"))
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_model_rejects_what_it_must() -> None:
    """The checker itself: torn checkpoints, lost fsync'ed bytes and foreign bytes fail."""
    ckpt = PathModel([b"A" * 100], atomic=True)
    ckpt.add(b"B" * 100)
    assert ckpt.check(b"A" * 100) is None
    assert ckpt.check(b"B" * 100) is None
    assert ckpt.check(b"A" * 50 + b"B" * 50) is not None  # mixed
    assert ckpt.check(b"B" * 99) is not None  # torn
    assert ckpt.check(None) is not None  # a durable version exists
    log = PathModel([b"line1\n"])
    log.add(b"line1\nline2\n")
    assert log.check(b"line1\nline2\n") is None
    assert log.check(b"line1\nli") is None  # unsynced tail partly there
    assert log.check(b"line1\n\0\0\0") is None  # ... or as a hole
    assert log.check(b"line") is not None  # fsync'ed prefix lost
    assert log.check(b"line1\nlinX") is not None  # a byte never written
    assert log.check(b"line1\nline2\nline3\n") is not None  # longer than anything written


@pytest.mark.parametrize("cycles", [10])
def test_crash_torture_smoke(workdir: Path, cycles: int) -> None:
    stats = run_torture(workdir, seed=SEED, cycles=cycles)
    print(f"seed {SEED}: {stats}")
    assert stats.cycles == cycles


@pytest.mark.slow
def test_crash_torture_50_cycles(workdir: Path) -> None:
    stats = run_torture(workdir, seed=SEED + 1, cycles=50)
    print(f"seed {SEED + 1}: {stats}")
    assert stats.cycles == 50
    assert all(stats.modes.values()), stats.modes  # every way of dying was exercised
