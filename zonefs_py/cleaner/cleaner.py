"""The cleaner: relocate live data out of partly dead zones, then reset them.

A victim zone's live extents are read (every block's checksum verified on the
way), appended to the cleaner stream's head, and re-pointed with EXTENT ops;
the victim's last live block goes with the last of those ops, so the normal
deferred-reset rule (INV-8) resets it once that transaction is durable.

Cleaning pass for victim V (docs/DESIGN.md "Cleaning then reset"):
  before: file F has extent X in V (and V has dead space);
  1. read X from V and verify it; append it to cleaner zone C (not durable);
  2. without awaiting: if F still maps those blocks to X, apply EXTENT(F -> C)
     and queue it (a newer write of the same blocks wins, nothing is undone);
  3. commit: flush (C's data durable, INV-7), append the JOURNAL record, flush:
     **durability point**; V now holds no live block;
  4. reset V (INV-8). A crash before 3 leaves F pointing at V, intact; a
     crash between 3 and 4 leaves V dead and unreset, reset at mount.

Policies: "cost-benefit" (Sprite LFS: benefit/cost = (1 - u) * age / (1 + u),
u = live fraction, age = time since the zone was last written) and "greedy"
(most dead bytes first). Background cleaning is rate-limited by a token bucket
(`cleaner_rate_mb_s`) and starts when empty zones fall below a low watermark;
foreground cleaning runs, unthrottled and with the same policy, when a writer
finds no empty zone left for users (`NeedCleaning`). The empty zones held back for the cleaner
(`Allocator.reserve_zones`) mean cleaning always has somewhere to write
(INV-14); a victim is only taken if its live data fits in the cleaner's room.

All of this runs on the trio thread except device I/O and checksums (worker
threads). Nothing between reading the current mapping and applying the new
EXTENT op awaits.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from zonefs_py import errors
from zonefs_py.alloc.allocator import DataZone
from zonefs_py.format.checksum import first_bad_block
from zonefs_py.format.constants import OpType, Stream
from zonefs_py.format.ops import Op

if TYPE_CHECKING:
    from zonefs_py.fs.filesystem import ZoneFS

log = logging.getLogger(__name__)

#: Largest piece copied with one read and one append.
COPY_UNIT = 256 << 10
C_CLEANER_BYTES = 4


@dataclass(slots=True)
class CleanerStats:
    zones_cleaned: int = 0
    bytes_copied: int = 0
    passes: int = 0
    foreground_passes: int = 0
    checksum_failures: int = 0


class Cleaner:
    """Background and foreground space reclaim for one mounted ZoneFS."""

    def __init__(self, fs: ZoneFS) -> None:
        self.fs = fs
        self.alloc = fs.alloc
        self.state = fs.state
        self.bs = fs.bs
        self.policy = fs.options.cleaner_policy
        self.rate = fs.options.cleaner_rate_mb_s * 1e6
        self.stats = CleanerStats()
        self._lock = trio.Lock()
        self._bucket_time = time.monotonic()
        #: Zones that could not be cleaned (unreadable data); not retried this mount.
        self.skip: set[int] = set()
        n = len(self.alloc.zones)
        self.low_watermark = self.alloc.reserve_zones + max(2, n // 10)

    # -- choosing ---------------------------------------------------------------------
    def dead_bytes(self, dz: DataZone) -> int:
        return dz.reserved - self.alloc.live_bytes(dz.idx)

    def candidates(self) -> list[DataZone]:
        """Zones worth cleaning: written, not being written, some data dead, some live."""
        pending = {z for z, _ in self.alloc.pending_resets}
        out = []
        for dz in self.alloc.zones.values():
            if ((dz.unusable and not dz.write_failed) or dz.head_of is not None
                    or dz.inflight or dz.reserved == 0 or dz.idx in pending
                    or dz.idx in self.skip):
                continue
            if self.dead_bytes(dz) > 0 and self.alloc.live_bytes(dz.idx) > 0:
                out.append(dz)
        return out

    def score(self, dz: DataZone, now_ns: int, policy: str) -> float:
        live = self.alloc.live_bytes(dz.idx)
        if policy == "greedy":
            return float(dz.reserved - live)
        u = live / dz.capacity
        age = max(1.0, (now_ns - dz.last_write_ns) / 1e9)
        return (1.0 - u) * age / (1.0 + u)

    def pick_victim(self, policy: str | None = None) -> DataZone | None:
        """Best candidate whose live data fits where the cleaner can write."""
        policy = policy or self.policy
        room = self._cleaner_room()
        now = time.time_ns()
        best: tuple[float, DataZone] | None = None
        for dz in self.candidates():
            if self.alloc.live_bytes(dz.idx) > room:
                continue
            s = self.score(dz, now, policy)
            if best is None or s > best[0]:
                best = (s, dz)
        return best[1] if best else None

    def _cleaner_room(self) -> int:
        head = self.alloc.heads.get((Stream.CLEANER, 0))
        room = self.alloc.zones[head].remaining if head is not None else 0
        return room + sum(dz.capacity for dz in self.alloc.empty_zones())

    # -- copying ------------------------------------------------------------------------
    async def _throttle(self, nbytes: int) -> None:
        if self.rate <= 0:
            return
        now = time.monotonic()
        self._bucket_time = max(self._bucket_time, now - 0.1) + nbytes / self.rate
        if self._bucket_time > now:
            await trio.sleep(self._bucket_time - now)

    async def clean_zone(self, victim: int, *, throttle: bool) -> int:
        """Relocate the live data of `victim`; return bytes copied.

        The victim becomes dead (and is reset after the next commit) unless
        a block of it could not be read correctly, in which case it is left
        alone and skipped from now on.
        """
        bs = self.bs
        zsize = self.state.zone_size
        pieces: list[tuple[int, int, int, int, bytes]] = []
        for ino in list(self.state.zone_owners.get(victim, ())):
            inode = self.state.inodes.get(ino)
            if inode is None or inode.extents is None:
                continue
            for e in inode.extents:
                if e.dev // zsize == victim:
                    for off in range(0, e.nblocks, COPY_UNIT // bs):
                        n = min(COPY_UNIT // bs, e.nblocks - off)
                        pieces.append((e.dev + off * bs, ino, e.fblock + off, n,
                                       e.csums[off * 4:(off + n) * 4]))
        pieces.sort()
        # The victim's data may die while we copy it (an overwrite, a delete); pinned,
        # the zone is not reset under our reads (INV-8), which would otherwise fail
        # their checksums and mark a healthy zone as damaged.
        self.alloc.pin_read(victim)
        try:
            return await self._copy_pieces(victim, pieces, throttle)
        finally:
            self.alloc.unpin_read(victim)

    async def _copy_pieces(self, victim: int, pieces: list[tuple[int, int, int, int, bytes]],
                           throttle: bool) -> int:
        """Relocate `pieces` (dev offset, ino, file block, blocks, checksums) of `victim`."""
        bs = self.bs
        copied = 0
        for dev_off, ino, fblock, nblocks, csums in pieces:
            nbytes = nblocks * bs
            if throttle:
                await self._throttle(nbytes)
            data = await trio.to_thread.run_sync(self._read_verified, dev_off, nbytes, csums,
                                                 limiter=self.fs.cleaner_limiter)
            if data is None:
                self.skip.add(victim)
                self.stats.checksum_failures += 1
                log.error("cleaner: zone %d holds data of inode %d that fails its checksum at "
                          "device offset %d; the zone is left as it is", victim, ino, dev_off)
                return copied
            copied += await self._relocate(ino, fblock, nblocks, dev_off, data, csums)
        self.stats.zones_cleaned += 1
        self.stats.bytes_copied += copied
        self.state.counters[C_CLEANER_BYTES] = self.state.counters.get(C_CLEANER_BYTES, 0) \
            + copied
        return copied

    def _read_verified(self, dev_off: int, nbytes: int, csums: bytes) -> bytes | None:
        try:
            data = self.fs.dev.read(dev_off, nbytes)
        except OSError:
            return None
        return None if first_bad_block(data, self.bs, csums) is not None else data

    async def _relocate(self, ino: int, fblock: int, nblocks: int, old_dev: int, data: bytes,
                        csums: bytes) -> int:
        bs = self.bs
        pos = 0
        copied = 0
        while pos < len(data):
            zone_ops: list[Op] = []
            to_finish: list[int] = []
            zone, granted = self.alloc.reserve(Stream.CLEANER, 0, len(data) - pos, zone_ops,
                                               to_finish)
            if zone_ops:
                self.fs.journal.add(zone_ops)
            try:
                for z in to_finish:
                    await trio.to_thread.run_sync(self.fs.dev.finish_zone, z,
                                                  limiter=self.fs.cleaner_limiter)
                new_dev = await trio.to_thread.run_sync(
                    self.fs.dev.append, zone, memoryview(data)[pos:pos + granted],
                    limiter=self.fs.cleaner_limiter)
            except OSError as exc:
                self.alloc.append_done(zone, ok=False)
                raise errors.IOFailure(f"cleaner write to zone {zone} failed: {exc}") from exc
            # No await from here: re-point only blocks still mapped to the old copy.
            first = fblock + pos // bs
            count = granted // bs
            ops = self._repoint(ino, first, count, old_dev + pos, new_dev,
                                csums[pos // bs * 4:(pos // bs + count) * 4])
            for op in ops:
                self.state.apply(op)
            self.alloc.append_done(zone, ok=True)
            if ops:
                self.fs.journal.add(ops)
            self.fs.journal.data_dirty = True
            copied += granted
            pos += granted
        return copied

    def _repoint(self, ino: int, first: int, count: int, old_dev: int, new_dev: int,
                 csums: bytes) -> list[Op]:
        inode = self.state.inodes.get(ino)
        if inode is None or inode.extents is None:
            return []
        bs = self.bs
        ops: list[Op] = []
        for start, n, dev, _csums in inode.extents.lookup(first, count, bs):
            if dev is None:
                continue
            rel = start - first
            if dev != old_dev + rel * bs:
                continue  # rewritten since we read it: the newer data stays
            ops.append((OpType.EXTENT, ino, start, n, new_dev + rel * bs,
                        csums[rel * 4:(rel + n) * 4]))
        return ops

    # -- passes --------------------------------------------------------------------------
    async def clean_for_space(self) -> bool:
        """Foreground: clean (unthrottled) until users have an empty zone again.

        Returns False when nothing could be freed (then the caller's ENOSPC is real).
        """
        async with self._lock:
            self.stats.foreground_passes += 1
            freed = False
            while len(self.alloc.empty_zones()) <= self.alloc.reserve_zones:
                await self.fs.commit_and_reset()
                if len(self.alloc.empty_zones()) > self.alloc.reserve_zones:
                    return True
                victim = self.pick_victim()
                if victim is None:
                    return freed
                await self.clean_zone(victim.idx, throttle=False)
                freed = True
            return True

    async def background_pass(self) -> int:
        """Clean one victim at the configured rate if empty zones run low."""
        if self.rate <= 0 or len(self.alloc.empty_zones()) >= self.low_watermark:
            return 0
        if self._lock.locked():
            return 0
        async with self._lock:
            victim = self.pick_victim()
            if victim is None:
                return 0
            self.stats.passes += 1
            copied = await self.clean_zone(victim.idx, throttle=True)
            await self.fs.commit_and_reset()
            log.info("cleaner: zone %d cleaned, %d bytes relocated (%s)", victim.idx, copied,
                     self.policy)
            return copied
