"""Move a drained object when its file is renamed: server-side copy, verify, delete.

A drained or evicted file whose path now gives another object key (the file
or a directory above it was renamed) has its object moved by the drainer
(drainer.py runs `move_object` as it runs uploads, in the same pool of
`drain_parallel` slots). The steps, each journaled like the drain states
(docs/DESIGN.md §6.3 gives the crash argument):

1. Journal the record with `moving_to` = the destination URL (the record keeps
   the old URL) and commit: a crash from here on resumes the move.
2. Unless the destination already holds the object (a resumed move: HEAD shows
   the size and xxh3), copy it server-side (CopyObject; UploadPartCopy ranges
   past 5 GiB) and HEAD it: size and xxh3 metadata must be the record's.
3. Delete the old key, unless another linked file's record names it.
4. Journal the record with the new URL and the copy's ETag (`move_done`).

At every instant the object is complete under the old key (until 3) or the
new one (from 2), and the record names both until 4, so a restore finds it
(manager.py `_restore_source`). A key another linked file's record still
names (its object, an upload or a move of its own) is never written or
deleted: the move waits (a cycle of renames among drained files waits for
good, each file keeping its own object under its old key; logged once).
Everything here runs under the file's lock (`DrainManager.lock`), so a
restore waits for a move and a move for a restore; eviction is refused
while it runs. Store calls run in worker threads.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from zonefs_py.drain.manager import DrainManager
from zonefs_py.drain.policy import object_metadata
from zonefs_py.drain.store import META_SIZE, META_XXH3, ObjectInfo, StoreError, parse_url
from zonefs_py.model import drain as model
from zonefs_py.model.drain import DrainRecord, DrainState
from zonefs_py.model.state import Inode

log = logging.getLogger(__name__)


class MoveDeferred(Exception):
    """The destination key is still another file's: try again later."""


def _holds(info: ObjectInfo, rec: DrainRecord) -> bool:
    meta = object_metadata(rec.size, rec.xxh3)
    return info.size == rec.size and info.metadata.get(META_XXH3) == meta[META_XXH3] \
        and info.metadata.get(META_SIZE) == meta[META_SIZE]


async def _head(m: DrainManager, url: bytes) -> ObjectInfo | None:
    bucket, key = parse_url(url.decode())
    try:
        info: ObjectInfo = await trio.to_thread.run_sync(m.store.head, bucket, key)
        return info
    except StoreError as exc:
        if exc.kind == "missing":
            return None
        raise


async def move_object(m: DrainManager, inode: Inode, warned: set[Any]) -> bool:
    """Move the object of a drained/evicted file to the key its path gives now.

    Returns True if it moved, False if there was nothing to do (or the file
    changed meanwhile). Raises StoreError (the caller backs off and retries)
    or MoveDeferred (the destination is another file's key for now).
    """
    ino = inode.ino
    async with m.lock(ino):
        rec = m.record(ino)
        if rec is None or not m.needs_move(inode, rec):
            return False
        gen = m.gen.get(ino, 0)
        if not rec.moving_to:
            dest = m.target_url(inode)
            assert dest is not None  # needs_move said so
            holder = m.key_holder(ino, dest)
            if holder is not None:
                if (ino, dest) not in warned:
                    warned.add((ino, dest))
                    log.warning("drain: %s stays under %s for now: %s is %s's object",
                                m.host.path_of(ino), rec.url.decode(), dest.decode(),
                                m.host.path_of(holder))
                raise MoveDeferred(dest.decode())
            rec = model.start_move(rec, dest)
            m._txn([rec.op(ino)])
            await m.host.journal.commit()  # step 1 durable before anything is copied
        info = await _head(m, rec.moving_to)
        if info is None or not _holds(info, rec):
            src_bucket, src_key = parse_url(rec.url.decode())
            bucket, key = parse_url(rec.moving_to.decode())
            await trio.to_thread.run_sync(m.store.copy, src_bucket, src_key, bucket, key,
                                          rec.size)
            info = await _head(m, rec.moving_to)
            if info is None or not _holds(info, rec):
                raise StoreError("fatal", f"the copy {rec.moving_to.decode()} of "
                                          f"{rec.url.decode()} is not the object")
        if m.key_holder(ino, rec.url) is None:
            bucket, key = parse_url(rec.url.decode())
            await trio.to_thread.run_sync(m.store.delete, bucket, key)
        now = m.record(ino)
        if m.gen.get(ino, 0) != gen or now is None or not now.moving_to \
                or now.state not in (DrainState.DRAINED, DrainState.EVICTED):
            return False  # written meanwhile (LOCAL): the next drain uploads anew
        m._txn([model.move_done(now, info.etag.encode()).op(ino)])
        m.files_moved += 1
        log.info("drain: moved %s -> %s (%s)", rec.url.decode(), rec.moving_to.decode(),
                 m.host.path_of(ino))
        return True
