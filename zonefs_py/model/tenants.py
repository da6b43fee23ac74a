"""Declared tenants (issue 45): the table, and which tenant a file or directory is in.

A tenant is a directory an operator declared (`zonefs-py tenant add`), at any
depth, never inside or above another tenant's directory. Its data lives in
zones it owns (State.zone_tenant, ZONE_TENANT ops) and nowhere else (INV-27);
`min_zones` of the empty zones are kept for it, `max_zones` caps what it owns
(0: no cap). The table is changed only by TENANT and TENANT_DEL ops.

A tenant may also have a bandwidth policy (fs/data/tenantqos.py): a write cap,
absolute (`write_cap_kbs`, kB/s) or a share of the device's write bandwidth
(`write_share`, percent), never both, and a read share (`read_share`, percent).
A TENANT op without one keeps the first (short) layout, so an image that
declares no bandwidth policy is byte for byte what it was before.

Pure: no I/O. A file's tenant is that of its primary parent (the directory of
its newest name), found by walking parents up: renames and hard links across
a tenant's boundary are refused (EXDEV, fs/tenants.py), so every name of a
file is in the same tenant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from zonefs_py.format.constants import ROOT_INO, TENANT_MAX_ID, OpType
from zonefs_py.format.ops import Op
from zonefs_py.model.errors import StateError

if TYPE_CHECKING:
    from zonefs_py.model.inode import Inode

#: Ancestors walked at most to find a tenant (deeper trees count from there up).
MAX_DEPTH = 4096


@dataclass(slots=True)
class TenantPolicy:
    """One declared tenant: its directory and zone policy."""

    tenant_id: int
    dir_ino: int
    #: Empty zones kept for it: nobody else may take them while it owns fewer.
    min_zones: int
    #: Zones it may own at most for users' data (0: no cap); its cleaner may
    #: take one more while it cleans (DESIGN 3.9a).
    max_zones: int
    #: Active (open) zones it may hold at once: its share of the device's active-zone
    #: tokens (0: no count of its own; alloc/allocator.py).
    max_active: int = 0
    flags: int = 0
    #: Write cap in kB/s (1,000 bytes/s; 0: none): applied while others are busy.
    write_cap_kbs: int = 0
    #: Write cap as a percentage of the device's write bandwidth (0: none).
    write_share: int = 0
    #: While it reads, everyone else's writes together get at most (100 - this)%
    #: of the device's write bandwidth (0: no read share).
    read_share: int = 0

    @property
    def has_bandwidth_policy(self) -> bool:
        return bool(self.write_cap_kbs or self.write_share or self.read_share)

    def op(self) -> Op:
        """The TENANT op of this entry: the short layout without a bandwidth policy."""
        base = (OpType.TENANT, self.tenant_id, self.flags, self.dir_ino, self.min_zones,
                self.max_zones, self.max_active)
        if not self.has_bandwidth_policy:
            return base
        return (*base, self.write_cap_kbs, self.write_share, self.read_share)


class TenantTable:
    """tenant id -> policy, and directory ino -> tenant id."""

    def __init__(self) -> None:
        self.by_id: dict[int, TenantPolicy] = {}
        self.by_dir: dict[int, int] = {}

    def __bool__(self) -> bool:
        return bool(self.by_id)

    def __len__(self) -> int:
        return len(self.by_id)

    def get(self, tenant_id: int) -> TenantPolicy | None:
        return self.by_id.get(tenant_id)

    def apply_set(self, op: Op) -> None:
        _, tid, flags, dir_ino, min_zones, max_zones, max_active = op[:7]
        cap_kbs, write_share, read_share = op[7:10] if len(op) > 7 else (0, 0, 0)
        if not 1 <= tid <= TENANT_MAX_ID:
            raise StateError(f"TENANT id {tid} out of range (1..{TENANT_MAX_ID})")
        if max_zones and min_zones > max_zones:
            raise StateError(f"TENANT {tid}: min_zones {min_zones} over max_zones {max_zones}")
        if write_share > 100 or read_share > 100 or (cap_kbs and write_share):
            raise StateError(f"TENANT {tid}: bandwidth policy {cap_kbs} kB/s, write "
                             f"{write_share}%, read {read_share}% is not valid")
        other = self.by_dir.get(dir_ino)
        if other is not None and other != tid:
            raise StateError(f"TENANT {tid}: directory {dir_ino} is tenant {other}'s")
        old = self.by_id.get(tid)
        if old is not None and old.dir_ino != dir_ino:
            del self.by_dir[old.dir_ino]
        self.by_id[tid] = TenantPolicy(tid, dir_ino, min_zones, max_zones, max_active, flags,
                                       cap_kbs, write_share, read_share)
        self.by_dir[dir_ino] = tid

    def apply_del(self, tid: int) -> None:
        old = self.by_id.pop(tid, None)
        if old is None:
            raise StateError(f"TENANT_DEL of unknown tenant {tid}")
        del self.by_dir[old.dir_ino]

    def free_id(self) -> int:
        """An unused id: one past the highest in use, else the lowest free (so an id
        is seldom reused at once). Raises StateError when all are taken."""
        top = max(self.by_id, default=0)
        if top < TENANT_MAX_ID:
            return top + 1
        for tid in range(1, TENANT_MAX_ID + 1):
            if tid not in self.by_id:
                return tid
        raise StateError("every tenant id is taken")


class TenantView(Protocol):
    """What tenant lookups read of a State (model/state.py imports this module)."""

    inodes: dict[int, Inode]
    tenants: TenantTable


def tenant_of_dir(state: TenantView, dir_ino: int) -> int:
    """The tenant whose directory is `dir_ino` or above it; 0 for none."""
    table = state.tenants
    if not table:
        return 0
    by_dir = table.by_dir
    ino = dir_ino
    for _ in range(MAX_DEPTH):
        tid = by_dir.get(ino)
        if tid is not None:
            return tid
        if ino == ROOT_INO or not ino:
            return 0
        d = state.inodes.get(ino)
        if d is None or d.parent == ino:
            return 0
        ino = d.parent
    return 0


def tenant_of(state: TenantView, inode: Inode) -> int:
    """The tenant of a file (that of its primary parent) or directory; 0 for none."""
    if not state.tenants:
        return 0
    if inode.is_dir:
        return tenant_of_dir(state, inode.ino)
    return tenant_of_dir(state, inode.parent)
