"""The filesystem's side of reclaiming space: dead zones reset, live data relocated.

`SpaceReclaim` resets data zones whose death is durable (INV-8) and
implements `CleanerHost` (zonefs_py/cleaner/host.py), the one interface
the cleaner uses: it shows the allocator's zones as `ZoneUsage`, a zone's
extents as `LivePiece`s, and relocates a piece for the cleaner: append to the
cleaner stream's head, then, without awaiting, re-point the blocks still
mapped to the old copy (INV-15) and queue the EXTENT ops (docs/DESIGN.md 3.8).

Shared blocks (instant copies, model/shared.py, DESIGN 3.13) move once: a
victim's pieces are listed once per device range (a piece another piece of
the listing covers whole is left out), and a relocated range re-points every
file that still maps any of it, with a SHARE op giving the new copy as many
references as the old one had among those files.

Device I/O runs in worker threads: resets under the write limiter, the
cleaner's reads and appends under its own limiter of one thread, so cleaning
never takes more than one device thread from users.
"""

from __future__ import annotations

import logging

import trio

from zonefs_py import errors
from zonefs_py.alloc.allocator import Allocator
from zonefs_py.cleaner.host import LivePiece, ZoneUsage
from zonefs_py.device.base import ZonedDevice
from zonefs_py.format.checksum import block_checksums, first_bad_block
from zonefs_py.format.constants import C_CLEANER_BYTES, C_TENANT_CLEANER_BASE, OpType, Stream
from zonefs_py.format.ops import Op
from zonefs_py.fs.data.zonesums import SumCache, ZoneSealer
from zonefs_py.fs.lazyio import warm_zone
from zonefs_py.journal.journal import Journal
from zonefs_py.model.state import State

log = logging.getLogger(__name__)


