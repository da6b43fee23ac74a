"""What a format-5 checkpoint writes: the namespace entries changed since the last one.

`DirtySet` records, as `State.apply` runs, which inode records and which
directory entries of the namespace index (format/nsindex.py) an op changed.
`IndexSnapshot` takes that set at one instant (a checkpoint's step 1) and
encodes each entry as it was then, a slice at a time, copy-on-write like the
format-4 `Snapshot` (model/snapshot.py): while it is installed
(`State.snapshot`), `State.apply` hands it each op first, and an entry the op
is about to change is encoded before the change if it is still to do.

So a checkpoint's cost follows what changed, not the namespace (issue 32).
Pure: no I/O, no trio.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from zonefs_py.format.constants import OpType
from zonefs_py.format.ops import Op, encode_op
from zonefs_py.model.errors import StateError
from zonefs_py.model.inode import Inode
from zonefs_py.model.snapshot import SnapshotSource, head_ops, inode_body_ops

#: Ops whose op[1] is an inode whose index record they change (DIRENT ops
#: change directory entries, which are index entries of their own).
INODE_RECORD_OPS = frozenset({
    OpType.INODE, OpType.INODE_FREE, OpType.EXTENT, OpType.TRUNCATE, OpType.SYMLINK,
    OpType.XATTR_SET, OpType.XATTR_DEL, OpType.DRAIN, OpType.INLINE, OpType.PREALLOC,
    OpType.PUNCH,
})

DirentKey = tuple[int, bytes]


class DirtySet:
    """Inode records, directory entries and zone owner lists changed since the last
    checkpoint took them, and those a checkpoint took that its tree does not
    publish yet (`inflight_*`, until `settle`): together, what is "changed"
    (model/lazy.py: answered from memory, not from the published tree)."""

    __slots__ = ("dirents", "dirs", "inflight_dirents", "inflight_dirs", "inflight_inos",
                 "inflight_zones", "inos", "zones")

    def __init__(self) -> None:
        self.inos: set[int] = set()
        self.dirents: set[DirentKey] = set()
        #: Directories some name of which is in `dirents`.
        self.dirs: set[int] = set()
        #: Data zones whose owner set changed (an inode added, or the zone reset).
        self.zones: set[int] = set()
        self.inflight_inos: set[int] = set()
        self.inflight_dirents: set[DirentKey] = set()
        self.inflight_dirs: set[int] = set()
        self.inflight_zones: set[int] = set()

    def note(self, op: Op) -> None:
        kind = op[0]
        if kind == OpType.DIRENT_ADD:
            self.dirents.add((op[1], op[3]))
            self.dirs.add(op[1])
            self.inos.add(op[2])  # the child's record names its (primary) parent
        elif kind == OpType.DIRENT_DEL:
            self.dirents.add((op[1], op[2]))
            self.dirs.add(op[1])
        elif kind in INODE_RECORD_OPS:
            self.inos.add(op[1])

    def take(self) -> tuple[set[int], set[DirentKey], set[int]]:
        """Return what changed and start over (the checkpoint takes it; it stays
        changed, in flight, until `settle`)."""
        taken = self.inos, self.dirents, self.zones
        self.inflight_inos |= self.inos
        self.inflight_dirents |= self.dirents
        self.inflight_dirs |= self.dirs
        self.inflight_zones |= self.zones
        self.inos, self.dirents, self.dirs, self.zones = set(), set(), set(), set()
        return taken

    def settle(self) -> tuple[set[int], set[DirentKey], set[int]]:
        """The tree holding everything taken is published: return what was in
        flight (the caller drops what memory no longer needs) and forget it."""
        settled = self.inflight_inos, self.inflight_dirents, self.inflight_zones
        self.inflight_inos, self.inflight_dirents = set(), set()
        self.inflight_dirs, self.inflight_zones = set(), set()
        return settled

    def changed_ino(self, ino: int) -> bool:
        return ino in self.inos or ino in self.inflight_inos

    def changed_dirent(self, key: DirentKey) -> bool:
        return key in self.dirents or key in self.inflight_dirents

    def changed_dir(self, ino: int) -> bool:
        return ino in self.dirs or ino in self.inflight_dirs

    def changed_zone(self, zone: int) -> bool:
        return zone in self.zones or zone in self.inflight_zones

    def mark_all(self, inos: Iterable[int], dirents: Iterable[DirentKey],
                 zones: Iterable[int]) -> None:
        """Everything changed (a conversion, or a tree without what a lazy mount
        needs): the next checkpoint writes every entry."""
        self.inos.update(inos)
        for parent, name in dirents:
            self.dirents.add((parent, name))
            self.dirs.add(parent)
        self.zones.update(zones)

    def __len__(self) -> int:
        return len(self.inos) + len(self.dirents) + len(self.zones)


def inode_record(state: SnapshotSource, inode: Inode) -> bytes:
    """Encode an inode's index record: its INODE op, its PARENT op (unless it has
    none) and body ops, no names."""
    parts = [encode_op(inode.op())]
    if inode.parent:
        parts.append(encode_op((OpType.PARENT, inode.ino, inode.parent)))
    parts.extend(encode_op(op) for op in inode_body_ops(state, inode, names=False))
    return b"".join(parts)


def owners_list(state: SnapshotSource, zone: int) -> list[int] | None:
    """A changed zone's owner inodes in memory (sorted), None when it has none."""
    owners = state.zone_owners.get(zone)
    return sorted(owners) if owners else None


