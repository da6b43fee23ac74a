"""The namespace index's keys and values, and the CHECKPOINT_INDEX payload (format 5).

Pure encode/decode, no I/O (docs/SPEC.md "Namespace index"). The index is a
B+tree of byte keys (zonefs_py/index); format 5 keeps the namespace in it:

* inode record ``0x01 ‖ ino (u64 BE) ‖ part (u16 BE)``: the inode's ops as a
  checkpoint writes them (INODE, then SYMLINK, XATTR_SETs, DRAIN, INLINE,
  EXTENT / EXTENT_SEALED, PREALLOC; no DIRENT_ADD), framed as in a JOURNAL
  payload and cut into parts of at most `part_bytes` bytes, numbered from 0;
* directory entry ``0x02 ‖ parent ino (u64 BE) ‖ name``: the child's ino (u64 LE);
* zone owners ``0x03 ‖ data zone (u32 BE) ‖ part (u16 BE)``: the inodes that
  have (or had, since the zone's last reset) extents in the zone, u64 LE
  each, cut into parts like inode records (a roots with FLAG_SELF_CONTAINED).

Big-endian numbers in keys make the tree's byte order the numeric order, so
one inode's parts are adjacent and a directory's names are one key range.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

INODE_PREFIX = b"\x01"
DIRENT_PREFIX = b"\x02"
OWNERS_PREFIX = b"\x03"
#: Past every key of the three kinds.
END_PREFIX = b"\x04"
#: CHECKPOINT_INDEX flag: the tree holds everything a lazy mount needs (inode
#: records with their PARENT op, the zone owners) and the checkpoint's head
#: the derived counts (ZONE_LIVE, INODE_COUNT, RESIDENT). Without it (images
#: written before issue 32's second step) a mount loads the whole tree.
FLAG_SELF_CONTAINED = 1
_KNOWN_FLAGS = FLAG_SELF_CONTAINED
_OWNERS_KEY = struct.Struct(">cIH")
_INO = struct.Struct(">Q")
_INODE_KEY = struct.Struct(">cQH")
_CHILD = struct.Struct("<Q")
#: CHECKPOINT_INDEX payload header: u32 page size, u32 flags, u64 root
#: address, u32 current zone, u32 zone count; then per zone u32 zone, u32 live pages.
_HEAD = struct.Struct("<IIQII")
_ZONE = struct.Struct("<II")
#: Zone number meaning "no current zone".
NO_ZONE = 0xFFFFFFFF


class IndexRecordError(Exception):
    """A CHECKPOINT_INDEX payload or an index key/value does not decode."""


def key_group(key: bytes) -> int:
    """Length of the prefix a key shares with the keys it grows beside: one
    directory's names (prefix and parent), or all inodes, or all owner lists
    (the prefix). The tree packs a leaf when a group grows at its end
    (index/btree.py, "Balance"); not part of the format."""
    return 1 + _INO.size if key[:1] == DIRENT_PREFIX else 1


def inode_key(ino: int, part: int) -> bytes:
    return _INODE_KEY.pack(INODE_PREFIX, ino, part)


def inode_key_range(ino: int) -> tuple[bytes, bytes]:
    """[start, end) of the keys of one inode's record parts."""
    return INODE_PREFIX + _INO.pack(ino), INODE_PREFIX + _INO.pack(ino + 1)


def split_inode_key(key: bytes) -> tuple[int, int]:
    """Return (ino, part) of an inode record key."""
    if len(key) != _INODE_KEY.size or key[:1] != INODE_PREFIX:
        raise IndexRecordError(f"bad inode key {key.hex()}")
    _, ino, part = _INODE_KEY.unpack(key)
    return ino, part


def dirent_key(parent: int, name: bytes) -> bytes:
    return DIRENT_PREFIX + _INO.pack(parent) + name


