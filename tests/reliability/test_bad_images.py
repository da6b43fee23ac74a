"""Bad images: the fuzzer of fuzz_images.py, in a subprocess (so a hang or a crash is caught).

Default suite: 1,000 mutations (~15 s), a quarter of them of sealed zones'
summary and data blocks only; slow suite: 10,000 (the documented long run
is `python3 tests/reliability/fuzz_images.py --iterations N --seed S`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FUZZER = Path(__file__).with_name("fuzz_images.py")
REPO = Path(__file__).resolve().parents[2]


def _fuzz(tmp_path: Path, iterations: int, seed: int, timeout_s: float) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(FUZZER), "--iterations", str(iterations),
                           "--seed", str(seed), "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    print(proc.stdout.splitlines()[-1] if proc.stdout else proc.stderr[-2000:])
    assert proc.returncode == 0, f"seed {seed}:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"


def test_fuzz_1000_mutated_images(tmp_path: Path) -> None:
    _fuzz(tmp_path, 1000, seed=11, timeout_s=600)


@pytest.mark.slow
def test_fuzz_10000_mutated_images(tmp_path: Path) -> None:
    _fuzz(tmp_path, 10_000, seed=12, timeout_s=1800)
