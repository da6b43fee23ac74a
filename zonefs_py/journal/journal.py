"""The journal: group commit (commit.py) and checkpoints of the State (async, trio).

`Journal` is the engine's journal: `add` and `commit` come from
`GroupCommit` (commit.py), the meta area's figures and estimates from
`MetaRoom` (metaroom.py); this module writes checkpoints.

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

The tunables below (RECORD_PAYLOAD_TARGET, CHECKPOINT_SLICE_INODES,
CHECKPOINT_WRITE_BYTES) are read at each use, so tests shrink them here.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, NoReturn, Protocol, TypeVar

import trio

from zonefs_py.errors import CorruptionError
from zonefs_py.format.constants import INDEX_DISK_VERSION, LENDING_DISK_VERSION, RecordType
from zonefs_py.format.nsindex import IndexRoot
from zonefs_py.format.ops import encode_op
from zonefs_py.format.records import padded_size
from zonefs_py.format.superblock import Superblock
from zonefs_py.journal.commit import GroupCommit, _pack, _pack_iter
from zonefs_py.journal.log import LogFull, LogPosition
from zonefs_py.journal.metaroom import DIRTY_ENTRY_BYTES
from zonefs_py.journal.nsindex import (
    CLEAN_ZONES_PER_CHECKPOINT,
    LOG_KEEP_ZONES,
    NamespaceIndex,
)
from zonefs_py.model.dirty import DirtySet, IndexSnapshot
from zonefs_py.model.state import Snapshot, State

log = logging.getLogger(__name__)

#: Payload of one JOURNAL / CHECKPOINT_DATA record at most (a bigger single
#: transaction gets a record of its own).
RECORD_PAYLOAD_TARGET = 1 << 20
CHECKPOINT_END = struct.Struct("<QQ")
#: Payload of CHECKPOINT_ABORT: the seq of the torn checkpoint's BEGIN.
CHECKPOINT_ABORT = struct.Struct("<Q")
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


class _Snap(Protocol):
    """What `_begin_checkpoint` does with either format's snapshot."""

    def step(self, max_items: int, /) -> bool: ...

    def close(self, failed: bool = False) -> None: ...


_S = TypeVar("_S", bound=_Snap)


@dataclass
class _Begun(Generic[_S]):
    """What steps 1 and 2 of a checkpoint leave for the rest (`_begin_checkpoint`)."""

    snap: _S
    #: Inodes and new-inode content bytes when the snapshot was taken (MetaRoom).
    inodes: int
    content_bytes: int
    first: LogPosition = field(default_factory=lambda: LogPosition(0, 0, 0))
    #: Meta-area bytes the checkpoint's records took so far, and the journal bytes
    #: since the previous checkpoint once its batch was written before BEGIN.
    disk: int = 0
    journal_before: int = 0


