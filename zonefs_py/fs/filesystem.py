"""ZoneFS: the namespace engine behind the FUSE adapter (see fs/api.py).

This module holds the engine's state and lifecycle (mount, load, background
loop, close), the engine API that drain/, the cleaner and fsck use, and the
whole-filesystem requests. The requests are served by three mixins, each with
one job: namespace-changing operations and xattrs in `NamespaceOps`
(fs/namespace.py); lookups and attributes in `AttrOps` (fs/attrs.py); open
files and directories in `HandleOps` (fs/handles.py). Around it: file data
in `DataPath` (fs/data/datapath.py); putting a recovered image in order at mount
(fs/after_recovery.py); zone resets and the cleaner's host (fs/reclaim.py);
the status figures (fs/status.py).

Every namespace operation follows one pattern: validate against the State,
build the ops, apply them and add them to the journal as one transaction,
all without an `await` in between (so each operation is atomic with respect
to the others, and a crash keeps all of its ops or none). File data goes
through `DataPath`. Durability comes from `Journal.commit` (fsync, fsyncdir,
the background commit every `commit_interval_s`, unmount).

Caveats:
  * The whole namespace lives in memory (about 0.9 KiB per file measured at
    1,000,000 files; issue 32 moves it to the device).
  * A checkpoint encodes the snapshot on the trio thread; with millions of
    files that pauses requests for a few seconds.
  * Permission checks beyond `access()` are left to the kernel
    (`default_permissions`), as the FUSE adapter always mounts with it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from zonefs_py import errors
from zonefs_py.alloc.allocator import Allocator
from zonefs_py.cleaner.cleaner import Cleaner
from zonefs_py.device.aread import AsyncReader
from zonefs_py.device.base import ZonedDevice
from zonefs_py.format.constants import (
    C_META_BYTES,
    DISK_VERSION,
    INDEX_DISK_VERSION,
    MIN_INDEX_META_ZONES,
    OpType,
)
from zonefs_py.format.ops import Op
from zonefs_py.fs.after_recovery import (
    convert_to_index,
    finish_recovery,
    index_conversion_refusal,
    refuse_non_tree,
)
from zonefs_py.fs.api import (
    ROOT_INO,
    Attr,
    FileSystemAPI,
    StatFs,
)
from zonefs_py.fs.attrs import AttrOps
from zonefs_py.fs.data.datapath import DataPath
from zonefs_py.fs.data.qos import ReadLatencyController
from zonefs_py.fs.handles import DirHandle, HandleOps
from zonefs_py.fs.inline import InlineData, inline_threshold
from zonefs_py.fs.latency import Histogram
from zonefs_py.fs.namespace import NamespaceOps
from zonefs_py.fs.options import FsOptions
from zonefs_py.fs.prealloc import Fallocator
from zonefs_py.fs.quota import QuotaTracker
from zonefs_py.fs.reclaim import SpaceReclaim
from zonefs_py.fs.reflink import Copier
from zonefs_py.fs.spacegate import SpaceGate
from zonefs_py.fs.status import build_status
from zonefs_py.fs.tasks import MountTasks
from zonefs_py.fs.tenants import TenantAdmin
from zonefs_py.fs.tenantspace import TenantSpace
from zonefs_py.journal.journal import Journal
from zonefs_py.journal.nsindex import IndexReader
from zonefs_py.journal.recovery import Recovered, recover
from zonefs_py.model.state import Inode, State, StateError

log = logging.getLogger(__name__)



class ZoneFS(NamespaceOps, HandleOps, AttrOps, FileSystemAPI):
    """A mounted zonefs-py filesystem: `async with ZoneFS.mount(dev, options) as fs:`.

    `ZoneFS.mount` owns the mount's background tasks (fs/tasks.py). An engine from
    `ZoneFS.load` owns none: it serves requests with no read-ahead, no io_uring
    reader and no pipelined chunks (written inline), and seals zones when it
    closes (`ZoneSealer.wait_idle`), for tools and tests that use the engine alone.
    """

    def __init__(self, dev: ZonedDevice, rec: Recovered, options: FsOptions,
                 tasks: MountTasks) -> None:
        self.dev = dev
        #: The mount's background tasks (open only inside `ZoneFS.mount`).
        self.tasks = tasks
        self.options = options
        self.sb = rec.sb
        self.state: State = rec.state
        self.recovered = rec
        self.bs = dev.info.block_size
        # Separate thread budgets so that reads never queue behind writes (dataset
        # reads keep their latency under checkpoint bursts) and a commit never
        # queues behind bulk data appends. io_threads= sets the read budget.
        self.read_limiter = trio.CapacityLimiter(options.max_device_threads)
        self.limiter = trio.CapacityLimiter(max(2, options.max_device_threads // 4))
        self.meta_limiter = trio.CapacityLimiter(2)
        # The checkpoint loaded sets the checkpoint trigger, the meta-zone
        # reserve and the bound on files until this mount writes one.
        self.journal = Journal(dev, rec.log, rec.sbstore, rec.sb, self.state, self.meta_limiter,
                               journal_limit=options.checkpoint_journal_bytes,
                               checkpoint_bytes=rec.checkpoint_bytes,
                               checkpoint_disk_bytes=rec.checkpoint_disk_bytes,
                               index=rec.index)
        # The allocator tells the journal of every append it accounts (INV-7).
        lent = frozenset(rec.index.store.data_zones()) if rec.index is not None else frozenset()
        self.alloc = Allocator(dev.info, rec.sb, self.state, dev.report_zones(), self.journal,
                               lent_zones=lent)
        # Format 6: the index borrows empty data zones when the meta zones run short
        # (DESIGN.md 3.14 "Meta area"); never space users were promised.
        self.alloc.used_bytes_fn = lambda: self.falloc.used_bytes()
        if rec.index is not None and not options.read_only:
            self.journal.zone_lender = self.alloc
        self.state.subscribe(zone_emptied=self.alloc.zone_emptied)
        reader = (AsyncReader(dev, tasks, self.read_limiter, options.sqpoll_ms)
                  if options.io_uring and tasks.is_open else None)
        self.data = DataPath(dev, self.state, self.journal, self.alloc, self.limiter,
                             self.path_of, read_limiter=self.read_limiter,
                             cache_bytes=options.cache_mb << 20,
                             qos=ReadLatencyController(options.read_latency_ms / 1e3),
                             reader=reader, stamp_times=not options.kernel_write_times,
                             prefetch_bytes=options.prefetch_mb << 20,
                             fast_read=options.fast_read, on_need_space=self._need_space,
                             device_write_bps=options.device_write_mb * 1e6, tasks=tasks)
        self.inline = InlineData(self.state, self.data, self.journal,
                                 inline_threshold(self.bs, options.inline_max_bytes))
        self.reclaim = SpaceReclaim(dev, self.state, self.journal, self.alloc, self.limiter,
                                    self.data.sealer, self.data.sums)
        self.cleaner = Cleaner(self.reclaim, options.cleaner_policy, options.cleaner_rate_mb_s)
        self.quota = QuotaTracker(self.state)
        #: Declared tenants: commands and figures (fs/tenants.py, issue 45).
        self.tenants = TenantAdmin(self.state, self.alloc, self.data, self._txn, self.path_of,
                                   self.data.writes.bandwidth)
        self._meta_base = self.state.counters.get(C_META_BYTES, 0)
        from zonefs_py.drain.manager import DrainManager

        self.drain = DrainManager(self)  # zonefs_py/drain (via DrainHost): the self.drain.* hooks
        self.falloc = Fallocator(self)  # fs/prealloc.py: fallocate, reserved blocks (INV-24)
        self.copier = Copier(self)  # fs/reflink.py: copy_file_range, shared extents (3.13)
        #: When write(2) through the kernel's page cache must be refused (issue 42);
        #: configured by the adapter once it knows the kernel's dirty limit.
        #: Declared tenants' space under their caps, for admission and the gate (issue 45).
        self.tenant_space = TenantSpace(self.state, self.alloc, lambda: self.data.writes)
        self.space_gate = SpaceGate(self.avail_bytes, relieve=self.drain.relieve_space,
                                    tenant_avail=self.tenant_space.avail_within)
        self.files: dict[int, int] = {}  # fh -> ino
        #: Time spent in read/write requests by the engine (not FUSE queueing).
        self.read_latency = Histogram()
        self.write_latency = Histogram()
        #: Bytes answered to read requests since mount (`stat`: user_bytes_read).
        self.bytes_read = 0
        self.dirs: dict[int, DirHandle] = {}
        self._next_fh = 1
        self.failsafe: str | None = None
        self._stop = trio.Event()
        self._wake = trio.Event()
        self._closed = False
        #: Inodes changed by the engine on its own, for the kernel's caches to drop
        #: (`changed_behind_kernel`); a set, so a burst of evictions is one batch.
        self._behind: set[int] = set()
        self._behind_event = trio.Event()
        self.mounted_ns = time.time_ns()

    # -- lifecycle ------------------------------------------------------------------
    @classmethod
    @asynccontextmanager
    async def mount(cls, dev: ZonedDevice, options: FsOptions | None = None, *,
                   progress: Callable[[int, int], None] | None = None,
                   close: bool = True) -> AsyncIterator[ZoneFS]:
        """Recover the filesystem on `dev` and serve it, owning its background tasks.

        On a normal exit of the block the filesystem is closed cleanly (flush,
        commit, checkpoint: `close`), then the mount's nursery is cancelled and
        waited for. On an exception, or with `close=False` (tests that cut the
        power inside the block), it is not closed (as after a crash: the next
        mount recovers); its tasks are cancelled all the same. A bug raised by
        a background task cancels the block and leaves from it. Raises as
        `load` does.
        """
        tasks = MountTasks()
        async with tasks.run():
            fs = await cls.load(dev, options, progress=progress, tasks=tasks)
            try:
                yield fs
                if close:
                    await fs.close()
            finally:
                if fs.data.reader is not None:
                    fs.data.reader.close()  # after close(): nothing left to free

    @classmethod
    async def load(cls, dev: ZonedDevice, options: FsOptions | None = None, *,
                   progress: Callable[[int, int], None] | None = None,
                   tasks: MountTasks | None = None) -> ZoneFS:
        """Recover the filesystem on `dev` and return it ready to serve.

        Without `tasks` (an open `MountTasks`) the engine owns no background task
        (see the class docstring); `ZoneFS.mount` is the mount.

        `progress(done_bytes, total_bytes)` follows the log replay (called from
        the worker thread that runs it).

        Raises errors.NotAFilesystem or errors.CorruptionError (one-line
        messages) when the device cannot be mounted.
        """
        options = options or FsOptions()
        tasks = tasks or MountTasks()
        while True:
            rec = await trio.to_thread.run_sync(functools.partial(
                recover, dev, progress=progress, inode_cache=options.inode_cache))
            refuse_non_tree(rec.state, dev.info.path)
            fs = cls(dev, rec, options, tasks)
            log.info("recovered %s: %d records, %d ops in %.2f s (torn tail: %s; journal "
                     "replayed after the checkpoint: %d bytes)", dev.info.path, rec.records,
                     rec.ops, rec.seconds, rec.scan.torn_tail, rec.journal_bytes)
            if options.read_only or not await fs.after_recovery() \
                    or options.inode_cache == 0:
                break
            # Converted to format 5: its format 4 replay loaded the namespace whole.
            # Close (nothing served yet) and mount the image it now is: lazily, in
            # bounded memory (DESIGN.md 3.14, "Conversion"); it converts no more.
            await fs.close()
            if fs.data.reader is not None:
                fs.data.reader.close()
            del fs, rec
            log.info("mounting the converted image again: format 5, lazily")
        if rec.index is not None and rec.index.reader is not None and fs.tasks.is_open:
            fs.tasks.start_soon(fs._pin_index_pages, rec.index.reader,
                                name="zonefs-index-pin")
        return fs

    @staticmethod
    async def _pin_index_pages(reader: IndexReader) -> None:
        """A lazy mount (DESIGN.md 3.15): the index's internal pages read into the
        reader's cache in the background, for good: a cold lookup reads a leaf."""
        t0 = time.monotonic()
        try:
            pinned = await trio.to_thread.run_sync(reader.pin_internal_pages)
        except (errors.IOFailure, errors.CorruptionError) as exc:
            # Only a read-ahead: the faults that need those pages meet the error.
            log.info("namespace index: caching its internal pages failed: %s", exc)
            return
        log.info("namespace index: %d internal pages cached in %.2f s", pinned,
                 time.monotonic() - t0)

    async def after_recovery(self) -> bool:
        """Put a recovered image in order before serving (fs/after_recovery.py);
        return whether it converted the image to format 5."""
        sb = await finish_recovery(self.recovered, self.journal, self.alloc, self.reclaim,
                                   self._txn, self.options.checkpoint_journal_bytes)
        if sb is not None:
            self.sb = sb
        target = self.options.convert_format
        if self.journal.index is None and target != DISK_VERSION:
            # A format 2-4 image: to format 5 unless format=4 (DESIGN.md 3.14,
            # "Conversion"); format=5 refuses the mount when it cannot be.
            why = index_conversion_refusal(self.state, self.journal)
            if why is None:
                self.sb = await convert_to_index(self.state, self.journal)
                return True
            if target == INDEX_DISK_VERSION:
                raise errors.InvalidArgument(
                    f"format=5: {why}; the image stays format {self.sb.disk_version}")
            # INFO when the image can never hold format 5 (its meta zones are
            # set at mkfs), a WARNING when its namespace is what is too large.
            level = logging.INFO if self.sb.meta_zone_count < MIN_INDEX_META_ZONES \
                else logging.WARNING
            log.log(level, "%s: not converted to on-disk format %d: %s; it stays format %d "
                    "(-o format=4 keeps it so without this message)",
                    self.dev.info.path, INDEX_DISK_VERSION, why, self.sb.disk_version)
        return False

    async def serve_background(self) -> None:
        """Run periodic commits, checkpoints and zone resets until `close()`.

        Meanwhile a commit that finds a checkpoint due wakes this task for it
        instead of writing it while its caller (an fsync) waits.
        """
        with self.journal.background_checkpoints(self.wake_background):
            while not self._stop.is_set():
                with trio.move_on_after(self.options.commit_interval_s):
                    await self._wake.wait()
                self._wake = trio.Event()
                if self._stop.is_set() or self.options.read_only or self.failsafe:
                    continue
                try:
                    await self.background_step()
                except errors.ZoneFSError as exc:
                    self.enter_failsafe(f"background commit failed: {exc}")

    async def background_step(self) -> None:
        """One round of background work (also used by tests)."""
        if self.journal.pending_bytes or self.journal.data_dirty:
            self._record_counters()
            await self.journal.commit()
        if self.journal.checkpoint_needed(self.options.checkpoint_journal_bytes):
            await self.journal.checkpoint()
        await self.reclaim.reset_dead_zones()
        await self.cleaner.background_pass()

    async def _need_space(self, tenant: int = 0) -> bool:
        """Foreground space for a write (DataPath's `on_need_space`): evict drained
        files first, then clean; False when nothing was freed. For a declared tenant
        at its zone cap: clean within that tenant only (issue 45)."""
        if tenant:
            return await self.cleaner.clean_for_space(tenant)
        if await self.drain.relieve_space(self.data.zone_size):
            await self.reclaim.commit_and_reset()
            return True
        return await self.cleaner.clean_for_space()

    def metadata_bytes_written(self) -> int:
        """Metadata bytes written over the filesystem's life (earlier mounts + this one)."""
        index = self.journal.index
        pages = 0 if index is None else index.store.pages_written * index.store.page_size_bytes
        return (self._meta_base + self.journal.log.bytes_written
                + self.journal.sbstore.bytes_written + pages)

    def wake_background(self) -> None:
        self._wake.set()

    def note_changed_behind_kernel(self, ino: int) -> None:
        """The engine changed `ino`'s attributes without a request (never awaits)."""
        self._behind.add(ino)
        self._behind_event.set()

    async def changed_behind_kernel(self) -> list[int]:
        while not self._behind:
            await self._behind_event.wait()
            self._behind_event = trio.Event()
        return self.take_changed_behind_kernel()

    def take_changed_behind_kernel(self) -> list[int]:
        out, self._behind = sorted(self._behind), set()
        return out

    async def close(self) -> None:
        """Clean unmount: write buffers, commit, checkpoint (unless the newest one
        holds everything already), flush, release the device."""
        if self._closed:
            return
        self._closed = True
        self.drain.stop()
        self._stop.set()
        self._wake.set()
        try:
            if not self.options.read_only and self.failsafe is None:
                await self._write_back_on_close()
        finally:
            if self.data.reader is not None:
                await self.data.reader.aclose()

    async def _flush_file(self, inode: Inode, wait: bool = True) -> None:
        """Flush a file's buffer: a small whole file inline, else as blocks (`wait`:
        see DataPath.flush)."""
        if not self.inline.flush(inode):
            await self.data.flush(inode, wait)

    async def _flush_all(self) -> None:
        # Files with chunks in flight and no buffer (sent by a close) are waited for too.
        for ino in list(self.data.buffers) + list(self.data.writes.inflight):
            inode = self.state.inodes.get(ino)
            if inode is not None:
                await self._flush_file(inode)

    async def _write_back_on_close(self) -> None:
        try:
            await self._flush_all()
            # Nobody holds an inode after unmount: free the unlinked ones the
            # kernel still had looked up or open (else they stay as orphans).
            for inode in [i for i in self.state.inodes.values()
                          if i.nlink == 0 and i.ino != ROOT_INO]:
                inode.lookups = inode.opens = 0
                self._free_if_unused(inode)
            # Zones filled or closed meanwhile: their seals go into this commit.
            await self.data.sealer.wait_idle()
            if self._checkpoint_holds_everything():
                log.info("unmount: nothing changed since the checkpoint loaded at mount; "
                         "no checkpoint written")
            else:
                self._record_counters()
                await self.journal.commit()
                await self.journal.checkpoint()
            await self.reclaim.reset_dead_zones()
            await trio.to_thread.run_sync(self.dev.flush)
        except (errors.ZoneFSError, OSError) as exc:
            log.error("unmount could not write everything: %s", exc)
            raise

    def _checkpoint_holds_everything(self) -> bool:
        """True when the checkpoint the superblock points at is the whole State,
        and a clean unmount may skip its own (DESIGN.md 4.5; at a million files
        that is seconds, for a mount that only read).

        It is when the log held nothing after that checkpoint at mount (no
        journal record to replay, no torn tail, no torn checkpoint, nothing
        salvaged), this mount wrote nothing to the log or the superblock (a
        mount that converted the format, completed a checkpoint, marked a torn
        one or freed orphans did; so did every commit, whose counters the
        checkpoint would then have to hold), and nothing is queued. The device
        then holds what the checkpoint would write, and the next mount replays
        the same empty tail. Call after the buffers are flushed.
        """
        rec, j = self.recovered, self.journal
        found_clean = (rec.journal_bytes == 0 and not rec.scan.torn_tail
                       and rec.torn_checkpoint is None and rec.salvaged is None)
        wrote_nothing = j.log.bytes_written == 0 and j.sbstore.bytes_written == 0
        return (found_clean and wrote_nothing and j.pending_bytes == 0 and not j.data_dirty
                and not self.quota.dirty_tenants and j.broken is None)

    def enter_failsafe(self, reason: str) -> None:
        """Refuse every later change (EROFS) until remount; keep serving reads."""
        if self.failsafe is None:
            self.failsafe = reason
            log.error("switching to read-only failsafe mode: %s", reason)
            if self.c_streams is not None:
                self.c_streams.stop()  # C answers no WRITE from now on

    def _record_counters(self) -> None:
        """Queue the write counters so that they survive a crash (persisted figures)."""
        self.state.counters[C_META_BYTES] = self.metadata_bytes_written()
        ops: list[Op] = [(OpType.COUNTERS, dict(self.state.counters))]
        for tenant in self.quota.dirty_tenants:
            if tenant in self.state.inodes:
                ops.append((OpType.TENANT_BYTES, tenant, self.state.tenant_written.get(tenant, 0)))
        self.quota.dirty_tenants.clear()
        self._txn(ops)

    # -- the engine API of drain/ (DrainHost) and fsck ---------------------------------
    def txn(self, ops: list[Op]) -> None:
        """Apply ops and queue them as one journal transaction (never awaits)."""
        for op in ops:
            self.state.apply(op)
        self.journal.add(ops)

    def check_writable(self) -> None:
        """Raise errors.ReadOnly unless the mount takes changes now."""
        if self.options.read_only:
            raise errors.ReadOnly("mounted read-only")
        if self.failsafe is not None:
            raise errors.ReadOnly(f"read-only failsafe after an error: {self.failsafe}")
        if self.journal.broken is not None:
            raise errors.ReadOnly(f"journal unusable: {self.journal.broken}")

    # The names the namespace handlers use.
    _txn = txn
    _writable = check_writable

    @property
    def qos(self) -> ReadLatencyController:
        """The read-latency controller (it gates appends and the drain's reads)."""
        return self.data.qos

    def has_unwritten_data(self, ino: int) -> bool:
        """True while the file has buffered bytes or chunks in flight."""
        return self.data.has_unwritten_data(ino)

    def release_zones_of(self, ino: int) -> None:
        """The file stops writing: give back its private write head (its zones
        are sealed and finished by a background task)."""
        to_finish: list[int] = []
        self.alloc.release_owner(ino, to_finish)
        self.finish_later(to_finish)

    async def place_file_data(self, inode: Inode, fblock: int,
                              data: bytes) -> list[tuple[Op, int]]:
        """Append `data` for file blocks from `fblock`; return the EXTENT ops (with
        their zones) for `apply_placed` or `discard_placed`."""
        return await self.data.place_file_data(inode, fblock, data)

    def apply_placed(self, inode: Inode, placed: list[tuple[Op, int]]) -> list[Op]:
        """Apply placed EXTENT ops (never awaits); return them for the journal."""
        return self.data.apply_placed(inode, placed)

    def discard_placed(self, placed: list[tuple[Op, int]]) -> None:
        """Give back placed pieces that will never be applied (garbage)."""
        self.data.discard_placed(placed)

    async def read_stored(self, inode: Inode, offset: int, length: int) -> bytes:
        """The stored bytes of a file (or a snapshot of one), inline or in blocks."""
        if inode.inline:
            return self.inline.read(inode, inode.size, offset, length)
        return await self.data.read_stored(inode, offset, length)

    def inode(self, ino: int) -> Inode:
        try:
            return self.state.inodes[ino]
        except KeyError:
            raise errors.NotFound(f"no inode {ino}") from None

    def _dir(self, ino: int) -> Inode:
        inode = self.inode(ino)
        if inode.entries is None:
            raise errors.NotDirectory(f"inode {ino} is not a directory")
        return inode

    def attr(self, inode: Inode) -> Attr:
        size = self.data.visible_size(inode) if inode.extents is not None else inode.size
        blocks = (inode.extents.mapped_blocks + self.falloc.held_blocks(inode.ino)) \
            * (self.bs // 512) if inode.extents is not None else 0
        if inode.inline:
            blocks = -(-len(inode.inline) // 512)  # stored, though in no data block
        return Attr(inode.ino, inode.mode, inode.nlink, inode.uid, inode.gid, inode.rdev, size,
                    blocks, inode.atime, inode.mtime, inode.ctime, self.bs,
                    self.state.generation_of(inode.ino))

    def path_of(self, ino: int) -> str:
        """Return one path of ino, for log lines; never raises (error paths call it:
        a lazy directory's names are read from the index, and the device may be
        what failed): "<inode N>" then."""
        try:
            return self._path_of(ino)
        except (OSError, errors.ZoneFSError, StateError) as exc:
            log.debug("no path of inode %d for a log line: %s", ino, exc)
            return f"<inode {ino}>"

    def _path_of(self, ino: int) -> str:
        parts: list[bytes] = []
        cur = ino
        for _ in range(256):
            if cur == ROOT_INO:
                break
            inode = self.state.inodes.get(cur)
            d = None if inode is None else self.state.inodes.get(inode.parent)
            name = None if d is None or d.entries is None else next(
                (n for n, c in d.entries.items() if c == cur), None)
            if d is None or name is None:
                return f"<inode {ino}, unlinked>"
            parts.append(name)
            cur = d.ino
        return "/" + b"/".join(reversed(parts)).decode(errors="replace")

    def _maybe_free(self, inode: Inode) -> list[Op]:
        """Ops that free an inode nobody references any more (none if still referenced)."""
        if inode.ino == ROOT_INO or inode.nlink > 0 or inode.lookups > 0 or inode.opens > 0:
            return []
        self.data.forget_file(inode.ino)
        return [(OpType.INODE_FREE, inode.ino)]

    def _free_if_unused(self, inode: Inode) -> None:
        ops = self._maybe_free(inode)
        if ops and not self.options.read_only and self.failsafe is None:
            to_finish: list[int] = []
            self.alloc.release_owner(inode.ino, to_finish)
            self._txn(ops)
            self.finish_later(to_finish)

    def finish_later(self, zones: list[int]) -> None:
        """Seal and finish zones the allocator stopped writing, from a task of the mount."""
        self.data.sealer.close_zones_later(zones)


    # -- whole filesystem -----------------------------------------------------------------------
    def has_reservation(self, ino: int) -> bool:
        """Whether the file holds blocks reserved by fallocate (the write gate leaves
        its handles alone: writes there never need free space, INV-24)."""
        return self.falloc.held_blocks(ino) > 0

    def avail_bytes(self) -> int:
        """Free space for users (statfs): capacity less the over-provisioning, live
        data, bytes accepted and not yet placed, and held blocks."""
        return max(0, self.alloc.user_capacity_bytes() - self.falloc.used_bytes())

    async def statfs(self) -> StatFs:
        bs = self.bs
        total = self.alloc.user_capacity_bytes() // bs
        free = self.avail_bytes() // bs
        free = min(free, total)
        # Inodes: as many more as the meta area's checkpoint budget allows (the
        # estimate of NamespaceOps._check_meta_room), so that df -i shows the limit.
        used = self.state.inode_count
        room = self.journal.inodes_room(used)
        return StatFs(bs, total, free, free, used + room, room)

    async def checkpoint(self) -> None:
        self._writable()
        await self._flush_all()
        self._record_counters()
        await self.journal.checkpoint()
        await self.reclaim.reset_dead_zones()

    async def sync(self) -> None:
        if self.options.read_only:
            return
        self._writable()
        await self._flush_all()
        # Zones that filled up are being sealed: their ZONE_SEAL ops go into this
        # commit too (a sync leaves nothing of what came before it in flight).
        await self.data.sealer.wait_idle()
        await self.journal.commit()

    def status(self) -> dict[str, object]:
        return build_status(self)


