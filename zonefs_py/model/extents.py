"""Per-file extent maps: file blocks -> device byte offsets, with per-block checksums.

Pure data structure, no I/O. An `Extent` maps `nblocks` file blocks starting at
`fblock` to `nblocks` device blocks starting at byte offset `dev`; `csums`
holds one little-endian u32 checksum per block. Extents of one map never
overlap (INV-5); a newer extent replaces whatever it overlaps, splitting older
extents. Adjacent extents that are contiguous both in the file and on the
device, inside one zone, are merged to keep memory small for large sequential
files (a 1 GiB checkpoint in its own zone is one extent).

`csums` is None for an extent in a *sealed* zone: its checksums are then in
the zone's summary blocks on the device (format/zonesum.py), not in memory.

Extents are changed in place (split, trimmed, merged) without an await in
between, so an extent and its checksums always change together (INV-5).
Code that awaits while using a mapping holds `Piece` copies from `lookup`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from operator import attrgetter
from typing import NamedTuple


class Extent:
    """A run of `nblocks` file blocks from `fblock`, stored contiguously from device
    byte `dev`, with their checksums (None once the zone is sealed: its summary
    holds them).
    """

    __slots__ = ("csums", "dev", "fblock", "nblocks")

    def __init__(self, fblock: int, nblocks: int, dev: int, csums: bytes | None) -> None:
        self.fblock = fblock
        self.nblocks = nblocks
        self.dev = dev
        self.csums = csums

    @property
    def fend(self) -> int:
        return self.fblock + self.nblocks

    def __repr__(self) -> str:
        return f"Extent(fblock={self.fblock}, nblocks={self.nblocks}, dev={self.dev})"


#: The bisect key of an ExtentMap's `exts`.
_FBLOCK = attrgetter("fblock")

#: A piece of the device that stopped being referenced: (dev_offset, nblocks).
Freed = tuple[int, int]


class Piece(NamedTuple):
    """A copy of part of a file's mapping, as `ExtentMap.lookup` saw it.

    `dev` is the device byte offset of file block `fblock`, or None for a
    hole; `csums` holds exactly `nblocks` checksums (empty for a hole), or is
    None when they are in the summary of the (sealed) zone. It stays true to
    the moment of the lookup whatever happens to the map later.
    """

    fblock: int
    nblocks: int
    dev: int | None
    csums: bytes | None


def _part(csums: bytes | None, lo: int, hi: int | None = None) -> bytes | None:
    """csums[lo*4:hi*4] (None stays None: the checksums are in a zone summary)."""
    if csums is None:
        return None
    return csums[lo * 4:] if hi is None else csums[lo * 4:hi * 4]


class ExtentMap:
    """Sorted, non-overlapping extents of one file."""

    __slots__ = ("exts", "mapped_blocks")

    def __init__(self) -> None:
        #: Sorted by fblock; searched with bisect on `fblock` (no second list of the
        #: starts: ~80 bytes a file, issue 15).
        self.exts: list[Extent] = []
        self.mapped_blocks = 0

    def __iter__(self) -> Iterator[Extent]:
        return iter(self.exts)

    def __len__(self) -> int:
        return len(self.exts)

    def _cut(self, lo: int, hi: int, block_size: int, freed: list[Freed]) -> int:
        """Remove file blocks [lo, hi) from the map; return the insert position."""
        i = bisect.bisect_right(self.exts, lo, key=_FBLOCK) - 1
        if i < 0:
            i = 0
        elif self.exts[i].fend <= lo:
            i += 1
        while i < len(self.exts) and self.exts[i].fblock < hi:
            e = self.exts[i]
            cut_lo = max(lo, e.fblock)
            cut_hi = min(hi, e.fend)
            freed.append((e.dev + (cut_lo - e.fblock) * block_size, cut_hi - cut_lo))
            self.mapped_blocks -= cut_hi - cut_lo
            left_n = cut_lo - e.fblock
            right_n = e.fend - cut_hi
            if left_n and right_n:
                right = Extent(cut_hi, right_n, e.dev + (cut_hi - e.fblock) * block_size,
                               _part(e.csums, cut_hi - e.fblock))
                e.nblocks = left_n
                e.csums = _part(e.csums, 0, left_n)
                self.exts.insert(i + 1, right)
                return i + 1
            if left_n:
                e.nblocks = left_n
                e.csums = _part(e.csums, 0, left_n)
                i += 1
            elif right_n:
                skip = cut_hi - e.fblock
                e.dev += skip * block_size
                e.csums = _part(e.csums, skip)
                e.fblock = cut_hi
                e.nblocks = right_n
                return i
            else:
                del self.exts[i]
        return i

    def insert(self, fblock: int, nblocks: int, dev: int, csums: bytes | None, block_size: int,
               zone_size: int) -> list[Freed]:
        """Map [fblock, fblock+nblocks) to dev; return the device pieces it replaced."""
        if not self.exts:
            # A list of exactly one (list.insert would reserve room for four: 16 bytes
            # more for each of the many files that never get a second extent).
            self.exts = [Extent(fblock, nblocks, dev, csums)]
            self.mapped_blocks = nblocks
            return []
        freed: list[Freed] = []
        i = self._cut(fblock, fblock + nblocks, block_size, freed)
        self.mapped_blocks += nblocks
        if i > 0:
            prev = self.exts[i - 1]
            if (prev.fend == fblock and prev.dev + prev.nblocks * block_size == dev
                    and prev.dev // zone_size == dev // zone_size
                    and (prev.csums is None) == (csums is None)):
                prev.nblocks += nblocks
                if prev.csums is not None:
                    assert csums is not None
                    prev.csums = prev.csums + csums
                return freed
        self.exts.insert(i, Extent(fblock, nblocks, dev, csums))
        return freed

    def truncate(self, first_dropped: int, block_size: int) -> list[Freed]:
        """Drop every mapping at or past file block `first_dropped`."""
        freed: list[Freed] = []
        if self.exts and self.exts[-1].fend > first_dropped:
            self._cut(first_dropped, self.exts[-1].fend, block_size, freed)
        return freed

    def punch(self, lo: int, hi: int, block_size: int) -> list[Freed]:
        """Drop every mapping of file blocks [lo, hi) (a hole punched, issue 28)."""
        freed: list[Freed] = []
        if self.exts and hi > lo:
            self._cut(lo, hi, block_size, freed)
        return freed

    def clear(self, block_size: int) -> list[Freed]:
        if not self.exts:
            return []
        freed = [(e.dev, e.nblocks) for e in self.exts]
        self.exts.clear()
        self.mapped_blocks = 0
        return freed

    def drop_csums(self, lo: int, hi: int) -> None:
        """Forget the checksums of the extents at device bytes [lo, hi) (a sealed
        zone: its summary blocks hold them now)."""
        for e in self.exts:
            if lo <= e.dev < hi:
                e.csums = None

    def is_shared_empty(self) -> bool:
        return self is EMPTY_EXTENTS

    def lookup(self, fblock: int, nblocks: int, block_size: int) -> list[Piece]:
        """Cover [fblock, fblock+nblocks) with `Piece`s, holes included, in file order.

        The pieces are copies: `insert`, `truncate` and the cleaner change
        `Extent` objects in place, so a caller that awaits between looking up
        and using a mapping must hold pieces, never extents (issue 18: a read
        that held an extent across an await saw it trimmed by a chunk that
        landed meanwhile, and sliced checksums that did not match its length).
        """
        out: list[Piece] = []
        end = fblock + nblocks
        pos = fblock
        i = bisect.bisect_right(self.exts, fblock, key=_FBLOCK) - 1
        if i < 0 or self.exts[i].fend <= fblock:
            i += 1
        while pos < end:
            if i >= len(self.exts) or self.exts[i].fblock >= end:
                out.append(Piece(pos, end - pos, None, b""))
                break
            e = self.exts[i]
            if e.fblock > pos:
                out.append(Piece(pos, e.fblock - pos, None, b""))
                pos = e.fblock
            hi = min(end, e.fend)
            rel = pos - e.fblock
            out.append(Piece(pos, hi - pos, e.dev + rel * block_size,
                             _part(e.csums, rel, hi - e.fblock)))
            pos = hi
            i += 1
        return out


#: The extent map of every regular file that has no data yet (most files of a
#: big namespace are small or empty): shared and never mutated, replaced by a
#: map of its own at the file's first EXTENT (saves ~200 bytes per empty file).
EMPTY_EXTENTS = ExtentMap()