class SpaceReclaim:
    """Zone resets and the cleaner's host, over one mounted filesystem's parts."""

    def __init__(self, dev: ZonedDevice, state: State, journal: Journal, alloc: Allocator,
                 limiter: trio.CapacityLimiter, sealer: ZoneSealer, sums: SumCache) -> None:
        self.dev = dev
        self.sealer = sealer
        self.sums = sums
        self.state = state
        self.journal = journal
        self.alloc = alloc
        self.limiter = limiter
        self.cleaner_limiter = trio.CapacityLimiter(1)
        self.block_size = dev.info.block_size

    # -- resets -------------------------------------------------------------------------
    async def reset_dead_zones(self) -> None:
        """Reset the data zones whose death is durable (INV-8) and queue their ZONE_STATE."""
        for zone in self.alloc.take_resettable(self.journal.durable_txn):
            # Reset or not, its old checksums can never be looked up again (SumCache).
            self.sums.forget_zone(zone)
            try:
                await trio.to_thread.run_sync(self.dev.reset_zone, zone, limiter=self.limiter)
            except OSError as exc:
                # The zone's data is dead and durable as such: losing the zone
                # costs space, not data. Keep going with the others.
                log.error("reset of dead data zone %d failed (%s); not used again "
                          "until remount", zone, exc)
                self.alloc.zone_reset_failed(zone)
                continue
            ops: list[Op] = []
            self.alloc.zone_was_reset(zone, ops)
            self.journal.add(ops)

    async def commit_and_reset(self) -> None:
        """Make queued changes durable, then reset the zones they left dead."""
        await self.journal.commit()
        await self.reset_dead_zones()

    # -- CleanerHost: zones ------------------------------------------------------------
    @property
    def reserve_zones(self) -> int:
        return self.alloc.reserve_zones

    def data_zone_count(self) -> int:
        return len(self.alloc.zones)

    def empty_zone_count(self) -> int:
        return len(self.alloc.empty_zones())

    def cleaner_room_bytes(self) -> int:
        head = self.alloc.heads.get((Stream.CLEANER, 0, 0))
        room = self.alloc.zones[head].remaining if head is not None else 0
        empty = self.alloc.empty_zones()
        owed = self.alloc.owed_zones()  # kept for tenants under min_zones (issue 45)
        cap = max((dz.capacity for dz in empty), default=0)
        return room + max(0, len(empty) - owed) * cap

    def tenant_cleaner_room_bytes(self, tenant: int) -> int:
        return self.alloc.tenant_cleaner_room_bytes(tenant)

    def tenant_full(self, tenant: int) -> bool:
        return self.alloc.tenant_at_cap(tenant)

    def tenants_near_cap(self) -> list[int]:
        capped = [(t, p.max_zones) for t, p in self.state.tenants.by_id.items() if p.max_zones]
        if not capped:
            return []
        owned = self.alloc.owned_counts()
        return [t for t, cap in capped if owned.get(t, 0) >= cap - 1]

    def candidate_zones(self) -> list[ZoneUsage]:
        pending = {z for z, _ in self.alloc.pending_resets}
        out = []
        for dz in self.alloc.zones.values():
            if ((dz.unusable and not dz.write_failed) or dz.head_of is not None
                    or dz.inflight or dz.reserved == 0 or dz.idx in pending):
                continue
            live = self.alloc.live_bytes(dz.idx)
            if dz.reserved - live > 0 and live > 0:
                out.append(ZoneUsage(dz.idx, dz.capacity, dz.reserved, live, dz.last_write_ns,
                                     dz.tenant))
        return out

    # -- CleanerHost: data ---------------------------------------------------------------
    async def warm_zone(self, zone_idx: int) -> None:
        await warm_zone(self.state, zone_idx)

    def live_pieces(self, zone_idx: int, max_bytes: int) -> list[LivePiece]:
        bs = self.block_size
        unit = max_bytes // bs
        zsize = self.state.zone_size
        pieces: list[LivePiece] = []
        for ino in list(self.state.zone_owners.get(zone_idx, ())):
            inode = self.state.inodes.get(ino)
            if inode is None or inode.extents is None:
                continue
            for e in inode.extents:
                if e.dev // zsize == zone_idx:
                    for off in range(0, e.nblocks, unit):
                        n = min(unit, e.nblocks - off)
                        pieces.append(LivePiece(
                            e.dev + off * bs, ino, e.fblock + off, n,
                            None if e.csums is None else e.csums[off * 4:(off + n) * 4]))
        if zone_idx not in self.state.shared.ranges:
            return pieces
        # Shared ranges: one piece per device range (the others' files follow it).
        pieces.sort(key=lambda p: (p.dev_offset_bytes, -p.nblocks))
        kept: list[LivePiece] = []
        covered = -1
        for p in pieces:
            end = p.dev_offset_bytes + p.nblocks * bs
            if end > covered:
                kept.append(p)
                covered = end
        return kept

    def pin_zone(self, zone_idx: int) -> None:
        self.alloc.pin_read(zone_idx)

    def unpin_zone(self, zone_idx: int) -> None:
        self.alloc.unpin_read(zone_idx)

    async def read_verified(self, piece: LivePiece) -> bytes | None:
        csums = piece.csums
        if csums is None:  # a sealed zone (pinned by the cleaner): from its summary
            try:
                csums = await self.sums.checksums(piece.ino, piece.fblock,
                                                  piece.dev_offset_bytes, piece.nblocks)
            except errors.IOFailure:
                return None
        return await trio.to_thread.run_sync(self._read_verified, piece, csums,
                                             limiter=self.cleaner_limiter)

    def _read_verified(self, piece: LivePiece, csums: bytes) -> bytes | None:
        try:
            data = self.dev.read(piece.dev_offset_bytes, piece.nblocks * self.block_size)
        except OSError:
            return None
        return None if first_bad_block(data, self.block_size, csums) is not None else data

    async def relocate(self, piece: LivePiece, data: bytes) -> int:
        bs = self.block_size
        # `data` passed `read_verified`: its checksums are the piece's.
        all_csums = piece.csums if piece.csums is not None else block_checksums(data, bs)
        pos = 0
        copied = 0
        # The copy stays in zones of the tenant owning the victim (INV-27).
        victim = self.alloc.zones.get(piece.dev_offset_bytes // self.state.zone_size)
        tenant = victim.tenant if victim is not None else 0
        while pos < len(data):
            zone_ops: list[Op] = []
            to_finish: list[int] = []
            zone, granted = self.alloc.reserve(Stream.CLEANER, 0, len(data) - pos, zone_ops,
                                               to_finish, tenant)
            if zone_ops:
                self.journal.add(zone_ops)
            try:
                await self.sealer.close_zones(to_finish, self.cleaner_limiter)
                new_dev = await trio.to_thread.run_sync(
                    self.dev.append, zone, memoryview(data)[pos:pos + granted],
                    limiter=self.cleaner_limiter)
            except OSError as exc:
                self.alloc.append_done(zone, ok=False)
                raise errors.IOFailure(f"cleaner write to zone {zone} failed: {exc}") from exc
            # No await from here: re-point only blocks still mapped to the old copy.
            first = piece.fblock + pos // bs
            count = granted // bs
            old_dev = piece.dev_offset_bytes + pos
            csums = all_csums[pos // bs * 4:(pos // bs + count) * 4]
            if old_dev // self.state.zone_size in self.state.shared.ranges:
                ops = self._repoint_shared(old_dev, count, new_dev, csums)
            else:
                ops = self._repoint(piece.ino, first, count, old_dev, new_dev, csums)
            for op in ops:
                self.state.apply(op)
            self.alloc.append_done(zone, ok=True)
            if ops:
                self.journal.add(ops)
            copied += granted
            pos += granted
            if tenant:
                key = C_TENANT_CLEANER_BASE + tenant
                self.state.counters[key] = self.state.counters.get(key, 0) + granted
        return copied

    def _repoint(self, ino: int, first: int, count: int, old_dev: int, new_dev: int,
                 csums: bytes) -> list[Op]:
        """EXTENT ops moving blocks first..first+count of ino to new_dev, where they are
        still at old_dev (INV-15: blocks rewritten since the read keep their new data)."""
        inode = self.state.inodes.get(ino)
        if inode is None or inode.extents is None:
            return []
        bs = self.block_size
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

    def _repoint_shared(self, old_dev: int, count: int, new_dev: int, csums: bytes
                        ) -> list[Op]:
        """EXTENT ops moving every file's blocks still at device blocks
        old_dev..+count to the copy at new_dev (INV-15 for each file), then SHARE
        ops for the new blocks that more than one of them now references."""
        bs = self.block_size
        zone = old_dev // self.state.zone_size
        old_end = old_dev + count * bs
        ops: list[Op] = []
        refs: list[tuple[int, int]] = []  # relative block ranges each op references
        for ino in sorted(self.state.zone_owners.get(zone, ())):
            inode = self.state.inodes.get(ino)
            if inode is None or inode.extents is None:
                continue
            for e in list(inode.extents):
                e_end = e.dev + e.nblocks * bs
                lo, hi = max(e.dev, old_dev), min(e_end, old_end)
                if lo >= hi:
                    continue
                fblock = e.fblock + (lo - e.dev) // bs
                rel = (lo - old_dev) // bs
                n = (hi - lo) // bs
                ops.append((OpType.EXTENT, ino, fblock, n, new_dev + rel * bs,
                            csums[rel * 4:(rel + n) * 4]))
                refs.append((rel, rel + n))
        # Blocks referenced k > 1 times get k - 1 extra references (a sweep).
        events = sorted([(a, 1) for a, _ in refs] + [(b, -1) for _, b in refs])
        depth = 0
        prev = 0
        for pos, delta in events:
            if pos > prev and depth > 1:
                ops.append((OpType.SHARE, new_dev + prev * bs, pos - prev, depth - 1))
            depth += delta
            prev = pos
        return ops

    def count_cleaned(self, nbytes: int) -> None:
        self.state.counters[C_CLEANER_BYTES] = self.state.counters.get(C_CLEANER_BYTES, 0) \
            + nbytes
