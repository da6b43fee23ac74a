"""The drainer: a background task that uploads queued files to the object store.

`Drainer(manager).run()` runs for the life of the mount (started by the
daemon next to the engine's background work; `stop()` ends it). Up to
`drain_parallel` files at once (uploads and moves, mover.py), oldest queued
first; each upload:

1. Snapshot the file's extents and size (the version queued, complete on
   the filesystem) and pin their zones (INV-8: none is reset under us, even
   if the file is overwritten meanwhile).
2. Read it once to compute its xxh3 (S3 metadata is set when an upload is
   created, so the checksum must be known first); a file of at most
   `drain_parts` parts keeps them for step 3 (read once in all).
3. Small files: one PUT. Larger: a multipart upload (`drain_part_mb`
   parts, `drain_parts` in flight in worker threads), UPLOADING with its
   upload id journaled first. Every part's ETag must be the MD5 we computed
   of it (a part damaged in transit is sent again before completion; a single
   PUT carries Content-MD5). An upload that UPLOADING names already
   (after a crash, an unmount or a store error) resumes: ListParts, and a
   part is sent only if the store lacks it or holds other bytes (its ETag is
   not the MD5 of our part); the hash pass is skipped (the record holds the
   xxh3) and the parts' xxh3 is checked against it before completion.
4. Verify: the returned ETag equals the MD5 (single PUT) or the multipart
   ETag computed from the parts' MD5s, and a HEAD shows the size and xxh3.
   Only then DRAINED (with the ETag) is journaled, and retention runs.

Reads of file data go through the read-QoS gate as appends do (training
reads first), wait for user writes to pause (WRITER_IDLE_S, at most
WRITER_WAIT_S per part: the burst first), and the upload passes a token
bucket (`drain_rate=`): `DrainPacer` (pacing.py).
A file modified, renamed or deleted while uploading (its generation moves)
loses that upload: it is aborted and the file re-queues when it is complete
again; a transient store error or a stop keeps the upload, to resume it.
Store errors: transient ones back off (1 s doubling to 60 s, for the whole
store: a dead store sees one attempt per step, however many files are in
flight); auth errors log one line, show in stat, and retry every 5 minutes
(or on `drain resume`). The token buckets (`drain_rate=`, the read-QoS
gate) are the drainer's one pacer, shared by every file in flight.
"""

from __future__ import annotations

import hashlib
import logging
import time

import trio
import xxhash

from zonefs_py import errors
from zonefs_py.drain.manager import DrainManager
from zonefs_py.drain.mover import MoveDeferred, move_object
from zonefs_py.drain.pacing import DrainPacer
from zonefs_py.drain.policy import object_metadata, object_url, snapshot_inode
from zonefs_py.drain.store import META_SIZE, META_XXH3, StoreError, multipart_etag, parse_url
from zonefs_py.model import drain as model
from zonefs_py.model.drain import DrainState
from zonefs_py.model.state import Inode

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 60.0
AUTH_RETRY_S = 300.0


class UploadAbandoned(Exception):
    """The file changed (or went away) while it was being uploaded."""


class KeyBusy(UploadAbandoned):
    """The object key is still another file's (its object waits to be moved)."""


