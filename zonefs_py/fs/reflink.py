"""copy_file_range: instant copies by sharing extents (issue 28, DESIGN.md 3.13).

A copy whose source and destination offsets are block-aligned, and whose
length is whole blocks or ends at the source's EOF (where the last block's
bytes past EOF are zero, INV-10) and reaches the destination's EOF, is made
without moving data: one transaction of a PUNCH of the destination's range,
an EXTENT op per source piece naming the source's own device blocks (and its
checksums, or none in a sealed zone, whose summary holds them), a SHARE op
per piece (its device blocks gain a reference, model/shared.py) and the
destination's INODE op (size, times). Holes of the source stay holes.
Copy-on-write needs nothing more: no block is ever written in place, so a
later write to either file goes to new blocks and releases only its own
reference.

A copy within one file shares the same way (its ranges never overlap: the
kernel refuses that with EINVAL, and so do we): the file then maps some
device blocks twice, which the reference counts, the cleaner (one EXTENT
op per mapping) and fsck take as they take two files.

Every other copy (unaligned, a destination that has inline data) is copied
by the daemon itself: read through the engine and written through the
ordinary write path (no data through the kernel), at most
`FALLBACK_MAX_BYTES` a call (copy_file_range may copy less; callers loop).

A copy is a write request of the destination (`write_arriving`) that also
reads: it waits for the write requests of the source that arrived before it,
never for itself nor later ones (`arrival`), and takes each file's lock
once. Issue 42: a copy within one file waited for its own unfinished
request (its reads waited for every write of the file that had arrived,
itself included) and was never answered.

Quotas charge the destination for the blocks it maps, shared or not (the
source keeps its charge). Drain: the destination is a file of its own; a
drained destination becomes LOCAL first, as for a truncate.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Protocol

from zonefs_py import errors
from zonefs_py.format.constants import OpType
from zonefs_py.format.ops import Op
from zonefs_py.fs.api import FILE_SIZE_MAX
from zonefs_py.fs.clock import now_ns
from zonefs_py.fs.data.datapath import DataPath
from zonefs_py.model.state import Inode, State
from zonefs_py.model.tenants import tenant_of

#: Bytes one fallback (in-daemon) copy call copies at most.
FALLBACK_MAX_BYTES = 16 << 20
#: Bytes per read/write step of the fallback.
_STEP = 1 << 20


class _Drain(Protocol):
    async def before_truncate(self, inode: Inode, new_size: int) -> None: ...


class CopyHost(Protocol):
    """What copy_file_range needs of the engine (ZoneFS; not imported: it imports this)."""

    state: State
    data: DataPath
    bs: int

    @property
    def drain(self) -> _Drain: ...

    def _check_quota(self, inode: Inode, extra_bytes: int) -> None: ...

    def _txn(self, ops: list[Op]) -> None: ...

    async def _write(self, inode: Inode, offset: int, data: bytes) -> int: ...

    async def _read_inode(self, inode: Inode, offset: int, length: int,
                          before: int | None = None) -> bytes | memoryview: ...


class Copier:
    """copy_file_range for one mounted engine."""

    def __init__(self, fs: CopyHost) -> None:
        self.fs = fs
        self.state = fs.state
        self.data = fs.data
        self.bs = fs.bs
        #: Copies made by sharing, and their bytes (status and tests).
        self.shared_copies = 0
        self.shared_bytes = 0

    async def copy(self, src: Inode, off_in: int, dst: Inode, off_out: int,
                   length: int, arrival: int | None = None) -> int:
        """Copy up to `length` bytes; return how many (0 at or past the source's EOF).

        `arrival`: the copy's own arrival number as a write request of `dst`
        (`DataPath.write_arriving`); the copy reads `src` after the write
        requests of `src` that arrived before it, never waiting for itself
        (None: after every one that arrived before now, for a caller that is no
        write request).

        Raises InvalidArgument (negative offsets, overlapping ranges of one
        file, a file that is not regular), FileTooBig, QuotaExceeded, NoSpace
        (fallback), IOFailure.
        """
        if off_in < 0 or off_out < 0 or length < 0:
            raise errors.InvalidArgument("negative offset or length")
        if not src.is_reg or not dst.is_reg:
            raise errors.InvalidArgument("copy_file_range of a file that is not regular")
        if self.data.writes_arriving(src.ino):
            await self.data.after_earlier_writes(src.ino, arrival)
        size_in = self.data.visible_size(src)
        length = min(length, max(0, size_in - off_in))
        if length == 0:
            return 0
        if off_out + length > FILE_SIZE_MAX:
            raise errors.FileTooBig("copy past the largest file size")
        if src is dst and off_in < off_out + length and off_out < off_in + length:
            raise errors.InvalidArgument("overlapping ranges of one file")
        if self._shareable(src, off_in, dst, off_out, length, size_in):
            await self.fs.drain.before_truncate(dst, max(dst.size, off_out + length))
            files = (src,) if src is dst else tuple(sorted((src, dst), key=lambda i: i.ino))
            async with AsyncExitStack() as locked:
                for inode in files:  # each lock once, in inode order
                    await locked.enter_async_context(self.data.lock(inode.ino))
                for inode in files:
                    await self.data.flush_locked(inode)
                # Checked again: the flushes awaited, and may have changed either file.
                if self._shareable(src, off_in, dst, off_out, length,
                                   self.data.visible_size(src)):
                    self.fs._check_quota(dst, -(-length // self.bs) * self.bs)
                    self._share_locked(src, off_in, dst, off_out, length)
                    return length
        return await self._copy_bytes(src, off_in, dst, off_out,
                                      min(length, FALLBACK_MAX_BYTES), arrival)

    def _shareable(self, src: Inode, off_in: int, dst: Inode, off_out: int, length: int,
                   size_in: int) -> bool:
        bs = self.bs
        if src.inline or dst.inline or off_in % bs or off_out % bs:
            return False
        if tenant_of(self.state, src) != tenant_of(self.state, dst):
            return False  # a tenant's blocks never become another's (INV-27): copy bytes
        if length % bs == 0:
            return True
        # A partial last block is shared whole: only if it is the source's last
        # block (zeros past EOF, INV-10) and nothing of the destination follows.
        return (off_in + length == size_in
                and off_out + length >= self.data.visible_size(dst))

    def _share_locked(self, src: Inode, off_in: int, dst: Inode, off_out: int,
                      length: int) -> None:
        """Build and apply the sharing transaction (never awaits: one instant)."""
        bs = self.bs
        assert src.extents is not None
        lo_in, lo_out = off_in // bs, off_out // bs
        nblocks = -(-length // bs)
        ops: list[Op] = [(OpType.PUNCH, dst.ino, lo_out, nblocks)]
        for p in src.extents.lookup(lo_in, nblocks, bs):
            if p.dev is None:
                continue  # a hole stays a hole
            ops.append((OpType.EXTENT, dst.ino, lo_out + (p.fblock - lo_in), p.nblocks,
                        p.dev, p.csums))
            ops.append((OpType.SHARE, p.dev, p.nblocks, 1))
        now = now_ns()
        ops.append(dst.op(size=max(dst.size, off_out + length), mtime=now, ctime=now))
        self.fs._txn(ops)
        self.shared_copies += 1
        self.shared_bytes += length

    async def _copy_bytes(self, src: Inode, off_in: int, dst: Inode, off_out: int,
                          length: int, arrival: int | None) -> int:
        """The fallback: read and write through the engine, `_STEP` at a time."""
        done = 0
        while done < length:
            data = await self.fs._read_inode(src, off_in + done, min(_STEP, length - done),
                                             arrival)
            if not data:
                break
            await self.fs._write(dst, off_out + done, bytes(data))
            done += len(data)
        return done
