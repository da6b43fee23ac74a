"""Space written once, not wasted (issue 44), through a real mount: files of round
sizes written with dd take the zones their bytes need and finish none early."""

from __future__ import annotations

import json
import subprocess

import pytest

from .conftest import Mount, zonefs

pytestmark = pytest.mark.integration

MiB = 1 << 20
ZONE = 16 * MiB  # conftest.ZONE_SIZE


def test_dd_of_round_sized_files_wastes_no_zone(mounted: Mount) -> None:
    """Four files of exactly two zones each (dd bs=1M conv=fsync): each spills a few
    blocks past two zones (every zone keeps room for its summary); those blocks
    go on in the next file's zone instead of a zone finished nearly empty (which
    left 12 zones used and half the bytes written wasted)."""
    for i in range(4):
        subprocess.run(["dd", "if=/dev/zero", f"of={mounted.path / f'f{i}'}", "bs=1M",
                        f"count={2 * ZONE // MiB}", "conv=fsync", "status=none"],
                       check=True, timeout=300)
    doc = json.loads(zonefs("stat", "--json", str(mounted.path)).stdout)
    written = 4 * 2 * ZONE
    assert doc["space"]["wasted_by_finish_bytes"] <= written * 2 // 100
    data_zones = sum(1 for c in doc["zone_map"] if c in "Dd")
    assert data_zones == 4 * 2 + 1, doc["zone_map"]
