"""On-disk constants. docs/SPEC.md documents each one.

A test checks that SPEC.md states this DISK_VERSION (tests/unit/test_spec_engine.py);
the other values are checked by review against SPEC.md, not by a test.

Retired values stay reserved forever: never reuse a record or op type number.
"""

from __future__ import annotations

import enum

#: Version of the on-disk format (independent of the package version).
#: 2: INLINE ops (small files' bytes in the metadata, issue 15). Version 1
#: images are refused at mount and by fsck (no conversion; docs/SPEC.md).
#: 3: JOURNAL records inside a checkpoint and CHECKPOINT_ABORT (commits do not
#: wait for checkpoints, issue 15), and JOURNAL / CHECKPOINT_DATA payloads that
#: may be zlib-compressed (record flag ZLIB). A version 2 image is read as it is and
#: converted by its first read-write mount, which rewrites the superblock
#: before it writes anything else.
#: 4: zone summaries (issue 19): a sealed data zone carries the checksums of its
#: blocks in summary blocks after its data (format/zonesum.py), recorded by a
#: ZONE_SEAL op; checkpoints then describe its extents with EXTENT_SEALED ops,
#: which carry no checksums. Versions 2 and 3 are read as they are (they have no
#: sealed zone) and converted like 2 was.
DISK_VERSION = 4
#: The oldest version this build reads (and converts at a read-write mount).
OLDEST_DISK_VERSION = 2
#: 5 (issue 32): the namespace (inodes with their extents, xattrs and inline
#: bytes; directory entries) lives in a copy-on-write B+tree of pages in meta
#: zones (zonefs_py/index, format/nsindex.py); a checkpoint writes the entries
#: changed since the previous one and records the tree's root in a
#: CHECKPOINT_INDEX record. What mkfs writes where the device has room for
#: its meta zones; a read-write mount converts a version 2-4 image to it when
#: its meta area has room (fs/after_recovery.py), else the image stays 4.
INDEX_DISK_VERSION = 5
#: What mkfs writes by default (MIN_INDEX_META_ZONES permitting, else DISK_VERSION).
MKFS_DISK_VERSION = INDEX_DISK_VERSION
#: 6 (issue 42): the namespace index may keep its pages in data zones lent to it
#: when the meta zones run short (a CHECKPOINT_INDEX may list zones of the data
#: range; such a zone is no data zone while it is listed with live pages, and goes
#: back to the data zones by a reset). No other byte changes: a version 5 image is
#: a valid version 6 image, and the journal rewrites the superblock as 6 before it
#: first lends a data zone to the index (`Journal._lend_index_zones`), so that a
#: build reading only 5 never sees index pages in what it takes for data zones.
LENDING_DISK_VERSION = 6
#: The newest version this build reads.
NEWEST_DISK_VERSION = LENDING_DISK_VERSION
#: Format 5's fewest meta zones: the log (its zone, a fresh one per checkpoint,
#: one kept for a mount after a crash) and the index (its zone, one it may move
#: to, cleaning room) share them.
MIN_INDEX_META_ZONES = 6

#: Largest inline body an INLINE op may carry (format limit; the engine inlines
#: files of at most min(this, block_size // 2) bytes, fs/inline.py).
INLINE_MAX_BYTES = 2048

#: b"ZFRC" read as a little-endian u32: starts every metadata record.
RECORD_MAGIC = 0x4352465A
RECORD_HEADER_SIZE = 32

#: Zones 0 and 1 of the sequential zones hold the rolling superblock.
SUPERBLOCK_ZONES = 2

#: The root directory's inode number (SPEC.md: "Root is inode 1").
ROOT_INO = 1
#: Name of the xattr that sets a directory tree's byte quota; stored as any
#: xattr (an XATTR_SET op), read back at mount (fs/quota.py).
QUOTA_XATTR = b"user.zonefs.quota"

#: Blocks of file data per checksum (the device block size is the checksum unit).
CHECKSUM_BYTES = 4


class RecordType(enum.IntEnum):
    """Type of a metadata log record (SPEC.md, "Records"). Retired values stay reserved."""

    SUPERBLOCK = 1
    ZONE_HEADER = 2
    JOURNAL = 3
    CHECKPOINT_BEGIN = 4
    CHECKPOINT_DATA = 5
    CHECKPOINT_END = 6
    #: A mount after a crash marks the checkpoint the crash tore (DISK_VERSION 3).
    CHECKPOINT_ABORT = 7
    #: The namespace index's root and zones, inside a checkpoint (DISK_VERSION 5).
    CHECKPOINT_INDEX = 8


