"""docs/SPEC.md states the on-disk format versions of the code: DISK_VERSION (the
newest whole-namespace version) and the one mkfs writes (MKFS_DISK_VERSION)."""

from __future__ import annotations

import re
from pathlib import Path

from zonefs_py.format.constants import DISK_VERSION, MKFS_DISK_VERSION

SPEC = Path(__file__).resolve().parents[2] / "docs" / "SPEC.md"


def test_spec_states_the_code_disk_version() -> None:
    text = SPEC.read_text(encoding="utf-8")
    found = re.findall(r"(?<![A-Z_])`?DISK_VERSION`?\s*(?:=|is)\s*`?(\d+)", text)
    assert found, f"{SPEC} has no line like '`DISK_VERSION` = 1'"
    assert {int(v) for v in found} == {DISK_VERSION}, (
        f"SPEC.md says DISK_VERSION {found}, the code's is {DISK_VERSION}")
    mkfs = re.findall(r"mkfs writes version (\d+) by default \(`MKFS_DISK_VERSION`\)",
                      " ".join(text.split()))
    assert mkfs == [str(MKFS_DISK_VERSION)], (
        f"SPEC.md says mkfs writes {mkfs}, the code {MKFS_DISK_VERSION}")
