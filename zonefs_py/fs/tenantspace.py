"""A declared tenant's space for admission: what its cap holds, what it uses (issue 45).

A tenant with `max_zones` (DESIGN 3.9a) may own that many zones for its users'
data. Placement enforces the cap zone by zone (`TenantFull`, then cleaning
within the tenant, then ENOSPC), but placement runs at writeback: with the
kernel's writeback cache a write refused there is reported at fsync or close
only. So a write is admitted for a tenant as the device admits it
(`HandleOps._write`): its bytes are counted against the tenant's capacity
before they are accepted, and the write gate (fs/spacegate.py) closes for a
tenant's handles when its free space nears what the kernel may hold.

* `capacity_bytes`: `max_zones` x the data capacity of one zone (the smallest
  of the usable data zones: zones of one device seldom differ).
* `used_bytes`: live bytes in the zones it owns, plus, for its files, bytes
  accepted and not yet placed (`pending_bytes_of`), bytes admitted and not yet
  pending (`admit`), and blocks held by fallocate, plus the room left in its
  partly written zones of *other* streams than the writer's (`lost_bytes`:
  streams never share a zone, so that room is not the writer's). Dead bytes
  in its zones do not count: its cleaner reclaims them (placement cleans
  within the tenant before it refuses, `ZoneFS._need_space`).

Pure accounting (no I/O, never awaits), on the trio thread. A tenant's used
bytes are found by walking the zones tenants own and the files with write
state, so the sums cost O(tenants' zones + files being written); only tenants
with a cap pay them, and only when the upper bound (`might_exceed`: the bytes
written in its zones, every pending byte of the device) says the cap might be
near.

Caveats: a writer's stream is that of its file (one not decided yet: the
stream with the most room, as for the gate). Dead bytes in a zone still
being written (a head) are not reclaimable until it is full, yet not
counted: a tenant overwriting data in place near its cap can still be
refused at writeback (the file's next fsync or close reports it). fallocate
into a tenant is held to its cap at the fallocate (`Fallocator._admit`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from zonefs_py.alloc.allocator import Allocator
from zonefs_py.format.constants import FLAG_STREAM_SET
from zonefs_py.model.inode import Inode
from zonefs_py.model.state import State
from zonefs_py.model.tenants import tenant_of, tenant_of_dir


class PendingWrites(Protocol):
    """What the accounting reads of the write state (fs/data/writestate.py)."""

    buffers: dict
    inflight: dict

    def pending_bytes(self) -> int: ...
    def pending_bytes_of(self, ino: int) -> int: ...
    def pending_blocks(self, ino: int, block_size: int) -> list[tuple[int, int]]: ...


class TenantSpace:
    """Per-tenant capacity and use, for the admission of writes and the write gate."""

    def __init__(self, state: State, alloc: Allocator,
                 writes: Callable[[], PendingWrites]) -> None:
        self.state = state
        self.alloc = alloc
        self._writes = writes
        #: tenant id -> bytes of write requests between their check and their
        #: bytes being pending (`admit`), as FileWrites.admit counts them.
        self.admitted: dict[int, int] = {}

    # -- lookups -------------------------------------------------------------------------
    def tenant_of(self, inode: Inode) -> int:
        """The declared tenant of a file (0: none)."""
        return tenant_of(self.state, inode)

    def tenant_of_ino(self, ino: int) -> int:
        inode = self.state.inodes.get(ino)
        return tenant_of(self.state, inode) if inode is not None else 0

    def zone_data_bytes(self) -> int:
        """Data capacity of one zone (the smallest usable one)."""
        return min((z.capacity for z in self.alloc.zones.values() if not z.unusable),
                   default=0)

    def capacity_bytes(self, tid: int) -> int | None:
        """What the tenant's cap holds (None: no cap, or no such tenant)."""
        policy = self.state.tenants.get(tid)
        if policy is None or not policy.max_zones:
            return None
        return policy.max_zones * self.zone_data_bytes()

    def _zones(self, tid: int) -> list[int]:
        """Zones the tenant owns: the recorded ownership (State.zone_tenant, set by the
        ZONE_TENANT op when a zone is opened for it, ended by its reset), walked instead
        of every zone of the device (this runs on every growing write of a capped
        tenant)."""
        return [z for z, t in self.state.zone_tenant.items() if t == tid]

    def live_bytes(self, tid: int) -> int:
        """Live bytes in the zones the tenant owns."""
        return sum(self.alloc.live_bytes(z) for z in self._zones(tid))

    def pending_bytes(self, tid: int) -> int:
        """The tenant's files' bytes accepted and not placed, admitted, or held, each
        byte once (a write into held blocks is both until it lands: counted as
        held only, as `Fallocator.used_bytes` does for the device)."""
        writes = self._writes()
        bs = self.alloc.block_size
        pre = self.state.prealloc
        total = self.admitted.get(tid, 0)
        for ino in {*writes.buffers, *writes.inflight}:
            if self.tenant_of_ino(ino) != tid:
                continue
            pending = writes.pending_bytes_of(ino)
            inode = self.state.inodes.get(ino)
            if ino in pre.ranges and inode is not None and inode.extents is not None:
                both = sum(pre.held_in(ino, inode.extents, lo, hi)
                           for lo, hi in writes.pending_blocks(ino, bs)) * bs
                pending -= min(both, pending)
            total += pending
        if pre.held:
            total += sum(blocks for ino, blocks in pre.held.items()
                         if self.tenant_of_ino(ino) == tid) * bs
        return total

    def lost_bytes(self, tid: int, stream: int | None) -> int:
        """Room in the tenant's partly written zones that a writer of `stream` cannot
        use: zones of other streams (streams never share a zone, INV-9; at its cap
        a writer shares only a head of its own stream). `stream` None: for the
        stream with the most room (the write gate's view of the tenant)."""
        zones = self.alloc.zones
        room: dict[int, int] = {}
        for z in self._zones(tid):
            dz = zones.get(z)
            if dz is not None and dz.remaining > 0:
                room[dz.stream] = room.get(dz.stream, 0) + dz.remaining
        if not room:
            return 0
        usable = max(room.values()) if stream is None else room.get(stream, 0)
        return sum(room.values()) - usable

    def used_bytes(self, tid: int, stream: int | None = None) -> int:
        """Live and pending bytes of the tenant, and the room its writer of `stream`
        cannot use (`lost_bytes`)."""
        return self.live_bytes(tid) + self.pending_bytes(tid) + self.lost_bytes(tid, stream)

    def avail_bytes(self, tid: int, stream: int | None = None) -> int | None:
        """Free bytes under the tenant's cap for a writer of `stream` (None: no cap)."""
        cap = self.capacity_bytes(tid)
        if cap is None:
            return None
        return max(0, cap - self.used_bytes(tid, stream))

    def might_exceed(self, tid: int, grow: int) -> bool:
        """A cheap upper bound: False when `grow` more bytes surely fit the cap (the
        whole capacity of the zones it owns and every pending byte of the device
        counted)."""
        cap = self.capacity_bytes(tid)
        if cap is None:
            return False
        zones = self.alloc.zones
        taken = sum(max(zones[z].capacity, zones[z].reserved) for z in self._zones(tid)
                    if z in zones)
        writes = self._writes()
        bound = (taken + writes.pending_bytes() + sum(self.admitted.values())
                 + self.state.prealloc.held_total * self.alloc.block_size)
        return bound + grow > cap

    def writing_streams(self, tid: int) -> set[int]:
        """Streams of the tenant's files with bytes accepted and not yet placed (the
        files being written; a file whose stream is not decided yet counts as
        none)."""
        writes = self._writes()
        streams: set[int] = set()
        for ino in {*writes.buffers, *writes.inflight}:
            inode = self.state.inodes.get(ino)
            if (inode is not None and inode.flags & FLAG_STREAM_SET
                    and tenant_of(self.state, inode) == tid):
                streams.add(inode.stream)
        return streams

    def avail_within(self, tid: int, within: int) -> int | None:
        """The tenant's free bytes under its cap when they may be below `within`; None
        when it has no cap or surely has more (the write gate, fs/spacegate.py).
        For the stream being written with the least room (the stream with the
        most room when none is being written)."""
        if not self.might_exceed(tid, within):
            return None
        cap = self.capacity_bytes(tid)
        assert cap is not None
        base = self.live_bytes(tid) + self.pending_bytes(tid)
        streams: list[int | None] = [*self.writing_streams(tid)] or [None]
        return max(0, cap - base - max(self.lost_bytes(tid, s) for s in streams))

    def over_bytes(self, tid: int, grow: int, stream: int | None = None) -> int:
        """By how much `grow` more bytes of a writer of `stream` would exceed the
        tenant's cap (<= 0: fit)."""
        if not self.might_exceed(tid, grow):
            return 0
        cap = self.capacity_bytes(tid)
        assert cap is not None
        return self.used_bytes(tid, stream) + grow - cap

    def admit(self, tid: int, nbytes: int) -> Callable[[], None] | None:
        """Count `nbytes` against the tenant from its check until its bytes are pending;
        return the callback that ends the count (`Admitted.on_settle`), None when
        nothing was counted."""
        if not tid or nbytes <= 0:
            return None
        self.admitted[tid] = self.admitted.get(tid, 0) + nbytes

        def settle() -> None:
            left = self.admitted.get(tid, 0) - nbytes
            if left > 0:
                self.admitted[tid] = left
            else:
                self.admitted.pop(tid, None)
        return settle

    def capped_dir_tenant(self, dir_ino: int) -> int:
        """The tenant of a directory if it has a cap, else 0."""
        tid = tenant_of_dir(self.state, dir_ino)
        return tid if self.capacity_bytes(tid) is not None else 0


__all__ = ["TenantSpace"]
