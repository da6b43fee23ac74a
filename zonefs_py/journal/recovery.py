"""Mount-time recovery: newest superblock, its checkpoint, then the journal.

Blocking; call from a worker thread. Returns the rebuilt State plus what the
scan learned about the log (where to append next, zones to reset). Raises:

* errors.NotAFilesystem when no valid superblock exists,
* errors.CorruptionError (message names `zonefs-py fsck`) when the log is
  damaged anywhere but its tail, or the ops do not fit together.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from zonefs_py import errors
from zonefs_py.device.base import ZonedDevice
from zonefs_py.format.constants import DISK_VERSION, LENDING_DISK_VERSION, RecordType
from zonefs_py.format.nsindex import IndexRecordError, IndexRoot
from zonefs_py.format.ops import Op, OpDecodeError, decode_ops, record_body
from zonefs_py.format.superblock import Superblock
from zonefs_py.index.errors import IndexCorrupt
from zonefs_py.journal.journal import CHECKPOINT_ABORT, CHECKPOINT_END
from zonefs_py.journal.log import LogCorrupt, LogPosition, MetaLog, ScanResult
from zonefs_py.journal.nsindex import NamespaceIndex
from zonefs_py.journal.sbstore import SuperblockStore
from zonefs_py.model.dirty import DirtySet
from zonefs_py.model.state import State, StateError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Recovered:
    """Everything `recover` rebuilt from the device, for the engine to mount: superblock, State,
    the log and superblock writers, and what the scan found.
    """

    sb: Superblock
    state: State
    scan: ScanResult
    log: MetaLog
    sbstore: SuperblockStore
    records: int = 0
    ops: int = 0
    journal_bytes: int = 0
    #: Payload bytes (inflated) of the newest complete checkpoint loaded.
    checkpoint_bytes: int = 0
    #: What that checkpoint takes of the meta area: its records as stored, its
    #: first zone's header, and the zones' tails it left unused (the unit of
    #: `Journal.last_checkpoint_disk_bytes`).
    checkpoint_disk_bytes: int = 0
    seconds: float = 0.0
    #: BEGIN of the newest complete checkpoint met in the log (may be newer than
    #: the superblock's, when a crash hit between the checkpoint and the SB write).
    newest_checkpoint: LogPosition | None = None
    #: BEGIN of a checkpoint torn by a crash at the end of the log (its data is
    #: dropped; its zones are garbage unless commits were written inside it).
    torn_checkpoint: LogPosition | None = None
    #: True when commits were written inside that torn checkpoint (its zones
    #: hold durable journal records, and stay until the next checkpoint).
    torn_checkpoint_holds_commits: bool = False
    salvaged: str | None = None
    #: Format 5: the namespace index of the newest complete checkpoint loaded
    #: (the engine's checkpoints go on from it), else None.
    index: NamespaceIndex | None = None
    #: Format 5: every meta zone holding live pages of some complete checkpoint's
    #: tree met in the replay (kept out of `scan.garbage_zones`; those the newest
    #: does not use are reset once the superblock points at it).
    index_zones_seen: set[int] = field(default_factory=set)


def superblock_zones(dev: ZonedDevice) -> tuple[int, int]:
    """Return the two superblock zones: the first two sequential zones."""
    seq = [z.index for z in dev.report_zones() if z.is_sequential]
    if len(seq) < 2:
        raise errors.NotAFilesystem(f"{dev.info.path}: fewer than two sequential zones")
    return seq[0], seq[1]


def read_superblock(dev: ZonedDevice) -> tuple[Superblock, SuperblockStore]:
    a, b = superblock_zones(dev)
    store = SuperblockStore(dev, a, b)
    sb = store.read_latest()
    if sb is None and store.refusal is not None:
        raise errors.CorruptionError(f"{dev.info.path}: {store.refusal}")
    if sb is None:
        raise errors.NotAFilesystem(
            f"{dev.info.path}: no zonefs-py superblock found (run 'zonefs-py mkfs' first)")
    info = dev.info
    if (sb.block_size, sb.zone_size, sb.nr_zones) != (
            info.block_size, info.zone_size_bytes, info.nr_zones):
        raise errors.CorruptionError(
            f"{info.path}: superblock geometry (block {sb.block_size}, zone {sb.zone_size}, "
            f"{sb.nr_zones} zones) does not match the device; run 'zonefs-py fsck'")
    meta_end = sb.meta_first_zone + sb.meta_zone_count
    cp_start = sb.checkpoint_zone * sb.zone_size
    if not (sb.meta_first_zone >= 0 and sb.meta_zone_count > 0 and meta_end <= sb.nr_zones
            and sb.data_first_zone + sb.data_zone_count <= sb.nr_zones
            and sb.meta_first_zone <= sb.checkpoint_zone < meta_end
            and cp_start <= sb.checkpoint_offset < cp_start + sb.zone_size
            and sb.checkpoint_offset % sb.block_size == 0):
        # A valid checksum over impossible fields: refuse, never index with them.
        raise errors.CorruptionError(
            f"{info.path}: superblock layout (meta zones {sb.meta_first_zone}+"
            f"{sb.meta_zone_count}, checkpoint zone {sb.checkpoint_zone} at "
            f"{sb.checkpoint_offset}) is impossible; run 'zonefs-py fsck'")
    return sb, store


#: Records replayed between two calls of a progress callback.
PROGRESS_EVERY = 512


def recover(dev: ZonedDevice, *, salvage: bool = False,
            progress: Callable[[int, int], None] | None = None,
            inode_cache: int = 0) -> Recovered:
    """Rebuild the State (see `_recover`), with the cyclic GC paused meanwhile.

    `progress(done_bytes, total_bytes)` is called now and then during the
    replay (payload bytes replayed against the bytes written in the metadata
    zones, so it ends a little short of the total) and once at the end.

    Recovery creates millions of small objects and no garbage cycles; letting
    the collector scan them over and over made mount ~15% slower.

    `inode_cache` > 0: a format-5 image whose index is self-contained is
    mounted lazily (model/lazy.py) with a cache of that many inodes; 0 loads
    the whole namespace (fsck, and the mount option inode_cache=0).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _recover(dev, salvage=salvage, progress=progress, inode_cache=inode_cache)
    finally:
        if was_enabled:
            gc.enable()


