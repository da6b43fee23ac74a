"""docs/SPEC.md states the on-disk format version the code writes (DISK_VERSION)."""

from __future__ import annotations

import re
from pathlib import Path

from zonefs_py.format.constants import DISK_VERSION

SPEC = Path(__file__).resolve().parents[2] / "docs" / "SPEC.md"


def test_spec_states_the_code_disk_version() -> None:
    text = SPEC.read_text(encoding="utf-8")
    found = re.findall(r"`?DISK_VERSION`?\s*(?:=|is)\s*`?(\d+)", text)
    assert found, f"{SPEC} has no line like '`DISK_VERSION` = 1'"
    assert {int(v) for v in found} == {DISK_VERSION}, (
        f"SPEC.md says DISK_VERSION {found}, the code writes {DISK_VERSION}")
