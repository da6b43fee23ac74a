"""fsck of a format-5 image in bounded memory (issue 32, DESIGN.md 3.15).

The checks of fsck/metadata.py walk a State holding the whole namespace:
~1 KiB per file, 10 GiB at ten million. For a SELF_CONTAINED format-5 image
`check_filesystem` mounts lazily instead (the head, the root, the journal
tail) and streams the namespace index:

1. inode records in key order (1 MiB device reads), decoded a batch of
   1,024 at a time into a scratch State and checked per inode (INV-4, 5,
   13, 22, by the same functions, on the batch) while compact per-inode
   tables take what the cross checks need: kind and nlink (`array`s indexed
   by inode number, 5 bytes an inode), the stream and extents per data zone
   (INV-6 live counts, INV-9, the zone owner lists of INV-26), directories'
   parent fields. Inodes the journal tail changed are taken from memory
   instead of their records. With data checks, each batch's extents are
   read and verified then (INV-12, `DataCheck`: zone by zone in device
   order within the batch, the last 16 zone summaries kept);
2. directory entries in key order (the changed ones from memory): names
   per inode, subdirectories per directory, the directory tree (INV-11);
3. per data zone: extents overlapping only as the shared-block map says
   (INV-6), owner lists naming every inode with an extent there (INV-26).

Memory: ~5 bytes per inode number, 16 bytes per extent and 8 per (zone,
inode) pair in compact arrays, dicts for directories only, and a scratch
batch. The per-zone, per-drain and per-reservation checks (INV-21, 23, 24,
25) run as for a loaded namespace: they go through the lazy State.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

from zonefs_py.device.base import Zone, ZonedDevice
from zonefs_py.format.constants import ROOT_INO
from zonefs_py.format.nsindex import (
    IndexRecordError,
)
from zonefs_py.format.superblock import Superblock
from zonefs_py.fsck.data import DataCheck, extents_by_zone
from zonefs_py.fsck.metadata import (
    _merged,
    _shared_spans,
    check_inv4_extents_within_wp,
    check_inv5_extents_sorted,
    check_inv13_file_types,
    check_inv22_inline_data,
    report_mixed_streams,
    report_mixed_tenants,
)
from zonefs_py.fsck.report import Progress, Report
from zonefs_py.index.errors import IndexCorrupt
from zonefs_py.journal.nsindex import LOAD_READ_AHEAD_BYTES, checked_records
from zonefs_py.journal.recovery import Recovered
from zonefs_py.model.errors import StateError
from zonefs_py.model.inode import Inode
from zonefs_py.model.lazy import LazyEntries
from zonefs_py.model.state import State
from zonefs_py.model.tenants import tenant_of

_NONE, _DIR, _OTHER = 0, 1, 2


class _Batch:
    """A State whose `inodes` are one batch (the per-inode checks walk them)."""

    def __init__(self, state: State, inodes: dict[int, Inode]) -> None:
        self.inodes = inodes
        self._state = state
        # The fields the checks read per extent, without __getattr__ each time.
        self.block_size = state.block_size
        self.zone_size = state.zone_size
        self.zone_seals = state.zone_seals

    def __getattr__(self, name: str) -> object:
        return getattr(self._state, name)


class BoundedCheck:
    """The streaming checks of one lazily recovered format-5 image (module docstring)."""

    def __init__(self, sb: Superblock, rec: Recovered, zones: dict[int, Zone],
                 report: Report, progress: Progress | None = None,
                 data: DataCheck | None = None) -> None:
        self.sb = sb
        #: INV-12 per batch (fsck with data checks), or None (--no-data).
        self.data = data
        self.rec = rec
        self.state = rec.state
        self.zones = zones
        self.report = report
        self.progress = progress
        # Inode numbers below next_ino (a damaged next_ino: at most a few times the
        # inode count, and 2**26); any other goes to `stray`.
        n = min(self.state.next_ino + 1, 4 * self.state.inode_count + (1 << 20), 1 << 26)
        self.kind = bytearray(n)
        self.nlink = array("I", bytes(4 * n))
        self.refs = array("I", bytes(4 * n))
        #: Inode numbers past next_ino (damage): kind, nlink and names here.
        self.stray: dict[int, list[int]] = {}
        self.subdirs: dict[int, int] = {}
        #: directory -> its `parent` field; directory -> the directories naming it.
        self.parent_field: dict[int, int] = {}
        self.named_in: dict[int, list[int]] = {}
        self.counted: dict[int, int] = {}
        self.streams: dict[int, set[int]] = {}
        #: zone -> tenants of the files with extents there (INV-27; only with tenants).
        self.tenants_of: dict[int, set[int]] = {}
        self.spans: dict[int, array[int]] = {}
        self.zone_inos: dict[int, array[int]] = {}
        self.resident_needed: set[int] = set()
        self.inodes = 0

    # -- 1. inode records -----------------------------------------------------------
    def _batch(self, inodes: dict[int, Inode]) -> None:
        state = self.state
        proxy = _Batch(state, inodes)
        report = self.report
        check_inv4_extents_within_wp(self.sb, proxy, self.zones, report)  # type: ignore[arg-type]
        check_inv5_extents_sorted(proxy, report)  # type: ignore[arg-type]
        check_inv13_file_types(proxy, report)  # type: ignore[arg-type]
        check_inv22_inline_data(proxy, report)  # type: ignore[arg-type]
        if self.data is not None:
            self.data.check(extents_by_zone(inodes.values(), state.zone_size))
        zsize = state.zone_size
        bs = state.block_size
        pinning = state.resident_xattrs
        for ino, inode in inodes.items():
            self.inodes += 1
            is_dir = inode.entries is not None
            if ino < len(self.kind):
                self.kind[ino] = _DIR if is_dir else _OTHER
                self.nlink[ino] = min(inode.nlink, 0xFFFFFFFF)
            else:
                self.stray[ino] = [_DIR if is_dir else _OTHER, inode.nlink, 0]
            if is_dir:
                self.parent_field[ino] = inode.parent
            if inode.nlink == 0 or (inode.xattrs and not pinning.isdisjoint(inode.xattrs)):
                self.resident_needed.add(ino)
            if inode.extents is None:
                continue
            stream = inode.stream
            tid = (tenant_of(state, inode) if state.tenants and inode.nlink
                   and len(inode.extents) else None)
            last_zone = -1
            for e in inode.extents:
                zone = e.dev // zsize
                self.counted[zone] = self.counted.get(zone, 0) + e.nblocks
                self.streams.setdefault(zone, set()).add(stream)
                if tid is not None:
                    self.tenants_of.setdefault(zone, set()).add(tid)
                spans = self.spans.get(zone)
                if spans is None:
                    spans = self.spans[zone] = array("Q")
                spans.append(e.dev)
                spans.append(e.dev + e.nblocks * bs)
                if zone != last_zone:
                    owners = self.zone_inos.get(zone)
                    if owners is None:
                        owners = self.zone_inos[zone] = array("Q")
                    owners.append(ino)
                    last_zone = zone

    def inodes_pass(self) -> None:
        state = self.state
        dirty = state.dirty
        assert dirty is not None
        index = self.rec.index
        assert index is not None
        for inos, blobs in index.record_batches():
            scratch = State(state.block_size, state.zone_size)
            scratch.zone_seals = state.zone_seals
            # A changed inode's record is as old as the tree (its zone may have been
            # reset since, say): memory has the inode, below.
            scratch.install([op for op in checked_records(inos, blobs)
                             if not dirty.changed_ino(op[1])])
            self._batch(scratch.inodes)
            if self.progress and self.data is None:
                self.progress("inodes", self.inodes, state.inode_count)
        # What the journal tail changed is in memory (a changed inode absent: freed).
        self._batch({ino: inode for ino, inode in dict.items(state.inodes)
                     if dirty.changed_ino(ino)})

    # -- 2. names -------------------------------------------------------------------
    def _name(self, parent: int, child: int, name: bytes) -> None:
        report = self.report
        kind = self.kind[child] if child < len(self.kind) else \
            self.stray.get(child, [_NONE])[0]
        if kind == _NONE:
            report.add("INV-11", f"entry {name!r} in directory {parent} names missing inode "
                       f"{child}", repairable=True)
            return
        if child < len(self.refs):
            self.refs[child] += 1
        else:
            self.stray[child][2] += 1
        if kind == _DIR:
            self.subdirs[parent] = self.subdirs.get(parent, 0) + 1
            self.named_in.setdefault(child, []).append(parent)
            if self.parent_field.get(child) != parent:
                report.add("INV-11", f"directory {child} is listed in {parent} but its "
                           f"parent is {self.parent_field.get(child)}")

    def names_pass(self) -> None:
        index = self.rec.index
        state = self.state
        dirty = state.dirty
        assert index is not None
        assert dirty is not None
        for parent, name, child in index.dirents():
            if not dirty.changed_dirent((parent, name)):
                self._name(parent, child, name)
        changed = dirty.dirents | dirty.inflight_dirents
        for parent, name in sorted(changed):
            d = dict.get(state.inodes, parent)
            if d is None or d.entries is None:
                continue
            now = d.entries.known(name) if isinstance(d.entries, LazyEntries) \
                else d.entries.get(name)
            if now is not None:
                self._name(parent, now, name)

    def namespace_findings(self) -> None:
        """INV-11 from the tables: one name per directory, reachable, link counts."""
        report = self.report
        if self._kind(ROOT_INO) != _DIR:
            report.add("INV-11", "the root directory is missing")
            return
        reached: dict[int, bool] = {ROOT_INO: True}
        for d in self.parent_field:
            self._reachable(d, reached)
        for ino, k in self._all_kinds():
            if ino == ROOT_INO or k == _NONE:
                continue
            refs = self._refs(ino)
            nlink = self._nlink(ino)
            if k == _DIR:
                if refs != 1:
                    report.add("INV-11", f"directory {ino} has {refs} names")
                elif not reached.get(ino):
                    report.add("INV-11", f"directory {ino} is not reachable from the root")
                want = 2 + self.subdirs.get(ino, 0)
            else:
                want = refs
            if want == 0 and nlink == 0:
                continue  # unlinked while open before a crash: every mount frees it
            if want == 0:
                report.add("INV-11", f"inode {ino} is an orphan (no names)", repairable=True)
            elif nlink != want:
                report.add("INV-11", f"inode {ino} has nlink {nlink}, expected {want}",
                           repairable=True)
        want_root = 2 + self.subdirs.get(ROOT_INO, 0)
        if self._nlink(ROOT_INO) != want_root:
            report.add("INV-11", f"root has nlink {self._nlink(ROOT_INO)}, expected "
                       f"{want_root}", repairable=True)

    def _reachable(self, d: int, reached: dict[int, bool]) -> bool:
        path: list[int] = []
        cur = d
        ok = False
        while True:
            known = reached.get(cur)
            if known is not None:
                ok = known
                break
            if cur in path:
                break  # a loop
            path.append(cur)
            parents = self.named_in.get(cur)
            if not parents or len(parents) != 1:
                break
            cur = parents[0]
        for p in path:
            reached[p] = ok
        return ok

    def _kind(self, ino: int) -> int:
        return self.kind[ino] if ino < len(self.kind) else self.stray.get(ino, [_NONE])[0]

    def _nlink(self, ino: int) -> int:
        return self.nlink[ino] if ino < len(self.nlink) else self.stray.get(ino, [0, 0])[1]

    def _refs(self, ino: int) -> int:
        return self.refs[ino] if ino < len(self.refs) else self.stray.get(ino, [0, 0, 0])[2]

    def _all_kinds(self) -> Iterator[tuple[int, int]]:
        kind = self.kind
        for ino in range(len(kind)):
            if kind[ino]:
                yield ino, kind[ino]
        for ino, entry in self.stray.items():
            yield ino, entry[0]

    # -- 3. zones -------------------------------------------------------------------
    def zone_findings(self) -> None:
        """INV-6 (live counts, shared blocks), INV-9 (streams), INV-26 (owner lists,
        counts, RESIDENT) from the tables."""
        state = self.state
        report = self.report
        bs = state.block_size
        zsize = state.zone_size
        for zone in sorted(set(self.spans) | set(state.shared.ranges)):
            spans = self.spans.get(zone, array("Q"))
            pairs = sorted(zip(spans[0::2], spans[1::2], strict=True))
            found = _shared_spans([(a, b, 0) for a, b in pairs], bs, zsize)
            recorded = _merged([r for r in state.shared.items() if r[0] // zsize == zone],
                               bs, zsize)
            if found != recorded:
                report.add("INV-6", f"zone {zone}: device blocks referenced by several "
                           f"extents {found[:3]} do not match the shared-block map "
                           f"{recorded[:3]}")
        if state.live_blocks_total != sum(state.zone_live_blocks.values()):
            report.add("INV-6", f"live block total {state.live_blocks_total} does not match "
                       f"the zones' {sum(state.zone_live_blocks.values())}")
        for zone in sorted(set(state.zone_live_blocks) | set(self.counted)):
            live = state.zone_live_blocks.get(zone, 0)
            if live != self.counted.get(zone, 0):
                report.add("INV-6", f"zone {zone}: live count {live} but extents hold "
                           f"{self.counted.get(zone, 0)} blocks")
        report_mixed_streams(state, dict(sorted(self.streams.items())), report)
        if state.tenants:
            report_mixed_tenants(state, self.tenants_of, report)
        shown = 0
        dirty = state.dirty
        reader = self.rec.index.reader if self.rec.index is not None else None
        for zone, inos in sorted(self.zone_inos.items()):
            # One zone's list at a time, not kept (ZoneOwnersTable would keep them all).
            if (dirty is not None and dirty.changed_zone(zone)) or reader is None:
                owners = dict.get(state.zone_owners, zone) or set()
            else:
                owners = set(reader.zone_owners(zone))
            for ino in inos:
                if ino not in owners and shown < 10:
                    report.add("INV-26", f"inode {ino} has extents in zone {zone}, whose "
                               "owner list in the index does not name it")
                    shown += 1
        if state.inode_count != self.inodes:
            report.add("INV-26", f"the mount counts {state.inode_count} inodes, the "
                       f"namespace holds {self.inodes}")
        if not self.rec.journal_bytes:
            needed = self.resident_needed | set(state.prealloc.ranges) | set(state.drain)
            missing = sorted(needed - set(state.recorded_resident))
            if missing:
                report.add("INV-26", "inodes a mount must load at once are not listed "
                           f"(RESIDENT): {missing[:10]}")


def check_bounded(sb: Superblock, rec: Recovered, zones: dict[int, Zone], report: Report,
                  progress: Progress | None = None, dev: ZonedDevice | None = None) -> None:
    """Run the streaming checks (module docstring), with `dev` the data checks
    too; damage met in the tree is an INV-25 finding (the walk stops there)."""
    state = rec.state
    data = None if dev is None else DataCheck(dev, state, report, progress,
                                              state.live_blocks_total)
    check = BoundedCheck(sb, rec, zones, report, progress, data)
    index = rec.index
    assert index is not None
    index.store.set_read_ahead(LOAD_READ_AHEAD_BYTES)
    try:
        check.inodes_pass()
        check.names_pass()
    except (IndexCorrupt, IndexRecordError, StateError) as exc:
        report.add("INV-25", f"namespace index: {exc}")
        return
    finally:
        index.store.set_read_ahead(0)
    report.inodes = check.inodes
    check.namespace_findings()
    check.zone_findings()
