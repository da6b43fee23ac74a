"""Inline data: a small file's bytes kept in the metadata instead of a data block.

A regular file whose whole content is at most `threshold` bytes (mount
option inline_max=, default 512; never more than `INLINE_MAX_BYTES`, 2 KiB,
nor half a device block) when
it is flushed (close, fsync, sync) gets an INLINE op carrying its bytes
instead of a device block: a 256-byte file costs ~270 bytes of journal
instead of a 4 KiB block (docs/DESIGN.md "Inline data"). The bytes live in
`Inode.inline` (in memory, like the rest of the namespace) and in every
checkpoint; the journal and checkpoint records that carry them are
checksummed like every other op.

Rules (INV-22): a file's bytes are inline or in blocks, never both; the
inline bytes are never longer than the file; bytes between their end and the
size read as zeros (a sparse tail).

* **Into inline** (`flush`): only a file with no extents, nothing in flight,
  and its whole content in the write buffer from offset 0. One transaction
  one INLINE op (it carries the size and times too); no device I/O. Called before the data path's
  own flush, never awaiting (a file whose data lock is held takes the block
  path instead).
* **Out of inline** (`convert`, before any write to an inline file): the
  inline bytes go into the write buffer at offset 0 and are flushed as block
  0 like any write; applying that block's EXTENT op drops the inline bytes
  (`State._apply_extent`), in the same transaction. Until it lands the inline
  bytes stay the file's content, so a crash leaves the inline version, and
  readers keep reading them (the buffer holds the same bytes). Rewriting a
  small file therefore costs one block append (rare for datasets written once).
* **Truncate**: shrinking cuts the inline bytes in the truncate's transaction
  (`truncate_ops`); growing keeps them (the tail is a hole). A file shrunk
  into the threshold keeps its blocks until it is rewritten whole.

Caveats: inline bytes cost memory in the daemon (they are part of the
in-memory namespace) and are rewritten by every checkpoint (why the default
is 512 bytes, not 2 KiB: docs/DESIGN.md "Inline data"); a drained file
with inline data is never evicted (there is no block to free).
"""

from __future__ import annotations

from zonefs_py.format.constants import C_USER_BYTES, INLINE_MAX_BYTES
from zonefs_py.format.ops import Op
from zonefs_py.fs.data.datapath import DataPath
from zonefs_py.journal.journal import Journal
from zonefs_py.model.state import Inode, State, inline_op


def inline_threshold(block_size: int, max_bytes: int = INLINE_MAX_BYTES) -> int:
    """The largest file (bytes) kept inline on a device of `block_size` when the
    mount allows `max_bytes` (mount option inline_max=, default 512)."""
    return min(INLINE_MAX_BYTES, max_bytes, block_size // 2)


class InlineData:
    """Moves small files' bytes into and out of the metadata (module docstring)."""

    def __init__(self, state: State, data: DataPath, journal: Journal,
                 threshold: int | None = None) -> None:
        self.state = state
        self.data = data
        self.journal = journal
        self.threshold = inline_threshold(data.bs) if threshold is None else threshold
        #: Files moved into inline / out of it since mount (`zonefs-py stat`).
        self.files_inlined = 0
        self.files_converted = 0

    # -- into inline -------------------------------------------------------------------
    def _eligible(self, inode: Inode) -> bool:
        """True if `inode`'s whole content is its write buffer and small enough (no await)."""
        ino = inode.ino
        data = self.data
        buf = data.buffers.get(ino)
        if buf is None or buf.start != 0 or inode.inline or not inode.is_reg:
            return False
        if inode.extents is None or len(inode.extents) or ino in data.inflight \
                or ino in data.writes.write_errors:
            return False
        size = max(inode.size, buf.end)
        return size <= self.threshold and inode.ino in self.state.inodes

    def flush(self, inode: Inode) -> bool:
        """Make a small file inline instead of writing a block; True if it did.

        Never awaits: the checks and the transaction are atomic. A file whose
        data lock is held (a writer, or a reader that found its buffer and
        waits for the lock: it would then read neither buffer nor inline
        bytes) is left to `DataPath.flush`, which the caller calls next.
        """
        if not self._eligible(inode):
            return False
        lk = self.data.locks.get(inode.ino)
        if lk is not None and lk.locked():
            return False
        buf = self.data.writes.drop_buffer(inode.ino)
        assert buf is not None  # _eligible: the file has a buffer
        mtime = buf.mtime  # 0: no write since a SETATTR set the times (DataPath.times_set)
        body = bytes(buf.data).rstrip(b"\0")  # trailing zeros read back as the hole
        # One op: the INLINE op carries the size and times (no INODE op, 73 bytes less).
        op = inline_op(inode, body, size=max(inode.size, buf.end), mtime=mtime or inode.mtime,
                       ctime=mtime or inode.ctime)
        self.state.apply(op)
        self.journal.add([op])
        self.files_inlined += 1
        drop_idle_lock(self.data, inode.ino)
        return True

    # -- out of inline -----------------------------------------------------------------
    async def convert(self, inode: Inode) -> None:
        """Move an inline file's bytes into block 0 before a write changes it.

        Raises what the data path's flush raises (NoSpace, IOFailure); the file
        then keeps its inline bytes.
        """
        async with self.data.lock(inode.ino):
            body = inode.inline
            if not body:
                return  # another writer converted it meanwhile
            buffered = inode.ino in self.data.buffers
        if not buffered:
            await self.data.write(inode, 0, body)
            # The conversion is not user data (keeps the write amplification honest).
            self.data.counters[C_USER_BYTES] = self.data.counters.get(C_USER_BYTES, 0) - len(body)
        await self.data.flush(inode)  # applies EXTENT(block 0), which drops the inline bytes
        if inode.inline:
            # Cannot happen: block 0 was written from the buffer holding the inline bytes.
            raise AssertionError(f"inode {inode.ino} kept inline data after its first block")
        self.files_converted += 1

    # -- truncate and reads ------------------------------------------------------------
    def truncate_ops(self, inode: Inode, new_size: int) -> list[Op]:
        """Cut the inline bytes to `new_size` (apply and return the op; no await)."""
        if len(inode.inline) <= new_size:
            return []
        op = inline_op(inode, inode.inline[:new_size].rstrip(b"\0"))
        self.state.apply(op)
        return [op]

    @staticmethod
    def read(inode: Inode, size: int, offset: int, length: int) -> bytes:
        """The bytes [offset, offset+length) of an inline file of visible `size`."""
        end = min(size, offset + length)
        if offset >= end:
            return b""
        piece = inode.inline[offset:end]
        return piece + bytes(end - offset - len(piece))


def drop_idle_lock(data: DataPath, ino: int) -> None:
    """Forget the data lock of a file with no write state (it costs ~200 bytes a file)."""
    lk = data.locks.get(ino)
    if lk is not None and not lk.locked() and ino not in data.buffers \
            and ino not in data.inflight and not lk.statistics().tasks_waiting:
        del data.locks[ino]
