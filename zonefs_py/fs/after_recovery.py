"""What a mount does between journal recovery and serving its first request.

`refuse_non_tree` checks the recovered namespace (INV-11) on every mount;
`finish_recovery` runs on writable mounts and puts a crashed image back in
order: an older format converted, stale log zones reset, a torn checkpoint
marked, a checkpoint
completed whose superblock write was lost, orphans freed, dead data zones
queued for reset (docs/DESIGN.md 3.4).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from zonefs_py import errors
from zonefs_py.alloc.allocator import Allocator
from zonefs_py.format.constants import (
    DISK_VERSION,
    INDEX_DISK_VERSION,
    MIN_INDEX_META_ZONES,
    OpType,
)
from zonefs_py.format.ops import Op
from zonefs_py.format.superblock import Superblock
from zonefs_py.fs.api import ROOT_INO
from zonefs_py.fs.reclaim import SpaceReclaim
from zonefs_py.journal.journal import Journal
from zonefs_py.journal.metaroom import index_budget_bytes
from zonefs_py.journal.nsindex import NamespaceIndex
from zonefs_py.journal.recovery import Recovered
from zonefs_py.model.dirty import DirtySet, inode_record
from zonefs_py.model.lazy import InodeTable
from zonefs_py.model.state import State

log = logging.getLogger(__name__)


def refuse_non_tree(state: State, path: str) -> None:
    """Raise CorruptionError unless every linked directory has one name, reachable from the root.

    INV-11; checked at mount so that the kernel never walks a loop or a
    directory alias, whatever a damaged (but checksummed) log says.
    Directories with nlink 0 (removed while open before a crash) are freed later.
    """
    if state.lazy:
        _refuse_replayed_non_tree(state, path)
        return
    names: dict[int, int] = {}
    for d in state.inodes.values():
        for child in (d.entries or {}).values():
            c = state.inodes.get(child)
            if c is not None and c.is_dir:
                names[child] = names.get(child, 0) + 1
    root = state.inodes.get(ROOT_INO)
    if root is None or not root.is_dir:
        raise errors.CorruptionError(f"{path}: the root directory is missing; "
                                     "run 'zonefs-py fsck'")
    reached, stack = {ROOT_INO}, [ROOT_INO]
    while stack:
        for child in (state.inodes[stack.pop()].entries or {}).values():
            c = state.inodes.get(child)
            if c is not None and c.is_dir and child not in reached:
                reached.add(child)
                stack.append(child)
    for ino, inode in state.inodes.items():
        if not inode.is_dir or ino == ROOT_INO or (inode.nlink == 0 and ino not in names):
            continue
        if names.get(ino, 0) != 1 or ino not in reached:
            raise errors.CorruptionError(
                f"{path}: directory {ino} has {names.get(ino, 0)} names or is not reachable "
                "from the root (INV-11); run 'zonefs-py fsck'")


def _refuse_replayed_non_tree(state: State, path: str) -> None:
    """INV-11 for a lazy mount (format 5): it reads the root and the journal tail,
    not the namespace, so it checks what the replayed ops changed (the tree was
    checked by the mount that wrote it): each directory that gained or lost a
    name keeps one name (one more if the replay created it, none if it was
    removed while open), and its parents lead to the root. Then stops counting."""
    changes = state.dir_name_changes or {}
    state.dir_name_changes = None
    root = state.inodes.get(ROOT_INO)
    if root is None or not root.is_dir:
        raise errors.CorruptionError(f"{path}: the root directory is missing; "
                                     "run 'zonefs-py fsck'")
    assert isinstance(state.inodes, InodeTable)
    tree_next_ino = state.inodes.reader.next_ino
    for ino, delta in sorted(changes.items()):
        inode = state.inodes.get(ino)
        if inode is None or ino == ROOT_INO:
            continue
        want = (1 if ino >= tree_next_ino else 0) - (1 if inode.nlink == 0 else 0)
        if delta != want:
            raise errors.CorruptionError(
                f"{path}: the journal gives directory {ino} {delta:+d} names, not "
                f"{want:+d} (INV-11); run 'zonefs-py fsck'")
        if inode.nlink == 0:
            continue
        seen = {ino}
        cur = inode.parent
        while cur != ROOT_INO:
            d = state.inodes.get(cur)
            if d is None or not d.is_dir or cur in seen:
                raise errors.CorruptionError(
                    f"{path}: directory {ino} is not reachable from the root "
                    "(INV-11); run 'zonefs-py fsck'")
            seen.add(cur)
            cur = d.parent


#: Index bytes per inode beyond its record (key, entry header) and per name
#: beyond its bytes (key prefix and parent, child value, entry header), and
#: per zone owner (format/nsindex.py, index/page.py).
_INODE_ENTRY_BYTES = 15
_NAME_ENTRY_BYTES = 21
_OWNER_BYTES = 8
#: Inode records encoded to measure a namespace's average (`estimated_index_bytes`).
_RECORD_SAMPLE = 1024
#: A conversion leaves at least half of format 5's file bound free.
CONVERT_HEADROOM = 2
#: Memory a conversion takes beyond the namespace already loaded, per byte of
#: index pages: the checkpoint holds every page it writes, decoded and encoded,
#: until its commit (measured: 1.7 GiB peak with 767 MiB loaded for 422 MiB of
#: pages at a million files, bench/results/2026-12-05-issue32-default).
CONVERT_MEMORY_PER_PAGE_BYTE = 2.5


def memory_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def estimated_index_bytes(state: State) -> int:
    """The page bytes a format 5 index of this (whole, eager) namespace takes:
    every name and owner counted, the inode records from a sample of
    _RECORD_SAMPLE encoded, pages 95% full (leaves are cut at their key
    group's end, index/btree.py). O(inodes) over memory, no encoding beyond
    the sample."""
    inodes = state.inodes
    step = max(1, len(inodes) // _RECORD_SAMPLE)
    names = name_bytes = sampled = sample_bytes = 0
    for n, inode in enumerate(inodes.values()):
        if inode.entries:
            names += len(inode.entries)
            name_bytes += sum(map(len, inode.entries))
        if n % step == 0:
            sampled += 1
            sample_bytes += len(inode_record(state, inode))
    owners = sum(len(o) for o in state.zone_owners.values())
    records = sample_bytes * len(inodes) // max(1, sampled)
    total = (records + _INODE_ENTRY_BYTES * len(inodes) + name_bytes
             + _NAME_ENTRY_BYTES * names + _OWNER_BYTES * owners)
    return total * 20 // 19


def index_conversion_refusal(state: State, journal: Journal) -> str | None:
    """Why this format 2-4 image cannot become format 5 now, or None if it can.

    It can when it has MIN_INDEX_META_ZONES meta zones, its index would take
    at most 1 / CONVERT_HEADROOM of format 5's file bound (`index_budget_bytes`:
    a meta area sized for format 4's compressed checkpoints holds fewer files
    as format 5 pages), the conversion's checkpoint fits beside the format 4
    checkpoint it replaces (which stays until the superblock moves), and the
    memory it takes (CONVERT_MEMORY_PER_PAGE_BYTE) is available: a mount that
    ran out of memory half way would leave the image at format 4 (a crash of
    the conversion loses nothing) but not mounted.
    """
    sb = journal.sb
    meta = sb.meta_zone_count
    if meta < MIN_INDEX_META_ZONES:
        return (f"this image has {meta} meta zones, format {INDEX_DISK_VERSION} needs at "
                f"least {MIN_INDEX_META_ZONES} (its log and index share them)")
    cap = journal.log.zone_capacity_bytes
    need = estimated_index_bytes(state)
    budget = index_budget_bytes(meta, cap)
    zones = (-(-need // cap) + -(-journal.last_checkpoint_disk_bytes // cap)
             + MIN_INDEX_META_ZONES - 3)
    if need * CONVERT_HEADROOM > budget or zones > meta:
        return (f"its {state.inode_count} files and directories would take "
                f"~{need / (1 << 20):.1f} MiB of index pages, and its {meta} meta zones hold "
                f"{budget / (1 << 20):.1f} MiB of them (a conversion leaves half of that free)")
    memory = int(need * CONVERT_MEMORY_PER_PAGE_BYTE)
    available = memory_available_bytes()
    if available is not None and memory > available:
        return (f"converting its {state.inode_count} files and directories takes ~"
                f"{memory >> 20} MiB of memory more, and {available >> 20} MiB are available")
    return None


async def convert_to_index(state: State, journal: Journal) -> Superblock:
    """Convert a format 2-4 image to format 5 (DESIGN.md 3.14, "Conversion").

    Every inode and name is marked changed and the next checkpoint, written
    now, builds the index from them; its superblock write makes the image
    format 5. A crash before that leaves the image at its format: a torn
    checkpoint is ignored (its index zones are garbage), a complete one is
    loaded by the next mount, which then writes the format-5 superblock.
    The caller checked `index_conversion_refusal`.
    """
    dirty = DirtySet()
    dirty.mark_all(state.inodes, ((d.ino, name) for d in state.inodes.values()
                                  for name in (d.entries or ())), state.zone_owners)
    inodes, names = len(dirty.inos), len(dirty.dirents)  # (the checkpoint takes them)
    journal.start_index(NamespaceIndex(journal.dev, journal.log, None), dirty)
    await journal.checkpoint()
    assert journal.index is not None
    log.info("converted on-disk format %d to %d: %d inodes, %d names in the index "
             "(%.1f MiB of pages)", DISK_VERSION, INDEX_DISK_VERSION, inodes, names,
             journal.index.live_bytes() / (1 << 20))
    return journal.sb


async def finish_recovery(rec: Recovered, journal: Journal, alloc: Allocator,
                          reclaim: SpaceReclaim, txn: Callable[[list[Op]], None],
                          checkpoint_journal_bytes: int) -> Superblock | None:
    """Convert an older format, free orphans, reset dead zones, and mark a torn
    checkpoint.

    `txn` applies and queues one transaction (ZoneFS._txn). Returns the
    superblock written (to convert a version 2 image, or to complete a
    checkpoint whose superblock write was lost), else None.
    """
    written: Superblock | None = None
    if journal.sb.disk_version < DISK_VERSION:
        # Before anything else is written: an older build must refuse the image
        # from the first record it could not read (docs/SPEC.md "Versions").
        written = journal.sb.upgraded()
        await journal.write_superblock(written)
        log.info("converted on-disk format %d to %d", rec.sb.disk_version, DISK_VERSION)
    scan = rec.scan
    stale = scan.obsolete_zones + scan.garbage_zones
    if stale:
        await trio.to_thread.run_sync(journal.log.reset_zones, stale)
    torn = rec.torn_checkpoint
    if torn is not None and rec.torn_checkpoint_holds_commits:
        # Commits were written inside it (recovery applied them): keep its zones,
        # and tell later replays that it ends here; the checkpoint below then
        # makes them obsolete.
        await journal.abort_torn_checkpoint(torn.seq)
    elif torn is not None:
        # Nothing but the checkpoint in its zones (it starts a fresh one): drop
        # them and continue the log from its first sequence number (so the chain
        # stays gapless), else later journal records would land inside it.
        mlog = journal.log
        first_seq = mlog.zone_first_seq[torn.zone]
        garbage = [z for z, s in mlog.zone_first_seq.items() if s >= first_seq]
        mlog.cur_zone = None
        await trio.to_thread.run_sync(mlog.reset_zones, garbage)
        mlog.next_seq = first_seq
    cp = rec.newest_checkpoint
    if cp is not None and cp.offset != rec.sb.checkpoint_offset:
        # A crash hit between a complete checkpoint and its superblock write:
        # finish that step, or the zones before it stay in use for good and
        # the log runs out of meta zones (LogFull).
        written = rec.sb.with_checkpoint(cp.zone, cp.offset, cp.seq)
        if rec.index is not None and not written.has_index:
            # That checkpoint converted the image to format 5 (convert_to_index).
            written = written.as_version(INDEX_DISK_VERSION)
        await journal.write_superblock(written)
        mlog = journal.log
        obsolete = mlog.zones_before(mlog.zone_first_seq[cp.zone])
        if obsolete:
            await trio.to_thread.run_sync(mlog.reset_zones, obsolete)
    if rec.index is not None:
        # Format 5: index zones the newest checkpoint leaves without a live page
        # (listed by it or by an older CHECKPOINT_INDEX met in the replay); the
        # superblock points at that checkpoint by now.
        store = rec.index.store
        chain = set(journal.log.zone_first_seq)  # never a log zone (defensive)
        unused = sorted(((rec.index_zones_seen - set(store.live)) | set(store.empty_zones()))
                        - chain)
        if unused:
            # A data zone lent to the index (format 6) and no longer used by it is
            # not reset here: the allocator, which no longer counts it lent, finds
            # it written with no live data and resets it as a dead data zone below.
            meta = set(journal.log.zones)
            await trio.to_thread.run_sync(journal.log.reset_zones,
                                          [z for z in unused if z in meta])
            for zone in unused:
                if zone in store.live:
                    store.forget_zone(zone)
            if rec.index.reader is not None:
                rec.index.reader.zones_reset(unused, store.zone_size)
    orphans = [i for i in rec.state.inodes.values() if i.nlink == 0 and i.ino != ROOT_INO]
    for inode in orphans:
        log.info("freeing orphan inode %d (unlinked while open before a crash)", inode.ino)
        txn([(OpType.INODE_FREE, inode.ino)])
    for zone in alloc.finish_at_mount:
        # Data capacity used up, not FULL on the device (a crash before its seal,
        # or an image of format 3 or older): finish it so it holds no active token.
        try:
            await trio.to_thread.run_sync(reclaim.dev.finish_zone, zone)
        except OSError as exc:
            log.error("finishing data zone %d failed: %s", zone, exc)
    alloc.finish_at_mount.clear()
    for zone in alloc.adopt_partial_zones():
        alloc.pending_resets.append((zone, 0))
    await journal.commit()
    if scan.torn_tail or torn is not None or journal.checkpoint_needed(
            checkpoint_journal_bytes):
        await journal.checkpoint()
    await reclaim.reset_dead_zones()
    return written
