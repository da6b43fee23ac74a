"""Offline consistency checks, one per numbered invariant of docs/DESIGN.md.

`check_filesystem(dev)` recovers the metadata read-only (exactly as a mount
would), then runs every `check_inv*` function over the result and returns a
`Report`. `repair_filesystem(dev)` mounts, fixes what can be fixed without
guessing (link counts, orphans, extents that point past a write pointer,
a damaged log tail), and writes a fresh checkpoint.

Each finding names its invariant, so a test can corrupt one thing and assert
that exactly that checker flags it. Modules: `report` (Finding, Report),
`metadata` (the checks of the recovered metadata), `data` (the checks that read
the device: zone summaries, data checksums), `repair`.
"""

from __future__ import annotations

from zonefs_py import errors
from zonefs_py.device.base import ZonedDevice
from zonefs_py.fsck.bounded import check_bounded
from zonefs_py.fsck.data import (
    check_inv12_data_checksums,
    check_inv23_zone_summaries,
    check_inv25_namespace_index,
    check_inv26_lazy_records,
)
from zonefs_py.fsck.metadata import (
    check_inv2_layout,
    check_inv4_extents_within_wp,
    check_inv5_extents_sorted,
    check_inv6_zone_accounting,
    check_inv9_streams_apart,
    check_inv11_namespace,
    check_inv13_file_types,
    check_inv21_drain_records,
    check_inv22_inline_data,
    check_inv24_reservations,
    check_inv27_tenant_table,
    check_inv27_tenants,
)
from zonefs_py.fsck.repair import repair_filesystem
from zonefs_py.fsck.report import Finding, Progress, Report
from zonefs_py.journal.recovery import read_superblock, recover

__all__ = ["Finding", "Progress", "Report", "check_filesystem", "repair_filesystem"]


#: Inodes a bounded fsck's lazy State keeps (fsck/bounded.py).
BOUNDED_INODE_CACHE = 4096


def check_filesystem(dev: ZonedDevice, *, check_data: bool = True,
                     progress: Progress | None = None,
                     bounded: bool | None = None) -> Report:
    """Run every check; never raises for damage (it becomes a Finding).

    `bounded`: stream a format-5 image's namespace index instead of loading
    it (fsck/bounded.py: memory no longer grows ~1 KiB per file), data checks
    (INV-12) a batch of inodes at a time; None (default): when the image is
    format 5. False: load it whole (the tests compare the two)."""
    report = Report()
    try:
        sb, _store = read_superblock(dev)
    except errors.NotAFilesystem as exc:
        report.add("INV-1", str(exc))
        report.fatal = True
        return report
    except errors.CorruptionError as exc:
        report.add("INV-1", str(exc))
        report.fatal = True
        return report
    if bounded is None:
        bounded = sb.has_index
    try:
        rec = recover(dev, progress=(lambda done, total: progress("replaying the log", done,
                                                                   total)) if progress else None,
                      inode_cache=BOUNDED_INODE_CACHE if bounded else 0)
    except errors.CorruptionError as exc:
        report.add("INV-3", str(exc), repairable=True)
        report.fatal = True
        return report
    zones = {z.index: z for z in dev.report_zones()}
    state = rec.state
    if state.lazy:
        check_inv2_layout(sb, zones, report)
        check_bounded(sb, rec, zones, report, progress, dev if check_data else None)
        check_inv21_drain_records(state, report)
        check_inv24_reservations(sb, state, zones, report)
        check_inv27_tenant_table(sb, state, report)  # (the zones: in check_bounded)
        check_inv23_zone_summaries(dev, state, zones, report, read=not check_data)
        check_inv25_namespace_index(range(sb.meta_first_zone, sb.meta_first_zone
                                          + sb.meta_zone_count), rec, report)
        return report
    report.inodes = len(state.inodes)
    check_inv2_layout(sb, zones, report)
    check_inv4_extents_within_wp(sb, state, zones, report)
    check_inv5_extents_sorted(state, report)
    check_inv6_zone_accounting(state, report)
    check_inv9_streams_apart(state, report)
    check_inv11_namespace(state, report)
    check_inv13_file_types(state, report)
    check_inv21_drain_records(state, report)
    check_inv22_inline_data(state, report)
    check_inv24_reservations(sb, state, zones, report)
    check_inv27_tenants(sb, state, report)
    check_inv23_zone_summaries(dev, state, zones, report, read=not check_data)
    check_inv25_namespace_index(range(sb.meta_first_zone, sb.meta_first_zone
                                      + sb.meta_zone_count), rec, report)
    check_inv26_lazy_records(rec, report)
    if check_data:
        check_inv12_data_checksums(dev, rec, report, progress)
    return report
