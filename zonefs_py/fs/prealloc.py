"""fallocate(2): reservations, punched holes and zeroed ranges (issue 28).

Modes (`FallocFlags`), each one transaction of ops (DESIGN.md 3.12):

* 0 and KEEP_SIZE: reserve the file blocks of the range (PREALLOC op, the
  blocks become *held*, model/prealloc.py) and, for mode 0, extend the size
  (INODE op; the new bytes read as zeros). No data is written. Held blocks
  count as used in statfs, in st_blocks and in quotas, and the write
  admission check (`ZoneFS._write`) lets a write into held blocks through
  without asking for space again: it cannot fail with ENOSPC for want of
  room (INV-24).
* PUNCH_HOLE | KEEP_SIZE: whole blocks of the range become holes (PUNCH op:
  their device blocks are dead at once, their reservations dropped); the
  partial blocks at the edges are rewritten with the range's bytes zeroed
  (read-modify-write, one block each). Nothing is written for whole blocks.
* ZERO_RANGE (with or without KEEP_SIZE): a punch, then the range's blocks
  reserved (the man page: "blocks are preallocated for the regions that span
  holes"), and without KEEP_SIZE the size extended to the range's end.
* COLLAPSE_RANGE, INSERT_RANGE, UNSHARE_RANGE, NO_HIDE_STALE, PUNCH_HOLE
  without KEEP_SIZE, and unknown bits: `NotSupported` (EOPNOTSUPP).

Atomicity: the edge blocks are appended first (not durable, not referenced);
then, with no await, their EXTENT ops, the PUNCH, PREALLOC and INODE ops are
applied and queued as one transaction: after a crash the call happened
wholly or not at all (the appended edge blocks of a lost transaction are
garbage past their zone's last reference, as for any write).

Caveats: a punch or zero range on a drained file makes it LOCAL again (and
restores an evicted one first), like a truncate; a punch inside an inline
file rewrites its inline bytes instead of blocks.
"""

from __future__ import annotations

from typing import Protocol

from zonefs_py import errors
from zonefs_py.alloc.allocator import Allocator
from zonefs_py.format.constants import OpType
from zonefs_py.format.ops import Op
from zonefs_py.fs.api import FILE_SIZE_MAX, FallocFlags
from zonefs_py.fs.clock import now_ns
from zonefs_py.fs.data.datapath import DataPath
from zonefs_py.journal.journal import Journal
from zonefs_py.model.prealloc import mapped_in
from zonefs_py.model.state import Inode, State, inline_op

#: The modes this module implements (anything else is NotSupported).
SUPPORTED = FallocFlags.KEEP_SIZE | FallocFlags.PUNCH_HOLE | FallocFlags.ZERO_RANGE


class _Drain(Protocol):
    async def before_truncate(self, inode: Inode, new_size: int) -> None: ...

    async def relieve_space(self, need_bytes: int, tenant: int = 0) -> bool: ...


class FallocHost(Protocol):
    """What fallocate needs of the engine (ZoneFS; not imported: it imports this)."""

    state: State
    data: DataPath
    journal: Journal
    alloc: Allocator
    bs: int

    @property
    def drain(self) -> _Drain: ...

    def _check_quota(self, inode: Inode, extra_bytes: int) -> None: ...

    async def _admit_tenant(self, inode: Inode, grow: int) -> int: ...

    def _txn(self, ops: list[Op]) -> None: ...


