"""The in-memory namespace and the one function that changes it: `State.apply`.

Every change to metadata, live or during recovery, is an op (format.ops)
applied here. Live code validates a request, builds its ops, applies them and
hands the same ops to the journal, without awaiting in between (so a
transaction is atomic with respect to other requests). Recovery applies the
checkpoint's ops and then the journal's. Because the same code runs in both
cases, what is recovered is exactly what was acknowledged.

Pure: no I/O, no trio. Accounting of live blocks per zone is kept here
(`zone_live_blocks`), because only apply() knows which device blocks stopped
being referenced.

The inode record is in model/inode.py, the checkpoint's listing of a State
(and its copy-on-write `Snapshot`) in model/snapshot.py.
"""

from __future__ import annotations

import bisect
import stat as statmod
from collections.abc import Callable, Iterator

from zonefs_py.format.constants import (
    C_TENANT_CLEANER_BASE,
    C_TENANT_RESETS_BASE,
    C_TENANT_USER_BASE,
    QUOTA_XATTR,
    ROOT_INO,
    OpType,
)
from zonefs_py.format.ops import Op
from zonefs_py.format.zonesum import summary_end
from zonefs_py.model.dirty import DirtySet
from zonefs_py.model.drain import DrainRecord
from zonefs_py.model.errors import StateError
from zonefs_py.model.extents import EMPTY_EXTENTS, ExtentMap, Freed
from zonefs_py.model.inode import CAPABILITY_XATTR, Inode, inline_op
from zonefs_py.model.lazy import IndexReader, InodeTable, LazyEntries, ZoneOwnersTable
from zonefs_py.model.prealloc import Reservations
from zonefs_py.model.shared import SharedBlocks
from zonefs_py.model.snapshot import Snapshot, SnapshotHook, snapshot_ops
from zonefs_py.model.tenants import TenantTable

# Importers of the model's names from here keep working (the classes live in
# model/inode.py, model/snapshot.py and model/errors.py).
__all__ = ["CAPABILITY_XATTR", "Inode", "Snapshot", "State", "StateError", "inline_op"]

#: State shares the int objects of at most this many distinct modes, uids and gids.
_SHARED_INTS_MAX = 4096


