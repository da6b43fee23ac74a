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

from collections.abc import Callable

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
    """Inode records and directory entries changed since the last checkpoint took them."""

    __slots__ = ("dirents", "inos")

    def __init__(self) -> None:
        self.inos: set[int] = set()
        self.dirents: set[DirentKey] = set()

    def note(self, op: Op) -> None:
        kind = op[0]
        if kind == OpType.DIRENT_ADD:
            self.dirents.add((op[1], op[3]))
        elif kind == OpType.DIRENT_DEL:
            self.dirents.add((op[1], op[2]))
        elif kind in INODE_RECORD_OPS:
            self.inos.add(op[1])

    def take(self) -> tuple[set[int], set[DirentKey]]:
        """Return what changed and start over (the checkpoint takes it)."""
        taken = self.inos, self.dirents
        self.inos, self.dirents = set(), set()
        return taken

    def __len__(self) -> int:
        return len(self.inos) + len(self.dirents)


def inode_record(state: SnapshotSource, inode: Inode) -> bytes:
    """Encode an inode's index record: its INODE op and body ops, no names."""
    parts = [encode_op(inode.op())]
    parts.extend(encode_op(op) for op in inode_body_ops(state, inode, names=False))
    return b"".join(parts)


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
        self.head = [encode(op) for op in head_ops(state)]
        self._dirty = dirty
        self._inos, self._dirents = dirty.take()
        self._todo_inos = list(self._inos)
        self._todo_dirents = list(self._dirents)
        self.inodes: dict[int, bytes | None] = {}
        self.dirents: dict[DirentKey, int | None] = {}
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

    def before_apply(self, op: Op) -> None:
        kind = op[0]
        if kind == OpType.DIRENT_ADD or kind == OpType.DIRENT_DEL:
            key = (op[1], op[3] if kind == OpType.DIRENT_ADD else op[2])
            if key in self._dirents:
                self._take_dirent(key)
                self.copied += 1
        elif kind in INODE_RECORD_OPS and op[1] in self._inos:
            self._take_inode(op[1])
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
        return not self._todo_inos and not self._todo_dirents

    def __len__(self) -> int:
        """Entries this snapshot covers (done or to do)."""
        return len(self.inodes) + len(self.dirents) + len(self._inos) + len(self._dirents)

    def close(self, failed: bool = False) -> None:
        """Stop tracking changes (always call it). `failed`: the checkpoint was not
        written (its BEGIN failed): every entry it took is changed again for the
        next one, which must not miss them (`dirty`, given at construction)."""
        if self.state.snapshot is self:
            self.state.snapshot = None
        if failed:
            self._dirty.inos.update(self._inos, self.inodes)
            self._dirty.dirents.update(self._dirents, self.dirents)
