"""The untar-like dataset of bench/metadata, shared with bench/engine_rss.

A tree of 3 levels (`t000/m00/n00/`), 10 files per leaf directory in name
order, sizes drawn once from a fixed seed: 70% 200 B - 2 KiB, 25% 2 - 32 KiB,
5% 32 - 200 KiB, log-uniform inside each band.
"""

from __future__ import annotations

import math
import random

SIZE_BANDS = ((0.70, 200, 2048), (0.25, 2048, 32768), (0.05, 32768, 204800))
FILES_PER_DIR = 10
FANOUT = 100  # directories per level below the top (3 levels)


def _band(pick: float) -> tuple[int, int]:
    """The (low, high) size of the band a uniform draw `pick` falls in."""
    for share, low, high in SIZE_BANDS:
        if pick < share:
            return low, high
        pick -= share
    return SIZE_BANDS[-1][1], SIZE_BANDS[-1][2]


def dataset_layout(files: int, seed: int = 15) -> list[tuple[str, int]]:
    """(relative path, size) of every file, in creation order (tar order)."""
    rng = random.Random(seed)
    out: list[tuple[str, int]] = []
    for idx in range(files):
        leaf = idx // FILES_PER_DIR
        a, b, c = leaf // (FANOUT * FANOUT), leaf // FANOUT % FANOUT, leaf % FANOUT
        lo, hi = _band(rng.random())
        size = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        out.append((f"t{a:03d}/m{b:02d}/n{c:02d}/s{idx:07d}.bin", size))
    return out
