"""The checkpoint's view of the model: the ops that rebuild a State, and `Snapshot`.

`snapshot_ops(state)` lists a State as ops, in an order apply() accepts from
nothing (DESIGN.md, "Checkpoint"). `Snapshot` produces the same list a slice
at a time while requests keep changing the State, copy-on-write: State.apply
hands it each inode an op is about to change (`before_apply`).

Pure: no I/O, no trio; the journal's checkpoint writer drives it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from zonefs_py.format.constants import OpType
from zonefs_py.format.ops import RESIDENT_MAX_INODES, Op
from zonefs_py.model.drain import DrainRecord
from zonefs_py.model.errors import StateError
from zonefs_py.model.inode import Inode, inline_op
from zonefs_py.model.prealloc import Reservations
from zonefs_py.model.shared import SharedBlocks
from zonefs_py.model.tenants import TenantTable


class SnapshotHook(Protocol):
    """What State.apply tells the checkpoint snapshot being taken (copy-on-write):
    `Snapshot` here, `IndexSnapshot` (model/dirty.py) for format 5."""

    def before_apply(self, op: Op) -> None: ...

    def before_change(self, inode: Inode) -> None: ...

    def before_owners(self, zone: int) -> None: ...


class SnapshotSource(Protocol):
    """What a snapshot reads of a model.state.State (which imports this module)."""

    block_size: int
    zone_size: int
    inodes: dict[int, Inode]
    zone_owners: dict[int, set[int]]
    zone_live_blocks: dict[int, int]
    next_ino: int
    ino_generations: list[tuple[int, int]]
    counters: dict[int, int]
    tenant_written: dict[int, int]
    tenants: TenantTable
    zone_tenant: dict[int, int]
    zone_info: dict[int, tuple[int, int, int]]
    zone_seals: dict[int, tuple[int, int]]
    shared: SharedBlocks
    drain: dict[int, DrainRecord]
    prealloc: Reservations
    #: The snapshot being encoded, if any; apply() hands it each inode it changes.
    snapshot: SnapshotHook | None
    snapshot_gen: int

    @property
    def inode_count(self) -> int: ...

    def resident_inos(self) -> list[int]: ...


#: Ops whose op[1] is an inode they change (for DIRENT_* the directory; the
#: child's `parent` is derived, not stored).
_CHANGES_INODE = frozenset({
    OpType.INODE, OpType.INODE_FREE, OpType.DIRENT_ADD, OpType.DIRENT_DEL, OpType.EXTENT,
    OpType.TRUNCATE, OpType.SYMLINK, OpType.XATTR_SET, OpType.XATTR_DEL, OpType.DRAIN,
    OpType.INLINE, OpType.PREALLOC, OpType.PUNCH,
})


def snapshot_ops(state: SnapshotSource, max_csum_blocks: int = 65536) -> Iterator[Op]:
    """Yield ops that rebuild `state` from nothing (the checkpoint).

    Order matters: counters and zones, then every inode, then names,
    symlink targets, xattrs and extents (which need their inodes).
    """
    yield from head_ops(state)
    for inode in state.inodes.values():
        yield inode.op()
    for inode in state.inodes.values():
        yield from inode_body_ops(state, inode, max_csum_blocks)


def head_ops(state: SnapshotSource, *, index: bool = False) -> Iterator[Op]:
    """Yield the snapshot's ops that belong to no inode: counters, tenants, zones;
    with `index` (format 5) also what a lazy mount reads instead of the whole
    namespace: the inode count, each data zone's live blocks, and the inodes
    it loads at once (DESIGN.md 3.15)."""
    yield (OpType.NEXT_INO, state.next_ino)
    for first, generation in state.ino_generations:
        yield (OpType.INO_GENERATION, first, generation)
    yield (OpType.COUNTERS, dict(state.counters))
    for dir_ino, written in state.tenant_written.items():
        yield (OpType.TENANT_BYTES, dir_ino, written)
    for _tid, policy in sorted(state.tenants.by_id.items()):
        yield policy.op()
    for zone, (stream, flags, resets) in sorted(state.zone_info.items()):
        yield (OpType.ZONE_STATE, zone, stream, flags, resets)
    for zone, tid in sorted(state.zone_tenant.items()):
        yield (OpType.ZONE_TENANT, zone, tid)
    for zone, (resets, data_blocks) in sorted(state.zone_seals.items()):
        yield (OpType.ZONE_SEAL, zone, resets, data_blocks)
    for dev, nblocks, extra in state.shared.items():
        yield (OpType.SHARE, dev, nblocks, extra)
    if not index:
        return
    yield (OpType.INODE_COUNT, state.inode_count)
    for zone, live in sorted(state.zone_live_blocks.items()):
        if live and 0 <= zone <= _ZONE_MAX:  # (a forged extent can name no zone)
            yield (OpType.ZONE_LIVE, zone, live)
    resident = state.resident_inos()
    for i in range(0, len(resident), RESIDENT_MAX_INODES):
        yield (OpType.RESIDENT, tuple(resident[i:i + RESIDENT_MAX_INODES]))


#: Zone numbers are u32 on the device (SPEC).
_ZONE_MAX = 0xFFFFFFFF


def inode_body_ops(state: SnapshotSource, inode: Inode, max_csum_blocks: int = 65536,
                   *, names: bool = True) -> Iterator[Op]:
    """Yield the snapshot's ops of one inode after its INODE op: names (of a
    directory; not with `names=False`), symlink target, xattrs, drain state,
    inline data, extents."""
    if names and inode.entries:
        for name, child in inode.entries.items():
            yield (OpType.DIRENT_ADD, inode.ino, child, name)
    if inode.target is not None:
        yield (OpType.SYMLINK, inode.ino, inode.target)
    if inode.xattrs:
        for name, value in inode.xattrs.items():
            yield (OpType.XATTR_SET, inode.ino, name, value)
    drain = state.drain.get(inode.ino)
    if drain is not None:
        yield drain.op(inode.ino)
    if inode.inline:
        yield inline_op(inode, inode.inline)
    if inode.extents is not None:
        bs = state.block_size
        for e in inode.extents:
            if e.csums is None:  # sealed zone: no checksums to carry
                yield (OpType.EXTENT, inode.ino, e.fblock, e.nblocks, e.dev, None)
                continue
            # Split huge extents so one op stays well under a record's size.
            for off in range(0, e.nblocks, max_csum_blocks):
                n = min(max_csum_blocks, e.nblocks - off)
                yield (OpType.EXTENT, inode.ino, e.fblock + off, n, e.dev + off * bs,
                       e.csums[off * 4:(off + n) * 4])
        for lo, hi in state.prealloc.ranges.get(inode.ino, ()):
            yield (OpType.PREALLOC, inode.ino, lo, hi - lo)


class Snapshot:
    """The State as it was when this object was made, encoded a slice at a time.

    A checkpoint of a big namespace takes seconds to encode (about 3 us per
    file); `step()` encodes a slice of the inodes that existed at the start,
    and the caller lets other requests run between slices. Requests keep
    changing the State meanwhile, so the snapshot is copy-on-write: while it
    is installed (`State.snapshot`), `State.apply` calls `before_apply`
    first, which encodes the inode the op is about to change if it existed
    at the start and is not encoded yet (its pre-image). Each inode is
    encoded exactly once, either way, as it was at the start:

    * an inode not yet encoded has not been changed since the start (every
      change goes through apply(), and apply() would have encoded it first);
    * inodes born after the start carry this snapshot's generation and are
      never encoded; inodes freed after it were encoded before the free.

    Everything outside inodes (next inode number, counters, tenants, zone
    states) is small and encoded at once by the constructor. The result is
    exactly what `snapshot_ops(state)` would have given at the start, except for
    the order of names across directories (DESIGN.md, "Checkpoint").
    """

    def __init__(self, state: SnapshotSource, encode: Callable[[Op], bytes]) -> None:
        if state.snapshot is not None:
            raise StateError("a snapshot is already being taken")
        state.snapshot_gen += 1
        self.gen = state.snapshot_gen
        self.state = state
        self.encode = encode
        self.head = [encode(op) for op in head_ops(state)]
        self.inode_part: list[bytes] = []
        self.body_part: list[bytes] = []
        self._todo: list[Inode] = list(state.inodes.values())
        self._pos = 0
        #: Inodes encoded ahead of the cursor because an op was about to change them.
        self.copied = 0
        state.snapshot = self

    def _take(self, inode: Inode) -> None:
        inode.ckpt_gen = self.gen
        encode = self.encode
        self.inode_part.append(encode(inode.op()))
        self.body_part.extend(encode(op) for op in inode_body_ops(self.state, inode))

    def before_apply(self, op: Op) -> None:
        if op[0] in _CHANGES_INODE:
            inode = self.state.inodes.get(op[1])
            if inode is not None:
                self.before_change(inode)

    def before_change(self, inode: Inode) -> None:
        """Encode `inode` now if it is not encoded yet: it is about to change."""
        if inode.ckpt_gen != self.gen:
            self._take(inode)
            self.copied += 1

    def step(self, max_inodes: int) -> bool:
        """Encode up to `max_inodes` more inodes; True once every one is encoded."""
        todo = self._todo
        end = min(self._pos + max_inodes, len(todo))
        gen = self.gen
        for i in range(self._pos, end):
            inode = todo[i]
            if inode.ckpt_gen != gen:
                self._take(inode)
        self._pos = end
        if end < len(todo):
            return False
        self._todo = []
        return True

    def encoded_ops(self) -> list[bytes]:
        """Every encoded op, in checkpoint order (call once `step` returned True)."""
        if self._todo:
            raise StateError("snapshot is not complete")
        return self.head + self.inode_part + self.body_part

    def before_owners(self, zone: int) -> None:
        """Format 4 lists no zone owners (they are derived from the extents)."""

    def close(self, failed: bool = False) -> None:
        """Stop tracking changes (always call it, also when the checkpoint fails;
        `failed` changes nothing here: a format-4 checkpoint holds everything)."""
        if self.state.snapshot is self:
            self.state.snapshot = None
