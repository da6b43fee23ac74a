"""Group commit on top of the metadata log (async, trio).

`add(ops)` queues one *transaction* (the ops of one namespace operation) and
never awaits; the caller applied the same ops to the State just before,
without awaiting in between. `commit()` makes every transaction added so far
durable: concurrent callers share one device write and one flush (group
commit). A commit is: take the pending batch, flush the device if file data
was appended since the last flush (so extents never point at data that is
not durable, INV-7), append the JOURNAL records, flush.

A queued INODE op that changed only mtime/ctime is left out when a later
queued op of the same inode sets them again (`_drop_superseded` has the
crash argument): a directory's times at every create in it, the kernel's
SETATTR of times before a close.

`GroupCommit` is the base class of `Journal` (journal.py), which adds the
checkpoint writer; a commit that finds a checkpoint due asks the engine's
background task for it, or writes it itself (`checkpoint()`). Device calls
run in worker threads (`trio.to_thread.run_sync`) with the journal's
CapacityLimiter; only one commit or checkpoint write goes to the log at a
time (`_write_lock`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import trio

from zonefs_py.device.base import ZonedDevice
from zonefs_py.format.constants import RECORD_HEADER_SIZE, OpType, RecordType
from zonefs_py.format.ops import Op, encode_op
from zonefs_py.format.superblock import Superblock
from zonefs_py.journal.log import LogFull, LogPosition, MetaLog
from zonefs_py.journal.metaroom import _NEW_INODE_CONTENT, DIRENT_ALLOWANCE_BYTES, MetaRoom
from zonefs_py.journal.nsindex import NamespaceIndex
from zonefs_py.journal.sbstore import SuperblockStore
from zonefs_py.model.state import State

log = logging.getLogger("zonefs_py.journal.journal")


class GroupCommit(MetaRoom):
    """Transactions queued and made durable together (module docstring)."""

    def __init__(self, dev: ZonedDevice, log_: MetaLog, sbstore: SuperblockStore,
                 sb: Superblock, state: State, limiter: trio.CapacityLimiter, *,
                 journal_limit: int = 64 << 20, checkpoint_bytes: int = 0,
                 checkpoint_disk_bytes: int = 0, index: NamespaceIndex | None = None) -> None:
        self.dev = dev
        self.log = log_
        #: Format 5: the namespace index checkpoints write into (journal/nsindex.py).
        self.index = index
        super().__init__(state, checkpoint_bytes, checkpoint_disk_bytes,
                         None if index is None else index.live_bytes())
        self.sbstore = sbstore
        self.sb = sb
        self.state = state
        self.limiter = limiter
        self._pending: list[list[bytes]] = []  # per transaction, its encoded ops
        self._pending_bytes = 0
        #: Per inode with an INODE op queued: its attributes but mtime / ctime as of
        #: the last INODE op kept, and where a later INODE op that changed only
        #: mtime / ctime sits (txn, op index).
        self._kept_attrs: dict[int, tuple[int, ...]] = {}
        self._times_only: dict[int, tuple[int, int]] = {}
        #: Bytes of INODE ops left out because a later one superseded them.
        self.superseded_bytes = 0
        self.added_txn = 0
        self.durable_txn = 0
        self.data_dirty = False
        self._write_lock = trio.Lock()
        self._checkpoint_lock = trio.Lock()
        #: Requests in `urgent()` (fsyncs, commits) right now.
        self._urgent = 0
        self._checkpoint_done = trio.Event()
        #: True from a checkpoint's BEGIN to its superblock write.
        self.checkpoint_running = False
        #: Set while the engine's background task runs (`background_checkpoints`): a
        #: commit that finds a checkpoint due asks for one there instead of writing it.
        self.request_checkpoint: Callable[[], None] | None = None
        self.checkpoints_written = 0
        self.commits = 0
        #: Commits written while a checkpoint was being written (inside it).
        self.commits_during_checkpoints = 0
        self.last_commit_ns = 0
        #: Set when a device error left the journal unable to make progress.
        self.broken: str | None = None
        self.on_durable: list[Callable[[int], None]] = []
        #: Journal bytes after which a commit becomes a checkpoint (mount option),
        #: at least: see `checkpoint_needed`.
        self.journal_limit = journal_limit

    def data_appended(self) -> None:
        """Note that file data (or a zone summary) was written to the device: the
        next commit or checkpoint flushes the device before its records (INV-7)."""
        self.data_dirty = True

    @contextlib.contextmanager
    def background_checkpoints(self, request: Callable[[], None]) -> Iterator[None]:
        """While inside, a commit that finds a checkpoint due calls `request()`
        (the engine's background task then writes it) instead of writing it."""
        self.request_checkpoint = request
        try:
            yield
        finally:
            self.request_checkpoint = None

    # -- adding ------------------------------------------------------------------
    def add(self, ops: list[Op]) -> int:
        """Queue one transaction (already applied to the State). Never awaits."""
        if not ops:
            return self.added_txn
        encoded = [encode_op(op) for op in ops]
        txn = len(self._pending)
        self._pending.append(encoded)
        self._pending_bytes += sum(map(len, encoded))
        kept, times_only = self._kept_attrs, self._times_only
        for k, op in enumerate(ops):
            kind = op[0]
            where_ino = _NEW_INODE_CONTENT.get(kind)
            if where_ino is not None and op[where_ino] >= self._new_ino_floor:
                extra = len(encoded[k])
                if kind == OpType.DIRENT_ADD:
                    extra -= DIRENT_ALLOWANCE_BYTES
                self._new_content_bytes += max(0, extra)
            if kind == OpType.INODE:
                ino = op[1]
                where = times_only.pop(ino, None)
                if where is not None:
                    self._drop_superseded(*where)
                attrs = op[2:9] + op[11:]  # mode, uid, gid, nlink, rdev, size, atime, flags
                if kept.get(ino) == attrs:
                    times_only[ino] = (txn, k)  # only mtime / ctime changed
                else:
                    kept[ino] = attrs
            elif kind == OpType.INLINE and op[1] in kept:
                # An INLINE op sets size, mtime and ctime: it supersedes an INODE op
                # that changed only mtime / ctime, and it is what replay then holds.
                where = times_only.pop(op[1], None)
                if where is not None:
                    self._drop_superseded(*where)
                attrs = kept[op[1]]
                kept[op[1]] = attrs[:5] + (op[2],) + attrs[6:]
            elif kind == OpType.INODE_FREE:
                kept.pop(op[1], None)
                times_only.pop(op[1], None)
        self.added_txn += 1
        return self.added_txn

    def _drop_superseded(self, txn: int, k: int) -> None:
        """Leave out queued op `k` of queued transaction `txn`: an INODE op that
        changed only mtime and ctime, now that a later queued INODE or INLINE op
        of the same inode sets them again (a directory's times at every create
        in it, the kernel's SETATTR of times before a close).

        Safe: INODE ops are physical, and both go out in the same commit, whose
        records land as a prefix. If the commit completes, the replayed state is
        the same. If it is torn, nothing in it was acknowledged; where the newer
        op was lost, replay misses only that inode's time changes, because the
        dropped op's other attributes equal those of the last kept INODE op of
        the inode in this batch (INLINE ops, which set the size, are followed),
        which is what replay holds before it. The first INODE op of an inode in
        a batch is always kept (it may create the inode).
        """
        op_bytes = self._pending[txn]
        dropped = len(op_bytes[k])
        op_bytes[k] = b""
        self._pending_bytes -= dropped
        self.superseded_bytes += dropped

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def _take_batch(self) -> tuple[list[bytes], int]:
        batch = [txn for txn in map(b"".join, self._pending) if txn]
        upto = self.added_txn
        self._pending = []
        self._pending_bytes = 0
        self._kept_attrs = {}
        self._times_only = {}
        return batch, upto

    def _set_durable(self, upto: int) -> None:
        if upto > self.durable_txn:
            self.durable_txn = upto
        for cb in self.on_durable:
            cb(self.durable_txn)

    def _check_broken(self) -> None:
        if self.broken is not None:
            from zonefs_py import errors

            raise errors.IOFailure(f"metadata journal unusable: {self.broken}")

    @contextlib.contextmanager
    def urgent(self) -> Iterator[None]:
        """Mark a request that waits for the device (an fsync) while it runs: a
        checkpoint being encoded meanwhile pauses between its slices for it."""
        self._urgent += 1
        try:
            yield
        finally:
            self._urgent -= 1

    # -- commit ------------------------------------------------------------------
    async def commit(self) -> None:
        """Return once every transaction added before the call is durable.

        It never waits for a checkpoint being written (only for one of its
        record writes), unless meta zones run out meanwhile.
        """
        with self.urgent():
            await self._commit()

    async def _commit(self) -> None:
        target = self.added_txn
        while self.durable_txn < target:
            self._check_broken()
            if self.checkpoint_needed(self.journal_limit):
                if self.checkpoint_running:
                    if self._last_meta_zones_at_stake():
                        # The log could run out of zones before the running
                        # checkpoint frees some: wait for it (it makes our batch
                        # durable too).
                        await self._checkpoint_done.wait()
                        continue
                elif self.request_checkpoint is None or self._last_meta_zones_at_stake():
                    # Nobody runs checkpoints in the background (engine tests, fsck),
                    # or it is busy and the log would run out of zones first: write
                    # it here; it makes the queued transactions durable.
                    await self.checkpoint()
                    continue
                else:
                    self.request_checkpoint()
            # (No waiting for a "durable" event while another task writes: the lock
            # holder may mark transactions durable before it releases the lock, and a
            # waiter that arrived in between would sleep until someone else's commit.
            # Queue for the lock instead; a batch that made ours durable meanwhile
            # ends the loop.)
            async with self._write_lock:
                if self.durable_txn >= target:
                    break
                await self._commit_locked()

    async def _commit_locked(self) -> None:
        # A write that failed while we queued for the lock took the queued
        # transactions with it (ours maybe among them): an empty batch now would
        # look like "all durable", so refuse before taking one.
        self._check_broken()
        batch, upto = self._take_batch()
        if not batch:
            if self.data_dirty:
                self.data_dirty = False
                await self._run(self.dev.flush)
            self._set_durable(upto)
            return
        records = [(RecordType.JOURNAL, p) for p in _pack(batch, self._payload_target())]
        flush_first = self.data_dirty
        self.data_dirty = False
        try:
            await self._run(self._write_records, records, flush_first)
        except (OSError, LogFull) as exc:
            self.broken = f"journal write failed: {exc}"
            log.error("%s", self.broken)
            self._set_durable(self.durable_txn)
            self._check_broken()
        size = sum(len(p) for _, p in records)
        self.journal_bytes_since_checkpoint += size
        self.commits += 1
        if self.checkpoint_running:
            self.commits_during_checkpoints += 1
        self.last_commit_ns = time.time_ns()
        self._set_durable(upto)

    def _write_records(self, records: list[tuple[RecordType, bytes]], flush_first: bool,
                       new_zone: bool = False) -> list[LogPosition]:
        if flush_first:
            self.dev.flush()
        positions = self.log.append(records, new_zone=new_zone)
        self.dev.flush()
        return positions

    async def _run(self, fn: Callable[..., object], *args: object) -> object:
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    def _last_meta_zones_at_stake(self) -> bool:
        """True when the queued batch would start a meta zone and at most two are
        empty. Those are kept for a checkpoint and for a mount after a crash
        that tore it (which writes a CHECKPOINT_ABORT and its own checkpoint,
        each maybe in a fresh zone): such a commit waits for the running
        checkpoint, or writes one first."""
        if self.log.free_zone_count() > 2:
            return False
        n = self._pending_bytes
        overhead = (n // self._payload_target() + 1) * (RECORD_HEADER_SIZE + self.log.block_size)
        return n + overhead > self.log.room_in_current_zone()

    # -- what the checkpoint writer (Journal) provides ---------------------------------
    async def checkpoint(self) -> None:
        """Write a checkpoint (Journal.checkpoint)."""
        raise NotImplementedError

    def _payload_target(self) -> int:
        """Record payload size to pack to (Journal._payload_target)."""
        raise NotImplementedError


def _pack(chunks: list[bytes], target: int) -> list[bytes]:
    """Group transaction/op byte strings into record payloads of about `target`
    bytes (journal.py's RECORD_PAYLOAD_TARGET, or less: `Journal._payload_target`).

    A chunk is never split: one transaction is always inside one record.
    """
    return list(_pack_iter(chunks, target))


def _pack_iter(chunks: list[bytes], target: int) -> Iterator[bytes]:
    """The payloads of `_pack`, one at a time."""
    limit = target
    cur: list[bytes] = []
    cur_len = 0
    for c in chunks:
        if cur and cur_len + len(c) > limit:
            yield b"".join(cur)
            cur, cur_len = [], 0
        cur.append(c)
        cur_len += len(c)
    if cur:
        yield b"".join(cur)
