"""The crash harnesses' shared parts: fresh images, fsck findings, power-cut detection.

Used by tests/unit (engine_helpers, crash_stress), tests/reliability (helpers)
and tests/torture (torture_lib), so that "make an image", "what does fsck say
about the crashed image" and "did the device lose power" mean the same thing
in every crash test. Importable as `crashlib`: pytest puts tests/ on sys.path
(tests/conftest.py lives there); scripts that run outside pytest insert it.

Findings are rendered as 'INV-n: message', the invariant fsck names
(docs/DESIGN.md's invariant index).
"""

from __future__ import annotations

import os
from pathlib import Path

from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.format.constants import INDEX_DISK_VERSION, MIN_INDEX_META_ZONES, MKFS_DISK_VERSION
from zonefs_py.fs.mkfs import make_filesystem
from zonefs_py.fsck import Report, check_filesystem
from zonefs_py.journal.recovery import read_superblock

MiB = 1 << 20


#: On-disk format of the images the tests make: ZONEFS_TEST_FORMAT=4 runs a suite
#: on format 4 (the whole namespace in memory) instead of the default, format 5.
TEST_DISK_VERSION = int(os.environ.get("ZONEFS_TEST_FORMAT", MKFS_DISK_VERSION))


def new_image(path: Path, *, size_bytes: int = 64 * MiB, zone_size_bytes: int = 2 * MiB,
              block_size: int = 4096, max_active: int = 0,
              meta_zones: int | None = None, disk_version: int | None = None) -> None:
    """Create an emulated image at `path` holding a fresh filesystem (closed again)."""
    dev = EmulatedZonedDevice.create(path, size_bytes=size_bytes,
                                     zone_size_bytes=zone_size_bytes, block_size=block_size,
                                     max_active=max_active)
    version = disk_version or TEST_DISK_VERSION
    if version == INDEX_DISK_VERSION and meta_zones is not None:
        # Geometries sized for format 4's log; format 5 keeps its index beside it.
        meta_zones = max(meta_zones + 3, MIN_INDEX_META_ZONES)
    try:
        make_filesystem(dev, meta_zones=meta_zones, disk_version=version)
    finally:
        dev.close()


def fsck_report(path: Path, *, check_data: bool = True) -> Report:
    """Run check_filesystem on a closed image, opened read-only, with the whole
    namespace loaded. A format-5 image found clean is also checked in bounded
    memory (fsck/bounded.py, what `zonefs-py fsck` runs on it, with the same
    data checks), which must find it clean too."""
    dev = EmulatedZonedDevice.open(path, read_only=True)
    try:
        report = check_filesystem(dev, check_data=check_data, bounded=False)
        if report.clean and not report.fatal and read_superblock(dev)[0].has_index:
            bounded = check_filesystem(dev, check_data=check_data, bounded=True)
            if not bounded.clean:
                report.findings.extend(bounded.findings)
                report.add("fsck", "the bounded fsck (--no-data, format 5) disagrees")
        return report
    finally:
        dev.close()


def findings_text(report: Report) -> list[str]:
    """A report's findings as 'INV-n: message' lines (empty when it is clean)."""
    return [f"{f.invariant}: {f.message}" for f in report.findings]


def fsck_findings(path: Path, *, check_data: bool = True) -> list[str]:
    """fsck a closed image read-only; return its findings as 'INV-n: message'."""
    return findings_text(fsck_report(path, check_data=check_data))


def power_was_cut(dev: EmulatedZonedDevice) -> bool:
    """True once an emulated device lost power (a cut hook fired, or it is dead)."""
    return bool(getattr(dev, "power_cut", False) or getattr(dev, "_dead", False))
