"""What fsck found: one `Finding` per broken invariant, gathered in a `Report`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

#: progress(phase, done, total)
Progress = Callable[[str, int, int], None]


@dataclass(slots=True)
class Finding:
    """One problem fsck found: the invariant it breaks (INV-n), a message, and whether repair fixes
    it.
    """

    invariant: str
    message: str
    repairable: bool = False


@dataclass(slots=True)
class Report:
    """What a check found, and what it covered (inodes, extents, data blocks)."""

    findings: list[Finding] = field(default_factory=list)
    inodes: int = 0
    extents: int = 0
    data_blocks_checked: int = 0
    fatal: bool = False

    def add(self, invariant: str, message: str, repairable: bool = False) -> None:
        self.findings.append(Finding(invariant, message, repairable))

    @property
    def clean(self) -> bool:
        return not self.findings
