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
  pending (`admit`), and blocks held by fallocate. Dead bytes in its zones
  do not count: its cleaner reclaims them (placement cleans within the tenant
  before it refuses, `ZoneFS._need_space`).

Pure accounting (no I/O, never awaits), on the trio thread. A tenant's used
bytes are found by walking the zones tenants own and the files with write
state, so the sums cost O(tenants' zones + files being written); only tenants
with a cap pay them, and only when the upper bound (`might_exceed`: the bytes
written in its zones, every pending byte of the device) says the cap might be
near.

Caveats: the capacity is live bytes; a tenant whose data is spread over many
streams (small files, several large files written at once, checkpoint lanes)
leaves room in heads of one stream that another cannot use, so within about a
zone per stream of its cap a write admitted here may still find no room at
writeback (reported by the file's next fsync or close, as before). fallocate
into a tenant is not held to its cap here (placement still is).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from zonefs_py.alloc.allocator import Allocator
from zonefs_py.model.inode import Inode
from zonefs_py.model.state import State
from zonefs_py.model.tenants import tenant_of, tenant_of_dir


class PendingWrites(Protocol):
    """What the accounting reads of the write state (fs/data/writestate.py)."""

    buffers: dict
    inflight: dict

    def pending_bytes(self) -> int: ...
    def pending_bytes_of(self, ino: int) -> int: ...


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
        """The tenant's files' bytes accepted and not placed, admitted, or held."""
        writes = self._writes()
        total = self.admitted.get(tid, 0)
        for ino in {*writes.buffers, *writes.inflight}:
            if self.tenant_of_ino(ino) == tid:
                total += writes.pending_bytes_of(ino)
        held = self.state.prealloc.held
        if held:
            total += sum(blocks for ino, blocks in held.items()
                         if self.tenant_of_ino(ino) == tid) * self.alloc.block_size
        return total

    def used_bytes(self, tid: int) -> int:
        return self.live_bytes(tid) + self.pending_bytes(tid)

    def avail_bytes(self, tid: int) -> int | None:
        """Free bytes under the tenant's cap (None: no cap)."""
        cap = self.capacity_bytes(tid)
        if cap is None:
            return None
        return max(0, cap - self.used_bytes(tid))

    def might_exceed(self, tid: int, grow: int) -> bool:
        """A cheap upper bound: False when `grow` more bytes surely fit the cap (its
        owned zones' written bytes and every pending byte of the device counted)."""
        cap = self.capacity_bytes(tid)
        if cap is None:
            return False
        zones = self.alloc.zones
        written = sum(zones[z].reserved for z in self._zones(tid) if z in zones)
        writes = self._writes()
        bound = (written + writes.pending_bytes() + sum(self.admitted.values())
                 + self.state.prealloc.held_total * self.alloc.block_size)
        return bound + grow > cap

    def avail_within(self, tid: int, within: int) -> int | None:
        """The tenant's free bytes under its cap when they may be below `within`; None
        when it has no cap or surely has more (the write gate, fs/spacegate.py)."""
        if not self.might_exceed(tid, within):
            return None
        return self.avail_bytes(tid)

    def over_bytes(self, tid: int, grow: int) -> int:
        """By how much `grow` more bytes would exceed the tenant's cap (<= 0: fit)."""
        if not self.might_exceed(tid, grow):
            return 0
        cap = self.capacity_bytes(tid)
        assert cap is not None
        return self.used_bytes(tid) + grow - cap

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
