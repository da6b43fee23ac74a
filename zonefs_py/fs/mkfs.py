"""Format a zoned device: superblock zones, metadata log, data zones.

Blocking; used by `zonefs-py mkfs` and by tests. Layout (docs/DESIGN.md
"Layout"): conventional zones are left unused; of the sequential zones, the
first two hold the superblock, the next `meta_zones` the metadata log, the
rest data. `reserve_percent` of the data capacity is over-provisioning that
statfs never shows as free (it gives the cleaner room to work).
"""

from __future__ import annotations

import math
import stat
import time
import uuid
from collections.abc import Callable

from zonefs_py import errors
from zonefs_py.device.base import ZoneCond, ZonedDevice, capabilities
from zonefs_py.format.constants import (
    DISK_VERSION,
    INDEX_DISK_VERSION,
    MIN_INDEX_META_ZONES,
    MKFS_DISK_VERSION,
    OpType,
)
from zonefs_py.format.ops import encode_op
from zonefs_py.format.superblock import LABEL_MAX, Superblock
from zonefs_py.fs.api import ROOT_INO
from zonefs_py.journal.journal import begin_record, checkpoint_records, index_checkpoint_tail
from zonefs_py.journal.log import MetaLog
from zonefs_py.journal.nsindex import NamespaceIndex
from zonefs_py.journal.sbstore import SuperblockStore
from zonefs_py.model.dirty import inode_record
from zonefs_py.model.snapshot import head_ops
from zonefs_py.model.state import State

MIN_DATA_ZONES = 4
DEFAULT_RESERVE_PERCENT = 5.0


def default_meta_zones(nr_seq_zones: int) -> int:
    """Meta zones for a device: 3% of its sequential zones, at least 4, at most 256."""
    return min(256, max(4, math.ceil(nr_seq_zones * 0.03)))


def choose_disk_version(dev: ZonedDevice, meta_zones: int | None = None) -> int:
    """mkfs's default format for `dev`: MKFS_DISK_VERSION (5) when the device
    has room for its meta zones (at least MIN_INDEX_META_ZONES, besides the
    superblock's 2 and MIN_DATA_ZONES) and `meta_zones` (if given) is no fewer,
    else DISK_VERSION (4, whose minimum is 3 meta zones)."""
    seq = sum(1 for z in dev.report_zones() if z.is_sequential)
    m = meta_zones if meta_zones is not None else max(default_meta_zones(seq),
                                                      MIN_INDEX_META_ZONES)
    if m >= MIN_INDEX_META_ZONES and seq >= 2 + m + MIN_DATA_ZONES:
        return MKFS_DISK_VERSION
    return DISK_VERSION