class State:
    """All metadata of a mounted filesystem."""

    def __init__(self, block_size: int, zone_size: int) -> None:
        self.block_size = block_size
        self.zone_size = zone_size
        self.inodes: dict[int, Inode] = {}
        self.next_ino = 2
        #: (first ino, generation) by increasing first ino (INO_GENERATION ops): an
        #: inode's generation is that of the last entry at or below its number, 0
        #: below the first (`generation_of`, DESIGN 4.2a).
        self.ino_generations: list[tuple[int, int]] = []
        #: zone -> (stream, flags, reset_count) as last recorded.
        self.zone_info: dict[int, tuple[int, int, int]] = {}
        #: Sealed zones: zone -> (reset count, data blocks) of its summary
        #: (ZONE_SEAL ops, format/zonesum.py); their extents keep no checksums.
        self.zone_seals: dict[int, tuple[int, int]] = {}
        #: zone -> device blocks referenced by some extent (INV-6).
        self.zone_live_blocks: dict[int, int] = {}
        #: Sum of zone_live_blocks, kept alongside it (read on every growing write).
        self.live_blocks_total = 0
        self.counters: dict[int, int] = {}
        #: top-level directory ino -> user bytes written below it (TENANT_BYTES ops).
        self.tenant_written: dict[int, int] = {}
        #: Declared tenants (TENANT / TENANT_DEL ops, model/tenants.py, issue 45).
        self.tenants = TenantTable()
        #: data zone -> the tenant owning it (ZONE_TENANT ops; INV-27); a zone
        #: not listed is nobody's (shared).
        self.zone_tenant: dict[int, int] = {}
        #: Called with (ino, delta_blocks) when a file's stored blocks change (quotas).
        self._on_blocks_changed: Callable[[int, int], None] | None = None
        #: zone -> inodes that have (or had, since the zone's last reset) extents in it;
        #: a superset, so the cleaner scans only these files for a victim's extents.
        self.zone_owners: dict[int, set[int]] = {}
        #: Values of Inode.mode, uid and gid seen so far, one int object each
        #: (until there are _SHARED_INTS_MAX of them).
        self._shared_ints: dict[int, int] = {}
        self._share_int = self._shared_ints.setdefault
        self._shared_room = True
        #: Called with (zone_idx) when a zone's live block count drops to zero.
        self._on_zone_emptied: Callable[[int], None] | None = None
        #: Called with (ino) before an op changes which bytes a file's blocks hold
        #: (EXTENT, TRUNCATE, INODE_FREE): read-ahead drops what it read before.
        self._on_data_changed: Callable[[int], None] | None = None
        #: Called with (ino) before an op changes a file's size or how its bytes are
        #: held (INODE, DRAIN, PREALLOC): the data plane revokes its read map.
        self._on_layout_changed: Callable[[int], None] | None = None
        #: The checkpoint snapshot being encoded, if any: apply() hands it every
        #: inode it is about to change (copy-on-write, see Snapshot).
        self.snapshot: SnapshotHook | None = None
        self.snapshot_gen = 0
        #: Format 5: the index entries changed since the last checkpoint took them
        #: (model/dirty.py); None for format 4, whose checkpoints hold everything.
        self.dirty: DirtySet | None = None
        #: ino -> drain state of files that are not LOCAL (DRAIN ops, zonefs_py/drain).
        self.drain: dict[int, DrainRecord] = {}
        #: Reserved file blocks (fallocate, PREALLOC / PUNCH ops, INV-24).
        self.prealloc = Reservations(block_size)
        #: Device blocks referenced by several extents (instant copies, SHARE ops):
        #: zone_live_blocks counts references, this the extra ones.
        self.shared = SharedBlocks(block_size, zone_size)
        #: Inodes that were given a security.capability xattr (a superset: a freed
        #: inode is not taken out). While empty, the FUSE adapter answers the
        #: kernel's capability probe before every write(2) without the engine.
        self.caps_inos: set[int] = set()
        #: Format 5 lazy mount (model/lazy.py, DESIGN.md 3.15): `inodes` and
        #: `zone_owners` fault in from the namespace index; set by `go_lazy`.
        self.lazy = False
        #: `install` is applying an inode's record read from the index: it restores
        #: what the tree holds and changes no count (they are in the checkpoint's head).
        self._installing = False
        #: Inodes in a lazy State (its `inodes` holds the resident ones only).
        self._inode_count = 0
        #: What a format-5 checkpoint's head recorded (INODE_COUNT, ZONE_LIVE,
        #: RESIDENT): a lazy mount takes them, fsck compares them.
        self.recorded_inode_count: int | None = None
        self.recorded_zone_live: dict[int, int] = {}
        self.recorded_resident: list[int] = []
        #: Xattrs that keep their inode resident (and listed in RESIDENT): the
        #: capability one, and those the engine adds (quota directories).
        self.resident_xattrs: set[bytes] = {CAPABILITY_XATTR, QUOTA_XATTR}
        #: Inodes that may have to stay resident (nlink 0, or a resident xattr was
        #: set); `resident_inos` filters them.
        self.pin_candidates: set[int] = set()
        #: A lazy mount's replay: directory -> names gained minus names lost by the
        #: ops replayed after the checkpoint (the mount's INV-11 check of what it
        #: replayed, fs/after_recovery.refuse_non_tree); None otherwise.
        self.dir_name_changes: dict[int, int] | None = None
        #: directory -> (parent, its name there): stream placement's memory of
        #: directory names (alloc/streams.py); a name op on it forgets it.
        self.name_hints: dict[int, tuple[int, bytes]] = {}
        self._dispatch = {
            OpType.INODE: self._apply_inode,
            OpType.INODE_FREE: self._apply_inode_free,
            OpType.DIRENT_ADD: self._apply_dirent_add,
            OpType.DIRENT_DEL: self._apply_dirent_del,
            OpType.EXTENT: self._apply_extent,
            OpType.TRUNCATE: self._apply_truncate,
            OpType.SYMLINK: self._apply_symlink,
            OpType.XATTR_SET: self._apply_xattr_set,
            OpType.XATTR_DEL: self._apply_xattr_del,
            OpType.ZONE_STATE: self._apply_zone_state,
            OpType.COUNTERS: self._apply_counters,
            OpType.NEXT_INO: self._apply_next_ino,
            OpType.TENANT_BYTES: self._apply_tenant_bytes,
            OpType.TENANT: self._apply_tenant,
            OpType.TENANT_DEL: self._apply_tenant_del,
            OpType.ZONE_TENANT: self._apply_zone_tenant,
            OpType.DRAIN: self._apply_drain,
            OpType.INLINE: self._apply_inline,
            OpType.ZONE_SEAL: self._apply_zone_seal,
            OpType.PREALLOC: self._apply_prealloc,
            OpType.PUNCH: self._apply_punch,
            OpType.SHARE: self._apply_share,
            OpType.PARENT: self._apply_parent,
            OpType.ZONE_LIVE: self._apply_zone_live,
            OpType.INODE_COUNT: self._apply_inode_count,
            OpType.RESIDENT: self._apply_resident,
            OpType.INO_GENERATION: self._apply_ino_generation,
        }

    # -- applying ops --------------------------------------------------------
    def subscribe(self, *, blocks_changed: Callable[[int, int], None] | None = None,
                  zone_emptied: Callable[[int], None] | None = None,
                  data_changed: Callable[[int], None] | None = None,
                  layout_changed: Callable[[int], None] | None = None) -> None:
        """Register the listener of each named event (once per State: a second
        registration of the same event is a wiring bug and raises).

        blocks_changed(ino, delta_blocks): a file's stored blocks changed (quotas).
        zone_emptied(zone): a zone's live block count dropped to zero (allocator).
        data_changed(ino): an op is about to change which bytes a file's blocks
        hold (EXTENT, TRUNCATE, INODE_FREE): read-ahead drops what it read before.
        layout_changed(ino): an op is about to change a file's size or how its bytes
        are held (INODE, DRAIN, PREALLOC): the data plane's read map goes.
        """
        for name, fn in (("blocks_changed", blocks_changed), ("zone_emptied", zone_emptied),
                         ("data_changed", data_changed), ("layout_changed", layout_changed)):
            if fn is None:
                continue
            attr = "_on_" + name
            if getattr(self, attr) is not None:
                raise RuntimeError(f"State: {name} already has a listener")
            setattr(self, attr, fn)

    def apply(self, op: Op) -> None:
        """Apply one op. Raises StateError if it does not fit the current state."""
        try:
            fn = self._dispatch[op[0]]
        except KeyError:
            raise StateError(f"unknown op {op[0]!r}") from None
        if self.snapshot is not None:
            self.snapshot.before_apply(op)
        if op[0] in _DATA_OPS and self._on_data_changed is not None:
            self._on_data_changed(op[1])
        elif op[0] in _LAYOUT_OPS and self._on_layout_changed is not None:
            self._on_layout_changed(op[1])
        fn(op)
        if self.dirty is not None:
            self.dirty.note(op)

    def apply_all(self, ops: list[Op]) -> None:
        for op in ops:
            self.apply(op)

    # -- the lazy namespace (format 5, model/lazy.py) -------------------------------------
    @property
    def inode_count(self) -> int:
        """Inodes of the filesystem (a lazy State holds some of them)."""
        return self._inode_count if self.lazy else len(self.inodes)

    def go_lazy(self, reader: IndexReader, capacity: int) -> None:
        """Take inodes, names and zone owners from `reader` from now on (a format-5
        mount, right after the checkpoint's head ops): adopt the head's counts
        and install the root and the RESIDENT inodes."""
        if self.inodes or self.zone_owners or self.recorded_inode_count is None:
            raise StateError("go_lazy: the State holds inodes, or the checkpoint "
                             "recorded no inode count")
        self.lazy = True
        self.inodes = InodeTable(self, reader, capacity)
        self.zone_owners = ZoneOwnersTable(self, reader)
        self._inode_count = self.recorded_inode_count
        self.dir_name_changes = {}
        self.zone_live_blocks = dict(self.recorded_zone_live)
        self.live_blocks_total = sum(self.zone_live_blocks.values())
        for ino in [ROOT_INO, *self.recorded_resident]:
            self.inodes.get(ino)

    def install(self, ops: list[Op]) -> None:
        """Apply an inode's record read from the index (InodeTable's fault): its
        INODE op first. Not a change: nothing is noted, no count moves."""
        self._installing = True
        try:
            for op in ops:
                self._dispatch[op[0]](op)
        finally:
            self._installing = False

    def forget_zone_owners(self, zone: int) -> None:
        """The zone was reset: no inode has extents in it (the allocator)."""
        if self.snapshot is not None:
            self.snapshot.before_owners(zone)
        self.zone_owners.pop(zone, None)
        if self.dirty is not None:
            self.dirty.zones.add(zone)

    def resident_inos(self) -> list[int]:
        """Inodes a lazy mount must load at once (a RESIDENT op lists them): open
        but unlinked, with reservations or a drain state, or with a resident xattr."""
        out = set(self.prealloc.ranges)
        out.update(self.drain)
        for ino in list(self.pin_candidates):
            inode = dict.get(self.inodes, ino)
            if inode is not None and (inode.nlink == 0 or (
                    inode.xattrs is not None
                    and not self.resident_xattrs.isdisjoint(inode.xattrs))):
                out.add(ino)
            else:
                self.pin_candidates.discard(ino)
        return sorted(out)

    def must_stay(self, inode: Inode) -> bool:
        """True when `inode` may not be evicted from a lazy State: the kernel or a
        handle holds it, memory is all there is of it (changed since the published
        tree), or a mount must find it loaded (`resident_inos`)."""
        ino = inode.ino
        dirty = self.dirty
        return (inode.lookups > 0 or inode.opens > 0 or ino == ROOT_INO or inode.nlink == 0
                or (dirty is not None and (dirty.changed_ino(ino) or (
                    inode.entries is not None and dirty.changed_dir(ino))))
                or ino in self.prealloc.ranges or ino in self.drain
                or (inode.xattrs is not None
                    and not self.resident_xattrs.isdisjoint(inode.xattrs)))

    def trim(self) -> int:
        """Evict inodes of a lazy State down to its cache (InodeTable.trim); call
        only where no caller holds an Inode across an await."""
        if not self.lazy:
            return 0
        assert isinstance(self.inodes, InodeTable)
        return self.inodes.trim(self.must_stay)

    def published(self, settled: tuple[set[int], set[tuple[int, bytes]], set[int]]) -> None:
        """The index tree holding what a checkpoint took is published (DirtySet.settle
        returned `settled`): memory drops the names and owner lists the tree now
        holds as they are."""
        if not self.lazy or self.dirty is None:
            return
        dirty = self.dirty
        for parent, name in settled[1]:
            if dirty.changed_dirent((parent, name)):
                continue
            d = dict.get(self.inodes, parent)
            if d is not None and isinstance(d.entries, LazyEntries):
                d.entries.published(name)
        assert isinstance(self.zone_owners, ZoneOwnersTable)
        self.zone_owners.trim()
        assert isinstance(self.inodes, InodeTable)
        self.inodes.retrim()

    def get(self, ino: int) -> Inode:
        try:
            return self.inodes[ino]
        except KeyError:
            raise StateError(f"op names inode {ino}, which does not exist") from None

    def _apply_parent(self, op: Op) -> None:
        self.get(op[1]).parent = op[2]

    def _apply_zone_live(self, op: Op) -> None:
        self.recorded_zone_live[op[1]] = op[2]

    def _apply_inode_count(self, op: Op) -> None:
        self.recorded_inode_count = op[1]

    def _apply_resident(self, op: Op) -> None:
        self.recorded_resident.extend(op[1])

    def _apply_inode(self, op: Op) -> None:
        (_, ino, mode, uid, gid, nlink, rdev, size, atime, mtime, ctime, flags) = op
        # Memory (issue 15): a decoded op has an int object of its own for every
        # field, 32-48 bytes each. Modes and owners take few values: share them;
        # times that are equal share one object (ctime == mtime after most writes).
        if self._shared_room:
            share = self._share_int
            mode = share(mode, mode)
            if uid > 256 or gid > 256:  # not one of CPython's static small ints
                uid = share(uid, uid)
                gid = share(gid, gid)
                self._shared_room = len(self._shared_ints) < _SHARED_INTS_MAX
        if ctime == mtime:
            ctime = mtime
        if atime == mtime:
            atime = mtime
        inode = dict.get(self.inodes, ino) if self._installing else self.inodes.get(ino)
        if nlink == 0:
            self.pin_candidates.add(ino)
        if inode is None:
            inode = self.inodes[ino] = Inode(ino, mode, uid, gid, nlink, rdev, size, atime,
                                             mtime, ctime, flags)
            if self.lazy:
                if inode.entries is not None:
                    assert isinstance(self.inodes, InodeTable)
                    inode.entries = LazyEntries(ino, self, self.inodes.reader)  # type: ignore[assignment]
                if self._installing:
                    return
                self._inode_count += 1
            if self.snapshot is not None:
                inode.ckpt_gen = self.snapshot_gen  # born after the snapshot: not in it
            if ino >= self.next_ino:
                self.next_ino = ino + 1
            return
        if statmod.S_IFMT(mode) != statmod.S_IFMT(inode.mode):
            raise StateError(f"inode {ino} changes its file type")
        inode.mode = mode
        inode.uid = uid
        inode.gid = gid
        inode.nlink = nlink
        inode.rdev = rdev
        inode.size = size
        inode.atime = atime
        inode.mtime = mtime
        inode.ctime = ctime
        inode.flags = flags

    def _apply_inode_free(self, op: Op) -> None:
        inode = self.inodes.pop(op[1], None)
        if inode is None:
            raise StateError(f"INODE_FREE of unknown inode {op[1]}")
        if inode.entries:
            self.inodes[op[1]] = inode
            raise StateError(f"INODE_FREE of non-empty directory {op[1]}")
        if self.lazy:
            self._inode_count -= 1
        self.pin_candidates.discard(op[1])
        self.tenant_written.pop(op[1], None)
        self.drain.pop(op[1], None)
        if inode.extents is not None:
            held = self.prealloc.forget(op[1])
            freed = inode.extents.clear(self.block_size)
            self._notify_blocks(op[1], held - sum(n for _, n in freed))
            self._release(freed)

    def _apply_dirent_add(self, op: Op) -> None:
        _, parent_ino, ino, name = op
        parent = self.get(parent_ino)
        if parent.entries is None:
            raise StateError(f"DIRENT_ADD into non-directory {parent_ino}")
        child = self.get(ino)
        changes = self.dir_name_changes
        if changes is not None:
            old = parent.entries.get(name)
            if old is not None and old != ino:
                old_inode = self.inodes.get(old)
                if old_inode is not None and old_inode.is_dir:
                    changes[old] = changes.get(old, 0) - 1
            if child.is_dir and old != ino:
                changes[ino] = changes.get(ino, 0) + 1
        if self.name_hints:
            self.name_hints.pop(ino, None)
        # The inodes' own int objects, not the op's (a decoded op's are new ones).
        parent.entries[name] = child.ino
        # Directories: their one parent. Other files: the directory of their newest
        # name (the "primary parent" that quotas and tenants account them to).
        child.parent = parent.ino

    def _apply_dirent_del(self, op: Op) -> None:
        _, parent_ino, name = op
        parent = self.get(parent_ino)
        child = None if parent.entries is None else parent.entries.pop(name, None)
        if child is None:
            raise StateError(f"DIRENT_DEL of missing entry {name!r} in {parent_ino}")
        if self.name_hints:
            self.name_hints.pop(child, None)
        changes = self.dir_name_changes
        if changes is not None:
            inode = self.inodes.get(child)
            if inode is not None and inode.is_dir:
                changes[child] = changes.get(child, 0) - 1

    def _apply_extent(self, op: Op) -> None:
        _, ino, fblock, nblocks, dev, csums = op
        inode = self.get(ino)
        if inode.extents is None:
            raise StateError(f"EXTENT on non-file inode {ino}")
        zone = dev // self.zone_size
        if (dev + nblocks * self.block_size - 1) // self.zone_size != zone:
            raise StateError(f"EXTENT of inode {ino} spans zones at {dev}")
        seal = self.zone_seals.get(zone)
        if seal is not None:
            # The zone's summary holds these blocks' checksums (an op journaled
            # before the seal, replayed after a checkpoint that has the seal).
            if (dev - zone * self.zone_size) // self.block_size + nblocks > seal[1]:
                raise StateError(f"EXTENT of inode {ino} at {dev} past the summary of "
                                 f"sealed zone {zone}")
            csums = None
        elif csums is None:
            raise StateError(f"EXTENT of inode {ino} at {dev} without checksums in "
                             f"zone {zone}, which is not sealed")
        # A lazy State may read the zone's owners from the index: before anything
        # changes, so that a read that fails leaves the State as it was.
        owners = None if self._installing else self.zone_owners.get(zone)
        if inode.extents is EMPTY_EXTENTS:
            inode.extents = ExtentMap()
        # A file's bytes are inline or in blocks, never both: the writer that
        # gives an inline file its first block put the inline bytes in it.
        inode.inline = b""
        if self._installing:
            # Restored as the tree holds it: its blocks are counted in the
            # checkpoint's ZONE_LIVE ops, its zones list it already.
            inode.extents.insert(fblock, nblocks, dev, csums, self.block_size, self.zone_size)
            return
        # Reserved blocks this maps stop being held: their charge becomes live (INV-24).
        held = self.prealloc.mapping(ino, inode.extents, fblock, fblock + nblocks)
        freed = inode.extents.insert(fblock, nblocks, dev, csums, self.block_size,
                                     self.zone_size)
        self.zone_live_blocks[zone] = self.zone_live_blocks.get(zone, 0) + nblocks
        self.live_blocks_total += nblocks
        if owners is None:
            owners = self.zone_owners[zone] = set()
        if inode.ino not in owners:
            owners.add(inode.ino)  # the inode's int object, not a new one (issue 15)
            if self.dirty is not None:
                self.dirty.zones.add(zone)
        self._notify_blocks(ino, held + nblocks - sum(n for _, n in freed))
        self._release(freed)

    def _apply_truncate(self, op: Op) -> None:
        inode = self.get(op[1])
        if inode.extents is None:
            raise StateError(f"TRUNCATE on non-file inode {op[1]}")
        held = self.prealloc.release(op[1], inode.extents, op[2], _NO_BLOCK)
        freed = inode.extents.truncate(op[2], self.block_size)
        self._notify_blocks(op[1], held - sum(n for _, n in freed))
        self._release(freed)

    def _apply_prealloc(self, op: Op) -> None:
        _, ino, fblock, nblocks = op
        inode = self.get(ino)
        if inode.extents is None or nblocks <= 0 or fblock + nblocks > _NO_BLOCK:
            raise StateError(f"PREALLOC of {nblocks} blocks at {fblock} on inode {ino}")
        self._notify_blocks(ino, self.prealloc.reserve(ino, inode.extents, fblock,
                                                       fblock + nblocks))

    def _apply_share(self, op: Op) -> None:
        _, dev, nblocks, count = op
        zone = dev // self.zone_size
        if (nblocks <= 0 or count <= 0 or dev % self.block_size
                or (dev + nblocks * self.block_size - 1) // self.zone_size != zone):
            raise StateError(f"SHARE of {nblocks} blocks at {dev} x{count}")
        self.shared.add(dev, nblocks, count)

    def _apply_punch(self, op: Op) -> None:
        """Drop the mappings and reservations of file blocks [fblock, fblock+nblocks)."""
        _, ino, fblock, nblocks = op
        inode = self.get(ino)
        if inode.extents is None or nblocks <= 0 or fblock + nblocks > _NO_BLOCK:
            raise StateError(f"PUNCH of {nblocks} blocks at {fblock} on inode {ino}")
        held = self.prealloc.release(ino, inode.extents, fblock, fblock + nblocks)
        freed = inode.extents.punch(fblock, fblock + nblocks, self.block_size)
        self._notify_blocks(ino, held - sum(n for _, n in freed))
        self._release(freed)

    def _apply_symlink(self, op: Op) -> None:
        self.get(op[1]).target = op[2]

    def _apply_xattr_set(self, op: Op) -> None:
        inode = self.get(op[1])
        if inode.xattrs is None:
            inode.xattrs = {}
        inode.xattrs[op[2]] = op[3]
        if op[2] == CAPABILITY_XATTR:
            self.caps_inos.add(op[1])
        if op[2] in self.resident_xattrs:
            self.pin_candidates.add(op[1])

    def _apply_xattr_del(self, op: Op) -> None:
        inode = self.get(op[1])
        if not inode.xattrs or inode.xattrs.pop(op[2], None) is None:
            raise StateError(f"XATTR_DEL of missing attribute on {op[1]}")
        if not inode.xattrs:
            inode.xattrs = None
        if op[2] == CAPABILITY_XATTR:
            self.caps_inos.discard(op[1])

    def _apply_zone_state(self, op: Op) -> None:
        _, zone, stream, flags, resets = op
        self.zone_info[zone] = (stream, flags, resets)
        # The log writes ZONE_STATE when a zone is reset or opened empty: either
        # way a summary it had is gone (a checkpoint lists ZONE_SEAL after it),
        # and so is its owner (ZONE_TENANT follows it when a tenant opened it).
        self.zone_seals.pop(zone, None)
        self.zone_tenant.pop(zone, None)

    def _apply_zone_seal(self, op: Op) -> None:
        _, zone, resets, data_blocks = op
        if data_blocks <= 0 or summary_end(data_blocks, self.block_size) > self.zone_size:
            raise StateError(f"ZONE_SEAL of zone {zone} after {data_blocks} blocks: "
                             "its summary would not fit in the zone")
        info = self.zone_info.get(zone)
        if info is not None and info[2] != resets:
            raise StateError(f"ZONE_SEAL of zone {zone} for reset {resets}, "
                             f"the zone is at reset {info[2]}")
        lo = zone * self.zone_size
        hi = lo + data_blocks * self.block_size
        # Resident owners only: a lazy State installs a file's extents of a sealed
        # zone without their checksums (_apply_extent).
        resident = dict.get
        owners = [inode for inode in (resident(self.inodes, i)
                                      for i in self.zone_owners.get(zone, ()))
                  if inode is not None and inode.extents is not None]
        for inode in owners:  # check everything before changing anything
            assert inode.extents is not None
            for e in inode.extents:
                if lo <= e.dev < lo + self.zone_size and e.dev + e.nblocks * self.block_size > hi:
                    raise StateError(f"ZONE_SEAL of zone {zone} after {data_blocks} blocks, "
                                     f"but inode {inode.ino} maps blocks past them")
        self.zone_seals[zone] = (resets, data_blocks)
        for inode in owners:
            assert inode.extents is not None
            if self.snapshot is not None:
                # The checkpoint being encoded describes the zone as unsealed:
                # it must take this file with its checksums (copy-on-write).
                self.snapshot.before_change(inode)
            inode.extents.drop_csums(lo, hi)

    def _apply_counters(self, op: Op) -> None:
        self.counters.update(op[1])

    def _apply_next_ino(self, op: Op) -> None:
        self.next_ino = max(self.next_ino, op[1])

    def _apply_ino_generation(self, op: Op) -> None:
        _, first, generation = op
        gens = self.ino_generations
        i = bisect.bisect_left(gens, (first, -1))
        if i < len(gens) and gens[i][0] == first:
            gens[i] = (first, generation)  # a later mount's, after a crash lost the first's
        else:
            gens.insert(i, (first, generation))

    def generation_of(self, ino: int) -> int:
        """Return the generation of inode number `ino` (DESIGN 4.2a)."""
        gens = self.ino_generations
        i = bisect.bisect_right(gens, (ino, 1 << 32)) - 1
        return gens[i][1] if i >= 0 else 0

    def _apply_tenant_bytes(self, op: Op) -> None:
        self.tenant_written[op[1]] = op[2]

    def _apply_tenant(self, op: Op) -> None:
        self.tenants.apply_set(op)

    def _apply_tenant_del(self, op: Op) -> None:
        tid = op[1]
        self.tenants.apply_del(tid)
        for zone in [z for z, t in self.zone_tenant.items() if t == tid]:
            del self.zone_tenant[zone]
        for base in (C_TENANT_USER_BASE, C_TENANT_CLEANER_BASE, C_TENANT_RESETS_BASE):
            self.counters.pop(base + tid, None)

    def _apply_zone_tenant(self, op: Op) -> None:
        _, zone, tid = op
        if tid == 0:
            self.zone_tenant.pop(zone, None)
            return
        if self.tenants.get(tid) is None:
            raise StateError(f"ZONE_TENANT gives zone {zone} to unknown tenant {tid}")
        self.zone_tenant[zone] = tid

    def _apply_drain(self, op: Op) -> None:
        inode = self.get(op[1])
        if not inode.is_reg:
            raise StateError(f"DRAIN on non-file inode {op[1]}")
        try:
            rec = DrainRecord.from_op(op)
        except ValueError:
            raise StateError(f"DRAIN of inode {op[1]} has unknown state {op[2]}") from None
        if rec is None:
            self.drain.pop(op[1], None)
        else:
            self.drain[op[1]] = rec

    def _apply_inline(self, op: Op) -> None:
        inode = self.get(op[1])
        if inode.extents is None:
            raise StateError(f"INLINE on non-file inode {op[1]}")
        if op[5] and len(inode.extents):
            raise StateError(f"INLINE data for inode {op[1]}, which has extents")
        mtime = op[3]
        inode.size, inode.mtime, inode.inline = op[2], mtime, op[5]
        inode.ctime = mtime if op[4] == mtime else op[4]

    def _notify_blocks(self, ino: int, delta: int) -> None:
        if delta and self._on_blocks_changed is not None and not self._installing:
            self._on_blocks_changed(ino, delta)

    def _release(self, freed: list[Freed]) -> None:
        shared = self.shared.ranges
        for dev, nblocks in freed:
            zone = dev // self.zone_size
            if zone in shared:
                self.shared.release(dev, nblocks)
            left = self.zone_live_blocks.get(zone, 0) - nblocks
            if left < 0:
                raise StateError(f"live block count of zone {zone} went negative")
            self.zone_live_blocks[zone] = left
            self.live_blocks_total -= nblocks
            if left == 0 and self._on_zone_emptied is not None:
                self._on_zone_emptied(zone)

    def snapshot_ops(self, max_csum_blocks: int = 65536) -> Iterator[Op]:
        """Yield ops that rebuild this state from nothing (model/snapshot.py)."""
        return snapshot_ops(self, max_csum_blocks)


#: Ops that change which bytes a file's blocks hold (State.subscribe's data_changed).
_DATA_OPS = frozenset({OpType.EXTENT, OpType.TRUNCATE, OpType.INODE_FREE, OpType.INLINE,
                       OpType.PUNCH})
#: Ops that change a file's size or how its bytes are held (State.subscribe's
#: layout_changed): INODE carries the size, DRAIN evicts and restores, PREALLOC.
_LAYOUT_OPS = frozenset({OpType.INODE, OpType.DRAIN, OpType.PREALLOC})

#: Past every file block (file sizes stay below 2**63 bytes, FILE_SIZE_MAX).
_NO_BLOCK = 1 << 63
