"""fsck's checks of the recovered metadata (no data read), one per invariant."""

from __future__ import annotations

import stat as statmod
from collections import Counter

from zonefs_py.device.base import Zone, ZoneCond
from zonefs_py.format.constants import INLINE_MAX_BYTES, Stream
from zonefs_py.format.superblock import Superblock
from zonefs_py.fs.api import ROOT_INO
from zonefs_py.fsck.report import Report
from zonefs_py.model.prealloc import mapped_in
from zonefs_py.model.state import State
from zonefs_py.model.tenants import tenant_of, tenant_of_dir


def check_inv2_layout(sb: Superblock, zones: dict[int, Zone], report: Report) -> None:
    """INV-2: superblock, metadata and data zones are sequential and usable."""
    needed = [sb.sb_zone_a, sb.sb_zone_b,
              *range(sb.meta_first_zone, sb.meta_first_zone + sb.meta_zone_count)]
    for idx in needed:
        z = zones.get(idx)
        if z is None or not z.is_sequential:
            report.add("INV-2", f"zone {idx} of the layout is missing or not sequential")
        elif z.cond == ZoneCond.OFFLINE:
            report.add("INV-2", f"metadata zone {idx} is OFFLINE")
    if sb.data_first_zone + sb.data_zone_count > len(zones):
        report.add("INV-2", "data zones run past the end of the device")


def check_inv4_extents_within_wp(sb: Superblock, state: State, zones: dict[int, Zone],
                                 report: Report) -> None:
    """INV-4: every extent lies in a data zone, below that zone's write pointer."""
    bs = state.block_size
    for inode in state.inodes.values():
        if inode.extents is None:
            continue
        for e in inode.extents:
            report.extents += 1
            zone_idx = e.dev // state.zone_size
            z = zones.get(zone_idx)
            end = e.dev + e.nblocks * bs
            if not sb.data_first_zone <= zone_idx < sb.data_first_zone + sb.data_zone_count:
                report.add("INV-4", f"inode {inode.ino}: extent at {e.dev} outside the data zones")
            elif z is None or z.cond == ZoneCond.OFFLINE:
                report.add("INV-4", f"inode {inode.ino}: extent in offline zone {zone_idx}")
            elif end > z.start_bytes + z.written_bytes:
                report.add("INV-4",
                           f"inode {inode.ino}: extent [{e.dev}, {end}) past the write pointer "
                           f"of zone {zone_idx} ({z.start_bytes + z.written_bytes})",
                           repairable=True)


def check_inv5_extents_sorted(state: State, report: Report) -> None:
    """INV-5: the extents of a file are sorted and never overlap; checksums match lengths."""
    for inode in state.inodes.values():
        if inode.extents is None:
            continue
        prev_end = -1
        for e in inode.extents:
            if e.fblock < prev_end:
                report.add("INV-5", f"inode {inode.ino}: overlapping extents at block {e.fblock}")
            if e.csums is not None and len(e.csums) != e.nblocks * 4:
                report.add("INV-5", f"inode {inode.ino}: extent at block {e.fblock} has "
                           f"{len(e.csums) // 4} checksums for {e.nblocks} blocks")
            if e.csums is None and e.dev // state.zone_size not in state.zone_seals:
                report.add("INV-5", f"inode {inode.ino}: extent at block {e.fblock} has no "
                           "checksums and its zone is not sealed")
            prev_end = e.fend