def make_filesystem(dev: ZonedDevice, label: bytes = b"", *, meta_zones: int | None = None,
                    reserve_percent: float = DEFAULT_RESERVE_PERCENT, force: bool = False,
                    progress: Callable[[int, int], None] | None = None,
                    root_uid: int = 0, root_gid: int = 0,
                    disk_version: int | None = None) -> Superblock:
    """Write a new empty filesystem; return its superblock.

    `disk_version` is INDEX_DISK_VERSION (5): the namespace in an on-device
    index, checkpoints that cost what changed (issue 32); or DISK_VERSION (4):
    the namespace in memory, whole in every checkpoint. None: 5 where the
    device has room for its MIN_INDEX_META_ZONES meta zones (and `meta_zones`
    asks for no fewer), else 4.

    The root directory (mode 755) belongs to `root_uid`:`root_gid` (the CLI
    passes the invoking user's, as mke2fs does).

    Raises errors.Exists if the device holds data and `force` is False, and
    errors.InvalidArgument if the device is too small or unsuitable.
    """
    if disk_version is None:
        disk_version = choose_disk_version(dev, meta_zones)
    if disk_version not in (DISK_VERSION, INDEX_DISK_VERSION):
        raise errors.InvalidArgument(
            f"mkfs writes on-disk format {DISK_VERSION} or {INDEX_DISK_VERSION}, "
            f"not {disk_version}")
    if len(label) > LABEL_MAX:
        raise errors.InvalidArgument(f"label longer than {LABEL_MAX} bytes")
    if not 0 <= reserve_percent < 50:
        raise errors.InvalidArgument("reserve must be between 0 and 50 percent")
    info = dev.info
    zones = dev.report_zones()
    seq = [z for z in zones if z.is_sequential]
    if seq and [z.index for z in seq] != list(range(seq[0].index, seq[0].index + len(seq))):
        raise errors.InvalidArgument(
            "sequential zones are not contiguous (conventional zones must come first)")
    m = meta_zones if meta_zones is not None else default_meta_zones(len(seq))
    if disk_version == INDEX_DISK_VERSION and meta_zones is None:
        m = max(m, MIN_INDEX_META_ZONES)
    if m < 3:
        raise errors.InvalidArgument("at least 3 meta zones are needed")
    if disk_version == INDEX_DISK_VERSION and m < MIN_INDEX_META_ZONES:
        raise errors.InvalidArgument(
            f"format {INDEX_DISK_VERSION} needs at least {MIN_INDEX_META_ZONES} meta zones "
            "(the log and the namespace index share them)")
    if len(seq) < 2 + m + MIN_DATA_ZONES:
        raise errors.InvalidArgument(
            f"device has {len(seq)} sequential zones; zonefs-py needs at least "
            f"{2 + m + MIN_DATA_ZONES} (2 superblock, {m} metadata, {MIN_DATA_ZONES} data)")
    written = [z for z in seq if z.cond not in (ZoneCond.EMPTY, ZoneCond.OFFLINE)]
    if written and not force:
        holds = "a zonefs-py filesystem" if _has_superblock(dev) else "data"
        raise errors.Exists(
            f"{info.path} holds {holds} ({len(written)} written zones); use --force to overwrite")
    for z in seq[:2 + m]:
        if z.cond in (ZoneCond.OFFLINE, ZoneCond.READONLY):
            raise errors.InvalidArgument(
                f"zone {z.index} is {z.cond.name}: it cannot hold the superblock or metadata")
    for i, z in enumerate(written):
        dev.reset_zone(z.index)
        if progress:
            progress(i + 1, len(written))
    base = seq[0].index
    data_zones = seq[2 + m:]
    declare = capabilities(dev).declare_data_zones
    if declare is not None:  # the emulator's data-discarding mode (device/base.py)
        declare(base + 2 + m)
    capacity = sum(z.capacity_bytes for z in data_zones)
    reserve = int(capacity * reserve_percent / 100) // info.block_size * info.block_size
    sb = Superblock(
        fs_uuid=uuid.uuid4().bytes, block_size=info.block_size, zone_size=info.zone_size_bytes,
        nr_zones=info.nr_zones, sb_zone_a=base, sb_zone_b=base + 1, meta_first_zone=base + 2,
        meta_zone_count=m, data_first_zone=base + 2 + m, data_zone_count=len(data_zones),
        reserve_bytes=reserve, label=label, checkpoint_zone=0, checkpoint_offset=0,
        checkpoint_seq=0, created_ns=time.time_ns(), disk_version=disk_version)
    state = State(info.block_size, info.zone_size_bytes)
    now = time.time_ns()
    state.apply((OpType.INODE, ROOT_INO, stat.S_IFDIR | 0o755, root_uid, root_gid, 2, 0, 0,
                 now, now, now, 0))
    mlog = MetaLog(dev, sb.meta_first_zone, m, sb.fs_uuid, sb.fs_id)
    if sb.has_index:
        # BEGIN first (the log keeps the first meta zone, as in format 4), then the
        # root's record in a new tree (pages flushed by the commit), then the
        # records that name its root.
        positions = mlog.append([begin_record(0)], new_zone=True)
        index = NamespaceIndex(dev, mlog, None)
        index.apply({ROOT_INO: inode_record(state, state.inodes[ROOT_INO])}, {})
        head = [encode_op(op) for op in head_ops(state, index=True)]
        mlog.append(index_checkpoint_tail(head, index.commit())[0])
    else:
        positions = mlog.append(checkpoint_records(state, 0), new_zone=True)
    dev.flush()
    first = positions[0]
    sb = sb.with_checkpoint(first.zone, first.offset, first.seq)
    SuperblockStore(dev, sb.sb_zone_a, sb.sb_zone_b).write(sb)
    dev.flush()
    return sb


def _has_superblock(dev: ZonedDevice) -> bool:
    from zonefs_py.journal.recovery import superblock_zones

    try:
        a, b = superblock_zones(dev)
    except errors.NotAFilesystem:
        return False
    store = SuperblockStore(dev, a, b)
    # A superblock of another format version is a filesystem too (--force to replace it).
    return store.read_latest() is not None or store.refusal is not None