class IndexSnapshot:
    """The changed index entries of a State at one instant, encoded a slice at a time.

    Made at a checkpoint's step 1: takes the State's `DirtySet`. `step()`
    encodes the next entries still to do; `before_apply` / `before_change`
    (called by `State.apply` while this is installed) encode an entry before
    an op changes it. Each entry is encoded once, as it was at the start:
    one not yet encoded was not changed since (apply would have encoded it
    first). Results: `inodes` (ino -> record, or None: the inode is gone)
    and `dirents` ((parent, name) -> child ino, or None: no such name);
    `head` holds the encoded ops of everything outside inodes (zones,
    counters, tenants, shared ranges), small and taken at once.
    """

    def __init__(self, state: SnapshotSource, dirty: DirtySet,
                 encode: Callable[[Op], bytes] = encode_op) -> None:
        if state.snapshot is not None:
            raise StateError("a snapshot is already being taken")
        self.state = state
        self.head = [encode(op) for op in head_ops(state, index=True)]
        #: Inode numbers from here on are not in this snapshot's tree.
        self.next_ino = state.next_ino
        self._dirty = dirty
        self._inos, self._dirents, self._zones = dirty.take()
        self._todo_inos = list(self._inos)
        self._todo_dirents = list(self._dirents)
        self._todo_zones = list(self._zones)
        self.inodes: dict[int, bytes | None] = {}
        self.dirents: dict[DirentKey, int | None] = {}
        #: zone -> its owner inodes (None: none).
        self.owners: dict[int, list[int] | None] = {}
        #: Entries encoded ahead of the cursor because an op was about to change them.
        self.copied = 0
        state.snapshot = self

    def _take_inode(self, ino: int) -> None:
        self._inos.discard(ino)
        inode = self.state.inodes.get(ino)
        self.inodes[ino] = None if inode is None else inode_record(self.state, inode)

    def _take_dirent(self, key: DirentKey) -> None:
        self._dirents.discard(key)
        parent = self.state.inodes.get(key[0])
        entries = None if parent is None else parent.entries
        self.dirents[key] = None if entries is None else entries.get(key[1])

    def _take_zone(self, zone: int) -> None:
        self._zones.discard(zone)
        self.owners[zone] = owners_list(self.state, zone)

    def before_apply(self, op: Op) -> None:
        kind = op[0]
        if kind == OpType.DIRENT_ADD or kind == OpType.DIRENT_DEL:
            key = (op[1], op[3] if kind == OpType.DIRENT_ADD else op[2])
            if key in self._dirents:
                self._take_dirent(key)
                self.copied += 1
            if kind == OpType.DIRENT_ADD and op[2] in self._inos:
                self._take_inode(op[2])  # its record names its parent
                self.copied += 1
        elif kind in INODE_RECORD_OPS and op[1] in self._inos:
            self._take_inode(op[1])
            self.copied += 1
        if kind == OpType.EXTENT and self._zones:
            self.before_owners(op[4] // self.state.zone_size)

    def before_owners(self, zone: int) -> None:
        """Encode `zone`'s owner list now if it is still to do: it is about to change."""
        if zone in self._zones:
            self._take_zone(zone)
            self.copied += 1

    def before_change(self, inode: Inode) -> None:
        """Encode `inode` now if it is still to do: it is about to change."""
        if inode.ino in self._inos:
            self._take_inode(inode.ino)
            self.copied += 1

    def step(self, max_entries: int) -> bool:
        """Encode up to `max_entries` more entries; True once every one is encoded."""
        n = 0
        while self._todo_inos and n < max_entries:
            ino = self._todo_inos.pop()
            if ino in self._inos:
                self._take_inode(ino)
            n += 1
        while self._todo_dirents and n < max_entries:
            key = self._todo_dirents.pop()
            if key in self._dirents:
                self._take_dirent(key)
            n += 1
        while self._todo_zones and n < max_entries:
            zone = self._todo_zones.pop()
            if zone in self._zones:
                self._take_zone(zone)
            n += 1
        return not self._todo_inos and not self._todo_dirents and not self._todo_zones

    def __len__(self) -> int:
        """Entries this snapshot covers (done or to do)."""
        return (len(self.inodes) + len(self.dirents) + len(self.owners) + len(self._inos)
                + len(self._dirents) + len(self._zones))

    def close(self, failed: bool = False) -> None:
        """Stop tracking changes (always call it). `failed`: the checkpoint was not
        written (its BEGIN failed): every entry it took is changed again for the
        next one, which must not miss them (`dirty`, given at construction)."""
        if self.state.snapshot is self:
            self.state.snapshot = None
        if failed:
            self._dirty.inos.update(self._inos, self.inodes)
            self._dirty.dirents.update(self._dirents, self.dirents)
            self._dirty.dirs.update(p for p, _ in self._dirents)
            self._dirty.dirs.update(p for p, _ in self.dirents)
            self._dirty.zones.update(self._zones, self.owners)
