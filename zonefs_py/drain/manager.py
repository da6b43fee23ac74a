"""The drain's side of the engine: when files queue, eviction, restore.

`DrainManager` is owned by ZoneFS (`fs.drain`); the engine calls its hooks
at a few points (write, truncate, open, fsync, last close, rename, the
`user.zonefs.state` xattr, ENOSPC) and `Drainer` (drainer.py) uploads what
it queues. Every state change is a DRAIN op applied and journaled like any
other transaction (zonefs_py/model/drain.py gives the legal moves and the crash argument).

Around it, each with one job: the policy xattrs (`user.zonefs.drain`,
`user.zonefs.keep`) and object names in policy.py; fetching an object back
in restore.py; the figures in status.py; the engine it serves through
`DrainHost` (host.py).

When a file queues: QUEUED is journaled at an fsync after writing (so the
fsync's commit makes it durable with the data: a crash after the fsync
still drains that version) or at a rename of a written file; the upload is
scheduled at its last close (or at the rename, if it is closed). The object
key is taken when the upload starts (`drain_delay` after scheduling), so a
`.tmp` renamed into place uploads once, under its final name.

Eviction drops every extent of the file in one transaction with the
EVICTED record (size, times, xattrs unchanged; its zones die whole and are
reset, never cleaned). Restore fetches the object with ranged GETs (several
in flight, in worker threads), appends it to fresh zones, and makes it
visible only after the whole object's xxh3 and size match the record: a
corrupt object is EIO and leaves the file evicted. What runs off the trio
thread: every store call (trio.to_thread); appends (DataPath's threads).
No await sits between a check of a file's state and the op that changes it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Protocol

import trio

from zonefs_py import errors
from zonefs_py.drain import policy
from zonefs_py.drain.host import DrainHost
from zonefs_py.drain.policy import object_url
from zonefs_py.drain.restore import ObjectFetcher
from zonefs_py.drain.status import DrainStatus
from zonefs_py.drain.store import ObjectStore, S3Settings, S3Store, parse_url
from zonefs_py.format.constants import OpType
from zonefs_py.format.ops import Op
from zonefs_py.model import drain as model
from zonefs_py.model.drain import DrainRecord, DrainState
from zonefs_py.model.state import Inode
from zonefs_py.model.tenants import tenant_of

log = logging.getLogger(__name__)


class DrainerControl(Protocol):
    """What the manager asks of the mount's drainer (drainer.Drainer)."""

    def stop(self) -> None: ...
    def retry_now(self) -> None: ...


