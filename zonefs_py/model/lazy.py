"""Format 5's lazy namespace: inodes, names and zone owners faulted in from the index.

A lazy mount (issue 32, docs/DESIGN.md 3.15) does not load the namespace: its
State starts with the checkpoint's head (zones, counters, the derived counts a
format-5 checkpoint records) and the root, and takes the rest from the
namespace index on first use. Three tables here stand in for the State's
plain dicts:

* `InodeTable` (`State.inodes`): resident inodes; a missing one is read from
  the index (`IndexReader.inode_ops`) and installed (`State.install`), so
  `get`, `[]` and `in` answer for every inode. `values()` / `items()` /
  `len()` are of the resident ones only (`State.inode_count` counts all).
* `LazyEntries` (a directory's `Inode.entries`): the names changed since the
  published tree (`_known`, positive ones; a changed name absent from it is
  gone) over the tree's names, looked up one at a time and listed in name
  order a batch at a time (`names_after`), never loaded whole.
* `ZoneOwnersTable` (`State.zone_owners`): a data zone's owner set, read
  from the index when first asked for.

What decides between memory and the tree is the `DirtySet`
(model/dirty.py): an inode, name or zone changed since the tree the reader
publishes ("changed": dirty, or taken by a checkpoint not yet published) is
answered from memory only: resident, or gone. Everything else is answered by
the tree, which holds it as it is. Changed inodes and directories with
changed names are never evicted, so what memory says of them is all there
is. `InodeTable.trim` evicts the other inodes down to the cache's capacity,
oldest installed first, at points where no caller holds an Inode across an
await (the FUSE adapter's forget, the end of a checkpoint, recovery).

Pure: no I/O of its own (the reader does it), no trio.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import islice
from typing import TYPE_CHECKING, Any, Protocol

from zonefs_py import errors
from zonefs_py.format.ops import Op
from zonefs_py.model.errors import StateError
from zonefs_py.model.inode import Inode

if TYPE_CHECKING:
    from zonefs_py.model.dirty import DirtySet

#: Inodes one `InodeTable.trim` looks at, at most.
TRIM_SCAN = 8192
#: Names one `names_after` call asks the tree for.
NAMES_BATCH = 1024


class IndexReader(Protocol):
    """The published tree, read (journal/nsindex.IndexReader)."""

    #: Inode numbers from this one on are not in the tree (its checkpoint's NEXT_INO).
    next_ino: int

    def inode_ops(self, ino: int) -> list[Op] | None: ...

    def lookup(self, parent: int, name: bytes) -> int | None: ...

    def names_after(self, parent: int, after: bytes | None,
                    limit: int) -> list[tuple[bytes, int]]: ...

    def zone_owners(self, zone: int) -> list[int]: ...


class LazyHost(Protocol):
    """What the tables need of their State."""

    dirty: DirtySet | None

    def install(self, ops: list[Op]) -> None: ...


class InodeTable(dict[int, Inode]):
    """Resident inodes, faulting the others in from the index (module docstring)."""

    def __init__(self, host: LazyHost, reader: IndexReader, capacity: int) -> None:
        super().__init__()
        self.host = host
        self.reader = reader
        self.capacity = capacity
        self.faults = 0
        self.evictions = 0
        #: After a trim that evicted less than it wanted (the rest must stay:
        #: changed since the last checkpoint, held by the kernel), the next one
        #: waits until this many inodes are resident or `retrim()` (a publish).
        self._next_trim_at = 0
        #: Faults whose pages a worker thread read first (fs/lazyio.py).
        self.thread_reads = 0

    def _fault(self, ino: int) -> Inode | None:
        dirty = self.host.dirty
        if ino >= self.reader.next_ino or (dirty is not None and dirty.changed_ino(ino)):
            return None  # never in the tree, or gone since it was published
        ops = self.reader.inode_ops(ino)
        if ops is None:
            return None
        try:
            self.host.install(ops)
        except StateError as exc:
            # A record that decodes but does not fit (damage the page checksum
            # did not catch): EIO, and the engine's failsafe, never a wrong inode.
            dict.pop(self, ino, None)
            raise errors.CorruptionError(f"namespace index: the record of inode {ino} "
                                         f"does not fit: {exc}; run 'zonefs-py fsck'") from None
        self.faults += 1
        return dict.get(self, ino)

    def get(self, ino: int, default: Any = None) -> Any:
        inode = dict.get(self, ino)
        if inode is None:
            inode = self._fault(ino)
            if inode is None:
                return default
        return inode

    def __missing__(self, ino: int) -> Inode:
        inode = self._fault(ino)
        if inode is None:
            raise KeyError(ino)
        return inode

    def __contains__(self, ino: object) -> bool:
        if dict.__contains__(self, ino):
            return True
        return isinstance(ino, int) and self._fault(ino) is not None

    def pop(self, ino: int, *default: Any) -> Any:
        if not dict.__contains__(self, ino):
            self._fault(ino)
        return dict.pop(self, ino, *default)

    def resident(self, ino: int) -> Inode | None:
        """The inode if it is in memory (no fault)."""
        return dict.get(self, ino)

    def trim(self, keep: Callable[[Inode], bool], target: int | None = None) -> int:
        """Evict inodes `keep` does not hold, oldest installed first, down to
        `target` (default: 7/8 of the capacity) once above the capacity. Call
        only where no caller holds an Inode across an await. Return evictions."""
        size = dict.__len__(self)
        if target is None and (size <= self.capacity or size < self._next_trim_at):
            return 0
        want = self.capacity * 7 // 8 if target is None else target
        excess = dict.__len__(self) - want
        evicted = 0
        kept: list[Inode] = []
        # At most TRIM_SCAN inodes looked at per call (FORGETs come often, and the
        # kernel may hold more inodes than the cache): kept ones go to the end,
        # so the next call looks further.
        for ino in list(islice(dict.keys(self), min(2 * excess + 64, TRIM_SCAN))):
            if evicted >= excess:
                break
            inode = dict.__getitem__(self, ino)
            if keep(inode):
                kept.append(inode)
                continue
            dict.__delitem__(self, ino)
            evicted += 1
        # The ones that must stay go to the end: the next trim starts past them.
        for inode in kept:
            dict.__delitem__(self, inode.ino)
            dict.__setitem__(self, inode.ino, inode)
        self.evictions += evicted
        # Short of the goal: what is left must stay for now; look again once the
        # table grew by an eighth of the cache (or after a publish), not at every
        # FORGET (which scanned thousands of pinned inodes per call).
        self._next_trim_at = 0 if evicted >= excess else \
            dict.__len__(self) + max(1024, self.capacity // 8)
        return evicted

    def retrim(self) -> None:
        """Inodes may be evictable again (a checkpoint published them): the next
        `trim` looks."""
        self._next_trim_at = 0


class LazyEntries:
    """A directory's names: those changed since the published tree, over the tree's."""

    __slots__ = ("_host", "_known", "_reader", "ino")

    def __init__(self, ino: int, host: LazyHost, reader: IndexReader) -> None:
        self.ino = ino
        self._host = host
        self._reader = reader
        #: Names changed since the published tree that exist (name -> child).
        self._known: dict[bytes, int] = {}

    def _changed(self, name: bytes) -> bool:
        dirty = self._host.dirty
        return dirty is not None and dirty.changed_dirent((self.ino, name))

    def _in_tree(self) -> bool:
        return self.ino < self._reader.next_ino

    def get(self, name: bytes, default: Any = None) -> Any:
        child = self._known.get(name)
        if child is not None:
            return child
        if not self._in_tree() or self._changed(name):
            return default
        child = self._reader.lookup(self.ino, name)
        return default if child is None else child

    def __getitem__(self, name: bytes) -> int:
        child = self.get(name)
        if child is None:
            raise KeyError(name)
        return int(child)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, bytes) and self.get(name) is not None

    def __setitem__(self, name: bytes, child: int) -> None:
        # State.apply notes the name changed right after (DirtySet.note).
        self._known[name] = child

    def pop(self, name: bytes, default: Any = None) -> Any:
        child = self.get(name)
        if child is None:
            return default
        self._known.pop(name, None)  # noted changed right after: gone from here on
        return child

    def published(self, name: bytes) -> None:
        """The tree now holds `name` as memory does, and it did not change since:
        memory needs it no more."""
        self._known.pop(name, None)

    def names_after(self, after: bytes | None, limit: int = NAMES_BATCH
                    ) -> list[tuple[bytes, int]]:
        """At least `limit` (name, child) in name order after `after` (None: from
        the first), fewer only at the end; changed names as memory has them."""
        known = sorted(n for n in self._known if after is None or n > after)
        out: list[tuple[bytes, int]] = []
        ki = 0
        cursor = after
        tree_done = not self._in_tree()
        while len(out) < limit and not tree_done:
            batch = self._reader.names_after(self.ino, cursor, limit)
            tree_done = len(batch) < limit
            for name, child in batch:
                while ki < len(known) and known[ki] < name:
                    out.append((known[ki], self._known[known[ki]]))
                    ki += 1
                if ki < len(known) and known[ki] == name:
                    out.append((name, self._known[name]))
                    ki += 1
                elif not self._changed(name):
                    out.append((name, child))
                cursor = name
        if tree_done:
            out.extend((n, self._known[n]) for n in known[ki:])
        return out

    def items(self) -> Iterator[tuple[bytes, int]]:
        after: bytes | None = None
        while True:
            batch = self.names_after(after)
            yield from batch
            if len(batch) < NAMES_BATCH:
                return
            after = batch[-1][0]

    def keys(self) -> Iterator[bytes]:
        return (name for name, _ in self.items())

    def values(self) -> Iterator[int]:
        return (child for _, child in self.items())

    def __iter__(self) -> Iterator[bytes]:
        return self.keys()

    def __bool__(self) -> bool:
        return bool(self._known) or bool(self.names_after(None, 1))

    def __len__(self) -> int:
        return sum(1 for _ in self.items())

    def known(self, name: bytes) -> int | None:
        """The child of `name` if it changed since the published tree and exists
        (no read; None also when it did not change)."""
        return self._known.get(name)

    def known_items(self) -> Iterator[tuple[bytes, int]]:
        """The names in memory (changed since the published tree), no read."""
        return iter(self._known.items())


class ZoneOwnersTable(dict[int, set[int]]):
    """Data zone -> its owner inodes, read from the index when first asked for."""

    def __init__(self, host: LazyHost, reader: IndexReader) -> None:
        super().__init__()
        self.host = host
        self.reader = reader

    def get(self, zone: int, default: Any = None) -> Any:
        owners = dict.get(self, zone)
        if owners is not None:
            return owners
        dirty = self.host.dirty
        if dirty is not None and dirty.changed_zone(zone):
            return default
        inos = self.reader.zone_owners(zone)
        if not inos:
            return default
        owners = set(inos)
        dict.__setitem__(self, zone, owners)
        return owners

    def trim(self) -> None:
        """Drop the owner sets the tree holds as they are (after a publish)."""
        dirty = self.host.dirty
        for zone in [z for z in dict.keys(self) if dirty is None or not dirty.changed_zone(z)]:
            dict.__delitem__(self, zone)
