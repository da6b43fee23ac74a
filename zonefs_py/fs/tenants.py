"""Declared tenants (issue 45): declare, change, remove, the namespace rules, the figures.

A tenant is a directory an operator declared (`zonefs-py tenant add`, through
`trusted.zonefs.ctl`, control.py), with a zone policy: `min_zones` empty zones
kept for it, `max_zones` at most owned by its users' data (0: no cap). Its data,
every stream and the cleaner's copies of it, lives only in zones it owns (INV-27,
alloc/allocator.py). The table is in the journal (TENANT, TENANT_DEL ops) and in
every checkpoint; zone ownership too (ZONE_TENANT), see DESIGN 3.9a.

Rules, and why:

* Any depth, never nested: a tenant's directory is neither inside nor above
  another's. A file belongs to at most one tenant, found by walking its
  parents (model/tenants.py); nesting would make a file's zones ambiguous.
* Only a directory holding no file data may be declared (ENOTEMPTY otherwise:
  files with blocks, reserved blocks, buffered writes, or more than one link).
  Data already written sits in shared zones beside other tenants' data;
  moving it in the background needs the cleaner to treat a shared zone as
  partly a tenant's, which this first step does not do. Declaring then
  copying the data in (cp, rsync) gives the same result, visibly.
  Directories and inline files (their bytes are in the metadata) are fine.
* Renames and hard links across a tenant's boundary are EXDEV, as between
  two filesystems: mv and cp fall back to copy and unlink, which rewrites the
  data into the destination's zones. A rename that kept the blocks would
  leave one tenant's data in another's zones (or in shared ones).
  Moving a tenant's directory itself is allowed outside every tenant.
* A tenant's directory cannot be removed (rmdir, rename over it: EBUSY)
  while it is declared: `tenant remove` first.
* A copy_file_range between tenants copies bytes instead of sharing blocks
  (fs/reflink.py).

A tenant may have a bandwidth policy too: a write cap (MB/s, or a percentage of
the device's write bandwidth; one replaces the other, 0 clears it) and a read
share (percent; 0 clears it), kept in its TENANT op and enforced by
fs/data/tenantqos.py. Refused: negative values, a share over 100%, an
absolute cap and a share at once.

Runs on the trio thread; the checks and the op of one command never await
in between (one atomic step, as every namespace change).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from zonefs_py import errors
from zonefs_py.alloc.allocator import Allocator
from zonefs_py.format.constants import (
    C_TENANT_CLEANER_BASE,
    C_TENANT_RESETS_BASE,
    C_TENANT_USER_BASE,
    ROOT_INO,
    OpType,
)
from zonefs_py.format.ops import Op
from zonefs_py.fs.data.tenantqos import TenantBandwidth
from zonefs_py.model.inode import Inode
from zonefs_py.model.state import State
from zonefs_py.model.tenants import TenantPolicy, tenant_of, tenant_of_dir

#: Inodes a declaration examines at most below the directory (it is refused beyond).
SUBTREE_MAX = 1 << 20
#: Zone numbers the figures list at most, over all tenants (the status document must
#: fit an xattr, 64 KiB); a tenant whose list was cut says so ("zones_truncated").
ZONES_LISTED_MAX = 2048


class UnwrittenData(Protocol):
    def has_unwritten_data(self, ino: int) -> bool: ...


class TenantAdmin:
    """The tenant commands and figures of one mounted engine."""

    def __init__(self, state: State, alloc: Allocator, data: UnwrittenData,
                 txn: Callable[[list[Op]], None], path_of: Callable[[int], str],
                 bandwidth: TenantBandwidth | None = None) -> None:
        self.state = state
        #: Write caps and read shares (None: an engine without them; no figures).
        self.bandwidth = bandwidth
        self.alloc = alloc
        self.data = data
        self.txn = txn
        self.path_of = path_of

    # -- commands ------------------------------------------------------------------------
    def declare(self, dir_ino: int, min_zones: int, max_zones: int,
                max_active: int = 0, *, write_cap_kbs: int = 0, write_share: int = 0,
                read_share: int = 0) -> int:
        """Declare directory `dir_ino` a tenant; return its id. Raises NotFound,
        NotDirectory, InvalidArgument (the root, nested, a bad bandwidth policy),
        Exists (already one), NotEmpty (it holds file data), NoSpace (the
        reservation does not fit)."""
        _check_bandwidth(write_cap_kbs, write_share, read_share)
        d = self._dir(dir_ino)
        table = self.state.tenants
        if dir_ino in table.by_dir:
            raise errors.Exists(f"{self.path_of(dir_ino)} is a tenant already")
        if dir_ino == ROOT_INO:
            raise errors.InvalidArgument("the root directory cannot be a tenant")
        outer = tenant_of_dir(self.state, d.parent)
        if outer:
            raise errors.InvalidArgument(
                f"{self.path_of(dir_ino)} is inside tenant {self._path(outer)}")
        for policy in table.by_id.values():
            if self._is_ancestor(dir_ino, policy.dir_ino):
                raise errors.InvalidArgument(
                    f"{self.path_of(dir_ino)} holds tenant {self.path_of(policy.dir_ino)}")
        self._refuse_data_below(d)
        tid = table.free_id()
        self._check_policy(tid, min_zones, max_zones, max_active)
        self.txn([TenantPolicy(tid, dir_ino, min_zones, max_zones, max_active, 0,
                               write_cap_kbs, write_share, read_share).op()])
        return tid

    def change(self, dir_ino: int, min_zones: int | None, max_zones: int | None,
               max_active: int | None = None, *, write_cap_kbs: int | None = None,
               write_share: int | None = None, read_share: int | None = None) -> None:
        """Change a tenant's policy (None: keep). Raises NotFound, InvalidArgument,
        NoSpace. A cap below what it owns is accepted: it opens no zone until
        deletes and its cleaner bring it under. The write cap is one thing: giving
        `write_cap_kbs` or `write_share` replaces it whole (0: no cap)."""
        tid = self._tenant_at(dir_ino)
        policy = self.state.tenants.by_id[tid]
        lo = policy.min_zones if min_zones is None else min_zones
        hi = policy.max_zones if max_zones is None else max_zones
        active = policy.max_active if max_active is None else max_active
        cap, share = policy.write_cap_kbs, policy.write_share
        if write_cap_kbs is not None or write_share is not None:
            cap, share = write_cap_kbs or 0, write_share or 0
        reads = policy.read_share if read_share is None else read_share
        _check_bandwidth(cap, share, reads)
        self._check_policy(tid, lo, hi, active)
        self.txn([TenantPolicy(tid, dir_ino, lo, hi, active, policy.flags, cap, share,
                               reads).op()])

    def remove(self, dir_ino: int) -> None:
        """Remove a tenant: its zones are shared from now on (their data stays).
        Raises NotFound."""
        tid = self._tenant_at(dir_ino)
        self.txn([(OpType.TENANT_DEL, tid)])
        self.alloc.tenant_removed(tid)

    # -- checks ----------------------------------------------------------------------------
    def _dir(self, ino: int) -> Inode:
        d = self.state.inodes.get(ino)
        if d is None:
            raise errors.NotFound(f"no inode {ino}")
        if not d.is_dir:
            raise errors.NotDirectory(f"{self.path_of(ino)} is not a directory")
        return d

    def _tenant_at(self, dir_ino: int) -> int:
        tid = self.state.tenants.by_dir.get(dir_ino)
        if tid is None:
            raise errors.NotFound(f"{self.path_of(dir_ino)} is not a tenant")
        return tid

    def _path(self, tid: int) -> str:
        policy = self.state.tenants.get(tid)
        return self.path_of(policy.dir_ino) if policy is not None else f"<tenant {tid}>"

    def _is_ancestor(self, anc: int, ino: int) -> bool:
        cur = ino
        for _ in range(4096):
            if cur == anc:
                return True
            inode = self.state.inodes.get(cur)
            if cur == ROOT_INO or inode is None or inode.parent in (0, cur):
                return False
            cur = inode.parent
        return False

    def _refuse_data_below(self, d: Inode) -> None:
        stack = [d]
        seen = 0
        while stack:
            cur = stack.pop()
            for name, child_ino in (cur.entries or {}).items():
                seen += 1
                if seen > SUBTREE_MAX:
                    raise errors.NotEmpty(f"{self.path_of(d.ino)} holds over {SUBTREE_MAX} "
                                          "entries; declare tenants on new directories")
                child = self.state.inodes.get(child_ino)
                if child is None:
                    continue
                if child.is_dir:
                    stack.append(child)
                    continue
                held = self.state.prealloc.held.get(child_ino, 0)
                mapped = child.extents.mapped_blocks if child.extents is not None else 0
                if mapped or held or self.data.has_unwritten_data(child_ino):
                    raise errors.NotEmpty(
                        f"{self.path_of(child_ino)} has data in shared zones: declare "
                        "tenants on directories without file data, then copy data in")
                if child.nlink > 1:
                    raise errors.NotEmpty(
                        f"{self.path_of(cur.ino)}/{name.decode(errors='replace')} has "
                        "other links, maybe outside the directory")

    def _check_policy(self, tid: int, min_zones: int, max_zones: int,
                      max_active: int = 0) -> None:
        """Raise InvalidArgument or NoSpace unless the reservations add up (INV-27)."""
        if min_zones < 0 or max_zones < 0 or max_active < 0:
            raise errors.InvalidArgument("zone counts cannot be negative")
        if max_active > 0xFFFFFFFF or max_zones > 0xFFFFFFFF or min_zones > 0xFFFFFFFF:
            raise errors.InvalidArgument("zone counts are u32")
        if max_zones and max_zones < max(1, min_zones):
            raise errors.InvalidArgument(f"--max-zones {max_zones} is below --min-zones "
                                         f"{min_zones}")
        user_zones = len(self.alloc.zones) - self.alloc.reserve_zones - 1
        others = sum(p.min_zones for t, p in self.state.tenants.by_id.items() if t != tid)
        if others + min_zones > user_zones:
            raise errors.NoSpace(f"the tenants' reservations ({others} + {min_zones} zones) "
                                 f"exceed the {user_zones} data zones users may fill")
        owned = len(self.alloc.tenant_zones(tid))
        owed = self.alloc.owed_zones(exclude=tid) + max(0, min_zones - owned)
        spare = len(self.alloc.empty_zones()) - self.alloc.reserve_zones - 1
        if owed > spare:
            raise errors.NoSpace(f"{owed} empty zones would be reserved, {spare} are "
                                 "empty beyond the cleaner's: free space first")

    # -- figures ---------------------------------------------------------------------------
    def report(self) -> dict[str, dict[str, Any]]:
        """Per declared tenant, keyed by its path relative to the mount root."""
        out: dict[str, dict[str, Any]] = {}
        if not self.state.tenants:
            return out
        c = self.state.counters
        by_tenant: dict[int, list[int]] = {t: [] for t in self.state.tenants.by_id}
        for dz in self.alloc.zones.values():
            if dz.tenant in by_tenant and (dz.reserved or dz.head_of is not None):
                by_tenant[dz.tenant].append(dz.idx)
        budget = ZONES_LISTED_MAX
        for tid, policy in sorted(self.state.tenants.by_id.items()):
            zones = sorted(by_tenant[tid])
            listed = zones[:max(0, budget)]
            budget -= len(listed)
            resets = [self.alloc.zones[z].resets for z in zones]
            user = c.get(C_TENANT_USER_BASE + tid, 0)
            cleaner = c.get(C_TENANT_CLEANER_BASE + tid, 0)
            out[self.path_of(policy.dir_ino).lstrip("/")] = {
                "declared": True,
                "tenant_id": tid,
                "zones": listed,
                "zones_truncated": len(listed) < len(zones),
                "zones_owned": len(zones),
                "zones_reserved": policy.min_zones,
                "zones_max": policy.max_zones or None,
                "active_zones": sum(1 for z in zones
                                    if 0 < self.alloc.zones[z].reserved
                                    < self.alloc.zones[z].capacity
                                    and not self.alloc.zones[z].unusable),
                "active_zones_max": policy.max_active or None,
                "bytes_stored": sum(self.alloc.live_bytes(z) for z in zones),
                "device_bytes_written_users": user,
                "device_bytes_written_cleaner": cleaner,
                "write_amplification": round((user + cleaner) / user, 4) if user else None,
                "zone_resets": c.get(C_TENANT_RESETS_BASE + tid, 0),
                "wear": {"max": max(resets, default=0),
                         "mean": round(sum(resets) / len(resets), 3) if resets else 0.0},
            }
            if self.bandwidth is not None:
                out[self.path_of(policy.dir_ino).lstrip("/")].update(
                    self.bandwidth.report(tid))
        return out


def _check_bandwidth(write_cap_kbs: int, write_share: int, read_share: int) -> None:
    """Raise InvalidArgument unless the bandwidth policy is one the TENANT op holds."""
    if write_cap_kbs < 0 or write_share < 0 or read_share < 0:
        raise errors.InvalidArgument("bandwidth caps and shares cannot be negative")
    if write_share > 100 or read_share > 100:
        raise errors.InvalidArgument("a share is a percentage: at most 100")
    if write_cap_kbs and write_share:
        raise errors.InvalidArgument("give a write cap in MB/s or as a share, not both")
    if write_cap_kbs > 0xFFFFFFFF:
        raise errors.InvalidArgument("the write cap is at most 4,294,967 MB/s")


# -- the namespace rules (fs/namespace.py calls these before building its ops) ------------
def check_link(state: State, inode: Inode, new_parent_ino: int) -> None:
    """Raise CrossDevice when a new name would put the file in another tenant."""
    if state.tenants and tenant_of(state, inode) != tenant_of_dir(state, new_parent_ino):
        raise errors.CrossDevice("hard link across a tenant's boundary")


def check_remove_dir(state: State, ino: int) -> None:
    """Raise Busy when the directory is a declared tenant's (rmdir, rename over it)."""
    if ino in state.tenants.by_dir:
        raise errors.Busy("the directory is a declared tenant: zonefs-py tenant remove first")


def check_rename(state: State, src: Inode, old_parent_ino: int, new_parent_ino: int,
                 dst: Inode | None, exchange: bool) -> None:
    """Raise CrossDevice for a move across a tenant's boundary, Busy for one that
    replaces a tenant's directory."""
    if not state.tenants:
        return
    _check_move(state, src, old_parent_ino, new_parent_ino)
    if dst is not None:
        if exchange:
            _check_move(state, dst, new_parent_ino, old_parent_ino)
        else:
            check_remove_dir(state, dst.ino)


def _check_move(state: State, inode: Inode, from_dir: int, to_dir: int) -> None:
    target = tenant_of_dir(state, to_dir)
    if inode.ino in state.tenants.by_dir:
        # The tenant's own directory moves with its tenant, never into another.
        if target:
            raise errors.CrossDevice("a tenant's directory cannot move into a tenant")
        return
    if tenant_of_dir(state, from_dir) != target:
        raise errors.CrossDevice("rename across a tenant's boundary")
