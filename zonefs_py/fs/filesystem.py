"""ZoneFS: the namespace engine behind the FUSE adapter (see fs/api.py).

This module serves requests: lookups, attributes, files, directories and
whole-filesystem operations, plus the lifecycle that wraps them (load,
background loop, close). Around it, each with one job: namespace-changing
operations and xattrs in the `NamespaceOps` mixin (fs/namespace.py); file data
in `DataPath` (fs/datapath.py); putting a recovered image in order at mount
(fs/after_recovery.py); zone resets and the cleaner's host (fs/reclaim.py);
the status figures (fs/status.py).

Every namespace operation follows one pattern: validate against the State,
build the ops, apply them and add them to the journal as one transaction,
all without an `await` in between (so each operation is atomic with respect
to the others, and a crash keeps all of its ops or none). File data goes
through `DataPath`. Durability comes from `Journal.commit` (fsync, fsyncdir,
the background commit every `commit_interval_s`, unmount).

Caveats:
  * The whole namespace lives in memory (about 0.5 KiB per file).
  * A checkpoint encodes the snapshot on the trio thread; with millions of
    files that pauses requests for a few seconds.
  * Permission checks beyond `access()` are left to the kernel
    (`default_permissions`), as the FUSE adapter always mounts with it.
"""

from __future__ import annotations

import functools
import logging
import os
import stat as statmod
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import trio

from zonefs_py import errors
from zonefs_py.alloc.allocator import Allocator
from zonefs_py.cleaner.cleaner import Cleaner
from zonefs_py.device.aread import AsyncReader
from zonefs_py.device.base import ZonedDevice
from zonefs_py.format.constants import C_META_BYTES, OpType
from zonefs_py.format.ops import Op
from zonefs_py.fs.after_recovery import finish_recovery, refuse_non_tree
from zonefs_py.fs.api import (
    FILE_SIZE_MAX,
    NAME_MAX,
    ROOT_INO,
    Attr,
    Ctx,
    DirEntry,
    FallocFlags,
    FileSystemAPI,
    SetAttrRequest,
    StatFs,
)
from zonefs_py.fs.clock import now_ns
from zonefs_py.fs.datapath import DataPath
from zonefs_py.fs.inline import InlineData, drop_idle_lock, inline_threshold
from zonefs_py.fs.latency import Histogram
from zonefs_py.fs.namespace import XATTR_PREFIXES, NamespaceOps
from zonefs_py.fs.options import FsOptions
from zonefs_py.fs.prealloc import Fallocator
from zonefs_py.fs.qos import ReadLatencyController
from zonefs_py.fs.quota import QuotaTracker
from zonefs_py.fs.reclaim import SpaceReclaim
from zonefs_py.fs.reflink import Copier
from zonefs_py.fs.status import build_status
from zonefs_py.fs.tasks import MountTasks
from zonefs_py.journal.journal import Journal
from zonefs_py.journal.recovery import Recovered, recover
from zonefs_py.model.state import Inode, State

log = logging.getLogger(__name__)



class _DirHandle:
    __slots__ = ("ino", "names")

    def __init__(self, ino: int, names: list[bytes]) -> None:
        self.ino = ino
        self.names = names


