"""Faulting in from the namespace index without blocking the event loop (format 5).

A lazy State (model/lazy.py) reads a cold inode or name from the index when
it is first used, synchronously. The request paths that meet cold entries
(a lookup of a name the kernel does not cache, readdir) first try under the
reader's `cached_only()`: served from the index page cache, nothing waits;
a page not cached raises NotCached, and the pages are read in a worker
thread (`IndexReader.warm`) before the request goes on, from the cache.
Other paths (the cleaner's owners, quotas' walks, recovery) may read on the
thread they run on: DESIGN.md 3.15 lists them.
"""

from __future__ import annotations

import logging

import trio

from zonefs_py import errors
from zonefs_py.journal.nsindex import NotCached
from zonefs_py.model.lazy import InodeTable, LazyEntries
from zonefs_py.model.state import State

log = logging.getLogger(__name__)


async def fault_in(state: State, entries: LazyEntries, name: bytes) -> None:
    """Make `name` of the directory and the inode it names resident (if it exists)."""
    table = state.inodes
    assert isinstance(table, InodeTable)
    reader = table.reader
    try:
        with reader.cached_only():  # type: ignore[attr-defined]
            child = entries.get(name)
            if child is not None:
                table.get(child)
        return
    except NotCached:
        pass
    table.thread_reads += 1
    try:
        await trio.to_thread.run_sync(reader.warm, entries.ino, name)  # type: ignore[attr-defined]
    except (errors.IOFailure, errors.CorruptionError) as exc:
        # Only a read-ahead: the lookup's own read meets the error (EIO).
        log.debug("reading ahead %r in directory %d: %s", name, entries.ino, exc)


async def warm_zone_owners(state: State, zones: set[int]) -> None:
    """Bring into memory the owner lists of the data zones an EXTENT op is about to
    be applied to (`State._apply_extent`; a zone the tree holds as it is, after
    a checkpoint published it): from the index's cached pages at once, else
    their pages read in a worker thread."""
    table = state.inodes
    if not isinstance(table, InodeTable):
        return
    owners = state.zone_owners
    dirty = state.dirty
    cold = [z for z in zones if dict.get(owners, z) is None
            and not (dirty is not None and dirty.changed_zone(z))]
    if not cold:
        return
    reader = table.reader
    try:
        with reader.cached_only():  # type: ignore[attr-defined]
            for zone in cold:
                owners.get(zone)  # in memory from the cached pages: no thread
        return
    except NotCached:
        pass
    except (errors.IOFailure, errors.CorruptionError):
        return  # the apply's own read meets the error (apply_placed)
    table.thread_reads += 1

    def read() -> None:
        for zone in cold:
            reader.zone_owners(zone)

    try:
        await trio.to_thread.run_sync(read)
    except (errors.IOFailure, errors.CorruptionError) as exc:
        # Only a read-ahead: the apply's own read meets the error (apply_placed).
        log.debug("reading ahead the owners of zones %s: %s", cold, exc)


async def warm_zone(state: State, zone: int) -> None:
    """Read into the index cache, in a worker thread, the owner list of data zone
    `zone` and its owners' records (the cleaner's `live_pieces`, a zone's seal)."""
    table = state.inodes
    if not isinstance(table, InodeTable):
        return
    dirty = state.dirty
    owners: set[int] | None = None
    if dirty is not None and dirty.changed_zone(zone):
        owners = state.zone_owners.get(zone)  # in memory (no read) once changed
    missing = [ino for ino in owners or () if table.resident(ino) is None]
    table.thread_reads += 1
    try:
        await trio.to_thread.run_sync(table.reader.warm_zone, zone, missing)  # type: ignore[attr-defined]
    except (errors.IOFailure, errors.CorruptionError) as exc:
        # Only a read-ahead: the caller's own reads meet the error where it is handled.
        log.debug("reading ahead the owners of zone %d: %s", zone, exc)
