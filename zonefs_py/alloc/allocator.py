"""Zone allocation: write heads per stream, the active-zone budget, deferred resets.

Runs on the trio thread and never awaits: `reserve()` hands out space in a
zone before the append is issued from a worker thread, so two appends never
race for the same bytes and the device's write pointer never surprises us.

Write heads are keyed by (stream, owner, tenant): owner 0 is the shared head of
a stream (small files are packed together per stream) within a tenant (0: no
declared tenant); a file written sequentially past `private_head_bytes` (a
quarter of a zone's capacity) gets a head of its own (owner = its inode), so
its zones hold little else and deleting it frees them whole (INV-9).
Checkpoint-stream files get, from their first byte, a head of their *group*:
the files of one directory (the shards of one step: they die together) share
up to `group_lanes` heads, interleaved, whatever the number of files written at
once (`owner_for`; DESIGN 3.7). A group is one directory, so one tenant.

Space written once, not wasted (issue 44): a zone is never finished because
its writer stopped. When a file (or the last file of a group) stops writing,
its head becomes a *spare* zone of its stream (and of its tenant, whose zone it
stays), and the next head the stream needs within the same tenant takes the
fullest spare before an empty zone (`_take_spare`). So a file of exactly two
zones' bytes, which spills a few blocks past two zones (each keeps its summary
room), leaves those blocks at the start of the zone the stream's next file
fills; files written one after the other (a rotation) share only the zone at
their boundary, which is reset once both are deleted.

Budget (ZenFS-style tokens): the device's max active zones, less what the
superblock (1) and the metadata log (2: current and next zone) may hold
active, and less one zone kept for the cleaner, is the number of data heads
that may be open at once. When a new head is needed, the budget is spent and
the stream has no spare, an idle zone (a spare of another stream, then the
private head with the least space left) is finished (becomes FULL), which
frees its token; its unused capacity counts in `wasted_bytes`. Shared heads
are never taken from. A device without limits gets a soft budget of 64 heads.

Zone summaries (format/zonesum.py): every data zone keeps the last
`room_blocks` of its capacity for the summary written when it is sealed, so
`DataZone.capacity` is what data may use. A zone is sealed once it takes no
more data and no append to it is in flight: when its data capacity is used up
(`seal_queue`, written by the engine's `ZoneSealer`), or when it is finished
early (`_mark_finished`: the caller seals it before finishing it). Until its
summary is written the seal counts as an append in flight, so the zone is
neither cleaned nor reset under it.

Tenants (issue 45, model/tenants.py, DESIGN 3.9a): a zone opened for a declared
tenant's head is owned by it (ZONE_TENANT op after its ZONE_STATE) until its
next reset, and takes only that tenant's data, cleaner copies included
(INV-27). A tenant's users may own at most `max_zones` zones (its cleaner one
more while it cleans: `TenantFull` asks for cleaning within it first); the
zones others still owe to tenants under their `min_zones` stay empty for them.

A zone whose live block count drops to zero is reset only when (a) it is not a
head, (b) no append to it is in flight, and (c) the journal transaction that
made it dead is durable (INV-8): otherwise a crash could bring back extents
pointing into a reset zone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from zonefs_py import errors
from zonefs_py.device.base import DeviceInfo, Zone, ZoneCond
from zonefs_py.format.constants import C_TENANT_RESETS_BASE, OpType, Stream
from zonefs_py.format.ops import Op
from zonefs_py.format.superblock import Superblock
from zonefs_py.format.zonesum import room_blocks, summary_end
from zonefs_py.model.state import State

log = logging.getLogger(__name__)

#: Active zones kept back from data heads: superblock 1, metadata log 2, cleaner 1.
RESERVED_ACTIVE = 4
SOFT_HEAD_BUDGET = 64
#: Heads a group of files that die together (`owner_for`) writes at most.
MAX_GROUP_LANES = 4


@dataclass(slots=True)
class DataZone:
    """One data zone as the allocator accounts it: capacity, bytes handed out, appends in flight,
    its stream and seal.
    """

    idx: int
    start: int
    #: Bytes data may fill: the zone's capacity less the room kept for its summary.
    capacity: int
    #: Bytes handed out so far (>= the device write pointer while appends are in flight).
    reserved: int
    inflight: int = 0
    stream: int = Stream.DEFAULT
    resets: int = 0
    head_of: tuple[int, int, int] | None = None
    unusable: bool = False
    #: Unusable because an append failed (not READONLY/OFFLINE): once its data is
    #: dead a reset is tried, and a zone that resets cleanly is used again.
    write_failed: bool = False
    #: When data was last appended (mount time for zones written before it).
    last_write_ns: int = 0
    #: The zone's summary is written (a ZONE_SEAL op for its current reset count).
    sealed: bool = False
    #: Data bytes of a seal decided and not written yet (it counts in `inflight`).
    seal_at: int | None = None
    #: The zone's whole capacity on the device (data room plus summary room).
    zone_capacity: int = 0
    #: The declared tenant owning it (0: nobody; INV-27), until its next reset.
    tenant: int = 0

    @property
    def remaining(self) -> int:
        return 0 if self.unusable else self.capacity - self.reserved


class NeedCleaning(errors.NoSpace):
    """No empty zone is left for users; the cleaner must make one (or it is ENOSPC)."""

    #: The declared tenant whose cap was met (`TenantFull`), 0 for the device.
    tenant = 0


class TenantFull(NeedCleaning):
    """A tenant owns `max_zones` zones: cleaning within it must free one (or it is
    that tenant's ENOSPC; the others still write)."""

    def __init__(self, tenant: int, message: str) -> None:
        super().__init__(message)
        self.tenant = tenant


class AppendJournal(Protocol):
    """What the allocator needs of the journal (journal.Journal is one)."""

    @property
    def added_txn(self) -> int:
        """The number of the last transaction added."""
        ...

    def data_appended(self) -> None:
        """File data reached the device: flush before the next commit's records."""
        ...


class Allocator:
    """Hands out space in data zones; see the module docstring."""

    def __init__(self, info: DeviceInfo, sb: Superblock, state: State, zones: list[Zone],
                 journal: AppendJournal, private_head_bytes: int | None = None,
                 lent_zones: set[int] | frozenset[int] = frozenset()) -> None:
        self.info = info
        self.journal = journal
        self.state = state
        self.block_size = info.block_size
        self.zones: dict[int, DataZone] = {}
        bs = info.block_size
        #: Zones whose data capacity is used up (full, or written past it by an
        #: older format) but that are not FULL on the device: finished at mount so
        #: they give back their active-zone tokens (`finish_at_mount`).
        self.finish_at_mount: list[int] = []
        #: Data zones lent to the namespace index (format 6): out of the data zones'
        #: use (capacity, heads, cleaning) until given back (`zone_returned`).
        #: At mount: the zones the loaded index lists with live pages.
        self.lent: dict[int, DataZone] = {}
        #: Space taken from users (the engine's `Fallocator.used_bytes`): lending
        #: never takes what users were promised. None: live data only.
        self.used_bytes_fn: Callable[[], int] | None = None
        for z in zones:
            if not (sb.data_first_zone <= z.index < sb.data_first_zone + sb.data_zone_count):
                continue
            if z.index in lent_zones:
                self.lent[z.index] = DataZone(z.index, z.start_bytes, 0, 0,
                                              zone_capacity=z.capacity_bytes)
                continue
            stream, _flags, resets = state.zone_info.get(z.index, (Stream.DEFAULT, 0, 0))
            cap_blocks = z.capacity_bytes // bs
            data_cap = (cap_blocks - room_blocks(cap_blocks, bs)) * bs
            dz = DataZone(z.index, z.start_bytes, data_cap, min(z.written_bytes, data_cap),
                          stream=stream, resets=resets, zone_capacity=z.capacity_bytes,
                          tenant=state.zone_tenant.get(z.index, 0))
            seal = state.zone_seals.get(z.index)
            if seal is not None and z.written_bytes < summary_end(seal[1], bs):
                if not state.zone_live_blocks.get(z.index):
                    # Reset after its seal, and the reset's record was lost in a
                    # crash (resets are journaled, not waited for): nothing of it
                    # is live, and the summary is gone.
                    del state.zone_seals[z.index]
                    seal = None
                else:
                    # Damaged metadata (fsck: INV-23): keep the seal, so reads of
                    # its blocks fail as unverifiable (EIO), never as unmapped.
                    log.error("data zone %d is sealed after %d blocks, but its write "
                              "pointer is below the summary; its data cannot be "
                              "verified (run fsck)", z.index, seal[1])
            dz.sealed = seal is not None
            if z.cond in (ZoneCond.READONLY, ZoneCond.OFFLINE):
                dz.unusable = True
            elif z.cond == ZoneCond.FULL or dz.sealed or z.written_bytes >= data_cap:
                if z.cond != ZoneCond.FULL and z.written_bytes:
                    self.finish_at_mount.append(z.index)
                dz.reserved = dz.capacity
            self.zones[z.index] = dz
        cap = max((z.capacity for z in self.zones.values()), default=0)
        self.private_head_bytes = private_head_bytes or max(cap // 4, 1 << 20)
        #: Empty zones only the cleaner may take, so cleaning always has room (INV-14).
        self.reserve_zones = max(2, -(-sb.reserve_bytes // cap)) if cap else 2
        # What users can never fill: the mkfs over-provisioning, but at least the
        # cleaner's zones plus one zone of slack for out-of-place overwrites (a full
        # filesystem must still be able to take an overwrite and clean after it).
        self.reserve_bytes = max(sb.reserve_bytes, (self.reserve_zones + 1) * cap)
        now = time.time_ns()
        for dz in self.zones.values():
            dz.last_write_ns = now
        limit = info.max_active_zones
        self.head_budget = max(1, limit - RESERVED_ACTIVE) if limit else SOFT_HEAD_BUDGET
        # Never let partly written zones take more than a quarter of the data zones.
        self.head_budget = min(self.head_budget, max(4, len(self.zones) // 4))
        self.heads: dict[tuple[int, int, int], int] = {}
        #: Heads per group (`owner_for`): a quarter of the budget, 1 to 4.
        self.group_lanes = max(1, min(MAX_GROUP_LANES, self.head_budget // 4))
        #: The owner each file writing to a head of its own or of its group writes as.
        self.file_owner: dict[int, int] = {}
        #: Files writing as each group owner (a group's heads are let go at 0).
        self.owner_users: dict[int, int] = {}
        #: (zone, journal transaction that must be durable first)
        self.pending_resets: list[tuple[int, int]] = []
        #: Device reads in flight per zone: a zone is not reset under a read that
        #: looked up its extent before the data died (it would read garbage: EIO).
        self.read_pins: dict[int, int] = {}
        #: Reads of a zone in C (the data plane, INV-8): zone -> pins, or None.
        self.c_pins: Callable[[int], int] | None = None
        self.dead_bytes_reset = 0
        #: Capacity given up by finishing zones early.
        self.wasted_bytes = 0
        self._total_capacity: int | None = None
        #: Zones whose seal is decided (`seal_at` set) for the engine's sealer to write.
        self.seal_queue: list[int] = []
        #: Called (trio thread) when `seal_queue` gains a zone (`subscribe_seal_ready`).
        self._on_seal_ready: Callable[[], None] | None = None

    def subscribe_seal_ready(self, fn: Callable[[], None]) -> None:
        """Register the one listener called (trio thread) when `seal_queue` gains
        a zone: the engine's sealer. A second registration raises."""
        if self._on_seal_ready is not None:
            raise RuntimeError("Allocator: seal_ready already has a listener")
        self._on_seal_ready = fn

    # -- queries -------------------------------------------------------------------
    def live_bytes(self, zone: int) -> int:
        """Distinct live bytes of the zone (blocks shared by copies count once)."""
        return (self.state.zone_live_blocks.get(zone, 0)
                - self.state.shared.extra_by_zone.get(zone, 0)) * self.block_size

    def total_capacity(self) -> int:
        """Capacity of the usable data zones (cached: asked on every growing write,
        it changes only when a zone becomes unusable or usable again)."""
        if self._total_capacity is None:
            self._total_capacity = sum(z.capacity for z in self.zones.values()
                                       if not z.unusable)
        return self._total_capacity

    def _set_unusable(self, dz: DataZone, unusable: bool, write_failed: bool) -> None:
        dz.unusable = unusable
        dz.write_failed = write_failed
        self._total_capacity = None

    def free_bytes(self) -> int:
        """Bytes that can still be written without cleaning (unwritten + pending resets)."""
        free = sum(z.remaining for z in self.zones.values())
        pending = {zone for zone, _ in self.pending_resets}
        free += sum(self.zones[z].reserved for z in pending if z in self.zones)
        return free

    def active_heads(self) -> int:
        return sum(1 for z in self.heads.values() if 0 < self.zones[z].reserved
                   < self.zones[z].capacity)

    # -- mount-time adoption -----------------------------------------------------
    def adopt_partial_zones(self) -> list[int]:
        """Make partially written zones heads of their stream again after mount.

        Returns zones that hold no live data and can be reset at once
        (torn writes after a crash, or data freed just before it).
        """
        dead: list[int] = []
        for dz in sorted(self.zones.values(), key=lambda z: z.idx):
            if dz.unusable or dz.reserved == 0:
                continue
            if self.live_bytes(dz.idx) == 0:
                dead.append(dz.idx)
                continue
            key = (dz.stream, 0, dz.tenant)
            if dz.reserved < dz.capacity and key not in self.heads:
                self.heads[key] = dz.idx
                dz.head_of = key
        return dead

    # -- allocation ---------------------------------------------------------------
    def reserve(self, stream: int, owner: int, nbytes: int, journal_ops: list[Op],
                to_finish: list[int], tenant: int = 0) -> tuple[int, int]:
        """Reserve up to `nbytes` (block multiple) in a zone for (stream, owner) of
        `tenant` (0: none; only zones it owns, INV-27).

        Returns (zone index, granted bytes); the caller first finishes the
        zones appended to `to_finish` (to give back their active-zone tokens),
        then appends exactly `granted` bytes to the zone, then calls
        `append_done`. A new zone is recorded by appending a ZONE_STATE op to
        `journal_ops` (and a ZONE_TENANT op for a tenant's). Raises errors.NoSpace
        when no zone can take the data (NeedCleaning / TenantFull when cleaning may
        make room).
        """
        if tenant and self.state.tenants.get(tenant) is None:
            tenant = 0  # removed while this write waited (for the cleaner): shared now
        key = (stream, owner, tenant)
        zone_idx = self.heads.get(key)
        if zone_idx is None or self.zones[zone_idx].remaining <= 0:
            if zone_idx is not None:
                self._drop_head(key)
            zone_idx = self._new_head(key, journal_ops, to_finish)
        dz = self.zones[zone_idx]
        granted = min(nbytes, dz.remaining)
        dz.reserved += granted
        dz.inflight += 1
        dz.last_write_ns = time.time_ns()
        if dz.remaining <= 0 and dz.head_of is not None:
            # Whoever's head it is (a file may be sharing another's head): a full
            # zone is nobody's head any more, so it is reset as soon as it dies.
            self._drop_head(dz.head_of)
        return zone_idx, granted

    def append_done(self, zone_idx: int, ok: bool) -> None:
        """Account an append issued after `reserve` (ok=False: it failed), or the
        write of a seal."""
        dz = self.zones[zone_idx]
        dz.inflight -= 1
        if ok:
            # Told here, where every append is accounted: the next commit flushes
            # the device before records that point at this data (INV-7).
            self.journal.data_appended()
        if not ok:
            # A failed write leaves the zone's state unknown: stop using it.
            self._set_unusable(dz, True, write_failed=True)
            if dz.head_of is not None:
                self._drop_head(dz.head_of)
            log.error("data zone %d stopped taking writes after a write error", zone_idx)
        elif not dz.inflight and dz.reserved >= dz.capacity and self._decide_seal(dz):
            self.seal_queue.append(zone_idx)
            if self._on_seal_ready is not None:
                self._on_seal_ready()
        self._maybe_dead(zone_idx)

    def _decide_seal(self, dz: DataZone) -> bool:
        """Decide to seal a zone that takes no more data (its data is `dz.reserved`
        bytes, no append in flight); True if it is to be sealed. Nothing is
        sealed that has no live data (it is about to be reset) or that a failed
        write left unknown."""
        if (dz.sealed or dz.seal_at is not None or dz.unusable or dz.reserved == 0
                or not self.state.zone_live_blocks.get(dz.idx)):
            return False
        dz.seal_at = dz.reserved
        dz.inflight += 1
        return True

    def seal_written(self, zone_idx: int, ok: bool) -> None:
        """The seal decided for the zone was written (ok) or given up."""
        dz = self.zones[zone_idx]
        dz.seal_at = None
        dz.sealed = dz.sealed or ok
        dz.inflight -= 1
        self._maybe_dead(zone_idx)

    def owner_for(self, ino: int, group: int | None) -> int:
        """The owner whose heads file `ino` writes to (its own: `ino`; or a lane of
        `group`, a directory whose files die together). The file keeps it until
        `release_owner`. A group's lanes are negative owners, never an inode;
        a file joins the lane with the fewest files writing, so files written
        one after the other stay on lane 0 and files written at once spread
        over `group_lanes` heads."""
        owner = self.file_owner.get(ino)
        if owner is not None:
            return owner
        if group is None:
            owner = ino
        else:
            lanes = [-(1 + group * MAX_GROUP_LANES + lane) for lane in range(self.group_lanes)]
            owner = min(lanes, key=lambda o: (self.owner_users.get(o, 0), -o))
            self.owner_users[owner] = self.owner_users.get(owner, 0) + 1
        self.file_owner[ino] = owner
        return owner

    def release_owner(self, owner: int, to_finish: list[int]) -> None:
        """File `owner` (an inode) stops writing (closed or deleted): let go of its
        private heads, or of its group's once no file of the group writes.

        A head let go with room left becomes a spare zone of its stream (still its
        tenant's), taken by the next new head of the stream within the same
        tenant (`_take_spare`), never finished here: its room
        is written, not wasted. `to_finish` is kept for callers; nothing is
        appended to it now (zones are finished only for a token, `_new_head`).
        """
        group_owner = self.file_owner.pop(owner, owner)
        if group_owner != owner:
            users = self.owner_users.get(group_owner, 0) - 1
            if users > 0:
                self.owner_users[group_owner] = users
                return
            self.owner_users.pop(group_owner, None)
            owner = group_owner
        for key in [k for k in self.heads if k[1] == owner]:
            # With appends in flight (another file of the stream shares this
            # zone while empty zones are scarce) the zone is left active and
            # headless too: it takes no new data until a head takes it.
            self._drop_head(key)

    def _mark_finished(self, dz: DataZone, to_finish: list[int]) -> None:
        """Stop writing the zone; the caller seals it (if `seal_at` is set) and
        finishes it (`ZoneSealer.close_zones`)."""
        assert not dz.inflight, f"finishing zone {dz.idx} with appends in flight"
        self.wasted_bytes += dz.remaining
        self._decide_seal(dz)
        dz.reserved = dz.capacity
        to_finish.append(dz.idx)
        self._maybe_dead(dz.idx)

    def _drop_head(self, key: tuple[int, int, int]) -> None:
        zone_idx = self.heads.pop(key, None)
        if zone_idx is not None:
            self.zones[zone_idx].head_of = None
            self._maybe_dead(zone_idx)

    def active_zones(self) -> list[DataZone]:
        """Data zones holding an active token: partially written or reserved, not finished."""
        return [dz for dz in self.zones.values()
                if not dz.unusable and 0 < dz.reserved < dz.capacity]

    def _take_spare(self, key: tuple[int, int, int]) -> int | None:
        """Make the fullest spare zone of the key's stream and tenant (partly
        written, no head, not dead) the key's head; return it, or None if there
        is none. A spare is already active and already its tenant's, so taking
        it costs no token and no zone of the tenant's cap (INV-27: only the
        tenant that owns it writes it again)."""
        pending = {z for z, _ in self.pending_resets}
        spare = [dz for dz in self.zones.values()
                 if dz.stream == key[0] and dz.tenant == key[2] and dz.head_of is None
                 and not dz.unusable and 0 < dz.reserved < dz.capacity
                 and dz.seal_at is None and dz.idx not in pending
                 and (dz.inflight or self.state.zone_live_blocks.get(dz.idx))]
        if not spare:
            return None
        dz = max(spare, key=lambda z: (z.reserved, -z.idx))
        dz.head_of = key
        self.heads[key] = dz.idx
        return dz.idx

    def _new_head(self, key: tuple[int, int, int], journal_ops: list[Op],
                  to_finish: list[int]) -> int:
        spare = self._take_spare(key)
        if spare is not None:
            return spare
        tenant = key[2]
        if tenant:
            # Checked before any zone is finished for a token: a tenant at its cap
            # shares a head of its own or asks for cleaning within it.
            capped = self._tenant_cap_head(key)
            if capped is not None:
                return capped
        active = self.active_zones()
        policy = self.state.tenants.get(tenant) if tenant else None
        if policy is not None and policy.max_active:
            mine = [dz for dz in active if dz.tenant == tenant]
            if len(mine) >= policy.max_active:
                # The tenant's own tokens first (issue 45): finish one of its zones
                # or share one of its heads; never another tenant's zone for it. If
                # every one of its zones has an append in flight it goes over its
                # count rather than fail (the device budget below still holds).
                freed, share = self._free_token(mine, key, to_finish)
                if share is not None:
                    return share
                if freed:
                    active = self.active_zones()
        if len(active) >= self.head_budget:
            freed, share = self._free_token(active, key, to_finish)
            if share is not None:
                return share
            if not freed:
                raise errors.NoSpace("every active zone has a write in flight")
        empty = self.empty_zones()
        # Empty zones owed to other tenants under their min_zones are not ours.
        owed = self.owed_zones(exclude=tenant)
        own_reserve = bool(tenant) and self._owns_fewer_than_min(tenant)
        usable = len(empty) - owed
        if key[0] == Stream.CLEANER or own_reserve:
            # The cleaner (INV-14), and a tenant under its reservation, may take
            # any empty zone nobody else is owed.
            if usable <= 0:
                raise errors.NoSpace("no empty data zone left" if not owed else
                                     f"the {len(empty)} empty data zones are reserved "
                                     "for other tenants")
        elif usable <= self.reserve_zones + 1:
            # Empty zones are scarce: share a head of the same stream that has room
            # rather than opening a zone (INV-9 only keeps streams apart).
            same = [self.zones[z] for k, z in self.heads.items()
                    if k[0] == key[0] and k[2] == tenant and self.zones[z].remaining > 0]
            if same:
                return max(same, key=lambda dz: dz.remaining).idx
            if usable <= self.reserve_zones:
                raise NeedCleaning(
                    f"{len(empty)} empty data zones left, kept for the cleaner"
                    + (f" and for tenants ({owed})" if owed else ""))
        dz = min(empty, key=lambda z: (z.resets, z.idx))
        dz.stream = key[0]
        dz.head_of = key
        dz.tenant = tenant
        self.heads[key] = dz.idx
        op = (OpType.ZONE_STATE, dz.idx, key[0], 0, dz.resets)
        self.state.apply(op)
        journal_ops.append(op)
        if tenant:
            top = (OpType.ZONE_TENANT, dz.idx, tenant)
            self.state.apply(top)
            journal_ops.append(top)
        return dz.idx

    def _free_token(self, active: list[DataZone], key: tuple[int, int, int],
                    to_finish: list[int]) -> tuple[bool, int | None]:
        """Give back an active-zone token from `active` for a new head of `key`:
        finish an idle zone, else the fullest private head; or, for a private head,
        share the stream's head; else finish the fullest shared head. Returns
        (a token was freed, a zone to share instead); (False, None) when every
        zone has an append in flight."""
        idle = [dz for dz in active if dz.head_of is None and not dz.inflight]
        private = [dz for dz in active
                   if dz.head_of is not None and dz.head_of[1] != 0 and not dz.inflight]
        if idle:
            self._mark_finished(max(idle, key=lambda z: z.reserved), to_finish)
            return True, None
        if private:
            victim = max(private, key=lambda z: z.reserved)
            assert victim.head_of is not None
            self._drop_head(victim.head_of)
            self._mark_finished(victim, to_finish)
            return True, None
        shared_key = (key[0], 0, key[2])
        if key[1] != 0 and shared_key in self.heads:
            # No token for a private head: share the stream's head.
            return False, self.heads[shared_key]
        shared = [dz for dz in active if dz.head_of is not None and not dz.inflight]
        if not shared:
            return False, None
        victim = max(shared, key=lambda z: z.reserved)
        assert victim.head_of is not None
        self._drop_head(victim.head_of)
        self._mark_finished(victim, to_finish)
        return True, None

    # -- tenants (issue 45) ----------------------------------------------------------
    def tenant_zones(self, tenant: int) -> list[DataZone]:
        """Zones the tenant owns: written, being written, or awaiting a reset."""
        return [dz for dz in self.zones.values()
                if dz.tenant == tenant and (dz.reserved or dz.head_of is not None)]

    def owned_counts(self) -> dict[int, int]:
        """tenant -> zones it owns (`tenant_zones`), for every declared tenant."""
        out = dict.fromkeys(self.state.tenants.by_id, 0)
        for dz in self.zones.values():
            if dz.tenant and (dz.reserved or dz.head_of is not None) and dz.tenant in out:
                out[dz.tenant] += 1
        return out

    def owed_zones(self, exclude: int = 0) -> int:
        """Empty zones the declared tenants (but `exclude`) are still owed: the sum
        of min_zones less what each owns, where positive."""
        tenants = self.state.tenants.by_id
        if not any(p.min_zones for p in tenants.values()):
            return 0
        owned = self.owned_counts()
        return sum(max(0, p.min_zones - owned.get(t, 0)) for t, p in tenants.items()
                   if t != exclude)

    def _owns_fewer_than_min(self, tenant: int) -> bool:
        policy = self.state.tenants.get(tenant)
        return policy is not None and len(self.tenant_zones(tenant)) < policy.min_zones

    def tenant_at_cap(self, tenant: int, cleaner: bool = False) -> bool:
        """True when the tenant may not own another zone (its cleaner: one more)."""
        policy = self.state.tenants.get(tenant)
        if policy is None or not policy.max_zones:
            return False
        return len(self.tenant_zones(tenant)) >= policy.max_zones + (1 if cleaner else 0)

    def _tenant_cap_head(self, key: tuple[int, int, int]) -> int | None:
        """At the tenant's cap: a head of its own of the same stream with room to
        share, else TenantFull. None: under the cap."""
        tenant = key[2]
        if not self.tenant_at_cap(tenant, cleaner=key[0] == Stream.CLEANER):
            return None
        same = [self.zones[z] for k, z in self.heads.items()
                if k[0] == key[0] and k[2] == tenant and self.zones[z].remaining > 0]
        if same:
            return max(same, key=lambda dz: dz.remaining).idx
        policy = self.state.tenants.get(tenant)
        assert policy is not None
        raise TenantFull(tenant, f"tenant {tenant} owns its {policy.max_zones} zones")

    def tenant_cleaner_room_bytes(self, tenant: int) -> int:
        """Bytes the tenant's cleaner can append: its head's room, plus empty zones
        it may still take (its cap plus one, nobody else's reservation)."""
        head = self.heads.get((Stream.CLEANER, 0, tenant))
        room = self.zones[head].remaining if head is not None else 0
        empty = self.empty_zones()
        n = len(empty) - self.owed_zones(exclude=tenant)
        policy = self.state.tenants.get(tenant)
        if policy is not None and policy.max_zones:
            n = min(n, policy.max_zones + 1 - len(self.tenant_zones(tenant)))
        cap = max((dz.capacity for dz in empty), default=0)
        return room + max(0, n) * cap

    def tenant_removed(self, tenant: int) -> None:
        """After a TENANT_DEL is applied: its zones are nobody's, its heads go (the
        zones they held stay written and are shared data from now on)."""
        for key in [k for k in self.heads if k[2] == tenant]:
            self._drop_head(key)
        for dz in self.zones.values():
            if dz.tenant == tenant:
                dz.tenant = 0

    def empty_zones(self) -> list[DataZone]:
        """Zones that can become a new head now (empty, usable, not awaiting reset)."""
        pending = {z for z, _ in self.pending_resets}
        return [dz for dz in self.zones.values()
                if dz.reserved == 0 and not dz.unusable and dz.head_of is None
                and dz.idx not in pending]

    def live_total_bytes(self) -> int:
        # Distinct blocks: references less the extra ones of shared blocks (copies).
        return (self.state.live_blocks_total - self.state.shared.extra_total) * self.block_size

    def user_capacity_bytes(self) -> int:
        """What users may fill with live data: capacity less the over-provisioning."""
        return max(0, self.total_capacity() - self.reserve_bytes)

    # -- freeing ------------------------------------------------------------------
    def zone_emptied(self, zone_idx: int) -> None:
        """State callback: the zone's last live block was released.

        Called from inside State.apply, before the engine queues the releasing
        transaction: that transaction is the *next* one, and it must be durable
        before the reset (INV-8).
        """
        self._maybe_dead(zone_idx, after_next_txn=True)

    def _maybe_dead(self, zone_idx: int, after_next_txn: bool = False) -> None:
        """Queue the zone for reset if nothing references or writes it any more.

        Outside State.apply (a head dropped, an append done, a zone finished) the
        transaction that released the zone's data is already queued, since every
        path queues its ops right after applying them without awaiting: the reset
        then waits for the current transaction only (waiting for a later one
        could leave a dead zone unreset for as long as nothing else happens).
        """
        dz = self.zones.get(zone_idx)
        if dz is None or dz.head_of is not None or dz.inflight or dz.reserved == 0:
            return
        if self.live_bytes(zone_idx) != 0 or (dz.unusable and not dz.write_failed):
            return
        txn = self.current_txn() + (1 if after_next_txn else 0)
        for i, (z, queued) in enumerate(self.pending_resets):
            if z == zone_idx:
                # Already queued (it died, was reused as a head, died again): the
                # reset waits for the later death to be durable too (INV-8).
                self.pending_resets[i] = (z, max(queued, txn))
                return
        self.pending_resets.append((zone_idx, txn))

    def current_txn(self) -> int:
        """The number of the last journal transaction added."""
        return self.journal.added_txn

    def summary_written(self, zone_idx: int) -> None:
        """Note that the summary of `zone_idx` was written (before its ZONE_SEAL op
        is added): the next commit flushes it first (INV-7)."""
        self.journal.data_appended()

    def pin_read(self, zone_idx: int) -> None:
        self.read_pins[zone_idx] = self.read_pins.get(zone_idx, 0) + 1

    def unpin_read(self, zone_idx: int) -> None:
        left = self.read_pins[zone_idx] - 1
        if left:
            self.read_pins[zone_idx] = left
        else:
            del self.read_pins[zone_idx]

    def take_resettable(self, durable_txn: int) -> list[int]:
        """Pop zones whose death is durable, that are still dead and not being read."""
        ready: list[int] = []
        keep: list[tuple[int, int]] = []
        for zone_idx, txn in self.pending_resets:
            dz = self.zones[zone_idx]
            if txn > durable_txn or zone_idx in self.read_pins or (
                    self.c_pins is not None and self.c_pins(zone_idx)):
                keep.append((zone_idx, txn))
            elif self.live_bytes(zone_idx) == 0 and dz.head_of is None and not dz.inflight:
                ready.append(zone_idx)
        self.pending_resets = keep
        return ready

    def zone_reset_failed(self, zone_idx: int) -> None:
        """A reset of a dead zone failed: the zone is out of use for this mount."""
        self._set_unusable(self.zones[zone_idx], True, write_failed=False)

    def zone_was_reset(self, zone_idx: int, journal_ops: list[Op]) -> None:
        dz = self.zones[zone_idx]
        if dz.unusable:
            log.info("data zone %d is usable again after a reset", zone_idx)
        self._set_unusable(dz, False, write_failed=False)
        self.dead_bytes_reset += dz.reserved
        dz.reserved = 0
        dz.sealed = False
        dz.resets += 1
        if dz.tenant:
            key = C_TENANT_RESETS_BASE + dz.tenant
            self.state.counters[key] = self.state.counters.get(key, 0) + 1
            dz.tenant = 0
        self.state.forget_zone_owners(zone_idx)
        op = (OpType.ZONE_STATE, zone_idx, Stream.DEFAULT, 0, dz.resets)
        self.state.apply(op)
        journal_ops.append(op)

    # -- zones lent to the namespace index (format 6; journal.metaroom.ZoneLender) ----
    def lendable_zones(self) -> int:
        """Empty zones the index may borrow: beyond the cleaner's reserve and one
        spare, and no more than the free space users were promised allows (a
        lent zone's capacity leaves `user_capacity_bytes`)."""
        cap = max((z.capacity for z in self.zones.values()), default=0)
        if not cap:
            return 0
        used = self.used_bytes_fn() if self.used_bytes_fn is not None \
            else self.live_total_bytes()
        spare = (self.user_capacity_bytes() - used) // cap
        owed = self.owed_zones()  # empty zones kept for tenants are not lent (issue 45)
        return max(0, min(len(self.empty_zones()) - self.reserve_zones - 1 - owed, spare))

    def lend_zones(self, count: int) -> list[int]:
        """Take up to `count` empty zones out of data use for the index (the most
        worn last); memory only: they become index zones once a durable
        CHECKPOINT_INDEX lists them, and a lent zone left empty is given back."""
        n = min(count, self.lendable_zones())
        if n <= 0:
            return []
        chosen = sorted(self.empty_zones(), key=lambda z: (z.resets, -z.idx))[:n]
        for dz in chosen:
            self.lent[dz.idx] = self.zones.pop(dz.idx)
        self._total_capacity = None
        return [dz.idx for dz in chosen]

    def take_back_zones(self, zones: list[int]) -> None:
        """Lent zones the index did not write (still empty) are data zones again."""
        for zone in zones:
            self.zones[zone] = self.lent.pop(zone)
        self._total_capacity = None

    def zone_returned(self, zone: int) -> None:
        """A lent zone was reset (the index no longer uses it): a data zone again."""
        dz = self.lent.pop(zone)
        dz.reserved = 0
        dz.sealed = False
        dz.resets += 1
        dz.capacity = self._data_capacity(dz.zone_capacity)
        self.zones[zone] = dz
        self._total_capacity = None

    def _data_capacity(self, zone_capacity: int) -> int:
        bs = self.block_size
        cap_blocks = zone_capacity // bs
        return (cap_blocks - room_blocks(cap_blocks, bs)) * bs

    def lent_bytes(self) -> int:
        """Capacity of the data zones lent to the index (stat: the meta area's share)."""
        return sum(dz.zone_capacity for dz in self.lent.values())

    def wear(self) -> dict[str, float]:
        counts = [z.resets for z in self.zones.values()]
        if not counts:
            return {"min": 0, "mean": 0.0, "max": 0}
        return {"min": min(counts), "mean": sum(counts) / len(counts), "max": max(counts)}
