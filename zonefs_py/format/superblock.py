"""Superblock payload: encode and decode, no I/O (layout in docs/SPEC.md)."""

from __future__ import annotations

import struct
import uuid
from dataclasses import dataclass, replace

from zonefs_py.format.constants import (
    DISK_VERSION,
    INDEX_DISK_VERSION,
    NEWEST_DISK_VERSION,
    OLDEST_DISK_VERSION,
)

_SB = struct.Struct("<I16sIQIIIIIIQ64sIQQQQ")
LABEL_MAX = 64


class SuperblockError(Exception):
    """The superblock payload does not decode or names an unsupported version."""


@dataclass(frozen=True, slots=True)
class Superblock:
    """Where everything is, and where recovery starts.

    Zone indices are device zone numbers. `checkpoint_offset` is the absolute
    byte offset of the CHECKPOINT_BEGIN record of the newest complete
    checkpoint, `checkpoint_seq` its record sequence number.
    """

    fs_uuid: bytes
    block_size: int
    zone_size: int
    nr_zones: int
    sb_zone_a: int
    sb_zone_b: int
    meta_first_zone: int
    meta_zone_count: int
    data_first_zone: int
    data_zone_count: int
    reserve_bytes: int
    label: bytes
    checkpoint_zone: int
    checkpoint_offset: int
    checkpoint_seq: int
    created_ns: int
    disk_version: int = DISK_VERSION

    @property
    def fs_id(self) -> int:
        """32-bit id stamped in every record of this filesystem."""
        return int.from_bytes(self.fs_uuid[:4], "little")

    @property
    def uuid_str(self) -> str:
        return str(uuid.UUID(bytes=self.fs_uuid))

    def with_checkpoint(self, zone: int, offset: int, seq: int) -> Superblock:
        return replace(self, checkpoint_zone=zone, checkpoint_offset=offset, checkpoint_seq=seq)

    def upgraded(self) -> Superblock:
        """This superblock as the current format version (a version 2 log is a
        valid version 3 log: the conversion is this rewrite)."""
        return replace(self, disk_version=DISK_VERSION)

    def as_version(self, version: int) -> Superblock:
        """This superblock with another on-disk format version (a conversion)."""
        return replace(self, disk_version=version)

    @property
    def has_index(self) -> bool:
        """Whether the namespace lives in the on-device index (version 5)."""
        return self.disk_version >= INDEX_DISK_VERSION

    def encode(self) -> bytes:
        label = self.label[:LABEL_MAX]
        return _SB.pack(
            self.disk_version, self.fs_uuid, self.block_size, self.zone_size, self.nr_zones,
            self.sb_zone_a, self.sb_zone_b, self.meta_first_zone, self.meta_zone_count,
            self.data_first_zone, self.reserve_bytes, label.ljust(LABEL_MAX, b"\0"),
            self.data_zone_count, self.checkpoint_offset, self.checkpoint_seq,
            self.created_ns, self.checkpoint_zone,
        )

    @classmethod
    def decode(cls, payload: bytes) -> Superblock:
        if len(payload) < _SB.size:
            raise SuperblockError(f"superblock payload of {len(payload)} bytes is too short")
        (version, fs_uuid, bs, zsize, nzones, sba, sbb, mfirst, mcount, dfirst, reserve,
         label, dcount, cpoff, cpseq, created, cpzone) = _SB.unpack_from(payload)
        if not OLDEST_DISK_VERSION <= version <= NEWEST_DISK_VERSION:
            raise SuperblockError(_version_refusal(version))
        return cls(fs_uuid, bs, zsize, nzones, sba, sbb, mfirst, mcount, dfirst, dcount,
                   reserve, label.rstrip(b"\0"), cpzone, cpoff, cpseq, created, version)


def _version_refusal(version: int) -> str:
    """The one-line refusal of a superblock of another on-disk format version."""
    if version == 1:
        # docs/SPEC.md "Versions": 2 added INLINE ops; no in-place conversion.
        return ("on-disk format version 1 predates inline small-file data (this build "
                f"reads versions {OLDEST_DISK_VERSION}-{NEWEST_DISK_VERSION}, no conversion): "
                "mount it with a build "
                "of format 1, copy the files out, and mkfs again")
    return (f"on-disk format version {version} is not supported (this build reads "
            f"versions {OLDEST_DISK_VERSION}-{NEWEST_DISK_VERSION})")
