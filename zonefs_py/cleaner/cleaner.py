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

Tenants (issue 45): a declared tenant's zone is cleaned into that tenant's own
cleaner head (the host's `relocate`), so its room is the tenant's
(`tenant_cleaner_room_bytes`); a writer whose tenant is at its zone cap gets a
foreground pass that cleans only that tenant's zones (`clean_for_space(tenant)`),
so one tenant's churn never moves another's data.

The cleaner reaches the filesystem only through `CleanerHost` (host.py):
it sees zones as `ZoneUsage` figures and live data as `LivePiece`s, and the
host reads, relocates and re-points them (`zonefs_py.fs.reclaim`). All of this
runs on the trio thread except device I/O and checksums (worker threads, in
the host). Nothing between reading the current mapping and applying the new
EXTENT op awaits (the host's `relocate` keeps that promise).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import trio

from zonefs_py.cleaner.host import CleanerHost, LivePiece, ZoneUsage

log = logging.getLogger(__name__)

#: Largest piece copied with one read and one append.
COPY_UNIT = 256 << 10


@dataclass(slots=True)
class CleanerStats:
    """What the cleaner did since mount (the `stat` and metrics figures)."""

    zones_cleaned: int = 0
    bytes_copied: int = 0
    passes: int = 0
    foreground_passes: int = 0
    checksum_failures: int = 0


class Cleaner:
    """Background and foreground space reclaim for one mounted filesystem (its host)."""

    def __init__(self, host: CleanerHost, policy: str, rate_mb_s: float) -> None:
        self.host = host
        self.policy = policy
        self.rate = rate_mb_s * 1e6
        self.stats = CleanerStats()
        self._lock = trio.Lock()
        self._bucket_time = time.monotonic()
        #: Zones that could not be cleaned (unreadable data); not retried this mount.
        self.skip: set[int] = set()
        self.low_watermark = host.reserve_zones + max(2, host.data_zone_count() // 10)

    # -- choosing ---------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """True while a pass (background or foreground) is cleaning."""
        return self._lock.locked()

    def candidates(self) -> list[ZoneUsage]:
        """Zones worth cleaning: the host's candidates less the ones given up on."""
        return [z for z in self.host.candidate_zones() if z.zone_idx not in self.skip]

    @staticmethod
    def score(zone: ZoneUsage, now_ns: int, policy: str) -> float:
        if policy == "greedy":
            return float(zone.dead_bytes)
        u = zone.live_bytes / zone.capacity_bytes
        age = max(1.0, (now_ns - zone.last_write_ns) / 1e9)
        return (1.0 - u) * age / (1.0 + u)

    def pick_victim(self, policy: str | None = None,
                    tenant: int | None = None) -> ZoneUsage | None:
        """Best candidate whose live data fits where the cleaner can write it (in
        its tenant's zones); with `tenant`, among that tenant's zones only."""
        policy = policy or self.policy
        rooms: dict[int, int] = {}
        now = time.time_ns()
        best: tuple[float, ZoneUsage] | None = None
        for zone in self.candidates():
            if tenant is not None and zone.tenant != tenant:
                continue
            room = rooms.get(zone.tenant)
            if room is None:
                room = rooms[zone.tenant] = (
                    self.host.tenant_cleaner_room_bytes(zone.tenant) if zone.tenant
                    else self.host.cleaner_room_bytes())
            if zone.live_bytes > room:
                continue
            s = self.score(zone, now, policy)
            if best is None or s > best[0]:
                best = (s, zone)
        return best[1] if best else None

    # -- copying ------------------------------------------------------------------------
    async def _throttle(self, nbytes: int) -> None:
        if self.rate <= 0:
            return
        now = time.monotonic()
        self._bucket_time = max(self._bucket_time, now - 0.1) + nbytes / self.rate
        if self._bucket_time > now:
            await trio.sleep(self._bucket_time - now)

    async def clean_zone(self, victim: int, *, throttle: bool) -> int:
        """Relocate the live data of `victim`, in device order; return bytes copied.

        The victim becomes dead (and is reset after the next commit) unless
        a block of it could not be read correctly, in which case it is left
        alone and skipped from now on.
        """
        await self.host.warm_zone(victim)
        pieces = sorted(self.host.live_pieces(victim, COPY_UNIT))
        # Pinned in the same step as the pieces were taken (INV-8): data that dies
        # while we copy it stays readable until we are done.
        self.host.pin_zone(victim)
        try:
            return await self._copy_pieces(victim, pieces, throttle)
        finally:
            self.host.unpin_zone(victim)

    async def _copy_pieces(self, victim: int, pieces: list[LivePiece], throttle: bool) -> int:
        """Copy `pieces` of `victim` elsewhere (device order); return bytes copied."""
        copied = 0
        for piece in pieces:
            if throttle:
                await self._throttle(piece.nblocks * self.host.block_size)
            data = await self.host.read_verified(piece)
            if data is None:
                self.skip.add(victim)
                self.stats.checksum_failures += 1
                log.error("cleaner: zone %d holds data of inode %d that fails its checksum at "
                          "device offset %d; the zone is left as it is", victim, piece.ino,
                          piece.dev_offset_bytes)
                return copied
            copied += await self.host.relocate(piece, data)
        self.stats.zones_cleaned += 1
        self.stats.bytes_copied += copied
        self.host.count_cleaned(copied)
        return copied

    # -- passes --------------------------------------------------------------------------
    def _users_short(self) -> bool:
        return self.host.empty_zone_count() <= self.host.reserve_zones

    async def clean_for_space(self, tenant: int = 0) -> bool:
        """Foreground: clean (unthrottled) until users have an empty zone again; for
        a declared tenant at its cap, clean its zones until it is under the cap.

        Returns False when nothing could be freed (then the caller's ENOSPC is real).
        """
        if tenant:
            return await self._clean_tenant(tenant)
        async with self._lock:
            self.stats.foreground_passes += 1
            freed = False
            while self._users_short():
                await self.host.commit_and_reset()
                if not self._users_short():
                    return True
                victim = self.pick_victim()
                if victim is None:
                    return freed
                await self.clean_zone(victim.zone_idx, throttle=False)
                freed = True
            return True

    async def _clean_tenant(self, tenant: int) -> bool:
        async with self._lock:
            self.stats.foreground_passes += 1
            freed = False
            while self.host.tenant_full(tenant):
                await self.host.commit_and_reset()
                if not self.host.tenant_full(tenant):
                    return True
                victim = self.pick_victim(tenant=tenant)
                if victim is None:
                    return freed
                await self.clean_zone(victim.zone_idx, throttle=False)
                freed = True
            return True

    async def background_pass(self) -> int:
        """Clean one victim at the configured rate if empty zones run low, or else
        one of a declared tenant near its zone cap (so its writers meet a
        foreground pass less often), if a quarter of that zone is dead."""
        if self.rate <= 0 or self._lock.locked():
            return 0
        tenant: int | None = None
        if self.host.empty_zone_count() >= self.low_watermark:
            tenant = next(iter(self.host.tenants_near_cap()), None)
            if tenant is None:
                return 0
        async with self._lock:
            victim = self.pick_victim(tenant=tenant)
            if victim is None or (tenant is not None
                                  and victim.dead_bytes * 4 < victim.capacity_bytes):
                return 0
            self.stats.passes += 1
            copied = await self.clean_zone(victim.zone_idx, throttle=True)
            await self.host.commit_and_reset()
            log.info("cleaner: zone %d cleaned, %d bytes relocated (%s)", victim.zone_idx,
                     copied, self.policy)
            return copied