class ZoneFS(NamespaceOps, FileSystemAPI):
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
                               checkpoint_disk_bytes=rec.checkpoint_disk_bytes)
        # The allocator tells the journal of every append it accounts (INV-7).
        self.alloc = Allocator(dev.info, rec.sb, self.state, dev.report_zones(), self.journal)
        self.state.on_zone_emptied = self.alloc.zone_emptied
        reader = (AsyncReader(dev, tasks, self.read_limiter, options.sqpoll_ms)
                  if options.io_uring and tasks.is_open else None)
        self.data = DataPath(dev, self.state, self.journal, self.alloc, self.limiter,
                             self.path_of, read_limiter=self.read_limiter,
                             cache_bytes=options.cache_mb << 20,
                             qos=ReadLatencyController(options.read_latency_ms / 1e3),
                             reader=reader, stamp_times=not options.kernel_write_times,
                             prefetch_bytes=options.prefetch_mb << 20,
                             fast_read=options.fast_read, on_need_space=self._need_space,
                             tasks=tasks)
        self.inline = InlineData(self.state, self.data, self.journal,
                                 inline_threshold(self.bs, options.inline_max_bytes))
        self.reclaim = SpaceReclaim(dev, self.state, self.journal, self.alloc, self.limiter,
                                    self.data.sealer, self.data.sums)
        self.cleaner = Cleaner(self.reclaim, options.cleaner_policy, options.cleaner_rate_mb_s)
        self.quota = QuotaTracker(self.state)
        self._meta_base = self.state.counters.get(C_META_BYTES, 0)
        from zonefs_py.drain.manager import DrainManager

        self.drain = DrainManager(self)  # zonefs_py/drain (via DrainHost): the self.drain.* hooks
        self.falloc = Fallocator(self)  # fs/prealloc.py: fallocate, reserved blocks (INV-24)
        self.copier = Copier(self)  # fs/reflink.py: copy_file_range, shared extents (3.13)
        self.files: dict[int, int] = {}  # fh -> ino
        #: Time spent in read/write requests by the engine (not FUSE queueing).
        self.read_latency = Histogram()
        self.write_latency = Histogram()
        #: Bytes answered to read requests since mount (`stat`: user_bytes_read).
        self.bytes_read = 0
        self.dirs: dict[int, _DirHandle] = {}
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
        rec = await trio.to_thread.run_sync(functools.partial(recover, dev, progress=progress))
        refuse_non_tree(rec.state, dev.info.path)
        fs = cls(dev, rec, options, tasks or MountTasks())
        log.info("recovered %s: %d records, %d ops in %.2f s (torn tail: %s; journal "
                 "replayed after the checkpoint: %d bytes)", dev.info.path, rec.records,
                 rec.ops, rec.seconds, rec.scan.torn_tail, rec.journal_bytes)
        if not options.read_only:
            await fs.after_recovery()
        return fs

    async def after_recovery(self) -> None:
        """Put a recovered image in order before serving (fs/after_recovery.py)."""
        sb = await finish_recovery(self.recovered, self.journal, self.alloc, self.reclaim,
                                   self._txn, self.options.checkpoint_journal_bytes)
        if sb is not None:
            self.sb = sb

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

    async def _need_space(self) -> bool:
        """Foreground space for a write (DataPath's `on_need_space`): evict drained
        files first, then clean; False when nothing was freed."""
        if await self.drain.relieve_space(self.data.zone_size):
            await self.reclaim.commit_and_reset()
            return True
        return await self.cleaner.clean_for_space()

    def metadata_bytes_written(self) -> int:
        """Metadata bytes written over the filesystem's life (earlier mounts + this one)."""
        return (self._meta_base + self.journal.log.bytes_written
                + self.journal.sbstore.bytes_written)

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
                    blocks, inode.atime, inode.mtime, inode.ctime, self.bs)

    def path_of(self, ino: int) -> str:
        """Return one path of ino, for log lines (slow: scans directories)."""
        parts: list[bytes] = []
        cur = ino
        for _ in range(256):
            if cur == ROOT_INO:
                break
            for d in self.state.inodes.values():
                if d.entries and cur in d.entries.values():
                    parts.append(next(n for n, c in d.entries.items() if c == cur))
                    cur = d.ino
                    break
            else:
                return f"<inode {ino}, unlinked>"
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


    # -- lookups and attributes ------------------------------------------------------
    async def lookup(self, parent_ino: int, name: bytes) -> Attr:
        if name == b".":
            # Of any inode, not only directories: the kernel resolves an export
            # handle (open_by_handle_at, NFS) whose inode it no longer caches by
            # looking up "." in the handle's node id (DESIGN 4.2a).
            inode = self.inode(parent_ino)
            inode.lookups += 1
            return self.attr(inode)
        d = self._dir(parent_ino)
        if name == b"..":
            ino = d.parent or ROOT_INO
        else:
            if len(name) > NAME_MAX:
                raise errors.NameTooLong(f"name of {len(name)} bytes")
            assert d.entries is not None
            child = d.entries.get(name)
            if child is None:
                raise errors.NotFound(f"{name!r} not in directory {parent_ino}")
            ino = child
        inode = self.inode(ino)
        inode.lookups += 1
        return self.attr(inode)

    def add_lookup(self, ino: int) -> None:
        """Count one kernel reference handed out by readdirplus."""
        self.inode(ino).lookups += 1

    def xattr_namespaces(self) -> tuple[bytes, ...]:
        return XATTR_PREFIXES

    def capability_xattrs_present(self) -> bool:
        return bool(self.state.caps_inos)

    def forget(self, forgets: Sequence[tuple[int, int]]) -> None:
        for ino, n in forgets:
            inode = self.state.inodes.get(ino)
            if inode is None:
                continue
            inode.lookups = max(0, inode.lookups - n)
            self._free_if_unused(inode)

    async def getattr(self, ino: int) -> Attr:
        return self.attr(self.inode(ino))

    async def setattr(self, ino: int, req: SetAttrRequest, ctx: Ctx) -> Attr:
        self._writable()
        inode = self.inode(ino)
        now = now_ns()
        ops: list[Op] = []
        if req.size is not None:
            if inode.is_dir:
                raise errors.IsDirectory("cannot truncate a directory")
            if not inode.is_reg:
                raise errors.InvalidArgument("can only truncate regular files")
            if req.size < 0 or req.size > FILE_SIZE_MAX:
                raise errors.FileTooBig(f"size {req.size} out of range")
            if req.size > self.data.visible_size(inode):
                self._check_quota(inode, req.size - self.data.visible_size(inode))
            await self.drain.before_truncate(inode, req.size)
            ops += await self.data.truncate(inode, req.size, now)
            ops += self.inline.truncate_ops(inode, req.size)
        changes: dict[str, int] = {}
        if req.mode is not None:
            changes["mode"] = statmod.S_IFMT(inode.mode) | (req.mode & 0o7777)
        if req.uid is not None:
            changes["uid"] = req.uid
        if req.gid is not None:
            changes["gid"] = req.gid
        if (req.uid is not None or req.gid is not None) and not inode.is_dir \
                and "mode" not in changes:
            # chown clears set-user-ID and set-group-ID on files (like the kernel does).
            changes["mode"] = inode.mode & ~(statmod.S_ISUID | statmod.S_ISGID)
        if req.atime_ns is not None:
            changes["atime"] = req.atime_ns
        if req.mtime_ns is not None:
            changes["mtime"] = req.mtime_ns
            self.data.times_set(ino)
        if changes or req.size is not None:
            changes["ctime"] = req.ctime_ns if req.ctime_ns is not None else now
            op = inode.op(**changes)
            self.state.apply(op)
            ops.append(op)
        if ops:
            self.journal.add(ops)
        return self.attr(inode)

    async def readlink(self, ino: int) -> bytes:
        inode = self.inode(ino)
        if inode.target is None:
            raise errors.InvalidArgument("not a symbolic link")
        return inode.target

    async def access(self, ino: int, mode: int, ctx: Ctx) -> None:
        inode = self.inode(ino)
        if mode == os.F_OK or ctx.uid == 0:
            if ctx.uid == 0 and mode & os.X_OK and not inode.is_dir \
                    and not inode.mode & 0o111:
                raise errors.PermissionDenied("no execute bit set")
            return
        if ctx.uid == inode.uid:
            perm = (inode.mode >> 6) & 7
        elif ctx.gid == inode.gid or inode.gid in ctx.groups:
            perm = (inode.mode >> 3) & 7
        else:
            perm = inode.mode & 7
        if mode & ~perm & 7:
            raise errors.PermissionDenied(f"mode {mode:o} denied on inode {ino}")

    # -- files ---------------------------------------------------------------------------
    def _new_fh(self, ino: int) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self.files[fh] = ino
        self.state.inodes[ino].opens += 1
        return fh

    def _fh_inode(self, fh: int) -> Inode:
        try:
            return self.state.inodes[self.files[fh]]
        except KeyError:
            raise errors.InvalidArgument(f"bad file handle {fh}") from None

    async def open(self, ino: int, flags: int) -> int:
        inode = self.inode(ino)
        if inode.is_dir:
            raise errors.IsDirectory("use opendir for directories")
        writing = flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
        if writing or flags & os.O_TRUNC:
            self._writable()
        await self.drain.before_open(inode, flags)
        fh = self._new_fh(ino)
        if flags & os.O_TRUNC and inode.is_reg and self.data.visible_size(inode) > 0:
            try:
                ops = await self.data.truncate(inode, 0, now_ns())
                ops += self.inline.truncate_ops(inode, 0)
                self.journal.add(ops)
            except BaseException:
                await self.release(fh)
                raise
        return fh

    async def create(self, parent_ino: int, name: bytes, mode: int, flags: int,
                     ctx: Ctx) -> tuple[int, Attr]:
        d = await self._admit_create(parent_ino, name)
        op = self._new_inode_op(statmod.S_IFREG | (mode & 0o7777), ctx, d, 1,
                                flags=self._stream_flags(d, name))
        inode = self._create_node(d, name, op)
        return self._new_fh(inode.ino), self.attr(inode)

    async def read(self, fh: int, offset: int, length: int) -> bytes | memoryview:
        inode = self._fh_inode(fh)
        if offset < 0:
            raise errors.InvalidArgument("negative offset")
        t0 = time.perf_counter_ns()
        if self.data.writes_arriving(inode.ino):
            # Served after the writes that reached us first (DataPath.write_arriving).
            await self.data.after_earlier_writes(inode.ino)
        if inode.inline:
            small = self.inline.read(inode, self.data.visible_size(inode), offset, length)
            self.bytes_read += len(small)
            return small
        data = await self.data.reads.read(inode, offset, length)
        self.read_latency.record(time.perf_counter_ns() - t0)
        self.bytes_read += len(data)
        return data

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        self._writable()
        inode = self._fh_inode(fh)
        with self.data.write_arriving(inode.ino):
            return await self._write(inode, offset, data)

    async def _write(self, inode: Inode, offset: int, data: bytes) -> int:
        if offset < 0:
            raise errors.InvalidArgument("negative offset")
        if offset + len(data) > FILE_SIZE_MAX:
            raise errors.FileTooBig(f"write past the largest file size at {offset}")
        grow = offset + len(data) - self.data.visible_size(inode)
        if grow > 0:
            # Blocks reserved by fallocate were charged already (INV-24).
            grow -= self.falloc.held_bytes_in(inode, offset, len(data))
        if grow > 0:
            self._check_quota(inode, grow)
            live = (self.alloc.live_total_bytes() + self.data.pending_bytes()
                    + self.falloc.held_total_bytes())
            # A hole takes no space: only the written bytes can become live data.
            over = live + min(grow, len(data)) - self.alloc.user_capacity_bytes()
            if over > 0 and not await self.drain.relieve_space(over):
                raise errors.NoSpace("the live data would not fit on the device")
        self.drain.on_write(inode)
        if inode.inline:
            await self.inline.convert(inode)
        t0 = time.perf_counter_ns()
        n = await self.data.write(inode, offset, data)
        self.write_latency.record(time.perf_counter_ns() - t0)
        self.quota.count_written(inode, n)
        if self.journal.pending_bytes > (4 << 20):
            self.wake_background()
        return n

    async def flush(self, fh: int) -> None:
        inode = self._fh_inode(fh)
        if self.failsafe is None and not self.options.read_only:
            # A close: the data goes to the device without the caller waiting for it
            # (close(2) promises no durability; fsync does, DESIGN 4.3). RELEASE, which
            # the kernel sends without making anyone wait, waits for it.
            await self._flush_file(inode, wait=False)

    async def release(self, fh: int) -> None:
        ino = self.files.pop(fh, None)
        if ino is None:
            return
        inode = self.state.inodes.get(ino)
        if inode is None:
            return
        inode.opens -= 1
        if inode.opens == 0:
            if self.failsafe is None and not self.options.read_only:
                await self._flush_file(inode, wait=False)
                # The chunk a close sent lands before the file's zones and drain
                # state are let go; its error, if any, stays for the next fsync or
                # close of the file (write_errors), as a writeback error would.
                await self.data.wait_written(inode)
                err = self.data.writes.write_errors.get(ino)
                if err is not None:
                    log.error("writing inode %d after its last close failed: %s (the "
                              "next fsync or close of the file reports it)", ino, err)
                drop_idle_lock(self.data, ino)
                to_finish: list[int] = []
                self.alloc.release_owner(ino, to_finish)
                if to_finish:
                    try:
                        await self.data.sealer.close_zones(to_finish)
                    except OSError as exc:
                        log.error("finishing zones %s failed: %s", to_finish, exc)
                self.drain.on_release(inode)
            self._free_if_unused(inode)

    async def fsync(self, fh: int, datasync: bool) -> None:
        inode = self._fh_inode(fh)
        if self.options.read_only:
            return
        self._writable()
        with self.journal.urgent():  # a checkpoint encoding meanwhile makes room for it
            await self._flush_file(inode)
            self.drain.on_fsync(inode)
            await self.journal.commit()

    async def fallocate(self, fh: int, mode: FallocFlags, offset: int, length: int) -> None:
        self._writable()
        inode = self._fh_inode(fh)
        with self.data.write_arriving(inode.ino):
            await self.falloc.fallocate(inode, mode, offset, length)

    async def copy_file_range(self, fh_in: int, off_in: int, fh_out: int, off_out: int,
                              length: int, flags: int) -> int:
        self._writable()
        if flags:
            raise errors.InvalidArgument(f"copy_file_range flags {flags:#x}")
        src = self._fh_inode(fh_in)
        dst = self._fh_inode(fh_out)
        with self.data.write_arriving(dst.ino):
            return await self.copier.copy(src, off_in, dst, off_out, length)

    async def _read_inode(self, inode: Inode, offset: int, length: int) -> bytes | memoryview:
        """Read an inode's bytes (inline or in blocks), as `read` does for a handle."""
        if self.data.writes_arriving(inode.ino):
            await self.data.after_earlier_writes(inode.ino)
        if inode.inline:
            return self.inline.read(inode, self.data.visible_size(inode), offset, length)
        return await self.data.read(inode, offset, length)

    # -- directories -------------------------------------------------------------------------
    async def opendir(self, ino: int) -> int:
        d = self._dir(ino)
        assert d.entries is not None
        fh = self._next_fh
        self._next_fh += 1
        self.dirs[fh] = _DirHandle(ino, list(d.entries))
        d.opens += 1
        return fh

    async def readdir(self, dh: int, offset: int) -> list[DirEntry]:
        """Entries from position `offset` of the snapshot taken at opendir (0 refreshes it).

        Offsets index the snapshot, so they stay valid however the directory
        changes; names removed since are skipped; names added since show up
        after a rewind (offset 0), as POSIX allows.
        """
        h = self.dirs.get(dh)
        if h is None:
            raise errors.InvalidArgument(f"bad directory handle {dh}")
        d = self.inode(h.ino)
        assert d.entries is not None
        if offset == 0:
            h.names = list(d.entries)
        out: list[DirEntry] = []
        specials = [(b".", d.ino), (b"..", d.parent or ROOT_INO)]
        for i in range(offset, len(h.names) + 2):
            if i < 2:
                name, ino = specials[i]
            else:
                name = h.names[i - 2]
                child = d.entries.get(name)
                if child is None:
                    continue
                ino = child
            inode = self.state.inodes.get(ino)
            if inode is None:
                continue
            out.append(DirEntry(name, self.attr(inode), i + 1))
            if len(out) >= 1024:
                break
        return out

    async def releasedir(self, dh: int) -> None:
        h = self.dirs.pop(dh, None)
        if h is not None:
            d = self.state.inodes.get(h.ino)
            if d is not None:
                d.opens -= 1
                self._free_if_unused(d)

    async def fsyncdir(self, dh: int, datasync: bool) -> None:
        if dh not in self.dirs:
            raise errors.InvalidArgument(f"bad directory handle {dh}")
        if not self.options.read_only:
            self._writable()
            await self.journal.commit()

    # -- whole filesystem -----------------------------------------------------------------------
    async def statfs(self) -> StatFs:
        bs = self.bs
        total = self.alloc.user_capacity_bytes() // bs
        free = max(0, self.alloc.user_capacity_bytes() - self.alloc.live_total_bytes()
                   - self.data.pending_bytes() - self.falloc.held_total_bytes()) // bs
        free = min(free, total)
        # Inodes: as many more as the meta area's checkpoint budget allows (the
        # estimate of NamespaceOps._check_meta_room), so that df -i shows the limit.
        used = len(self.state.inodes)
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