def split_dirent_key(key: bytes) -> tuple[int, bytes]:
    """Return (parent ino, name) of a directory entry key."""
    if len(key) <= 9 or key[:1] != DIRENT_PREFIX:
        raise IndexRecordError(f"bad directory entry key {key.hex()}")
    return _INO.unpack_from(key, 1)[0], key[9:]


def owners_key(zone: int, part: int) -> bytes:
    return _OWNERS_KEY.pack(OWNERS_PREFIX, zone, part)


def owners_key_range(zone: int) -> tuple[bytes, bytes]:
    """[start, end) of the keys of one zone's owner list parts."""
    return (_OWNERS_KEY.pack(OWNERS_PREFIX, zone, 0)[:5],
            OWNERS_PREFIX + struct.pack(">I", zone + 1) if zone < 0xFFFFFFFF else END_PREFIX)


def split_owners_key(key: bytes) -> tuple[int, int]:
    """Return (zone, part) of a zone owners key."""
    if len(key) != _OWNERS_KEY.size or key[:1] != OWNERS_PREFIX:
        raise IndexRecordError(f"bad zone owners key {key.hex()}")
    _, zone, part = _OWNERS_KEY.unpack(key)
    return zone, part


def encode_owners(inos: list[int]) -> bytes:
    return struct.pack(f"<{len(inos)}Q", *inos)


def decode_owners(value: bytes) -> list[int]:
    if len(value) % 8:
        raise IndexRecordError(f"zone owners value of {len(value)} bytes")
    return list(struct.unpack(f"<{len(value) // 8}Q", value))


def child_value(ino: int) -> bytes:
    return _CHILD.pack(ino)


def decode_child(value: bytes) -> int:
    if len(value) != _CHILD.size:
        raise IndexRecordError(f"directory entry value of {len(value)} bytes")
    return int(_CHILD.unpack(value)[0])


def split_parts(record: bytes, part_bytes: int) -> list[bytes]:
    """Cut an inode record into parts of at most `part_bytes` (at least one part)."""
    return [record[i:i + part_bytes] for i in range(0, max(len(record), 1), part_bytes)]


@dataclass(frozen=True, slots=True)
class IndexRoot:
    """A CHECKPOINT_INDEX payload: the tree's root and the meta zones holding its pages.

    `zones` maps each index zone to its live page count (pages the tree at
    `root_address` references there); `current_zone` is the zone pages are
    appended to next (NO_ZONE: none yet).
    """

    page_size_bytes: int
    root_address: int
    current_zone: int
    zones: dict[int, int]
    flags: int = 0

    @property
    def self_contained(self) -> bool:
        return bool(self.flags & FLAG_SELF_CONTAINED)

    def encode(self) -> bytes:
        head = _HEAD.pack(self.page_size_bytes, self.flags, self.root_address,
                          self.current_zone, len(self.zones))
        return head + b"".join(_ZONE.pack(z, n) for z, n in sorted(self.zones.items()))

    @classmethod
    def decode(cls, payload: bytes) -> IndexRoot:
        if len(payload) < _HEAD.size:
            raise IndexRecordError(f"CHECKPOINT_INDEX payload of {len(payload)} bytes")
        page, flags, root, cur, count = _HEAD.unpack_from(payload)
        if flags & ~_KNOWN_FLAGS or len(payload) != _HEAD.size + count * _ZONE.size:
            raise IndexRecordError(f"CHECKPOINT_INDEX with flags {flags:#x}, {count} zones "
                                   f"in {len(payload)} bytes")
        zones: dict[int, int] = {}
        for i in range(count):
            z, n = _ZONE.unpack_from(payload, _HEAD.size + i * _ZONE.size)
            if z in zones:
                raise IndexRecordError(f"CHECKPOINT_INDEX lists zone {z} twice")
            zones[z] = n
        if cur != NO_ZONE and cur not in zones:
            raise IndexRecordError(f"CHECKPOINT_INDEX current zone {cur} is not listed")
        return cls(page, root, cur, zones, flags)
