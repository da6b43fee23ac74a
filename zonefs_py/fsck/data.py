"""fsck's checks that read the device: zone summaries (INV-23), data checksums (INV-12),
the namespace index of format 5 (INV-25)."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

from zonefs_py.device.base import Zone, ZonedDevice
from zonefs_py.errors import CorruptionError
from zonefs_py.format import zonesum
from zonefs_py.format.checksum import first_bad_block
from zonefs_py.format.constants import LENDING_DISK_VERSION
from zonefs_py.format.nsindex import (
    END_PREFIX,
    OWNERS_PREFIX,
    IndexRecordError,
    decode_owners,
    split_owners_key,
)
from zonefs_py.fsck.report import Progress, Report
from zonefs_py.index.errors import IndexCorrupt
from zonefs_py.journal.recovery import Recovered
from zonefs_py.model.extents import Extent
from zonefs_py.model.inode import Inode
from zonefs_py.model.state import State


def read_zone_summary(dev: ZonedDevice, state: State, zone: int
                      ) -> list[bytes | None] | None:
    """The checksums of each summary block of a sealed zone (None for a damaged
    block), or None if the summary cannot be read at all."""
    resets, data_blocks = state.zone_seals[zone]
    bs = state.block_size
    nsum = zonesum.sum_blocks(data_blocks, bs)
    try:
        raw = dev.read(zone * state.zone_size + data_blocks * bs, nsum * bs)
    except OSError:
        return None
    mv = memoryview(raw)
    return [zonesum.decode_block(mv[k * bs:(k + 1) * bs], zone, resets, k, data_blocks)
            for k in range(nsum)]


def check_inv23_zone_summaries(dev: ZonedDevice, state: State, zones: dict[int, Zone],
                               report: Report, read: bool = True) -> None:
    """INV-23: a sealed zone is sealed for its current reset count, its summary lies
    below its write pointer after its data, and (with `read`) every summary block
    is intact (INV-12 reads them itself when it checks data)."""
    bs = state.block_size
    for zone, (resets, data_blocks) in sorted(state.zone_seals.items()):
        info = state.zone_info.get(zone)
        if info is None or info[2] != resets:
            report.add("INV-23", f"zone {zone} is sealed for reset {resets}, "
                       f"but is at reset {info[2] if info else 'unknown'}")
            continue
        z = zones.get(zone)
        end = zonesum.summary_end(data_blocks, bs)
        if not state.zone_live_blocks.get(zone):
            # Nothing reads it. (It may be stale: the zone reset, maybe written
            # again, and the records of that lost in a crash; the mount resets it.)
            continue
        if z is None or z.written_bytes < end:
            report.add("INV-23", f"the summary of zone {zone} ends at {end} bytes into the "
                       f"zone, past its write pointer "
                       f"({z.written_bytes if z is not None else 'no zone'})")
            continue
        if read:
            _check_summary_blocks(dev, state, zone, report)


def _check_summary_blocks(dev: ZonedDevice, state: State, zone: int, report: Report
                          ) -> list[bytes | None] | None:
    blocks = read_zone_summary(dev, state, zone)
    if blocks is None:
        report.add("INV-23", f"the summary of zone {zone} cannot be read")
        return None
    for k, csums in enumerate(blocks):
        if csums is None:
            report.add("INV-23", f"summary block {k} of zone {zone} is damaged")
    return blocks


def check_inv12_data_checksums(dev: ZonedDevice, rec: Recovered, report: Report,
                               progress: Progress | None) -> None:
    """INV-12: every stored data block matches its checksum (from the extent, or
    from the zone's summary for a sealed zone: INV-23 findings for damaged ones)."""
    state = rec.state
    by_zone = extents_by_zone(state.inodes.values(), state.zone_size)
    total = sum(e.nblocks for exts in by_zone.values() for _, e in exts)
    DataCheck(dev, state, report, progress, total).check(by_zone)


def extents_by_zone(inodes: Iterable[Inode], zone_size: int
                    ) -> dict[int, list[tuple[int, Extent]]]:
    """(inode, extent) pairs of `inodes` per data zone."""
    by_zone: dict[int, list[tuple[int, Extent]]] = {}
    for inode in inodes:
        if inode.extents is not None:
            for e in inode.extents:
                by_zone.setdefault(e.dev // zone_size, []).append((inode.ino, e))
    return by_zone


class DataCheck:
    """INV-12 over extents given a zone's worth at a time (`check`): all of them at
    once (a loaded namespace), or a batch of inodes at a time (fsck/bounded.py).
    A sealed zone's summary is read once for its first extents, its INV-23
    findings reported then; SUMMARIES_KEPT summaries stay for later batches."""

    SUMMARIES_KEPT = 16

    def __init__(self, dev: ZonedDevice, state: State, report: Report,
                 progress: Progress | None, total_blocks: int) -> None:
        self.dev = dev
        self.state = state
        self.report = report
        self.progress = progress
        self.total = total_blocks
        self.done = 0
        self._summaries: OrderedDict[int, list[bytes | None] | None] = OrderedDict()
        self._summaries_read: set[int] = set()

    def _summary(self, zone: int) -> list[bytes | None] | None:
        if zone in self._summaries:
            self._summaries.move_to_end(zone)
            return self._summaries[zone]
        if zone in self._summaries_read:  # reported once already
            summary = read_zone_summary(self.dev, self.state, zone)
        else:
            self._summaries_read.add(zone)
            summary = _check_summary_blocks(self.dev, self.state, zone, self.report)
        self._summaries[zone] = summary
        while len(self._summaries) > self.SUMMARIES_KEPT:
            self._summaries.popitem(last=False)
        return summary

    def check(self, by_zone: dict[int, list[tuple[int, Extent]]]) -> None:
        """Read and verify these extents, zone by zone in device order."""
        state = self.state
        report = self.report
        dev = self.dev
        bs = state.block_size
        zsize = state.zone_size
        step = 1 << 24
        for zone in sorted(by_zone):
            summary: list[bytes | None] | None = None
            if zone in state.zone_seals:
                summary = self._summary(zone)
            for ino, e in sorted(by_zone[zone], key=lambda x: x[1].dev):
                for off in range(0, e.nblocks * bs, step):
                    n = min(step, e.nblocks * bs - off)
                    first = off // bs
                    nb = n // bs
                    if e.csums is not None:
                        csums: bytes | None = e.csums[first * 4:(first + nb) * 4]
                    else:
                        rel = (e.dev - zone * zsize) // bs + first
                        csums = _summary_checksums(summary, bs, rel, nb)
                    if csums is None:
                        report.add("INV-12", f"inode {ino}: no intact summary checksums for "
                                   f"file offsets {(e.fblock + first) * bs} to "
                                   f"{(e.fblock + first + nb) * bs}")
                        self.done += nb
                        continue
                    try:
                        data = dev.read(e.dev + off, n)
                    except OSError as exc:
                        report.add("INV-12", f"inode {ino}: read error at file offset "
                                   f"{e.fblock * bs + off}: {exc}")
                        continue
                    bad = first_bad_block(data, bs, csums)
                    if bad is not None:
                        report.add("INV-12", f"inode {ino}: checksum mismatch at file offset "
                                   f"{(e.fblock + first + bad) * bs}")
                    self.done += nb
                    report.data_blocks_checked += nb
                    if self.progress:
                        self.progress("data", self.done, max(self.total, self.done))


def _summary_checksums(summary: list[bytes | None] | None, block_size: int, rel: int,
                       nblocks: int) -> bytes | None:
    """Checksums of zone blocks [rel, rel+nblocks) from a summary, None if any of
    the summary blocks holding them is damaged or missing."""
    if summary is None:
        return None
    out = bytearray()
    for k, a, b in zonesum.covering(rel, nblocks, block_size):
        block = summary[k] if k < len(summary) else None
        if block is None or len(block) < b * 4:
            return None
        out += block[a * 4:b * 4]
    return bytes(out)


def check_inv25_namespace_index(sb_meta: range, rec: Recovered, report: Report) -> None:
    """INV-25 (format 5): every page the index's root reaches decodes, lies in a
    meta zone the newest CHECKPOINT_INDEX lists, and each listed zone's live page
    count equals the pages the tree references there. (The mount's load already
    read every leaf and checked levels and separators.)"""
    index = rec.index
    if index is None:
        return
    counts: Counter[int] = Counter()
    zone_size = index.store.zone_size
    try:
        for address in index.tree.page_addresses():
            counts[address // zone_size] += 1
    except CorruptionError as exc:
        report.add("INV-25", f"namespace index: {exc}")
        return
    sb = rec.sb
    # Format 6: data zones lent to the index hold its pages too, and no live data.
    lending = sb.disk_version >= LENDING_DISK_VERSION
    data_zones = range(sb.data_first_zone, sb.data_first_zone + sb.data_zone_count)
    for zone in sorted(counts):
        if (zone not in sb_meta and not (lending and zone in data_zones)) \
                or zone not in index.store.live:
            report.add("INV-25", f"index pages in zone {zone}, which is no index zone")
        elif zone in data_zones and rec.state.zone_live_blocks.get(zone):
            report.add("INV-25", f"data zone {zone} lent to the index holds live data "
                       f"({rec.state.zone_live_blocks[zone]} blocks)")
    for zone, recorded in sorted(index.store.live.items()):
        if counts.get(zone, 0) != recorded:
            report.add("INV-25", f"index zone {zone}: the checkpoint records {recorded} live "
                       f"pages, the tree references {counts.get(zone, 0)}")


def check_inv26_lazy_records(rec: Recovered, report: Report) -> None:
    """INV-26 (format 5, a self-contained index): what a lazy mount trusts instead
    of the whole namespace matches it. The checkpoint's INODE_COUNT and ZONE_LIVE
    ops equal the counts of the loaded namespace, its RESIDENT ops list every
    inode a mount must load at once, and each zone's owner list in the index
    holds every inode with extents there. Checked when no journal follows the
    checkpoint (the replayed ops changed the namespace since the counts)."""
    index = rec.index
    state = rec.state
    if index is None or index.root_record is None or not index.root_record.self_contained \
            or rec.journal_bytes or state.recorded_inode_count is None:
        return
    if state.recorded_inode_count != len(state.inodes):
        report.add("INV-26", f"the checkpoint counts {state.recorded_inode_count} inodes, "
                   f"the namespace holds {len(state.inodes)}")
    live = {z: n for z, n in state.zone_live_blocks.items() if n}
    wrong = [z for z in sorted(set(live) | set(state.recorded_zone_live))
             if live.get(z, 0) != state.recorded_zone_live.get(z, 0)]
    for zone in wrong[:_INV26_SHOWN]:
        report.add("INV-26", f"zone {zone}: the checkpoint records "
                   f"{state.recorded_zone_live.get(zone, 0)} live blocks, the files "
                   f"map {live.get(zone, 0)}")
    missing = sorted(set(state.resident_inos()) - set(state.recorded_resident))
    if missing:
        report.add("INV-26", f"inodes a mount must load at once are not listed (RESIDENT): "
                   f"{missing[:_INV26_SHOWN]}")
    recorded: dict[int, set[int]] = {}
    try:
        for key, value in index.tree.scan(OWNERS_PREFIX, END_PREFIX, prefetch=True):
            zone, _ = split_owners_key(key)
            recorded.setdefault(zone, set()).update(decode_owners(value))
    except (IndexRecordError, IndexCorrupt, CorruptionError) as exc:
        report.add("INV-26", f"zone owner lists: {exc}")
        return
    zsize = state.zone_size
    shown = 0
    for zone in sorted(state.zone_owners):
        lo = zone * zsize
        for ino in sorted(state.zone_owners[zone] - recorded.get(zone, set())):
            inode = state.inodes.get(ino)
            if inode is None or inode.extents is None or not any(
                    lo <= e.dev < lo + zsize for e in inode.extents):
                continue
            report.add("INV-26", f"inode {ino} has extents in zone {zone}, whose owner "
                       "list in the index does not name it")
            shown += 1
            if shown >= _INV26_SHOWN:
                return


#: Findings of one kind INV-26 shows at most.
_INV26_SHOWN = 10