class Drainer:
    """Background task that uploads queued files to the object store, one `run()` per mount
    (`stop()` ends it).
    """

    def __init__(self, manager: DrainManager) -> None:
        self.m = manager
        self.host = manager.host
        self.backoff_s = 0.0
        #: trio time before which no new file starts (a store error's backoff).
        self.backoff_until = 0.0
        self._warned: set[object] = set()
        self._cancel = trio.CancelScope()
        # Registered now, not when run() starts: a stop() before the task first runs
        # must still stop it (a cancelled scope cancels what it is entered around).
        manager.attach_drainer(self)
        self.pace = DrainPacer(manager)

    def stop(self) -> None:
        """End `run` (the mount is closing)."""
        self._cancel.cancel()

    def retry_now(self) -> None:
        """Cut a store error's backoff short (`zonefs-py drain resume`)."""
        self.backoff_until = 0.0

    async def run(self) -> None:
        """Upload (and move) queued files, `drain_parallel` at once, until `stop()`."""
        if self.host.options.read_only:
            return
        m = self.m
        with self._cancel:
            m.resume_after_mount()
            async with trio.open_nursery() as nursery:
                while True:
                    await self._abort_stale()
                    ino, wait = self._next_ready()
                    if ino is None:
                        m.wake = trio.Event()
                        with trio.move_on_after(wait):
                            await m.wake.wait()
                        continue
                    m.queue.pop(ino, None)
                    m.uploading.add(ino)  # no await before the task owns it
                    nursery.start_soon(self._one, ino)

    async def _one(self, ino: int) -> None:
        try:
            await self.drain_one(ino)
        except errors.ZoneFSError as exc:
            # The journal refused a state change (failsafe, device error): this file
            # waits for the next mount, the other files in flight go on.
            self.m.note_error(f"{self.host.path_of(ino)}: {exc}")
            log.error("drain: %s: %s", self.host.path_of(ino), exc)
        finally:
            self.m.uploading.discard(ino)
            self.m.wake.set()  # a slot is free

    def _next_ready(self) -> tuple[int | None, float]:
        """The next file whose upload may start, or (None, seconds to wait)."""
        m = self.m
        if m.paused or self.host.failsafe is not None:
            return None, 3600.0
        if len(m.uploading) >= m.files_in_flight:
            return None, 3600.0  # woken when one ends
        now = trio.current_time()
        if self.backoff_until > now:
            return None, self.backoff_until - now
        soonest = 3600.0
        for ino, at in m.queue.items():
            if ino in m.uploading:
                continue  # its previous attempt still runs (and will see it changed)
            if at <= now:
                return ino, 0.0
            soonest = min(soonest, at - now)
        return None, soonest

    async def _abort_stale(self) -> None:
        while self.m.stale_uploads:
            bucket, key, upload_id = self.m.stale_uploads.pop()
            try:
                await trio.to_thread.run_sync(self.m.store.abort_multipart, bucket, key,
                                              upload_id)
                log.info("drain: aborted the upload of s3://%s/%s a crash interrupted",
                         bucket, key)
            except StoreError as exc:
                log.info("drain: could not abort an interrupted upload (%s); the store's "
                         "lifecycle rules must clean it", exc)

    # -- one file -------------------------------------------------------------------
    async def drain_one(self, ino: int) -> None:
        """Upload (or move) one queued file; on failure re-queue it with a backoff."""
        m = self.m
        rec = m.record(ino)
        inode = self.host.state.inodes.get(ino)
        if rec is None or inode is None:
            m.queued_since.pop(ino, None)
            return
        if rec.state in (DrainState.DRAINED, DrainState.EVICTED):
            await self._move_one(inode)
            return
        if rec.state not in (DrainState.QUEUED, DrainState.UPLOADING):
            m.queued_since.pop(ino, None)
            return
        target = m.policy_of(inode) if inode.nlink else None
        if target is None:
            # Deleted, unlinked or moved out of every drain directory: nothing to do.
            m._forget_upload(ino, rec)
            m._txn([model.local_op(ino)])
            m.queued_since.pop(ino, None)
            return
        try:
            etag = await self._upload(inode, *target)
        except KeyBusy as exc:
            log.debug("drain: %s waits: %s", self.host.path_of(ino), exc)
            self._requeue_if_needed(ino, max(1.0, m.delay_s), keep_upload=False)
        except UploadAbandoned as exc:
            log.info("drain: upload of %s abandoned: %s", self.host.path_of(ino), exc)
            self._requeue_if_needed(ino, max(1.0, m.delay_s), keep_upload=False)
        except StoreError as exc:
            self._store_failed(ino, exc)
        except errors.ZoneFSError as exc:
            # A local read failed (checksum, device): retrying will not help soon.
            m.note_error(f"{self.host.path_of(ino)}: {exc}")
            log.error("drain: cannot read %s for upload: %s", self.host.path_of(ino), exc)
            self._requeue_if_needed(ino, BACKOFF_MAX_S, keep_upload=False)
        else:
            self._succeeded()
            m.queued_since.pop(ino, None)
            m.files_drained += 1
            log.info("drain: %s -> s3://%s/%s (%d bytes, ETag %s)", self.host.path_of(ino),
                     target[0], target[1], inode.size, etag)
            rec = m.record(ino)
            if rec is not None and m.needs_move(inode, rec):
                m._schedule(ino, 0.0)  # a directory above was renamed meanwhile
            parent = self.host.state.inodes.get(inode.parent)
            if parent is not None:
                m.retention(parent)

    async def _move_one(self, inode: Inode) -> None:
        m = self.m
        ino = inode.ino
        try:
            moved = await move_object(m, inode, self._warned)
        except MoveDeferred:
            m._schedule(ino, max(1.0, m.delay_s))
            return
        except StoreError as exc:
            self._store_failed(ino, exc)
            return
        except errors.ZoneFSError as exc:
            # The journal refused the record (device error, failsafe): nothing moved
            # that a record does not name; retried after a long pause.
            m.note_error(f"{self.host.path_of(ino)}: {exc}")
            log.error("drain: cannot journal the move of %s: %s", self.host.path_of(ino), exc)
            self._requeue_if_needed(ino, BACKOFF_MAX_S, keep_upload=True)
            return
        if moved:
            self._succeeded()
        m.queued_since.pop(ino, None)
        rec = m.record(ino)
        if moved and rec is not None and m.needs_move(inode, rec):
            m._schedule(ino, 0.0)  # renamed again while it moved
        elif moved:
            parent = self.host.state.inodes.get(inode.parent)
            if parent is not None:
                m.retention(parent)  # eviction was refused while it moved

    def _succeeded(self) -> None:
        self.backoff_s = 0.0
        self.backoff_until = 0.0
        self.m.clear_auth_error()

    def _requeue_if_needed(self, ino: int, delay_s: float, keep_upload: bool) -> None:
        """Queue the file again after a failure. A multipart upload is kept (to resume)
        if `keep_upload`; else UPLOADING goes back to QUEUED (a fresh upload)."""
        m = self.m
        if self.host.failsafe is not None or self.host.options.read_only:
            return  # nothing can be journaled; the next mount resumes from the log
        rec = m.record(ino)
        if rec is not None and rec.state == DrainState.UPLOADING and not (
                keep_upload and rec.token):
            m._txn([model.upload_failed(rec).op(ino)])
            rec = m.record(ino)
        inode = self.host.state.inodes.get(ino)
        if rec is not None and (rec.state in (DrainState.QUEUED, DrainState.UPLOADING) or (
                inode is not None and m.needs_move(inode, rec))):
            m._schedule(ino, delay_s)
        else:
            m.queued_since.pop(ino, None)

    def _store_failed(self, ino: int, exc: StoreError) -> None:
        m = self.m
        m.note_error(str(exc))
        now = trio.current_time()
        if exc.kind == "auth":
            if m.note_auth_error(str(exc)):
                log.error("drain: the object store refused our credentials: %s. Uploads "
                          "wait (retried every %d s or on 'zonefs-py drain resume'); fix "
                          "the credentials (drain_credentials=, AWS_* variables, "
                          "~/.aws)", exc, AUTH_RETRY_S)
            self.backoff_s = AUTH_RETRY_S
            self.backoff_until = now + self.backoff_s
        elif self.backoff_until <= now:
            # One step per attempt window: files failing together double it once.
            self.backoff_s = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, self.backoff_s * 2))
            self.backoff_until = now + self.backoff_s
            log.warning("drain: %s failed (%s); retrying in %.0f s", self.host.path_of(ino),
                        exc, self.backoff_s)
        self._requeue_if_needed(ino, 0.0, keep_upload=exc.kind == "transient")

    async def _upload(self, inode: Inode, bucket: str, key: str) -> str:
        m = self.m
        ino = inode.ino
        gen = m.gen.get(ino, 0)
        if self.host.has_unwritten_data(ino):
            raise UploadAbandoned("it is being written")
        url = object_url(bucket, key)
        self._check_key(ino, url)
        snap = snapshot_inode(inode)
        zones = sorted({e.dev // self.host.state.zone_size for e in snap.extents or ()})
        for z in zones:
            self.host.alloc.pin_read(z)
        try:
            resumed = await self._resumable(snap, url)
            kept: list[bytes] | None = None
            if resumed is not None:
                xxh, upload_id, stored = resumed
            else:
                xxh, kept = await self._hash(snap, gen)
                upload_id, stored = "", {}
            meta = object_metadata(snap.size, xxh)
            if snap.size <= m.part_bytes:
                self._set_uploading(ino, gen, url, snap.size, xxh, b"")
                data = kept[0] if kept else await self._read(snap, 0, snap.size, gen)
                self._check_gen(ino, gen)
                await self.pace.before_upload(len(data))
                digest = hashlib.md5(data).digest()  # small: at most one part
                etag = await trio.to_thread.run_sync(m.store.put, bucket, key, data, meta,
                                                     digest)
                m.parts_sent += 1
                m.bytes_uploaded += len(data)
                want = digest.hex()
            else:
                if not upload_id:
                    upload_id = await trio.to_thread.run_sync(m.store.create_multipart,
                                                              bucket, key, meta)
                    try:
                        self._set_uploading(ino, gen, url, snap.size, xxh,
                                            upload_id.encode())
                    except UploadAbandoned:
                        with trio.CancelScope(shield=True):
                            await self._try_abort(bucket, key, upload_id)
                        raise
                    # Durable now: a crash mid-upload then resumes this upload.
                    await self.host.journal.commit()
                try:
                    etag, want = await self._parts(snap, gen, bucket, key, upload_id, stored,
                                                   xxh, kept)
                except (UploadAbandoned, errors.ZoneFSError):
                    await self._abort_shielded(bucket, key, upload_id)
                    raise
                except StoreError as exc:
                    # Transient: kept to resume (ListParts). Else it is of no use.
                    if exc.kind != "transient":
                        await self._abort_shielded(bucket, key, upload_id)
                    raise
            if etag != want:
                raise StoreError("fatal", f"s3://{bucket}/{key}: ETag {etag} is not the "
                                          f"MD5 of what was sent ({want})")
            info = await trio.to_thread.run_sync(m.store.head, bucket, key)
            if info.size != snap.size or info.metadata.get(META_XXH3) != meta[META_XXH3] \
                    or info.metadata.get(META_SIZE) != meta[META_SIZE]:
                raise StoreError("fatal", f"s3://{bucket}/{key}: the stored object "
                                          f"({info.size} bytes, {info.metadata}) is not "
                                          "what was uploaded")
            self._check_gen(ino, gen)
            rec = m.record(ino)
            m._txn([model.upload_done(rec, etag.encode()).op(ino)])
            m.bytes_drained += snap.size
            return etag
        finally:
            for z in zones:
                self.host.alloc.unpin_read(z)

    async def _resumable(self, snap: Inode, url: bytes
                         ) -> tuple[int, str, dict[int, tuple[str, int]]] | None:
        """(xxh3, upload id, stored parts) of the multipart upload the record names, if
        it can go on: same key and size, and the store still has it (ListParts).
        Else None, and an upload the record named is handed to `_abort_stale`."""
        m = self.m
        rec = m.record(snap.ino)
        if rec is None or rec.state != DrainState.UPLOADING or not rec.token:
            return None
        if rec.url == url and rec.size == snap.size and snap.size > m.part_bytes:
            bucket, key = parse_url(url.decode())
            try:
                stored = await trio.to_thread.run_sync(m.store.list_parts, bucket, key,
                                                       rec.token.decode())
            except StoreError as exc:
                if exc.kind != "missing":
                    raise
                log.info("drain: the upload of %s to resume is gone from the store; "
                         "starting again", url.decode())
                return None
            log.info("drain: resuming the upload of %s (%d part(s) stored)", url.decode(),
                     len(stored))
            return rec.xxh3, rec.token.decode(), stored
        try:
            bucket, key = parse_url(rec.url.decode())
            m.stale_uploads.append((bucket, key, rec.token.decode()))
        except ValueError:
            pass
        return None

    def _check_key(self, ino: int, url: bytes) -> None:
        """Raise KeyBusy if another linked file's record still names the key (INV-20:
        its object must not be overwritten before it moved away)."""
        holder = self.m.key_holder(ino, url)
        if holder is not None:
            raise KeyBusy(f"{url.decode()} still holds the object of "
                          f"{self.host.path_of(holder)} (waiting for its move)")

    def _set_uploading(self, ino: int, gen: int, url: bytes, size: int, xxh: int,
                       upload_id: bytes) -> None:
        self._check_gen(ino, gen)
        self._check_key(ino, url)  # no await since: the record claims the key
        rec = self.m.record(ino)
        self.m._txn([model.start_upload(rec, url, size, xxh, upload_id).op(ino)])

    def _check_gen(self, ino: int, gen: int) -> None:
        rec = self.m.record(ino)
        if self.m.gen.get(ino, 0) != gen or rec is None or ino not in self.host.state.inodes \
                or rec.state not in (DrainState.QUEUED, DrainState.UPLOADING):
            raise UploadAbandoned("it changed while it was uploading")

    async def _abort_shielded(self, bucket: str, key: str, upload_id: str) -> None:
        with trio.CancelScope(shield=True):
            await self._try_abort(bucket, key, upload_id)

    async def _try_abort(self, bucket: str, key: str, upload_id: str) -> None:
        try:
            await trio.to_thread.run_sync(self.m.store.abort_multipart, bucket, key, upload_id)
        except StoreError as exc:
            log.info("drain: abort of an upload of s3://%s/%s failed: %s", bucket, key, exc)

    async def _read(self, snap: Inode, offset: int, length: int, gen: int) -> bytes:
        """Read the snapshot's bytes behind the read-QoS gate (training reads first),
        after user writes pause."""
        await self.pace.before_read(length)
        self._check_gen(snap.ino, gen)
        return await self.host.read_stored(snap, offset, length)

    async def _hash(self, snap: Inode, gen: int) -> tuple[int, list[bytes] | None]:
        """The xxh3 of the snapshot, and its parts if it has at most `drain_parts` of
        them (kept for the upload, which then reads nothing again: the memory is
        what those parts in flight would take anyway)."""
        h = xxhash.xxh3_64()
        step = self.m.part_bytes
        keep = snap.size <= self.m.parts_in_flight * step
        parts: list[bytes] = []
        for off in range(0, snap.size, step):
            data = await self._read(snap, off, min(step, snap.size - off), gen)
            h.update(data)
            if keep:
                parts.append(data)
        return h.intdigest(), parts if keep else None

    async def _parts(self, snap: Inode, gen: int, bucket: str, key: str, upload_id: str,
                     stored: dict[int, tuple[str, int]], xxh: int,
                     kept: list[bytes] | None = None) -> tuple[str, str]:
        """Upload every part the store lacks (`stored`: number -> (ETag, size) from
        ListParts), `drain_parts` in flight; return (ETag, expected ETag).

        Every part is read in order (its MD5 is needed for the ETag check, and the
        xxh3 of all of them must equal `xxh`, the version the upload was created
        for); a stored part is kept only if its ETag is the MD5 of our bytes.
        """
        m = self.m
        step = m.part_bytes
        nparts = (snap.size + step - 1) // step
        etags: list[str] = [""] * nparts
        md5s: list[bytes] = [b""] * nparts
        limiter = trio.CapacityLimiter(m.parts_in_flight)
        failure: list[BaseException] = []
        hasher = xxhash.xxh3_64()
        sent = [0]

        def md5_and_send(i: int, data: bytes) -> str:
            # Worker thread: the MD5 of a part (~30 ms per 16 MiB) stays off the trio thread.
            md5s[i] = hashlib.md5(data).digest()
            have = stored.get(i + 1)
            if have is not None and have == (md5s[i].hex(), len(data)):
                return have[0]  # the store holds exactly these bytes: not sent again
            sent[0] += 1
            return m.store.upload_part(bucket, key, upload_id, i + 1, data, md5s[i])

        async def send(i: int, data: bytes) -> None:
            try:
                etags[i] = await trio.to_thread.run_sync(md5_and_send, i, data)
                m.bytes_uploaded += len(data)
            except StoreError as exc:
                failure.append(exc)
                nursery.cancel_scope.cancel()
            finally:
                limiter.release_on_behalf_of(i)

        t0 = time.monotonic()
        async with trio.open_nursery() as nursery:
            for i in range(nparts):
                await limiter.acquire_on_behalf_of(i)
                off = i * step
                try:
                    if kept is not None:
                        data = kept[i]
                        kept[i] = b""  # sent: not held twice
                        self._check_gen(snap.ino, gen)
                    else:
                        data = await self._read(snap, off, min(step, snap.size - off), gen)
                except (UploadAbandoned, errors.ZoneFSError) as exc:
                    # Raised here it would reach the caller wrapped in an ExceptionGroup.
                    limiter.release_on_behalf_of(i)
                    failure.append(exc)
                    nursery.cancel_scope.cancel()
                    break
                hasher.update(data)
                if i + 1 not in stored:
                    await self.pace.before_upload(len(data))
                nursery.start_soon(send, i, data)
        m.parts_sent += sent[0]
        m.parts_reused += nparts - sent[0] if not failure else 0
        if failure:
            raise failure[0]
        self._check_gen(snap.ino, gen)
        if hasher.intdigest() != xxh:
            raise UploadAbandoned(f"its bytes no longer hash to {xxh:016x} (the version "
                                  "the upload was created for)")
        for i, e in enumerate(etags):
            if e != md5s[i].hex():
                # Damaged on the way (or a store whose ETag is not the MD5): transient,
                # so the upload is kept and resumed, and ListParts shows that part's
                # ETag differs from our MD5: only it is sent again.
                raise StoreError("transient", f"part {i + 1} of s3://{bucket}/{key}: "
                                              f"ETag {e} is not its MD5")
        etag = await trio.to_thread.run_sync(m.store.complete_multipart, bucket, key,
                                             upload_id, etags)
        log.debug("drain: %d parts of s3://%s/%s in %.2f s (%d sent, %d already stored)",
                  nparts, bucket, key, time.monotonic() - t0, sent[0], nparts - sent[0])
        return etag, multipart_etag(md5s)