class OpType(enum.IntEnum):
    """Metadata operations carried by JOURNAL and CHECKPOINT_DATA records."""

    INODE = 1
    INODE_FREE = 2
    DIRENT_ADD = 3
    DIRENT_DEL = 4
    EXTENT = 5
    TRUNCATE = 6
    SYMLINK = 7
    XATTR_SET = 8
    XATTR_DEL = 9
    ZONE_STATE = 10
    COUNTERS = 11
    NEXT_INO = 12
    TENANT_BYTES = 13
    # 14, 16-19 left to other features of the same release; see docs/SPEC.md.
    INLINE = 15
    DRAIN = 20
    #: An EXTENT of a sealed zone: its checksums are in the zone's summary (version 4).
    EXTENT_SEALED = 21
    #: A data zone's summary blocks are written (version 4).
    ZONE_SEAL = 22
    #: File blocks reserved by fallocate (issue 28; no DISK_VERSION change, like DRAIN).
    PREALLOC = 23
    #: File blocks made holes by fallocate PUNCH_HOLE / ZERO_RANGE (issue 28).
    PUNCH = 24
    #: Device blocks gain references: an instant copy shares them (issue 28).
    SHARE = 25
    #: Format 5 inode records: the inode's primary parent directory (issue 32).
    PARENT = 26
    #: Format 5 checkpoints: a data zone's live block count (issue 32: mount reads
    #: it instead of summing every file's extents).
    ZONE_LIVE = 27
    #: Format 5 checkpoints: the number of inodes (`df -i`, the file bound).
    INODE_COUNT = 28
    #: Format 5 checkpoints: inodes a mount loads at once (open-unlinked files,
    #: reservations, drain states, quota and capability xattrs; DESIGN.md 3.15).
    RESIDENT = 29
    #: Inode generations (issue 42): inodes numbered from an ino on are of this
    #: generation (export handles of a reused number go stale; no DISK_VERSION change).
    INO_GENERATION = 30
    #: Declared tenants (issue 45; no DISK_VERSION change, as PREALLOC): a tenant's
    #: table entry (directory, zone reservation and cap), written when declared or
    #: changed and in every checkpoint.
    TENANT = 31
    #: A tenant is removed: its zones are nobody's (issue 45).
    TENANT_DEL = 32
    #: A data zone is owned by a tenant (issue 45): after the ZONE_STATE that
    #: opened it, and in every checkpoint; a ZONE_STATE (reset or reopen) ends it.
    ZONE_TENANT = 33


class Stream(enum.IntEnum):
    """Lifetime streams: data of different streams never shares a zone."""

    DEFAULT = 0
    METADATA = 1
    CHECKPOINT = 2
    DATASET = 3
    LOG = 4
    SCRATCH = 5
    CLEANER = 6


#: Role of a zone in the layout.
class ZoneRole(enum.IntEnum):
    """Role of a zone in the layout (SPEC.md, "Layout")."""

    UNUSED = 0  # conventional zones and zones past the layout
    SUPERBLOCK = 1
    META = 2
    DATA = 3


#: Inode flag: the stream in the low byte of the flags has been decided.
FLAG_STREAM_SET = 0x100

# Counter ids (persisted in COUNTERS ops; docs/SPEC.md "Counters").
C_USER_BYTES = 1
C_DATA_BYTES = 2
C_META_BYTES = 3
C_CLEANER_BYTES = 4
C_PAD_BYTES = 5
C_STREAM_BASE = 100  # + stream id: device data bytes per stream
#: Per declared tenant (issue 45), + tenant id: device data bytes users wrote,
#: device bytes the cleaner copied, resets of its zones. Dropped with the tenant.
C_TENANT_USER_BASE = 0x1000
C_TENANT_CLEANER_BASE = 0x2000
C_TENANT_RESETS_BASE = 0x3000
#: Tenant ids are 1..TENANT_MAX_ID (0: no tenant; the counters above leave room).
TENANT_MAX_ID = 0xFFF
