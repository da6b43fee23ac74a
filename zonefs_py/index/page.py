"""Encode and decode one index page: pure functions on bytes, no I/O.

Layout (little-endian; docs/SPEC.md "Namespace index (version 5)", "Page" has
the same table)::

    offset  width  field
    0       4      magic b"ZXPG"
    4       1      kind: 1 = leaf, 2 = internal
    5       1      level: 0 for a leaf, >= 1 for an internal page (leaves' parents are 1)
    6       2      count: entries of a leaf, children of an internal page
    8       8      xxh3-64 (seed 0) of the whole page with these 8 bytes zeroed
    16      ...    body, then zeros up to the page size

    leaf entry:      key_len u16, value_len u16, key, value   (keys strictly increasing)
    internal body:   child_0 u64, then count-1 times: key_len u16, key, child_i u64
                     (separator key_i: child_{i-1} holds keys < key_i <= child_i's keys)

Limits, for a page of P bytes (body B = P - 16):

* a key is at most `max_key_bytes` = (B - 8) // 4 - 10 bytes, so an internal
  page holds at least 4 separators of the largest size (it can always split
  into two pages of >= 2 children);
* a key plus its value is at most `max_entry_bytes` = B // 2 - 4 bytes, so a
  leaf always holds at least 2 entries (it can always split in two).

P = 512: keys <= 112 bytes, key + value <= 244. P = 4096: 1008 and 2036.

`decode` checks length, magic, kind, level, count, every length against the
page's end, key order, zero padding and the checksum, and raises
`IndexCorrupt(address, reason)`; it never returns a value from a bad page.
Caveat: the checksum does not cover the page's address, so a page read from
the wrong address that is itself intact is not detected here (the B+tree's
key-range and level checks catch some of those cases, not all).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import xxhash

from zonefs_py.index.errors import IndexCorrupt

MAGIC = b"ZXPG"
KIND_LEAF = 1
KIND_INTERNAL = 2
HEADER_BYTES = 16
DEFAULT_PAGE_SIZE_BYTES = 4096
MIN_PAGE_SIZE_BYTES = 128
MAX_PAGE_SIZE_BYTES = 65536
#: Deepest tree a page may claim to be part of (a level byte; real trees stay below 10).
MAX_LEVEL = 64

_HEADER = struct.Struct("<4sBBHQ")
_U16 = struct.Struct("<H")
_U16x2 = struct.Struct("<HH")
_U64 = struct.Struct("<Q")
_CSUM_AT = 8
_ZERO_CSUM = bytes(8)


@dataclass
class LeafPage:
    """A leaf: sorted keys and their values (level 0)."""

    keys: list[bytes] = field(default_factory=list)
    values: list[bytes] = field(default_factory=list)

    @property
    def level(self) -> int:
        return 0


@dataclass
class InternalPage:
    """An internal page: `len(children) - 1` sorted separators, children as page addresses.

    In memory (inside the B+tree) a child may be a negative number, the id of a
    dirty page not written yet; `encode` refuses those.
    """

    level: int
    keys: list[bytes] = field(default_factory=list)
    children: list[int] = field(default_factory=list)


Page = LeafPage | InternalPage


@dataclass(frozen=True)
class PageLimits:
    """Size limits that follow from a page size (see the module docstring)."""

    page_size_bytes: int
    body_bytes: int
    max_key_bytes: int
    max_entry_bytes: int

    @classmethod
    def for_page_size(cls, page_size_bytes: int) -> PageLimits:
        """Return the limits of `page_size_bytes` pages; raise ValueError on a bad size."""
        if not MIN_PAGE_SIZE_BYTES <= page_size_bytes <= MAX_PAGE_SIZE_BYTES:
            raise ValueError(f"page size {page_size_bytes} not in "
                             f"[{MIN_PAGE_SIZE_BYTES}, {MAX_PAGE_SIZE_BYTES}]")
        body = page_size_bytes - HEADER_BYTES
        return cls(page_size_bytes=page_size_bytes, body_bytes=body,
                   max_key_bytes=(body - 8) // 4 - 10, max_entry_bytes=body // 2 - 4)


def leaf_entry_bytes(key: bytes, value: bytes) -> int:
    """Bytes one leaf entry takes in the body."""
    return 4 + len(key) + len(value)


def separator_bytes(key: bytes) -> int:
    """Bytes one separator (with the child after it) takes in an internal body."""
    return 10 + len(key)


def body_bytes(page: Page) -> int:
    """Bytes the page's body takes when encoded (header excluded)."""
    if isinstance(page, LeafPage):
        return 4 * len(page.keys) + sum(map(len, page.keys)) + sum(map(len, page.values))
    return 8 + 10 * len(page.keys) + sum(map(len, page.keys))


def page_checksum(data: bytes | bytearray | memoryview) -> int:
    """Return the xxh3-64 of a page with its checksum field taken as zero."""
    h = xxhash.xxh3_64()
    h.update(data[:_CSUM_AT])
    h.update(_ZERO_CSUM)
    h.update(data[_CSUM_AT + 8:])
    return h.intdigest()