class DrainManager(DrainStatus):
    """The drain of one mount: the engine's hooks (open, write, truncate, release, unlink),
    eviction under space pressure, restore of evicted files, and the status figures.
    """

    def __init__(self, host: DrainHost, store: ObjectStore | None = None) -> None:
        super().__init__()
        o = host.options
        #: The engine that owns this manager, through its DrainHost API (drain/host.py).
        self.host = host
        self.state = host.state
        self.store: ObjectStore = store or S3Store(S3Settings(
            endpoint=o.drain_endpoint, region=o.drain_region, profile=o.drain_profile,
            credentials_file=o.drain_credentials))
        self.part_bytes = o.drain_part_mb << 20
        self.parts_in_flight = o.drain_parts
        #: Files (uploads and moves) in flight at once (`drain_parallel=`).
        self.files_in_flight = o.drain_parallel
        self.delay_s = o.drain_delay_s
        self.rate_bytes_s = o.drain_rate_mb_s * 1e6
        #: The drain's rate while foreground reads run (0: no limit of its own).
        self.rate_reads_bytes_s = o.drain_rate_reads_mb_s * 1e6
        #: ino -> trio time at which its upload may start (insertion = queue order).
        self.queue: dict[int, float] = {}
        #: ino -> time it was queued (for the lag in stat).
        self.queued_since: dict[int, float] = {}
        #: ino -> modification count (an upload whose count moved is discarded).
        self.gen: dict[int, int] = {}
        self.written: set[int] = set()
        self.synced: set[int] = set()
        self.renamed: set[int] = set()
        #: (bucket, key, upload id) of uploads a crash abandoned: aborted by the drainer.
        self.stale_uploads: list[tuple[str, str, str]] = []
        self.locks: dict[int, trio.Lock] = {}
        self.wake = trio.Event()
        self.paused = False
        #: Files the drainer is uploading or moving now.
        self.uploading: set[int] = set()
        self.recovered = False
        #: trio time of the last user write (the drainer yields to writers, drainer.py).
        self.last_write = float("-inf")
        self._drainer: DrainerControl | None = None

    # -- the background task ----------------------------------------------------------
    def attach_drainer(self, drainer: DrainerControl) -> None:
        """Register the mount's one drainer (its constructor calls this, so a `stop`
        before its task first runs still stops it). A second one raises."""
        if self._drainer is not None:
            raise RuntimeError("DrainManager: a drainer is attached already")
        self._drainer = drainer

    def stop(self) -> None:
        """Stop the drainer, if one is attached."""
        if self._drainer is not None:
            self._drainer.stop()

    def pause(self, paused: bool) -> None:
        """`zonefs-py drain pause|resume`: resume also retries at once after a store or
        auth error (cuts the backoff short)."""
        self.paused = paused
        if not paused:
            self.clear_auth_error()
            if self._drainer is not None:
                self._drainer.retry_now()
        self.wake.set()

    # -- recovery -------------------------------------------------------------------
    def resume_after_mount(self) -> None:
        """Queue what a previous mount left to do (drainer start): QUEUED files; a
        multipart upload in flight (UPLOADING with its id: resumed, ListParts first);
        a single PUT in flight (restarts); a move in flight, or a drained file whose
        path no longer gives its object's key (a rename whose move was not journaled)."""
        if self.recovered:
            return
        self.recovered = True
        now = trio.current_time()
        for ino, rec in list(self.state.drain.items()):
            after = model.after_recovery(rec)
            if after != rec:
                self._txn([after.op(ino)])
                rec = after
            inode = self.state.inodes.get(ino)
            if rec.state in (DrainState.QUEUED, DrainState.UPLOADING) or (
                    inode is not None and self.needs_move(inode, rec)):
                self.queue[ino] = now
                self.queued_since[ino] = now
        if self.queue:
            log.info("drain: %d file(s) left to upload or move by the previous mount",
                     len(self.queue))

    # -- helpers -----------------------------------------------------------------------
    def _txn(self, ops: list[Op]) -> None:
        self.host.txn(ops)

    def lock(self, ino: int) -> trio.Lock:
        lk = self.locks.get(ino)
        if lk is None:
            lk = self.locks[ino] = trio.Lock()
        return lk

    def record(self, ino: int) -> DrainRecord | None:
        return self.state.drain.get(ino)

    def target_url(self, inode: Inode) -> bytes | None:
        """s3://bucket/key the file's current path drains to (None: no policy, unlinked)."""
        target = self.policy_of(inode) if inode.nlink else None
        return object_url(*target) if target is not None else None

    def needs_move(self, inode: Inode, rec: DrainRecord) -> bool:
        """A drained/evicted file whose object must move: a move in flight, or its
        path now gives another key than its object's (renamed, or a directory above)."""
        if rec.state not in (DrainState.DRAINED, DrainState.EVICTED):
            return False
        if rec.moving_to:
            return True
        url = self.target_url(inode)
        return url is not None and url != rec.url

    def key_holder(self, ino: int, url: bytes) -> int | None:
        """Another linked file whose record names `url` (its object, or the one it is
        being moved to or uploaded as): nothing may write or delete that key now."""
        for other, rec in self.state.drain.items():
            if other == ino or url not in (rec.url, rec.moving_to):
                continue
            inode = self.state.inodes.get(other)
            if inode is not None and inode.nlink and rec.state != DrainState.QUEUED:
                return other
        return None

    def _forget_upload(self, ino: int, rec: DrainRecord) -> None:
        """A multipart upload waiting to resume is dropped: abort it in the store (an
        upload in flight is aborted by its own task)."""
        if rec.state == DrainState.UPLOADING and rec.token and ino not in self.uploading:
            try:
                bucket, key = parse_url(rec.url.decode())
            except ValueError:
                return
            self.stale_uploads.append((bucket, key, rec.token.decode()))
            self.wake.set()

    def policy_of(self, inode: Inode) -> tuple[str, str] | None:
        """(bucket, key) the file drains to (policy.py), or None."""
        return policy.policy_of(self.state, inode)

    def keep_of(self, d: Inode) -> tuple[int, bool] | None:
        """The `user.zonefs.keep` that applies to directory d (policy.py)."""
        return policy.keep_of(self.state, d)

    # -- hooks called by the engine (no await between check and op) ------------------------
    def on_write(self, inode: Inode) -> None:
        """Before a write is accepted: the file is no longer the drained/queued version.

        Raises IOFailure for an evicted file (open restores it first, so this
        is a bug or a handle that predates the eviction, which cannot exist).
        """
        ino = inode.ino
        self.written.add(ino)
        self.last_write = trio.current_time()
        rec = self.state.drain.get(ino)
        if rec is None:
            return
        if rec.state == DrainState.EVICTED:
            raise errors.IOFailure("the file is evicted; open it again to restore it")
        model.modify(rec)
        self._forget_upload(ino, rec)
        self.gen[ino] = self.gen.get(ino, 0) + 1
        self.queue.pop(ino, None)
        self.queued_since.pop(ino, None)
        self._txn([model.local_op(ino)])

    async def before_truncate(self, inode: Inode, new_size: int) -> None:
        """Before a size change: restore an evicted file (or drop it to LOCAL when
        truncated to 0, which needs no bytes), then count it as written."""
        rec = self.state.drain.get(inode.ino)
        if rec is not None and rec.state == DrainState.EVICTED:
            if new_size == 0:
                self._txn([model.local_op(inode.ino)])
            else:
                await self.restore(inode)
        self.on_write(inode)

    async def before_open(self, inode: Inode, flags: int) -> None:
        """Restore an evicted file on open (O_TRUNC for writing needs no bytes)."""
        rec = self.state.drain.get(inode.ino)
        if rec is None or rec.state != DrainState.EVICTED:
            return
        writing = flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
        if writing and flags & os.O_TRUNC:
            self._txn([model.local_op(inode.ino)])
            return
        await self.restore(inode)

    def on_fsync(self, inode: Inode) -> None:
        """fsync of a written file: journal QUEUED now, so the fsync's own commit makes
        it durable with the data (a crash before the close still drains this
        version; a later write sends it back to LOCAL). Upload starts at close."""
        ino = inode.ino
        if ino not in self.written:
            return
        self.synced.add(ino)
        rec = self.state.drain.get(ino)
        if rec is None and inode.nlink and self.policy_of(inode) is not None \
                and not self.host.options.read_only and self.host.failsafe is None:
            self._txn([model.queue(rec).op(ino)])

    def on_release(self, inode: Inode) -> None:
        """Last close: queue a written file that was fsync'ed or renamed."""
        ino = inode.ino
        if ino in self.written and (ino in self.synced or ino in self.renamed):
            self._queue(inode)

    def on_rename(self, inode: Inode) -> None:
        """A file got a new name: queue it if written and closed; an upload in
        flight under the old name is discarded and restarts under the new one; a
        drained or evicted file's object moves to the new key. A directory: every
        drained or evicted file below it moves (uploads in flight finish under the
        old key, then move)."""
        ino = inode.ino
        if inode.is_dir:
            self._move_below(inode)
            return
        if not inode.is_reg:
            return
        rec = self.state.drain.get(ino)
        if rec is not None and rec.state == DrainState.UPLOADING:
            self._forget_upload(ino, rec)
            self.gen[ino] = self.gen.get(ino, 0) + 1
            self._txn([model.upload_failed(rec).op(ino)])
            self._schedule(ino, self.delay_s)
            return
        if rec is not None and self.needs_move(inode, rec):
            self._schedule(ino, 0.0)
            return
        if ino in self.written:
            self.renamed.add(ino)
            if inode.opens == 0:
                self._queue(inode)

    def _move_below(self, d: Inode) -> None:
        """Schedule the move of every drained/evicted file below directory d."""
        if not self.state.drain:
            return
        todo, seen = [d.ino], 0
        while todo and seen < self.state.inode_count:
            cur = self.state.inodes.get(todo.pop())
            seen += 1
            for child in (cur.entries or {}).values() if cur is not None else ():
                inode = self.state.inodes.get(child)
                if inode is None:
                    continue
                if inode.is_dir:
                    todo.append(child)
                    continue
                rec = self.state.drain.get(child)
                if rec is not None and self.needs_move(inode, rec):
                    self._schedule(child, 0.0)

    def _queue(self, inode: Inode) -> None:
        ino = inode.ino
        self.written.discard(ino)
        self.synced.discard(ino)
        self.renamed.discard(ino)
        if inode.nlink == 0 or self.policy_of(inode) is None:
            return
        if self.host.options.read_only or self.host.failsafe is not None:
            return
        rec = self.state.drain.get(ino)
        if rec is None or rec.state != DrainState.QUEUED:
            self._txn([model.queue(rec).op(ino)])
        self._schedule(ino, self.delay_s)

    def _schedule(self, ino: int, delay_s: float) -> None:
        now = trio.current_time()
        self.queue.pop(ino, None)
        self.queue[ino] = now + delay_s
        self.queued_since.setdefault(ino, now)
        self.wake.set()

    # -- the user.zonefs.state xattr ------------------------------------------------------
    def state_value(self, inode: Inode) -> bytes:
        return model.state_name(self.state.drain.get(inode.ino)).encode()

    async def set_state(self, inode: Inode, value: bytes) -> None:
        """`evicted` evicts now; `drained`/`local`/`fetch` restores an evicted file."""
        word = value.strip(b"\0 \n").decode("ascii", errors="replace")
        if not inode.is_reg:
            raise errors.InvalidArgument("user.zonefs.state is a file's")
        if word in ("evicted", "evict"):
            self.evict(inode, by_hand=True)
        elif word in ("drained", "local", "fetch"):
            rec = self.state.drain.get(inode.ino)
            if rec is not None and rec.state == DrainState.EVICTED:
                await self.restore(inode)
        else:
            raise errors.InvalidArgument(
                f"user.zonefs.state can be set to 'evicted' or 'drained', not {word!r}")

    # -- eviction -------------------------------------------------------------------------
    def evictable(self, inode: Inode) -> str | None:
        """None if the file can be evicted now, else why not."""
        rec = self.state.drain.get(inode.ino)
        if rec is None or rec.state != DrainState.DRAINED:
            return f"it is {model.state_name(rec)}, not drained"
        if inode.opens or self.host.has_unwritten_data(inode.ino):
            return "it is open"
        if inode.inline:
            return "its bytes are inline in the metadata (no block to free)"
        if inode.ino in self.written or self.lock(inode.ino).locked():
            return "it is being written or restored"
        return None

    def evict(self, inode: Inode, by_hand: bool = False) -> bool:
        """Drop the local copy of a drained file (one transaction; never awaits)."""
        why = self.evictable(inode)
        if why is not None:
            if by_hand:
                raise errors.Busy(f"cannot evict {self.host.path_of(inode.ino)}: {why}")
            return False
        if self.host.options.read_only or self.host.failsafe is not None:
            self.host.check_writable()
        rec = self.state.drain[inode.ino]
        self._txn([(OpType.TRUNCATE, inode.ino, 0), model.evict(rec).op(inode.ino)])
        # st_blocks fell to 0: the kernel's cached attributes are stale (DESIGN 4.3).
        self.host.note_changed_behind_kernel(inode.ino)
        self.files_evicted += 1
        self.host.wake_background()
        return True

    def retention(self, d: Inode) -> int:
        """Evict the drained files of directory d past its newest `keep`; return how many."""
        keep = self.keep_of(d)
        if keep is None or d.entries is None:
            return 0
        count, by_number = keep
        files = [self.state.inodes[i] for i in d.entries.values()
                 if i in self.state.inodes and self.state.inodes[i].is_reg]

        def rank(inode: Inode) -> tuple[int, int]:
            if by_number:
                name = policy.name_in(d, inode.ino) or b""
                nums = policy.NUMBER.findall(name)
                return (int(nums[-1]) if nums else -1, inode.mtime)
            return (inode.mtime, inode.ino)

        files.sort(key=rank, reverse=True)
        evicted = 0
        for inode in files[count:]:
            if self.evict(inode):
                evicted += 1
        return evicted

    async def relieve_space(self, need_bytes: int, tenant: int = 0) -> bool:
        """ENOSPC: evict drained, closed files, oldest mtime first, until `need_bytes`
        of data are released; with `tenant`, only files of that declared tenant (its
        cap, issue 45). Returns True if anything was evicted."""
        bs = self.host.bs
        cands = [self.state.inodes[i] for i, r in self.state.drain.items()
                 if r.state == DrainState.DRAINED and i in self.state.inodes]
        if tenant:
            cands = [i for i in cands if tenant_of(self.state, i) == tenant]
        cands.sort(key=lambda i: i.mtime)
        freed = 0
        for inode in cands:
            if freed >= need_bytes:
                break
            mapped = inode.extents.mapped_blocks * bs if inode.extents else 0
            if self.evict(inode):
                freed += mapped
                log.info("drain: evicted %s (%d bytes) to relieve ENOSPC",
                         self.host.path_of(inode.ino), mapped)
        return freed > 0

    # -- restore -----------------------------------------------------------------------
    async def restore(self, inode: Inode) -> None:
        """Fetch an evicted file back; raise IOFailure (EIO) if the object is missing,
        unreachable or does not match the recorded size and xxh3."""
        async with self.lock(inode.ino):
            rec = self.state.drain.get(inode.ino)
            if rec is None or rec.state != DrainState.EVICTED:
                return  # restored by a concurrent opener
            self.host.check_writable()
            t0 = time.monotonic()
            # Built per restore: tests swap the store and the part sizes at run time.
            fetcher = ObjectFetcher(self.host, self.store, self.part_bytes, self.parts_in_flight)
            placed = await fetcher.fetch_and_place(inode, rec)
            rec = self.state.drain.get(inode.ino)
            if rec is None or rec.state != DrainState.EVICTED:
                self.host.discard_placed(placed)  # garbage: give the zones back
                raise errors.IOFailure("the file changed while it was restored")
            ops = self.host.apply_placed(inode, placed)
            op = model.restored(rec).op(inode.ino)
            self.state.apply(op)
            self.host.journal.add([*ops, op])
            self.host.note_changed_behind_kernel(inode.ino)
            if inode.opens == 0:
                self.host.release_zones_of(inode.ino)
            self.bytes_restored += rec.size
            log.info("drain: restored %s (%d bytes) from %s in %.2f s",
                     self.host.path_of(inode.ino), rec.size, rec.url.decode(),
                     time.monotonic() - t0)