def _recover(dev: ZonedDevice, *, salvage: bool = False,
             progress: Callable[[int, int], None] | None = None,
             inode_cache: int = 0) -> Recovered:
    """Rebuild the State from the newest checkpoint and the journal after it.

    `salvage` (fsck --repair only) stops at the first damaged record instead of
    refusing, keeping what came before it; `Recovered.salvaged` says so.
    """
    t0 = time.monotonic()
    sb, sbstore = read_superblock(dev)
    mlog = MetaLog(dev, sb.meta_first_zone, sb.meta_zone_count, sb.fs_uuid, sb.fs_id)
    state = State(sb.block_size, sb.zone_size)
    scan = ScanResult()
    res = Recovered(sb, state, scan, mlog, sbstore)
    start = LogPosition(sb.checkpoint_zone, sb.checkpoint_offset, sb.checkpoint_seq)
    loading: State | None = None
    #: Ops of the JOURNAL records met inside the checkpoint being loaded: commits
    #: written while it was written, applied after its END.
    inside: list[list[Op]] = []
    loaded_records = 0
    #: (payload bytes, meta-area bytes) of the checkpoint being loaded, and where
    #: its last record ended.
    cp_bytes = cp_disk = cp_end = 0
    #: Format 5: the CHECKPOINT_INDEX of the checkpoint being loaded.
    loading_root: IndexRoot | None = None
    first = True
    total_bytes = 0
    if progress is not None:
        meta = range(sb.meta_first_zone, sb.meta_first_zone + sb.meta_zone_count)
        total_bytes = sum(z.written_bytes for z in dev.report_zones() if z.index in meta)
    try:
        read_bytes = 0
        for rec, off in mlog.scan(start, scan):
            res.records += 1
            read_bytes += rec.size_bytes
            if progress is not None and res.records % PROGRESS_EVERY == 0:
                progress(read_bytes, total_bytes)
            if rec.flags and rec.type not in (RecordType.JOURNAL, RecordType.CHECKPOINT_DATA):
                raise LogCorrupt(f"{rec.type.name} record at {off} with flags {rec.flags:#x}")
            if first and rec.type != RecordType.CHECKPOINT_BEGIN:
                raise LogCorrupt(f"superblock points at a {rec.type.name} record, not a checkpoint")
            if rec.type == RecordType.CHECKPOINT_BEGIN:
                if loading is not None:
                    raise LogCorrupt(f"checkpoint at {off} begins inside another")
                loading = state if first else State(sb.block_size, sb.zone_size)
                loading_root = None
                inside = []
                loaded_records = 0
                begin = LogPosition(off // dev.info.zone_size_bytes, off, rec.seq)
                cp_bytes = 0
                cp_disk = sb.block_size + rec.size_bytes  # BEGIN starts a zone: + header
                cp_end = off + rec.size_bytes
            elif rec.type == RecordType.CHECKPOINT_DATA:
                if loading is None:
                    raise LogCorrupt(f"checkpoint data at {off} outside a checkpoint")
                body = record_body(rec.type, rec.flags, rec.payload)
                ops = decode_ops(body)
                loading.apply_all(ops)
                res.ops += len(ops)
                cp_bytes += len(body)
                cp_disk += _zone_change_bytes(mlog, cp_end, off) + rec.size_bytes
                cp_end = off + rec.size_bytes
                loaded_records += 1
            elif rec.type == RecordType.CHECKPOINT_INDEX:
                # In a format 4 log: the checkpoint of a conversion to format 5
                # whose superblock write was lost (fs/after_recovery.py).
                if loading is None or sb.disk_version < DISK_VERSION \
                        or loading_root is not None:
                    raise LogCorrupt(f"unexpected CHECKPOINT_INDEX record at {off}")
                try:
                    root = IndexRoot.decode(rec.payload)
                except IndexRecordError as exc:
                    raise LogCorrupt(f"checkpoint index at {off}: {exc}") from None
                _check_index_zones(sb, root, off)
                # Loaded at END only: a torn checkpoint's tree is never read (its
                # zones may be reset by then; DESIGN.md 3.14).
                loading_root = root
                cp_disk += _zone_change_bytes(mlog, cp_end, off) + rec.size_bytes
                cp_end = off + rec.size_bytes
            elif rec.type == RecordType.CHECKPOINT_END:
                if loading is None:
                    raise LogCorrupt(f"checkpoint end at {off} without a beginning")
                nrec, _nbytes = CHECKPOINT_END.unpack_from(rec.payload)
                if nrec != loaded_records:
                    raise LogCorrupt(f"checkpoint at {off} has {loaded_records} of {nrec} records")
                if (sb.has_index or res.index is not None) and loading_root is None:
                    raise LogCorrupt(f"format 5 checkpoint ending at {off} has no index")
                if loading_root is not None:
                    # Zones whose pages this tree references: kept (not garbage)
                    # until the superblock points past a checkpoint using them.
                    res.index_zones_seen.update(z for z, n in loading_root.zones.items() if n)
                    index = NamespaceIndex(dev, mlog, loading_root)
                    if inode_cache > 0 and loading_root.self_contained:
                        # Lazy (DESIGN.md 3.15): the head's counts, the root and
                        # the RESIDENT inodes; the rest on first use. (The tables
                        # ask the DirtySet: set first; installs note nothing.)
                        loading.dirty = DirtySet()
                        loading.go_lazy(index.open_reader(loading.next_ino), inode_cache)
                    else:
                        res.ops += index.load_into(loading)
                        # From here on, replayed ops are changes the index lacks.
                        loading.dirty = DirtySet()
                        if not loading_root.self_contained:
                            # A tree of an older format 5: the next checkpoint
                            # rewrites every entry, with what a lazy mount needs.
                            _mark_everything(loading)
                            index.self_contained = True
                    res.index = index  # only once loaded (a salvage may stop here)
                # The checkpoint is the State as of its BEGIN; the commits written
                # inside it came after. (When it is not the first, `state` got them
                # too, from the journal before BEGIN on: the two are the same.)
                for ops in inside:
                    loading.apply_all(ops)
                state = loading
                loading = None
                inside = []
                res.newest_checkpoint = begin
                res.checkpoint_bytes = cp_bytes
                res.checkpoint_disk_bytes = (cp_disk + _zone_change_bytes(mlog, cp_end, off)
                                             + rec.size_bytes)
            elif rec.type == RecordType.JOURNAL:
                body = record_body(rec.type, rec.flags, rec.payload)
                ops = decode_ops(body)
                if loading is None:
                    state.apply_all(ops)
                else:
                    inside.append(ops)
                    if loading is not state:
                        # Should this checkpoint turn out torn, the older state goes on.
                        state.apply_all(ops)
                res.ops += len(ops)
                res.journal_bytes += len(body)
                if loading is not None:
                    # (A commit inside the checkpoint: a zone change after it is
                    # counted to the checkpoint, erring high.)
                    cp_disk += _zone_change_bytes(mlog, cp_end, off)
                    cp_end = off + rec.size_bytes
            elif rec.type == RecordType.CHECKPOINT_ABORT:
                # Written by a mount after a crash tore this checkpoint: the journal
                # records inside it were applied to `state` already.
                if len(rec.payload) != CHECKPOINT_ABORT.size:
                    raise LogCorrupt(f"checkpoint abort at {off} has a "
                                     f"{len(rec.payload)}-byte payload")
                (aborted,) = CHECKPOINT_ABORT.unpack_from(rec.payload)
                if loading is None or loading is state or aborted != begin.seq:
                    raise LogCorrupt(f"checkpoint abort at {off} names seq {aborted}, not "
                                     "a torn checkpoint")
                loading = None
                inside = []
            else:
                raise LogCorrupt(f"unexpected {rec.type.name} record at {off}")
            first = False
        if first:
            raise LogCorrupt("the checkpoint the superblock points at is missing")
        if loading is state:
            raise LogCorrupt("the checkpoint the superblock points at is incomplete")
        if loading is not None:
            log.info("ignoring a checkpoint torn by a crash at the end of the log")
            res.torn_checkpoint = begin
            res.torn_checkpoint_holds_commits = bool(inside)
    except (LogCorrupt, OpDecodeError, StateError, IndexCorrupt) as exc:
        if not salvage or first or loading is state:
            raise _corruption(dev, exc) from None
        log.warning("salvage: stopping the log replay at damage: %s", exc)
        res.salvaged = str(exc)
        if loading is not None and loading is not state:
            loading = None
    res.state = state
    if res.index_zones_seen:
        # Index zones hold pages, not log records: not garbage (after_recovery
        # resets those the newest checkpoint's index leaves empty).
        scan.garbage_zones = [z for z in scan.garbage_zones if z not in res.index_zones_seen]
    res.seconds = time.monotonic() - t0
    if progress is not None:
        progress(total_bytes, total_bytes)
    return res


def _check_index_zones(sb: Superblock, root: IndexRoot, off: int) -> None:
    """The zones a CHECKPOINT_INDEX lists are meta zones, or from version 6 on
    (`LENDING_DISK_VERSION`) data zones lent to the index too; anything else (a
    data zone in an older image, a superblock zone, a zone past the device) is
    corruption, never loaded as index pages."""
    meta = range(sb.meta_first_zone, sb.meta_first_zone + sb.meta_zone_count)
    data = range(sb.data_first_zone, sb.data_first_zone + sb.data_zone_count)
    for zone in root.zones:
        if zone in meta:
            continue
        if zone in data:
            if sb.disk_version >= LENDING_DISK_VERSION:
                continue
            raise LogCorrupt(f"checkpoint index at {off} lists data zone {zone}, which "
                             f"an image of version {sb.disk_version} never lends to the "
                             f"index (version {LENDING_DISK_VERSION} does)")
        raise LogCorrupt(f"checkpoint index at {off} lists zone {zone}, neither a meta "
                         f"nor a data zone")


def _mark_everything(state: State) -> None:
    """Every inode, name and zone owner list changed (DirtySet.mark_all)."""
    assert state.dirty is not None
    state.dirty.mark_all(state.inodes, ((d.ino, name) for d in state.inodes.values()
                                        for name in (d.entries or ())), state.zone_owners)


def _zone_change_bytes(mlog: MetaLog, prev_end: int, off: int) -> int:
    """Meta-area bytes between a record ending at `prev_end` and the next, at
    `off`: none in the same zone, else the tail of the zone left (unused up to
    its capacity) and the new zone's header."""
    zone_size = mlog.dev.info.zone_size_bytes
    prev_zone = (prev_end - 1) // zone_size
    if off // zone_size == prev_zone:
        return 0
    tail = prev_zone * zone_size + mlog.capacity_bytes(prev_zone) - prev_end
    return max(0, tail) + mlog.block_size


def _corruption(dev: ZonedDevice, exc: Exception) -> errors.CorruptionError:
    if isinstance(exc, IndexCorrupt):
        return errors.CorruptionError(
            f"{dev.info.path}: namespace index damaged: {exc.reason}; run 'zonefs-py fsck'")
    if isinstance(exc, LogCorrupt):
        return errors.CorruptionError(
            f"{dev.info.path}: metadata log damaged: {exc}; run 'zonefs-py fsck'")
    return errors.CorruptionError(
        f"{dev.info.path}: metadata does not fit together: {exc}; run 'zonefs-py fsck'")