def check_inv6_zone_accounting(state: State, report: Report) -> None:
    """INV-6: a device block belongs to two extents only as the shared-block map
    records it (instant copies); live counts (references) match the extents."""
    bs = state.block_size
    counted: Counter[int] = Counter()
    spans: list[tuple[int, int, int]] = []
    for inode in state.inodes.values():
        if inode.extents is None:
            continue
        for e in inode.extents:
            counted[e.dev // state.zone_size] += e.nblocks
            spans.append((e.dev, e.dev + e.nblocks * bs, inode.ino))
    spans.sort()
    found = _shared_spans(spans, bs, state.zone_size)
    recorded = _merged(state.shared.items(), bs, state.zone_size)
    if found != recorded:
        extra = sorted(set(found) - set(recorded))[:5]
        missing = sorted(set(recorded) - set(found))[:5]
        report.add("INV-6", "device blocks referenced by several extents do not match the "
                   f"shared-block map: unrecorded (offset, blocks, extra) {extra}, recorded "
                   f"but not referenced so {missing}")
    if state.shared.extra_total != sum(n * x for _, n, x in recorded):
        report.add("INV-6", f"shared extra total {state.shared.extra_total} does not match "
                   "its ranges")
    if state.live_blocks_total != sum(state.zone_live_blocks.values()):
        report.add("INV-6", f"live block total {state.live_blocks_total} does not match the "
                   f"zones' {sum(state.zone_live_blocks.values())}")
    for zone, live in state.zone_live_blocks.items():
        if live != counted.get(zone, 0):
            report.add("INV-6", f"zone {zone}: live count {live} but extents hold "
                       f"{counted.get(zone, 0)} blocks")


def _shared_spans(spans: list[tuple[int, int, int]], bs: int, zone_size: int
                  ) -> list[tuple[int, int, int]]:
    """(device offset, blocks, references - 1) of every range more than one span covers."""
    events = sorted([(a, 1) for a, _, _ in spans] + [(b, -1) for _, b, _ in spans])
    out: list[tuple[int, int, int]] = []
    depth = prev = 0
    for pos, delta in events:
        if pos > prev and depth > 1:
            out.append((prev, (pos - prev) // bs, depth - 1))
        depth += delta
        prev = pos
    return _merged(out, bs, zone_size)


def _merged(ranges: list[tuple[int, int, int]], bs: int, zone_size: int
            ) -> list[tuple[int, int, int]]:
    """Join adjacent ranges of equal count inside one zone (a canonical form)."""
    out: list[tuple[int, int, int]] = []
    for dev, n, x in ranges:
        if out:
            pdev, pn, px = out[-1]
            if (pdev + pn * bs == dev and px == x
                    and pdev // zone_size == dev // zone_size):
                out[-1] = (pdev, pn + n, x)
                continue
        out.append((dev, n, x))
    return out


def check_inv9_streams_apart(state: State, report: Report) -> None:
    """INV-9: data of different streams never shares a zone."""
    owners: dict[int, set[int]] = {}
    for inode in state.inodes.values():
        if inode.extents is None:
            continue
        for e in inode.extents:
            owners.setdefault(e.dev // state.zone_size, set()).add(inode.stream)
    report_mixed_streams(state, owners, report)


def report_mixed_streams(state: State, streams_of: dict[int, set[int]],
                         report: Report) -> None:
    """INV-9 findings from zone -> streams of the files with data there."""
    for zone, streams in streams_of.items():
        zone_stream = state.zone_info.get(zone, (Stream.DEFAULT, 0, 0))[0]
        if zone_stream == Stream.CLEANER:
            continue
        if len(streams) > 1 or (streams and zone_stream not in streams):
            names = sorted(_stream_name(s) for s in streams)
            report.add("INV-9", f"zone {zone} ({_stream_name(zone_stream)}) holds data of "
                       f"streams {names}")


def check_inv27_tenants(sb: Superblock, state: State, report: Report) -> None:
    """INV-27: no zone holds live data of two tenants, a tenant's data lies only in
    zones it owns, and the tenant table adds up."""
    check_inv27_tenant_table(sb, state, report)
    if not state.tenants:
        return
    tenants_of: dict[int, set[int]] = {}
    for inode in state.inodes.values():
        if inode.extents is None or not len(inode.extents) or inode.nlink == 0:
            continue  # (an orphan's parent may be lost; it is freed at mount)
        tid = tenant_of(state, inode)
        for e in inode.extents:
            tenants_of.setdefault(e.dev // state.zone_size, set()).add(tid)
    report_mixed_tenants(state, tenants_of, report)


def check_inv27_tenant_table(sb: Superblock, state: State, report: Report) -> None:
    """INV-27's table part: each tenant's directory is a directory, none is inside
    another, min <= max, the reservations fit the data zones, owners are tenants."""
    table = state.tenants
    total_min = 0
    for tid, policy in sorted(table.by_id.items()):
        total_min += policy.min_zones
        d = state.inodes.get(policy.dir_ino)
        if d is None or not d.is_dir:
            report.add("INV-27", f"tenant {tid}'s directory {policy.dir_ino} is not a "
                       "directory")
            continue
        if policy.max_zones and policy.min_zones > policy.max_zones:
            report.add("INV-27", f"tenant {tid} reserves {policy.min_zones} zones, over its "
                       f"cap of {policy.max_zones}")
        outer = tenant_of_dir(state, d.parent) if d.parent != d.ino else 0
        if outer:
            report.add("INV-27", f"tenant {tid}'s directory lies inside tenant {outer}'s")
    if total_min > sb.data_zone_count:
        report.add("INV-27", f"the tenants reserve {total_min} zones, the filesystem has "
                   f"{sb.data_zone_count} data zones")
    for zone, tid in sorted(state.zone_tenant.items()):
        if tid not in table.by_id:
            report.add("INV-27", f"zone {zone} is owned by unknown tenant {tid}")


def report_mixed_tenants(state: State, tenants_of: dict[int, set[int]],
                         report: Report) -> None:
    """INV-27 findings from zone -> tenants of the files with live data there (0: none)."""
    for zone, tids in sorted(tenants_of.items()):
        owner = state.zone_tenant.get(zone, 0)
        declared = tids - {0}
        if len(tids) > 1:
            report.add("INV-27", f"zone {zone} holds live data of tenants {sorted(tids)} "
                       "(0: none)")
        elif declared and owner not in declared:
            report.add("INV-27", f"zone {zone} (owner {owner or 'none'}) holds live data of "
                       f"tenant {min(declared)}")
        elif owner and not declared:
            report.add("INV-27", f"zone {zone} is tenant {owner}'s but holds data of no "
                       "tenant")


def _stream_name(value: int) -> str:
    """The stream's name, or its number when it is no stream (damaged metadata)."""
    try:
        return Stream(value).name
    except ValueError:
        return f"unknown stream {value}"


def check_inv11_namespace(state: State, report: Report) -> None:
    """INV-11: the tree is connected and acyclic; link counts match the entries."""
    root = state.inodes.get(ROOT_INO)
    if root is None or not root.is_dir:
        report.add("INV-11", "the root directory is missing")
        return
    refs: Counter[int] = Counter()
    subdirs: Counter[int] = Counter()
    for d in state.inodes.values():
        if d.entries is None:
            continue
        for name, child in d.entries.items():
            c = state.inodes.get(child)
            if c is None:
                report.add("INV-11", f"entry {name!r} in directory {d.ino} names missing "
                           f"inode {child}", repairable=True)
                continue
            refs[child] += 1
            if c.is_dir:
                subdirs[d.ino] += 1
                if c.parent != d.ino:
                    report.add("INV-11", f"directory {child} is listed in {d.ino} but its "
                               f"parent is {c.parent}")
    seen = {ROOT_INO}
    stack = [ROOT_INO]
    while stack:
        d = state.inodes[stack.pop()]
        for child in (d.entries or {}).values():
            c = state.inodes.get(child)
            if c is not None and c.is_dir:
                if child in seen:
                    report.add("INV-11", f"directory {child} is reachable twice (a loop)")
                    continue
                seen.add(child)
                stack.append(child)
    for inode in state.inodes.values():
        if inode.ino == ROOT_INO:
            continue
        if inode.is_dir:
            if refs[inode.ino] != 1:
                report.add("INV-11", f"directory {inode.ino} has {refs[inode.ino]} names")
            elif inode.ino not in seen:
                report.add("INV-11", f"directory {inode.ino} is not reachable from the root")
            want = 2 + subdirs[inode.ino]
        else:
            want = refs[inode.ino]
        if want == 0 and inode.nlink == 0:
            # Unlinked while open before a crash: every mount frees it (DESIGN.md 3.4, step 5).
            continue
        if want == 0:
            report.add("INV-11", f"inode {inode.ino} is an orphan (no names)", repairable=True)
        elif inode.nlink != want:
            report.add("INV-11", f"inode {inode.ino} has nlink {inode.nlink}, expected {want}",
                       repairable=True)
    if root.nlink != 2 + subdirs[ROOT_INO]:
        report.add("INV-11", f"root has nlink {root.nlink}, expected {2 + subdirs[ROOT_INO]}",
                   repairable=True)


def check_inv13_file_types(state: State, report: Report) -> None:
    """INV-13: symlinks have targets of their size; only regular files have data."""
    for inode in state.inodes.values():
        fmt = statmod.S_IFMT(inode.mode)
        if fmt == statmod.S_IFLNK:
            if inode.target is None or inode.size != len(inode.target):
                report.add("INV-13", f"symlink {inode.ino} has no target or a wrong size")
        elif inode.target is not None:
            report.add("INV-13", f"inode {inode.ino} is not a symlink but has a target")
        if fmt not in (statmod.S_IFREG, statmod.S_IFDIR, statmod.S_IFLNK, statmod.S_IFIFO,
                       statmod.S_IFSOCK, statmod.S_IFCHR, statmod.S_IFBLK):
            report.add("INV-13", f"inode {inode.ino} has unknown file type {fmt:o}")


def check_inv21_drain_records(state: State, report: Report) -> None:
    """INV-21: drain records name s3:// objects; an EVICTED file has no extents and
    the size of its object; DRAINED/EVICTED records carry an ETag."""
    from zonefs_py.model.drain import DrainState

    for ino, rec in state.drain.items():
        inode = state.inodes.get(ino)
        if inode is None or not inode.is_reg:
            report.add("INV-21", f"drain record of inode {ino}, which is not a regular file")
            continue
        if rec.state in (DrainState.DRAINED, DrainState.EVICTED) and \
                (not rec.url.startswith(b"s3://") or not (rec.token or rec.moving_to)
                 or (rec.moving_to and not rec.moving_to.startswith(b"s3://"))):
            report.add("INV-21", f"inode {ino} is {rec.state.name} without an object URL "
                                 "or ETag")
        if rec.state == DrainState.EVICTED:
            if inode.extents is not None and inode.extents.mapped_blocks:
                report.add("INV-21", f"evicted inode {ino} still maps "
                                     f"{inode.extents.mapped_blocks} blocks")
            if inode.size != rec.size:
                report.add("INV-21", f"evicted inode {ino} has size {inode.size}, its object "
                                     f"{rec.size}")


def check_inv22_inline_data(state: State, report: Report) -> None:
    """INV-22: inline bytes belong to a regular file without extents, are at most
    INLINE_MAX_BYTES, and never longer than the file."""
    for inode in state.inodes.values():
        if not inode.inline:
            continue
        if not inode.is_reg:
            report.add("INV-22", f"inode {inode.ino} has inline data but is not a regular file")
        elif inode.extents is not None and len(inode.extents):
            report.add("INV-22", f"inode {inode.ino} has inline data and extents")
        if len(inode.inline) > INLINE_MAX_BYTES:
            report.add("INV-22", f"inode {inode.ino} has {len(inode.inline)} inline bytes "
                                 f"(at most {INLINE_MAX_BYTES})")
        if len(inode.inline) > inode.size:
            report.add("INV-22", f"inode {inode.ino}: {len(inode.inline)} inline bytes, longer "
                                 f"than the file ({inode.size} bytes)")


def check_inv24_reservations(sb: Superblock, state: State, zones: dict[int, Zone],
                             report: Report) -> None:
    """INV-24: reserved ranges belong to regular files, are sorted and disjoint; the
    held counts (reserved blocks no extent maps) add up; live + held fit the data zones."""
    res = state.prealloc
    total = 0
    for ino, ranges in res.ranges.items():
        inode = state.inodes.get(ino)
        if inode is None or inode.extents is None:
            report.add("INV-24", f"reservations of inode {ino}, which is no regular file")
            continue
        prev_end = -1
        for lo, hi in ranges:
            if not 0 <= lo < hi or lo <= prev_end:
                report.add("INV-24", f"inode {ino}: reserved ranges {ranges} are not sorted, "
                           "disjoint and non-empty")
                break
            prev_end = hi
        held = sum(hi - lo - mapped_in(inode.extents, lo, hi, state.block_size)
                   for lo, hi in ranges)
        total += held
        if res.held.get(ino, 0) != held:
            report.add("INV-24", f"inode {ino}: {res.held.get(ino, 0)} held blocks counted, "
                       f"its ranges and extents give {held}")
    stray = sorted(set(res.held) - set(res.ranges))
    if stray:
        report.add("INV-24", f"held counts without ranges: {stray}")
    if res.held_total != total:
        report.add("INV-24", f"held block total {res.held_total}, the files' sum is {total}")
    capacity = sum(z.capacity_bytes for i, z in zones.items()
                   if i >= sb.data_first_zone) // state.block_size
    distinct = state.live_blocks_total - state.shared.extra_total  # copies count once
    if distinct + total > capacity:
        report.add("INV-24", f"live ({distinct}) and held ({total}) blocks "
                   f"exceed the data zones' {capacity}")
