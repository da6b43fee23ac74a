"""Device blocks referenced by more than one extent (instant copies, issue 28): pure data.

`State.zone_live_blocks` counts *references*: a device block mapped by two
files counts twice, so a zone's count reaches 0 (and the zone may be reset,
INV-8) only when no file references any of its blocks. What the blocks cost
on the device is the *distinct* blocks: references less the extra ones this
map records. For every device block range mapped by k > 1 extents it holds
k - 1 (`extra`), as sorted disjoint intervals per zone, and the totals per
zone and overall (`extra_by_zone`, `extra_total`).

Changes: a SHARE op (an instant copy, or the cleaner moving a shared range
once for all its files) adds one extra reference to a range; every
reference released (`State._release`: an overwrite, truncate, punch, unlink,
a cleaner move) takes one away where the range had extras. Both are
deterministic on replay, so the map after recovery is the map before the
crash. A checkpoint lists the map as SHARE ops (`snapshot_ops`).

Cost: nothing for a filesystem without copies (no entries); a released
piece costs a dict lookup of its zone, and a bisect when the zone has
shared ranges.
"""

from __future__ import annotations

import bisect


class SharedBlocks:
    """Extra references of device block ranges, per zone (see the module docstring)."""

    __slots__ = ("block_size", "extra_by_zone", "extra_total", "ranges", "zone_size")

    def __init__(self, block_size: int, zone_size: int) -> None:
        self.block_size = block_size
        self.zone_size = zone_size
        #: zone -> sorted disjoint [lo_block, hi_block, extra] (device block numbers).
        self.ranges: dict[int, list[list[int]]] = {}
        self.extra_by_zone: dict[int, int] = {}
        self.extra_total = 0

    def _split_at(self, rs: list[list[int]], b: int) -> None:
        """Make `b` an interval boundary of `rs` (splits the interval containing it)."""
        i = bisect.bisect_right(rs, [b, 1 << 64]) - 1
        if i >= 0 and rs[i][0] < b < rs[i][1]:
            lo, hi, extra = rs[i]
            rs[i] = [lo, b, extra]
            rs.insert(i + 1, [b, hi, extra])

    def add(self, dev: int, nblocks: int, count: int = 1) -> None:
        """Record `count` more references of device bytes [dev, dev + nblocks blocks)."""
        if nblocks <= 0 or count <= 0:
            return
        zone = dev // self.zone_size
        lo = dev // self.block_size
        hi = lo + nblocks
        rs = self.ranges.setdefault(zone, [])
        self._split_at(rs, lo)
        self._split_at(rs, hi)
        i = bisect.bisect_left(rs, [lo, -1, -1])
        pos = lo
        while pos < hi:
            if i < len(rs) and rs[i][0] == pos:
                rs[i][2] += count
                pos = rs[i][1]
                i += 1
            else:
                end = rs[i][0] if i < len(rs) and rs[i][0] < hi else hi
                rs.insert(i, [pos, end, count])
                pos = end
                i += 1
        self._merge(rs)
        self.extra_by_zone[zone] = self.extra_by_zone.get(zone, 0) + nblocks * count
        self.extra_total += nblocks * count

    def release(self, dev: int, nblocks: int) -> None:
        """One reference of each block of [dev, dev + nblocks blocks) went away."""
        zone = dev // self.zone_size
        rs = self.ranges.get(zone)
        if not rs:
            return
        lo = dev // self.block_size
        hi = lo + nblocks
        self._split_at(rs, lo)
        self._split_at(rs, hi)
        i = bisect.bisect_left(rs, [lo, -1, -1])
        dropped = 0
        while i < len(rs) and rs[i][0] < hi:
            rs[i][2] -= 1
            dropped += rs[i][1] - rs[i][0]
            if rs[i][2] == 0:
                del rs[i]
            else:
                i += 1
        self._merge(rs)
        if not rs:
            del self.ranges[zone]
        if dropped:
            left = self.extra_by_zone.get(zone, 0) - dropped
            if left:
                self.extra_by_zone[zone] = left
            else:
                self.extra_by_zone.pop(zone, None)
            self.extra_total -= dropped

    @staticmethod
    def _merge(rs: list[list[int]]) -> None:
        i = 1
        while i < len(rs):
            if rs[i - 1][1] == rs[i][0] and rs[i - 1][2] == rs[i][2]:
                rs[i - 1][1] = rs[i][1]
                del rs[i]
            else:
                i += 1

    def items(self) -> list[tuple[int, int, int]]:
        """Every shared range as (device offset, blocks, extra references), in order."""
        bs = self.block_size
        return [(lo * bs, hi - lo, extra) for zone in sorted(self.ranges)
                for lo, hi, extra in self.ranges[zone]]