class Journal(GroupCommit):
    """Group commit of transactions and checkpoints of the State (module docstring).

    `checkpoint_bytes` / `checkpoint_disk_bytes` describe the checkpoint loaded
    at mount (its payload bytes, and what it takes of the meta area): they set
    the checkpoint trigger, the meta-zone reserve and the bound on files until
    this mount writes one. `journal_limit` is the mount option
    `checkpoint_journal_bytes`. Appenders of file data call `data_appended()`
    (through the allocator: `Allocator.append_done`), so that the next commit
    flushes the device before its records (INV-7).
    """

    # -- checkpoint -----------------------------------------------------------------
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
                if self.index is not None:
                    await self._write_index_checkpoint(self.index)
                else:
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

    async def _begin_checkpoint(self, snapshot: Callable[[], _S]) -> _Begun[_S]:
        """Steps 1 and 2 of a checkpoint (DESIGN.md 3.3), both formats: take the queued
        batch and `snapshot()` at one instant, write the batch and BEGIN (flushed),
        then encode the snapshot in slices. Raises as `_failed` when BEGIN fails."""
        async with self._write_lock:
            self._check_broken()  # (as in _commit_locked)
            # Atomic (no await): the queued transactions and the snapshot, which from
            # here on is the State as of `upto` (copy-on-write), however requests
            # change it while it is encoded between their turns.
            batch, upto = self._take_batch()
            flush_first = self.data_dirty
            self.data_dirty = False
            snap = snapshot()
            begun = _Begun(snap, self.state.inode_count, self._new_content_bytes)
            self._new_ino_floor = self.state.next_ino
            # The batch goes out as a journal record *before* BEGIN: should this
            # checkpoint be torn, recovery replays the older state through it and
            # then the commits written inside the checkpoint, which follow it.
            journal = [(RecordType.JOURNAL, p) for p in _pack(batch, self._payload_target())]
            begin = [begin_record(upto)]
            # BEGIN starts a fresh zone: its header and BEGIN are the checkpoint's.
            begun.disk = self.log.block_size + padded_size(len(begin[0][1]),
                                                           self.log.block_size)
            try:
                positions = await self._run(self._write_begin, journal, begin, flush_first)
            except (OSError, LogFull) as exc:
                snap.close(failed=True)
                self._failed("checkpoint write", exc)
            except BaseException:
                snap.close(failed=True)
                raise
            assert isinstance(positions, list)
            begun.first = positions[-1]
            self._set_durable(upto)
            begun.journal_before = self.journal_bytes_since_checkpoint + sum(
                len(p) for _, p in journal)
            self.journal_bytes_since_checkpoint = begun.journal_before
        try:
            # Shielded: the checkpoint must not stop half-way once BEGIN is written
            # (nor could it: the device writes below are not cancellable either).
            with trio.CancelScope(shield=True):
                while not snap.step(CHECKPOINT_SLICE_INODES):
                    await self._between_slices()
        finally:
            snap.close()
        return begun

    async def _write_checkpoint(self) -> None:
        """The steps of `checkpoint()` (DESIGN.md 3.3); the caller holds `_checkpoint_lock`."""
        begun = await self._begin_checkpoint(lambda: Snapshot(self.state, encode_op))
        snap, first, disk = begun.snap, begun.first, begun.disk
        journal_before = begun.journal_before
        snap_inodes, snap_content = begun.inodes, begun.content_bytes
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
                disk += await self._end_checkpoint([(RecordType.CHECKPOINT_END, end)], first)
                obsolete = await self._reset_before(first)
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

    async def _write_index_checkpoint(self, index: NamespaceIndex) -> None:
        """Format 5 (DESIGN.md 3.14): write the index entries changed since the last
        checkpoint and the tree's new root; the caller holds `_checkpoint_lock`.

        Steps 1 and 3-4 as `_write_checkpoint`; step 2 encodes only the entries a
        `DirtySet` collected (copy-on-write, `IndexSnapshot`), a worker thread puts
        them into the tree and commits it (pages flushed), and the checkpoint's
        records are its head ops (zones, counters, ...), CHECKPOINT_INDEX (root,
        index zones) and END. Index zones it left without a live page are reset
        once the superblock points at it.
        """
        dirty = self.state.dirty
        assert dirty is not None
        begun = await self._begin_checkpoint(lambda: IndexSnapshot(self.state, dirty))
        snap, first, disk = begun.snap, begun.first, begun.disk
        journal_before = begun.journal_before
        snap_inodes, snap_content = begun.inodes, begun.content_bytes
        entries = len(snap.inodes) + len(snap.dirents)
        pages_before = index.store.pages_written
        reset: list[int] = []
        total = 0
        with trio.CancelScope(shield=True):
            try:
                await self._lend_index_zones(index, entries)
                try:
                    root = await self._run(self._commit_index, index, snap)
                finally:
                    self._take_back_lent(index)
                assert isinstance(root, IndexRoot)
                records, total = index_checkpoint_tail(snap.head, root, self._payload_target())
                disk += await self._end_checkpoint(records, first)
                self._publish(index, snap)
                await self._reset_before(first)
                reset = index.take_empty_zones()
                if reset:
                    await self._run(self.reset_index_zones, reset)
                    self._data_zones_returned(reset)
            except (OSError, LogFull, CorruptionError) as exc:
                self._failed("checkpoint write", exc)
        page_bytes = (index.store.pages_written - pages_before) * index.store.page_size_bytes
        self.last_checkpoint_bytes = total
        self.last_checkpoint_disk_bytes = disk + page_bytes
        self.checkpoint_sample = (disk + index.live_bytes(), snap_inodes)
        self._new_content_base = snap_content
        self.journal_bytes_since_checkpoint = max(
            0, self.journal_bytes_since_checkpoint - journal_before)
        self.checkpoints_written += 1
        log.info("checkpoint written: %d changed entries, %d index pages (%d relocated, "
                 "%d obsolete), %d bytes of records; %d index zones reset", entries,
                 index.last_written, index.last_relocated, index.last_obsolete, disk,
                 len(reset))

    async def _end_checkpoint(self, records: list[tuple[RecordType, bytes]],
                              first: LogPosition) -> int:
        """Step 3 of both formats: append the checkpoint's last records (END last)
        holding the log, flushed, then point the superblock at its BEGIN `first`.
        Return the meta-area bytes the records took."""
        async with self._write_lock:
            self._check_broken()
            before = self.log.bytes_consumed
            await self._run(self._write_records, records, False)
            disk = self.log.bytes_consumed - before
        sb = self.sb.with_checkpoint(first.zone, first.offset, first.seq)
        await self._run(self.sbstore.write, sb)
        self.sb = sb
        return disk

    async def _reset_before(self, first: LogPosition) -> list[int]:
        """Step 4: reset the log zones before the checkpoint at `first` (the
        superblock points at it); return them."""
        obsolete = self.log.zones_before(self.log.zone_first_seq[first.zone])
        if obsolete:
            await self._run(self.log.reset_zones, obsolete)
        return obsolete

    def start_index(self, index: NamespaceIndex, dirty: DirtySet) -> None:
        """Turn this journal's checkpoints into format 5's (a conversion): from the
        next one on they write `dirty` (every entry) into `index`, and its
        superblock write says format 5. Call with no checkpoint running."""
        if self.index is not None or self.checkpoint_running:
            raise RuntimeError("start_index: the journal has an index or a checkpoint runs")
        self.index = index
        self.index_mode = True
        self.state.dirty = dirty
        self.sb = self.sb.as_version(INDEX_DISK_VERSION)

    def _publish(self, index: NamespaceIndex, snap: IndexSnapshot) -> None:
        """The superblock points at the checkpoint whose tree holds `snap`: lazy
        States read that tree from now on, and memory drops what it holds as
        it is (DESIGN.md 3.15). Trio thread, no await: one step for the State."""
        index.publish(snap.next_ino)
        dirty = self.state.dirty
        if dirty is not None:
            self.state.published(dirty.settle())
        self.state.trim()

    @staticmethod
    def _commit_index(index: NamespaceIndex, snap: IndexSnapshot) -> IndexRoot:
        """Worker thread: the snapshot's entries into the tree, cleaning, commit."""
        index.apply(snap.inodes, snap.dirents, snap.owners)
        index.clean(index.store.mlog.zone_capacity_bytes)
        return index.commit()

    async def _lend_index_zones(self, index: NamespaceIndex, entries: int) -> None:
        """Step 3's zones (format 6, DESIGN.md 3.14 "Meta area"): when the empty meta
        zones beyond the log's LOG_KEEP_ZONES may not hold the pages this commit
        writes (each changed entry at most DIRTY_ENTRY_BYTES, plus the zones
        cleaning relocates, plus the current zone's tail), borrow empty data zones
        from `zone_lender` for the store to take once the meta zones are down to
        LOG_KEEP_ZONES. Memory only; on an image of version 5 the store
        rewrites the superblock as version 6 before its first page goes to a
        lent zone (`_rewrite_as_lending`; same checkpoint), so that no build
        reading only version 5 ever finds index pages in its data zones, and an
        image whose index never needed a data zone keeps version 5."""
        lender = self.zone_lender
        if lender is None:
            return
        cap = max(1, self.log.zone_capacity_bytes)
        need_bytes = entries * DIRTY_ENTRY_BYTES + CLEAN_ZONES_PER_CHECKPOINT * cap
        need = -(-need_bytes // cap) + 1
        short = need - max(0, self.log.free_zone_count() - LOG_KEEP_ZONES)
        if short <= 0:
            return
        lent = lender.lend_zones(short)
        if not lent:
            return
        if self.sb.disk_version < LENDING_DISK_VERSION:
            index.store.before_lent_use = self._rewrite_as_lending
        index.store.lent = lent

    def _rewrite_as_lending(self) -> None:
        """Worker thread (the commit's, before the store's first page in a lent
        zone): the superblock as version 6, durable, same checkpoint fields. The
        trio thread is awaiting that commit, so `self.sb` changes under no reader
        that could write it back."""
        sb = self.sb.as_version(LENDING_DISK_VERSION)
        self.sbstore.write(sb)
        self.sb = sb
        log.info("on-disk format %d: the namespace index borrows data zones",
                 LENDING_DISK_VERSION)

    def _take_back_lent(self, index: NamespaceIndex) -> None:
        """After the commit: lent zones it did not take are data zones again."""
        index.store.before_lent_use = None
        unused, index.store.lent = index.store.lent, []
        if unused and self.zone_lender is not None:
            self.zone_lender.take_back_zones(unused)

    def _data_zones_returned(self, zones: list[int]) -> None:
        """Lent zones among `zones` (reset by `reset_index_zones`) go back to data."""
        lender = self.zone_lender
        if lender is None:
            return
        meta = set(self.log.zones)
        for zone in zones:
            if zone not in meta:
                lender.zone_returned(zone)

    def reset_index_zones(self, zones: list[int]) -> None:
        """Worker thread: reset index zones the current checkpoint no longer uses
        (the superblock points at it) and give them back to the log's pool, or,
        for data zones lent to the index, reset them only (the caller gives them
        back to the allocator: `_data_zones_returned`)."""
        assert self.index is not None
        meta = set(self.log.zones)
        self.log.reset_zones([z for z in zones if z in meta])
        for zone in zones:
            if zone not in meta:
                self.dev.reset_zone(zone)
        for zone in zones:
            self.index.store.forget_zone(zone)
        if self.index.reader is not None:
            self.index.reader.zones_reset(zones, self.index.store.zone_size)

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

    async def write_superblock(self, sb: Superblock) -> None:
        """Write `sb` to the superblock zone (durable on return) and use it from now on
        (mount-time steps: a format conversion, a checkpoint's unfinished last step)."""
        await self._run(self.sbstore.write, sb)
        self.sb = sb

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

    async def _between_slices(self) -> None:
        if self._urgent:
            await trio.sleep(CHECKPOINT_SLICE_PAUSE_S)
        else:
            await trio.lowlevel.checkpoint()


def checkpoint_records(state: State, upto_txn: int) -> list[tuple[RecordType, bytes]]:
    """Encode a snapshot of `state` as CHECKPOINT_BEGIN, _DATA..., _END records."""
    return _checkpoint_records([encode_op(op) for op in state.snapshot_ops()], upto_txn)


def begin_record(upto_txn: int) -> tuple[RecordType, bytes]:
    """A CHECKPOINT_BEGIN record of a snapshot holding transactions up to `upto_txn`."""
    return RecordType.CHECKPOINT_BEGIN, struct.pack("<QQ", upto_txn, time.time_ns())


def index_checkpoint_tail(head: list[bytes], root: IndexRoot,
                          payload_target: int = RECORD_PAYLOAD_TARGET
                          ) -> tuple[list[tuple[RecordType, bytes]], int]:
    """Format 5: the records after BEGIN of a checkpoint whose inodes and names are
    in the committed index `root`: CHECKPOINT_DATA (the encoded `head` ops),
    CHECKPOINT_INDEX and CHECKPOINT_END; and the DATA payload bytes."""
    payloads = _pack(head, payload_target)
    total = sum(len(p) for p in payloads)
    records = [(RecordType.CHECKPOINT_DATA, p) for p in payloads]
    records.append((RecordType.CHECKPOINT_INDEX, root.encode()))
    records.append((RecordType.CHECKPOINT_END, CHECKPOINT_END.pack(len(payloads), total)))
    return records, total


def _checkpoint_records(encoded_ops: list[bytes],
                        upto_txn: int) -> list[tuple[RecordType, bytes]]:
    payloads = _pack(encoded_ops, RECORD_PAYLOAD_TARGET)
    end = CHECKPOINT_END.pack(len(payloads), sum(len(p) for p in payloads))
    records = [begin_record(upto_txn)]
    records += [(RecordType.CHECKPOINT_DATA, p) for p in payloads]
    records.append((RecordType.CHECKPOINT_END, end))
    return records
