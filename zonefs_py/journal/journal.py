"""Group commit and checkpoints on top of the metadata log (async, trio).

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

`checkpoint()` takes the queued transactions and a copy-on-write snapshot of
the whole State at one instant, writes those transactions as a JOURNAL record
and a CHECKPOINT_BEGIN in a fresh meta zone (flushed: from here they are
durable as journal records), encodes the snapshot, writes it as
CHECKPOINT_DATA records and a CHECKPOINT_END, flushes, points the superblock
at it, and resets the meta zones it made obsolete. Commits do not wait for it
(issue 15): they take the log between its writes, so their JOURNAL records
land between BEGIN and END. Recovery applies such records after the
checkpoint they sit in, and to the older state when that checkpoint is torn
(DESIGN.md, "Checkpoint").

What runs where: encoding runs on the trio thread, a checkpoint's in slices
of CHECKPOINT_SLICE_INODES inodes with requests served in between (a
copy-on-write `State.Snapshot` keeps it the state of the moment the batch was
taken); device calls run in worker threads through `trio.to_thread.run_sync`
with the engine's CapacityLimiter. Only one commit or checkpoint write goes to
the log at a time (`_write_lock`), and one checkpoint at a time
(`_checkpoint_lock`).
"""

from __future__ import annotations

import contextlib
import logging
import struct
import time
from collections.abc import Callable, Iterator
from typing import NoReturn

import trio

from zonefs_py.device.base import ZonedDevice
from zonefs_py.format.constants import RECORD_HEADER_SIZE, OpType, RecordType
from zonefs_py.format.ops import Op, encode_op
from zonefs_py.format.records import padded_size
from zonefs_py.format.superblock import Superblock
from zonefs_py.journal.log import LogFull, LogPosition, MetaLog
from zonefs_py.journal.sbstore import SuperblockStore
from zonefs_py.model.state import Snapshot, State

log = logging.getLogger(__name__)

#: Payload of one JOURNAL / CHECKPOINT_DATA record at most (a bigger single
#: transaction gets a record of its own).
RECORD_PAYLOAD_TARGET = 1 << 20
CHECKPOINT_END = struct.Struct("<QQ")
#: Payload of CHECKPOINT_ABORT: the seq of the torn checkpoint's BEGIN.
CHECKPOINT_ABORT = struct.Struct("<Q")
#: Checkpoint bytes per inode assumed before any checkpoint was measured (an empty
#: file in a directory of 1000: ~130 bytes; with 256 bytes inline: ~380).
NOMINAL_CHECKPOINT_BYTES_PER_INODE = 256
#: Inodes a checkpoint must hold for its bytes per inode to be used instead
#: (mkfs's holds only the root: 93 bytes, below what a file costs).
SAMPLE_MIN_INODES = 64
#: Inodes to come are estimated at this many times (num / den) the device bytes
#: per inode of the newest checkpoint (records are compressed, format 3), plus
#: their metadata-only payloads, uncompressed (`_NEW_INODE_CONTENT`).
GROWTH_MARGIN = (5, 4)
#: Ops whose bytes count, uncompressed, toward the estimate of the next
#: checkpoint when they concern an inode made since the newest checkpoint's
#: snapshot: the payloads only metadata holds (inline bytes, targets, xattrs,
#: drain records, long names). A namespace of small files that compress well
#: can be followed by files whose payloads do not compress at all, and the
#: bytes per inode measured are then many times too low: the meta area ran
#: out in a test (5,000 empty files, then files of 500 random inline bytes, 4
#: meta zones), and random 255-byte names after short ones made a checkpoint
#: of 200 KiB where 128 KiB can rotate. A DIRENT_ADD counts only beyond
#: DIRENT_ALLOWANCE_BYTES: shorter names are left to the bytes per inode (one
#: such op per file would otherwise count twice, and `df -i` fall by two or
#: three per file between checkpoints). Extents are left out: their checksums
#: grow with the data stored, 4 bytes per 4 KiB block, far below the 3% of the
#: device the meta area gets. Value: where the op's subject inode sits.
_NEW_INODE_CONTENT = {OpType.INLINE: 1, OpType.SYMLINK: 1, OpType.XATTR_SET: 1,
                      OpType.DRAIN: 1, OpType.DIRENT_ADD: 2}
