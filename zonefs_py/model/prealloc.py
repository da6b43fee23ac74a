"""Reserved file blocks (fallocate, issue 28): pure data, no I/O.

A file's *reservations* are sorted, disjoint ranges of file blocks
[lo, hi) that fallocate (mode 0, KEEP_SIZE, ZERO_RANGE) set aside: a later
write into them must not fail for lack of space. A reserved block that no
extent maps is *held*: it counts as used space (statfs, the write admission
check) and towards the file's stored bytes (st_blocks, quotas), although no
device block backs it yet. When a write maps it, its charge moves from held
to live (no net change); a PUNCH, a TRUNCATE past it or the file's
INODE_FREE drops it (INV-24).

The ranges stay as fallocate set them when their blocks are written (like
ext4's unwritten extents, converted in place): what counts is
`held(ino)`, the reserved blocks not mapped, kept incrementally per file and
in total (`held_total`) by the State's apply of EXTENT, TRUNCATE, PUNCH,
PREALLOC and INODE_FREE. fsck recomputes both from the ranges and the
extents (`check_inv24_reservations`).

Cost: nothing for a file that was never fallocated (no entry); a file with
reservations pays a lookup of its mapping for every EXTENT op applied to it.
"""

from __future__ import annotations

import bisect

from zonefs_py.model.extents import ExtentMap

#: One reserved range of file blocks, [lo, hi).
Range = tuple[int, int]


def mapped_in(extents: ExtentMap, lo: int, hi: int, block_size: int) -> int:
    """Number of file blocks in [lo, hi) that `extents` maps."""
    if hi <= lo or not len(extents):
        return 0
    return sum(p.nblocks for p in extents.lookup(lo, hi - lo, block_size) if p.dev is not None)


def overlap(ranges: list[Range], lo: int, hi: int) -> list[Range]:
    """The parts of `ranges` inside [lo, hi), in order."""
    out: list[Range] = []
    i = max(0, bisect.bisect_right(ranges, (lo, lo)) - 1)
    while i < len(ranges) and ranges[i][0] < hi:
        a, b = ranges[i]
        a, b = max(a, lo), min(b, hi)
        if a < b:
            out.append((a, b))
        i += 1
    return out


def subtract(lo: int, hi: int, ranges: list[Range]) -> list[Range]:
    """[lo, hi) less `ranges`, as ranges in order."""
    out: list[Range] = []
    pos = lo
    for a, b in overlap(ranges, lo, hi):
        if a > pos:
            out.append((pos, a))
        pos = b
    if pos < hi:
        out.append((pos, hi))
    return out


class Reservations:
    """Every file's reserved ranges and held block counts (see the module docstring)."""

    __slots__ = ("block_size", "held", "held_total", "ranges")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        #: ino -> sorted disjoint reserved ranges (only files that have some).
        self.ranges: dict[int, list[Range]] = {}
        #: ino -> reserved blocks no extent maps (only files that have some ranges).
        self.held: dict[int, int] = {}
        #: Sum of `held`: space promised to reservations, not yet live.
        self.held_total = 0

    def held_in(self, ino: int, extents: ExtentMap, lo: int, hi: int) -> int:
        """Reserved blocks of `ino` in [lo, hi) that `extents` does not map."""
        ranges = self.ranges.get(ino)
        if not ranges:
            return 0
        return sum(b - a - mapped_in(extents, a, b, self.block_size)
                   for a, b in overlap(ranges, lo, hi))

    def new_held(self, ino: int, extents: ExtentMap, lo: int, hi: int) -> int:
        """Blocks that reserving [lo, hi) for `ino` would add to `held_total`."""
        return sum(b - a - mapped_in(extents, a, b, self.block_size)
                   for a, b in subtract(lo, hi, self.ranges.get(ino, [])))

    def reserve(self, ino: int, extents: ExtentMap, lo: int, hi: int) -> int:
        """Add [lo, hi) to `ino`'s ranges (merged); return the change of its held blocks."""
        if hi <= lo:
            return 0
        added = self.new_held(ino, extents, lo, hi)
        ranges = self.ranges.get(ino, [])
        keep = [r for r in ranges if r[1] < lo or r[0] > hi]
        touched = [r for r in ranges if not (r[1] < lo or r[0] > hi)]
        merged = (min([lo, *(a for a, _ in touched)]), max([hi, *(b for _, b in touched)]))
        keep.append(merged)
        keep.sort()
        self.ranges[ino] = keep
        self._add_held(ino, added)
        return added

    def release(self, ino: int, extents: ExtentMap, lo: int, hi: int) -> int:
        """Drop [lo, hi) from `ino`'s ranges (call before the mapping changes); return
        the change of its held blocks (<= 0)."""
        ranges = self.ranges.get(ino)
        if not ranges or hi <= lo:
            return 0
        dropped = self.held_in(ino, extents, lo, hi)
        left: list[Range] = []
        for a, b in ranges:
            if b <= lo or a >= hi:
                left.append((a, b))
                continue
            if a < lo:
                left.append((a, lo))
            if b > hi:
                left.append((hi, b))
        if left:
            self.ranges[ino] = left
        else:
            del self.ranges[ino]
        self._add_held(ino, -dropped)
        return -dropped

    def mapping(self, ino: int, extents: ExtentMap, lo: int, hi: int) -> int:
        """Blocks [lo, hi) of `ino` are about to be mapped (an EXTENT op; call before
        it is applied): return the change of its held blocks (<= 0)."""
        if ino not in self.ranges:
            return 0
        consumed = self.held_in(ino, extents, lo, hi)
        self._add_held(ino, -consumed)
        return -consumed

    def forget(self, ino: int) -> int:
        """The file is freed: drop everything; return the change of held blocks."""
        self.ranges.pop(ino, None)
        n = self.held.pop(ino, 0)
        self.held_total -= n
        return -n

    def _add_held(self, ino: int, delta: int) -> None:
        if not delta and ino in self.held:
            return
        n = self.held.get(ino, 0) + delta
        if ino in self.ranges:
            self.held[ino] = n
        else:
            self.held.pop(ino, None)
        self.held_total += delta
