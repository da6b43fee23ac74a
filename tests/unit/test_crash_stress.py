"""Randomised crash stress (crash_stress.py): concurrent workers, the background
task, checkpoints every 16 KiB of journal, one power cut per run at a random
device write, then fsck and a remount that must hold every acknowledged byte."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from crash_stress import one_run, stress_knobs

#: Both modes in every seed range: even seeds "drop", odd ones "tear".
QUICK_SEEDS = range(1, 13)
SLOW_SEEDS = range(1000, 1300)


async def _runs(tmp_path: Path, seeds: range) -> None:
    undo = stress_knobs()
    logging.disable(logging.CRITICAL)  # each cut logs a screenful of expected errors
    try:
        failures = []
        for seed in seeds:
            problems, _full, _run = await one_run(tmp_path, seed, ("drop", "tear")[seed % 2])
            failures.extend(problems[:5])
        assert not failures, "\n".join(failures)
    finally:
        logging.disable(logging.NOTSET)
        undo()


async def test_crash_stress_quick(tmp_path: Path) -> None:
    await _runs(tmp_path, QUICK_SEEDS)


@pytest.mark.slow
async def test_crash_stress_300_runs(tmp_path: Path) -> None:
    await _runs(tmp_path, SLOW_SEEDS)