def encode(page: Page, page_size_bytes: int = DEFAULT_PAGE_SIZE_BYTES) -> bytes:
    """Return the page as exactly `page_size_bytes` bytes.

    Raises ValueError if it does not fit, a key is out of order or too long, or
    an internal page has fewer than 2 children or an unwritten (negative) child.
    """
    limits = PageLimits.for_page_size(page_size_bytes)
    if body_bytes(page) > limits.body_bytes:
        raise ValueError(f"page body of {body_bytes(page)} bytes > {limits.body_bytes}")
    _check_keys(page.keys, limits.max_key_bytes)
    buf = bytearray(page_size_bytes)
    pos = HEADER_BYTES
    if isinstance(page, LeafPage):
        if len(page.keys) != len(page.values):
            raise ValueError("leaf with different numbers of keys and values")
        kind, level, count = KIND_LEAF, 0, len(page.keys)
        for key, value in zip(page.keys, page.values, strict=True):
            if len(key) + len(value) > limits.max_entry_bytes:
                raise ValueError(f"entry of {len(key) + len(value)} bytes > "
                                 f"{limits.max_entry_bytes}")
            _U16x2.pack_into(buf, pos, len(key), len(value))
            pos += 4
            buf[pos:pos + len(key)] = key
            pos += len(key)
            buf[pos:pos + len(value)] = value
            pos += len(value)
    else:
        if len(page.children) != len(page.keys) + 1 or len(page.children) < 2:
            raise ValueError(f"internal page with {len(page.children)} children and "
                             f"{len(page.keys)} separators")
        if not 1 <= page.level <= MAX_LEVEL:
            raise ValueError(f"internal page at level {page.level}")
        if min(page.children) < 0:
            raise ValueError("internal page refers to a page not written yet")
        kind, level, count = KIND_INTERNAL, page.level, len(page.children)
        _U64.pack_into(buf, pos, page.children[0])
        pos += 8
        for key, child in zip(page.keys, page.children[1:], strict=True):
            _U16.pack_into(buf, pos, len(key))
            pos += 2
            buf[pos:pos + len(key)] = key
            pos += len(key)
            _U64.pack_into(buf, pos, child)
            pos += 8
    _HEADER.pack_into(buf, 0, MAGIC, kind, level, count, 0)
    _U64.pack_into(buf, _CSUM_AT, page_checksum(buf))
    return bytes(buf)


def _check_keys(keys: list[bytes], max_key_bytes: int) -> None:
    for i, key in enumerate(keys):
        if len(key) > max_key_bytes:
            raise ValueError(f"key of {len(key)} bytes > {max_key_bytes}")
        if i and keys[i - 1] >= key:
            raise ValueError("keys not strictly increasing")


def decode(data: bytes | bytearray | memoryview, address: int,
           page_size_bytes: int = DEFAULT_PAGE_SIZE_BYTES) -> Page:
    """Return the page stored in `data` (read from `address`); raise IndexCorrupt if damaged."""
    limits = PageLimits.for_page_size(page_size_bytes)
    data = bytes(data)
    if len(data) != page_size_bytes:
        raise IndexCorrupt(address, f"page of {len(data)} bytes, expected {page_size_bytes}")
    magic, kind, level, count, csum = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise IndexCorrupt(address, f"bad magic {magic!r}")
    if csum != page_checksum(data):
        raise IndexCorrupt(address, "checksum mismatch")
    if kind == KIND_LEAF:
        if level != 0:
            raise IndexCorrupt(address, f"leaf at level {level}")
        page: Page = _decode_leaf(data, address, count, limits)
    elif kind == KIND_INTERNAL:
        if not 1 <= level <= MAX_LEVEL:
            raise IndexCorrupt(address, f"internal page at level {level}")
        page = _decode_internal(data, address, level, count, limits)
    else:
        raise IndexCorrupt(address, f"unknown page kind {kind}")
    for i in range(1, len(page.keys)):
        if page.keys[i - 1] >= page.keys[i]:
            raise IndexCorrupt(address, f"keys {i - 1} and {i} out of order")
    return page


def _decode_leaf(data: bytes, address: int, count: int, limits: PageLimits) -> LeafPage:
    if count > limits.body_bytes // 4:
        raise IndexCorrupt(address, f"leaf count {count} cannot fit")
    end = limits.page_size_bytes
    keys: list[bytes] = []
    values: list[bytes] = []
    pos = HEADER_BYTES
    for i in range(count):
        if pos + 4 > end:
            raise IndexCorrupt(address, f"entry {i} header past the page end")
        klen, vlen = _U16x2.unpack_from(data, pos)
        pos += 4
        if klen > limits.max_key_bytes or klen + vlen > limits.max_entry_bytes:
            raise IndexCorrupt(address, f"entry {i}: key {klen} / value {vlen} bytes over limit")
        if pos + klen + vlen > end:
            raise IndexCorrupt(address, f"entry {i} past the page end")
        keys.append(data[pos:pos + klen])
        pos += klen
        values.append(data[pos:pos + vlen])
        pos += vlen
    _check_padding(data, address, pos)
    return LeafPage(keys, values)


def _decode_internal(data: bytes, address: int, level: int, count: int,
                     limits: PageLimits) -> InternalPage:
    if not 2 <= count <= (limits.body_bytes - 8) // 10 + 1:
        raise IndexCorrupt(address, f"internal page with {count} children")
    end = limits.page_size_bytes
    pos = HEADER_BYTES
    children = [_U64.unpack_from(data, pos)[0]]
    pos += 8
    keys: list[bytes] = []
    for i in range(1, count):
        if pos + 2 > end:
            raise IndexCorrupt(address, f"separator {i} past the page end")
        (klen,) = _U16.unpack_from(data, pos)
        pos += 2
        if klen > limits.max_key_bytes:
            raise IndexCorrupt(address, f"separator {i} of {klen} bytes over limit")
        if pos + klen + 8 > end:
            raise IndexCorrupt(address, f"separator {i} past the page end")
        keys.append(data[pos:pos + klen])
        pos += klen
        children.append(_U64.unpack_from(data, pos)[0])
        pos += 8
    _check_padding(data, address, pos)
    return InternalPage(level, keys, children)


def _check_padding(data: bytes, address: int, pos: int) -> None:
    if data.count(0, pos) != len(data) - pos:
        raise IndexCorrupt(address, f"non-zero bytes after the body (from {pos})")