class Fallocator:
    """fallocate for one mounted engine; `held_*` feed its space checks."""

    def __init__(self, fs: FallocHost) -> None:
        self.fs = fs
        self.state = fs.state
        self.data = fs.data
        self.bs = fs.bs

    # -- accounting (no await) -------------------------------------------------------
    def held_total_bytes(self) -> int:
        """Bytes promised to reservations and not yet live (statfs, admission)."""
        return self.state.prealloc.held_total * self.bs

    def held_blocks(self, ino: int) -> int:
        """Held (reserved, unmapped) blocks of one file (st_blocks, quotas)."""
        return self.state.prealloc.held.get(ino, 0)

    def held_bytes_in(self, inode: Inode, offset: int, length: int) -> int:
        """Bytes of [offset, offset+length) that lie in held blocks of `inode`: a write
        there was charged already (INV-24)."""
        if inode.ino not in self.state.prealloc.ranges or inode.extents is None or length <= 0:
            return 0
        lo = offset // self.bs
        hi = -(-(offset + length) // self.bs)
        return self.state.prealloc.held_in(inode.ino, inode.extents, lo, hi) * self.bs

    def used_bytes(self) -> int:
        """Space taken from users (statfs, every admission check): live data, bytes
        accepted and not yet placed, and held blocks, each byte once.

        Write requests admitted and not yet buffered count too
        (`FileWrites.admit`). A write into held blocks is pending until its chunk
        lands and maps them (then their charge moves from held to live): until
        then its bytes are both pending and held, and are counted once. Without this, a file being
        written into its reservation made the device look fuller by what it
        had buffered, and near full its own writes got ENOSPC (INV-24).
        """
        used = (self.fs.alloc.live_total_bytes() + self.data.pending_bytes()
                + self.data.writes.admitted_bytes + self.held_total_bytes())
        pre = self.state.prealloc
        if not pre.ranges:
            return used
        writes = self.data.writes
        if len(pre.ranges) <= len(writes.buffers) + len(writes.inflight):
            inos = [ino for ino in pre.ranges if writes.has_state(ino)]
        else:
            inos = [ino for ino in {*writes.buffers, *writes.inflight} if ino in pre.ranges]
        for ino in inos:
            inode = self.state.inodes.get(ino)
            if inode is None or inode.extents is None:
                continue
            both = sum(pre.held_in(ino, inode.extents, lo, hi)
                       for lo, hi in writes.pending_blocks(ino, self.bs)) * self.bs
            used -= min(both, writes.pending_bytes_of(ino))
        return used

    async def _admit(self, inode: Inode, need_bytes: int) -> None:
        """Raise QuotaExceeded or NoSpace unless `need_bytes` more can be held."""
        if need_bytes <= 0:
            return
        self.fs._check_quota(inode, need_bytes)
        over = self.used_bytes() + need_bytes - self.fs.alloc.user_capacity_bytes()
        if over > 0 and not await self.fs.drain.relieve_space(over):
            raise errors.NoSpace("the reservation would not fit on the device")
        await self.fs._admit_tenant(inode, need_bytes)  # its tenant's cap (issue 45)

    # -- the call ----------------------------------------------------------------------
    async def fallocate(self, inode: Inode, mode: int, offset: int, length: int) -> None:
        """Apply fallocate(mode, offset, length) to `inode` (see the module docstring).

        Raises InvalidArgument, FileTooBig, NotSupported, NoSpace, QuotaExceeded,
        or what the data path raises for the edge blocks (IOFailure, NoSpace).
        """
        flags = FallocFlags(mode) if not mode & ~0x7F else None
        if flags is None or flags & ~SUPPORTED:
            raise errors.NotSupported(f"fallocate mode {mode:#x} is not supported")
        if offset < 0 or length <= 0:
            raise errors.InvalidArgument("fallocate needs offset >= 0 and length > 0")
        if offset + length > FILE_SIZE_MAX:
            raise errors.FileTooBig("fallocate past the largest file size")
        if not inode.is_reg:
            raise errors.InvalidArgument("fallocate of a file that is not regular")
        keep = bool(flags & FallocFlags.KEEP_SIZE)
        if flags & FallocFlags.PUNCH_HOLE:
            if not keep or flags & FallocFlags.ZERO_RANGE:
                raise errors.NotSupported("PUNCH_HOLE needs KEEP_SIZE, without ZERO_RANGE")
            await self._zero(inode, offset, length, reserve=False, keep_size=True)
        elif flags & FallocFlags.ZERO_RANGE:
            await self._zero(inode, offset, length, reserve=True, keep_size=keep)
        else:
            await self._reserve(inode, offset, length, keep_size=keep)

    async def _reserve(self, inode: Inode, offset: int, length: int, keep_size: bool) -> None:
        end = offset + length
        grows = not keep_size and end > self.data.visible_size(inode)
        if grows:
            await self.fs.drain.before_truncate(inode, end)
        with self.data.qos.expedited(inode.ino):
            async with self.data.lock(inode.ino):
                await self.data.flush_locked(inode)
                assert inode.extents is not None
                lo, hi = offset // self.bs, -(-end // self.bs)
                await self._admit(inode, self.state.prealloc.new_held(
                    inode.ino, inode.extents, lo, hi) * self.bs)
                if inode.ino not in self.state.inodes:
                    raise errors.NotFound("the file was freed meanwhile")
                ops: list[Op] = [(OpType.PREALLOC, inode.ino, lo, hi - lo)]
                if grows and end > inode.size:
                    now = now_ns()
                    ops.append(inode.op(size=end, mtime=now, ctime=now))
                self.fs._txn(ops)

    async def _zero(self, inode: Inode, offset: int, length: int, reserve: bool,
                    keep_size: bool) -> None:
        """PUNCH_HOLE (reserve False) or ZERO_RANGE (reserve True) of the range."""
        await self.fs.drain.before_truncate(inode, max(inode.size, offset + length))
        with self.data.qos.expedited(inode.ino):
            async with self.data.lock(inode.ino):
                await self.data.flush_locked(inode)
                await self._zero_locked(inode, offset, length, reserve, keep_size)

    async def _zero_locked(self, inode: Inode, offset: int, length: int, reserve: bool,
                           keep_size: bool) -> None:
        bs = self.bs
        ext = inode.extents
        assert ext is not None
        size = inode.size
        end = offset + length
        lo, hi = offset // bs, -(-end // bs)
        if reserve:
            await self._admit(inode, self.state.prealloc.new_held(inode.ino, ext, lo, hi) * bs)
        # Whole blocks: those the range covers, and the file's partial last block when
        # the range reaches EOF (its bytes past EOF are zero already, INV-10).
        whole_end = end if end < size else max(end, -(-size // bs) * bs)
        wlo, whi = -(-offset // bs), whole_end // bs
        edges = []
        if not inode.inline:
            for fblock in {lo, end // bs}:
                b_lo, b_hi = max(offset, fblock * bs), min(end, (fblock + 1) * bs, size)
                if wlo <= fblock < whi or b_lo >= b_hi:
                    continue
                if mapped_in(ext, fblock, fblock + 1, bs):
                    edges.append((fblock, b_lo - fblock * bs, b_hi - fblock * bs))
        placed: list[tuple[Op, int]] = []
        try:
            for fblock, b_lo, b_hi in sorted(edges):
                placed += await self.data.place_zeroed_locked(inode, fblock, b_lo, b_hi)
        except BaseException:
            self.data.discard_placed(placed)
            raise
        if inode.ino not in self.state.inodes:
            self.data.discard_placed(placed)
            raise errors.NotFound("the file was freed meanwhile")
        # From here to the journal: no await (one transaction, applied as queued).
        ops = self.data.apply_placed(inode, placed)
        now = now_ns()
        new_size = size if keep_size else max(size, end)
        tail: list[Op] = []
        if whi > wlo:
            tail.append((OpType.PUNCH, inode.ino, wlo, whi - wlo))
        if reserve:
            tail.append((OpType.PREALLOC, inode.ino, lo, hi - lo))
        if inode.inline:
            body = bytearray(inode.inline)
            cut_end = min(end, len(body))
            if offset < cut_end:
                body[offset:cut_end] = bytes(cut_end - offset)
            tail.append(inline_op(inode, bytes(body).rstrip(b"\0"), size=new_size,
                                  mtime=now, ctime=now))
        tail.append(inode.op(size=new_size, mtime=now, ctime=now))
        for op in tail:
            self.state.apply(op)
        self.fs.journal.add(ops + tail)