DIRENT_ALLOWANCE_BYTES = 64
#: Inodes a checkpoint encodes in one slice (~0.75 ms at ~3 us each). While
#: an fsync or commit is in flight (`Journal.urgent`), the encoder pauses
#: CHECKPOINT_SLICE_PAUSE_S after each slice (and after each ~1 MiB payload
#: packed): the trio thread then waits in epoll and leaves the GIL to worker
#: threads (that fsync's device writes). Without pauses they got the GIL only
#: at forced switches: an fsync during the encoding of a 1M-file checkpoint
#: took up to 1.8 s; with them, p99 25 ms (bench/checkpoint_fsync). A pause
#: is ~1 ms in practice (epoll's resolution), so a checkpoint under constant
#: fsyncs takes up to ~2.4x as long; with none in flight it does not pause.
CHECKPOINT_SLICE_INODES = 250
CHECKPOINT_SLICE_PAUSE_S = 0.00025
#: Checkpoint bytes written per hold of the log: a commit waits at most for
#: one such write (~10 ms), never for the whole checkpoint.
CHECKPOINT_WRITE_BYTES = 8 << 20


class Journal:
    """Group commit of transactions and checkpoints of the State (module docstring).

    `checkpoint_bytes` / `checkpoint_disk_bytes` describe the checkpoint loaded
    at mount (its payload bytes, and what it takes of the meta area): they set
    the checkpoint trigger, the meta-zone reserve and the bound on files until
    this mount writes one. `journal_limit` is the mount option
    `checkpoint_journal_bytes`. Appenders of file data call `data_appended()`
    (through the allocator: `Allocator.append_done`), so that the next commit
    flushes the device before its records (INV-7).
    """

    def __init__(self, dev: ZonedDevice, log_: MetaLog, sbstore: SuperblockStore,
                 sb: Superblock, state: State, limiter: trio.CapacityLimiter, *,
                 journal_limit: int = 64 << 20, checkpoint_bytes: int = 0,
                 checkpoint_disk_bytes: int = 0) -> None:
        self.dev = dev
        self.log = log_
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
        #: JOURNAL payload bytes (as encoded, before compression) written since
        #: the newest checkpoint's BEGIN, by this mount.
        self.journal_bytes_since_checkpoint = 0
        #: Payload bytes (before compression) of the newest checkpoint written (or
        #: loaded at mount).
        self.last_checkpoint_bytes = checkpoint_bytes
        #: What the newest checkpoint (written, or loaded at mount) took of the
        #: meta area: its records as stored, compressed, with the zone header and
        #: the tails of the zones it filled. The unit of
        #: everything that counts meta zones (`_meta_short`, the checkpoint
        #: trigger, `estimated_checkpoint_bytes`).
        self.last_checkpoint_disk_bytes = checkpoint_disk_bytes
        #: (device bytes, inodes) of the newest checkpoint written (or loaded at
        #: mount): what `estimated_checkpoint_bytes` scales from.
        self.checkpoint_sample: tuple[int, int] = (checkpoint_disk_bytes, len(state.inodes))
        #: Bytes of `_NEW_INODE_CONTENT` ops added for inodes numbered from
        #: `_new_ino_floor` on (the next inode number at the newest snapshot), and
        #: their count when the newest checkpoint's snapshot was taken.
        self._new_content_bytes = 0
        self._new_content_base = 0
        self._new_ino_floor = state.next_ino
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

    async def _between_slices(self) -> None:
        if self._urgent:
            await trio.sleep(CHECKPOINT_SLICE_PAUSE_S)
        else:
            await trio.lowlevel.checkpoint()

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

    # -- checkpoint -----------------------------------------------------------------
    def checkpoint_needed(self, journal_limit: int) -> bool:
        """True when the journal grew past the limit or meta zones run short.

        The limit is `journal_limit` or the size of the newest checkpoint on the
        device, whichever is larger: a checkpoint then costs at most about as
        many bytes as the journal written since the one before, so metadata
        writes stay within ~2x the journal however large the namespace (with a
        fixed limit they grew with the square of the bytes stored). Meta zones
        running short (`_meta_short`) still ask for one earlier. Memory only:
        called on the trio thread.
        """
        limit = max(journal_limit, self.last_checkpoint_disk_bytes)
        if self.journal_bytes_since_checkpoint >= limit:
            return True
        return self._meta_short() and self.journal_bytes_since_checkpoint > 0

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

    def _meta_short(self) -> bool:
        cap = self.log.zone_capacity_bytes
        # Twice the newest checkpoint as stored: the next one, grown by what the
        # journal meanwhile added (since `checkpoint_needed` lets the journal
        # reach the checkpoint's own size, it may be up to twice as large); +3:
        # its fresh first zone, room for the journal meanwhile, and one zone kept
        # spare so that a mount after a crash that tore this checkpoint can
        # write its own.
        needed = (self.last_checkpoint_disk_bytes * 2) // max(cap, 1) + 3
        return self.log.free_zone_count() < needed

    # -- how many files the meta area holds -----------------------------------------
    def checkpoint_budget_bytes(self) -> int:
        """The largest checkpoint the meta area can keep rotating.

        A checkpoint starts in a fresh meta zone and the previous one stays until
        it is complete; one more zone holds the journal meanwhile, and one is
        kept for a mount after a crash that tore a checkpoint (`checkpoint_needed`).
        So two checkpoints and two zones must fit: ceil(C / zone) <= (M - 2) / 2,
        C in device bytes (`last_checkpoint_disk_bytes`). Past that, checkpoints
        run back to back and then the log runs out of empty zones (LogFull: the
        mount turns read-only). Admission (`NamespaceOps._check_meta_room`)
        stops namespace growth at 80% of it, as the estimate it compares
        (`estimated_checkpoint_bytes`) is not exact.
        """
        cap = self.log.zone_capacity_bytes
        return max(1, (len(self.log.zones) - 2) // 2) * cap * 4 // 5

    def estimated_checkpoint_bytes(self, inodes: int) -> int:
        """The device bytes of a checkpoint of a namespace of `inodes` inodes: the
        newest checkpoint's, plus for each inode since its device bytes per
        inode with GROWTH_MARGIN (NOMINAL_CHECKPOINT_BYTES_PER_INODE, an
        uncompressed figure, while it held fewer than SAMPLE_MIN_INODES), plus
        the payloads of the new inodes that only metadata holds, uncompressed
        (`_NEW_INODE_CONTENT`). Device bytes, as the budget: records are
        compressed, and inflated sizes made creates fail at a sixth of what
        the meta area holds. An estimate: extents and inline bytes of older
        inodes grow without new inodes (too low lets growth run into the old
        read-only failure); the first checkpoint holds little more than the
        root (too high: the caller checkpoints to measure before refusing).
        """
        c, n = self.checkpoint_sample
        return (c + max(0, inodes - n) * self._checkpoint_bytes_per_inode()
                + self._new_content_bytes - self._new_content_base)

    def inodes_room(self, inodes: int) -> int:
        """How many more inodes the estimate lets a namespace of `inodes` add
        (each at the bytes per inode measured, with GROWTH_MARGIN: what `df -i`
        shows)."""
        spare = self.checkpoint_budget_bytes() - self.estimated_checkpoint_bytes(inodes)
        return max(0, spare // self._checkpoint_bytes_per_inode())

    def _checkpoint_bytes_per_inode(self) -> int:
        c, n = self.checkpoint_sample
        if n < SAMPLE_MIN_INODES:
            return NOMINAL_CHECKPOINT_BYTES_PER_INODE
        num, den = GROWTH_MARGIN
        return max(1, -(-c * num // (n * den)))

    async def checkpoint(self) -> None:
        """Write a checkpoint of the State and point the superblock at it.

        Every transaction added before the call is durable when it returns
        (they are durable already once its BEGIN is written).
        """
        self._check_broken()
        async with self._checkpoint_lock:
            self._check_broken()
            self.checkpoint_running = True
            try:
                await self._write_checkpoint()
            finally:
                self.checkpoint_running = False
                self._checkpoint_done.set()
                self._checkpoint_done = trio.Event()

    def _failed(self, what: str, exc: Exception) -> NoReturn:
        self.broken = f"{what} failed: {exc}"
        log.error("%s", self.broken)
        self._set_durable(self.durable_txn)
        self._check_broken()
        raise AssertionError("unreachable")

    async def _write_checkpoint(self) -> None:
        """The steps of `checkpoint()` (DESIGN.md 3.3); the caller holds `_checkpoint_lock`."""
        async with self._write_lock:
            self._check_broken()  # (as in _commit_locked)
            # Atomic (no await): the queued transactions and the snapshot, which from
            # here on is the State as of `upto` (copy-on-write), however requests
            # change it while it is encoded between their turns.
            batch, upto = self._take_batch()
            flush_first = self.data_dirty
            self.data_dirty = False
            snap = Snapshot(self.state, encode_op)
            snap_inodes = len(self.state.inodes)
            snap_content = self._new_content_bytes
            self._new_ino_floor = self.state.next_ino
            # The batch goes out as a journal record *before* BEGIN: should this
            # checkpoint be torn, recovery replays the older state through it and
            # then the commits written inside the checkpoint, which follow it.
            journal = [(RecordType.JOURNAL, p) for p in _pack(batch, self._payload_target())]
            begin = [(RecordType.CHECKPOINT_BEGIN, struct.pack("<QQ", upto, time.time_ns()))]
            # BEGIN starts a fresh zone: its header and BEGIN are the checkpoint's.
            disk = self.log.block_size + padded_size(len(begin[0][1]), self.log.block_size)
            try:
                positions = await self._run(self._write_begin, journal, begin, flush_first)
            except (OSError, LogFull) as exc:
                snap.close()
                self._failed("checkpoint write", exc)
            except BaseException:
                snap.close()
                raise
            assert isinstance(positions, list)
            self._set_durable(upto)
            journal_before = self.journal_bytes_since_checkpoint + sum(
                len(p) for _, p in journal)
            self.journal_bytes_since_checkpoint = journal_before
        first = positions[-1]
        try:
            # Shielded: the checkpoint must not stop half-way once BEGIN is written
            # (nor could it: the device writes below are not cancellable either).
            with trio.CancelScope(shield=True):
                while not snap.step(CHECKPOINT_SLICE_INODES):
                    await self._between_slices()
        finally:
            snap.close()
        obsolete: list[int] = []
        with trio.CancelScope(shield=True):
            try:
                # Packed on the trio thread a ~1 MiB payload at a time, pausing like
                # the encoder (in a worker thread, the packing of a 1M-file
                # checkpoint held the GIL ~200 ms against commits beside it),
                # and written a group at a time, each group its own hold of the log.
                count = total = 0
                group: list[bytes] = []
                group_bytes = 0
                for payload in _pack_iter(snap.encoded_ops(), self._payload_target()):
                    count += 1
                    total += len(payload)
                    group.append(payload)
                    group_bytes += len(payload)
                    if group_bytes >= CHECKPOINT_WRITE_BYTES:
                        disk += await self._append_data(group)
                        group, group_bytes = [], 0
                    else:
                        await self._between_slices()
                if group:
                    disk += await self._append_data(group)
                end = CHECKPOINT_END.pack(count, total)
                async with self._write_lock:
                    self._check_broken()
                    before = self.log.bytes_consumed
                    await self._run(self._write_records, [(RecordType.CHECKPOINT_END, end)],
                                    False)
                    disk += self.log.bytes_consumed - before
                sb = self.sb.with_checkpoint(first.zone, first.offset, first.seq)
                await self._run(self.sbstore.write, sb)
                self.sb = sb
                obsolete = self.log.zones_before(self.log.zone_first_seq[first.zone])
                if obsolete:
                    await self._run(self.log.reset_zones, obsolete)
            except (OSError, LogFull) as exc:
                self._failed("checkpoint write", exc)
        self.last_checkpoint_bytes = total
        self.last_checkpoint_disk_bytes = disk
        self.checkpoint_sample = (disk, snap_inodes)
        self._new_content_base = snap_content
        # Commits written inside the checkpoint are replayed after it.
        self.journal_bytes_since_checkpoint = max(
            0, self.journal_bytes_since_checkpoint - journal_before)
        self.checkpoints_written += 1
        log.info("checkpoint written: %d bytes (%d on the device) in %d records, "
                 "%d meta zones reset", total, disk, count + 2, len(obsolete))

    async def _append_data(self, payloads: list[bytes]) -> int:
        """Append CHECKPOINT_DATA records (not flushed), holding the log; return
        the meta-area bytes they took (`MetaLog.bytes_consumed`: nothing else
        appends while the log is held)."""
        async with self._write_lock:
            self._check_broken()
            before = self.log.bytes_consumed
            await self._run(self.log.append,
                            [(RecordType.CHECKPOINT_DATA, p) for p in payloads])
            return self.log.bytes_consumed - before

    def _payload_target(self) -> int:
        """Record payload size to pack to: RECORD_PAYLOAD_TARGET, or less where a
        meta zone is smaller (a record must fit in one, compressed or not)."""
        return min(RECORD_PAYLOAD_TARGET, self.log.max_payload_bytes)

    async def abort_torn_checkpoint(self, begin_seq: int) -> None:
        """Mark the checkpoint whose BEGIN has `begin_seq`, torn by a crash, as
        ended (mount, before anything else goes to the log): later replays then
        apply the records after it to the older state. Flushed."""
        async with self._write_lock:
            try:
                await self._run(self._write_records, [(RecordType.CHECKPOINT_ABORT,
                                                       CHECKPOINT_ABORT.pack(begin_seq))], False)
            except (OSError, LogFull) as exc:
                self._failed("checkpoint abort write", exc)

    def _write_begin(self, journal: list[tuple[RecordType, bytes]],
                     begin: list[tuple[RecordType, bytes]], flush_first: bool
                     ) -> list[LogPosition]:
        """Worker thread: the batch's records where the log is, then BEGIN in a
        fresh zone, one flush for both."""
        if flush_first:
            self.dev.flush()
        if journal:
            self.log.append(journal)
        positions = self.log.append(begin, new_zone=True)
        self.dev.flush()
        return positions


def checkpoint_records(state: State, upto_txn: int) -> list[tuple[RecordType, bytes]]:
    """Encode a snapshot of `state` as CHECKPOINT_BEGIN, _DATA..., _END records."""
    return _checkpoint_records([encode_op(op) for op in state.snapshot_ops()], upto_txn)


def _checkpoint_records(encoded_ops: list[bytes],
                        upto_txn: int) -> list[tuple[RecordType, bytes]]:
    payloads = _pack(encoded_ops)
    begin = struct.pack("<QQ", upto_txn, time.time_ns())
    end = CHECKPOINT_END.pack(len(payloads), sum(len(p) for p in payloads))
    records = [(RecordType.CHECKPOINT_BEGIN, begin)]
    records += [(RecordType.CHECKPOINT_DATA, p) for p in payloads]
    records.append((RecordType.CHECKPOINT_END, end))
    return records


def _pack(chunks: list[bytes], target: int | None = None) -> list[bytes]:
    """Group transaction/op byte strings into record payloads of about `target`
    bytes (RECORD_PAYLOAD_TARGET, 1 MiB, by default).

    A chunk is never split: one transaction is always inside one record.
    """
    return list(_pack_iter(chunks, target))


def _pack_iter(chunks: list[bytes], target: int | None = None) -> Iterator[bytes]:
    """The payloads of `_pack`, one at a time."""
    limit = RECORD_PAYLOAD_TARGET if target is None else target
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
