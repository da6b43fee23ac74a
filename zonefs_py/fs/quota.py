"""Directory quotas (`user.zonefs.quota`) and per-tenant accounting.

A directory carrying `user.zonefs.quota` = N (bytes, decimal) refuses writes
and size changes that would make the bytes stored below it exceed N
(`errors.QuotaExceeded`, EDQUOT). "Stored" counts allocated blocks of regular
files (a sparse hole costs nothing), each file once, accounted to its primary
parent (the directory of its newest name).

A *tenant* is a top-level directory. For each tenant the filesystem keeps the
user bytes written below it (persisted as TENANT_BYTES ops, committed with the
journal) and computes the bytes stored on demand for `zonefs-py stat`.

Usage of quota directories is kept incrementally: the State reports every
change of a file's stored blocks (`State.subscribe(blocks_changed=...)`) and the tracker adds
it to each quota directory above the file. A rename that moves a file or
directory to another parent, or a change of a quota xattr, marks the usages
stale; they are recomputed by walking those subtrees at the next check.

Caveats: a hard-linked file counts only under its primary parent; usage
includes the whole last block of a file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zonefs_py import errors
from zonefs_py.format.constants import QUOTA_XATTR, ROOT_INO

if TYPE_CHECKING:
    from zonefs_py.model.state import Inode, State

#: Ancestors walked at most (deeper trees are still accounted up to this depth).
MAX_DEPTH = 4096


#: Tenants the status document lists at most (besides quota directories).
TENANTS_SHOWN = 256


class QuotaTracker:
    """Per-directory-tree byte quotas (`QUOTA_XATTR`) and per-tenant written bytes, kept up to date
    from the State's block changes.
    """

    def __init__(self, state: State) -> None:
        self.state = state
        self.bs = state.block_size
        #: quota dir ino -> [limit bytes, used bytes]
        self.quotas: dict[int, list[int]] = {}
        self.stale = True
        #: tenant ino -> bytes written since the last TENANT_BYTES op was queued
        self.dirty_tenants: set[int] = set()
        state.subscribe(blocks_changed=self.blocks_changed)

    # -- maintenance ------------------------------------------------------------------
    def invalidate(self) -> None:
        """A quota xattr or a rename changed which files count where: recompute the
        usage at the next check (`reload`)."""
        self.stale = True

    def reload(self) -> None:
        """Find every quota directory and compute its usage (mount, xattr or rename)."""
        self.quotas = {}
        # (A list: the walks below fault inodes of a lazy State in. Quota
        # directories of a lazy State are resident: State.resident_xattrs.)
        for inode in list(self.state.inodes.values()):
            if inode.xattrs and QUOTA_XATTR in inode.xattrs and inode.is_dir:
                try:
                    limit = int(inode.xattrs[QUOTA_XATTR].strip())
                except ValueError:
                    continue
                self.quotas[inode.ino] = [limit, self.subtree_bytes(inode.ino)]
        self.stale = False

    def subtree_bytes(self, dir_ino: int) -> int:
        """Bytes stored by regular files whose primary parent lies below dir_ino."""
        total = 0
        seen: set[int] = set()
        stack = [dir_ino]
        while stack:
            d = self.state.inodes.get(stack.pop())
            if d is None or not d.entries:
                continue
            for child_ino in d.entries.values():
                c = self.state.inodes.get(child_ino)
                if c is None or child_ino in seen:
                    continue
                seen.add(child_ino)
                if c.entries is not None:
                    stack.append(child_ino)
                elif c.extents is not None and c.parent == d.ino:
                    # Reserved blocks (fallocate) are charged like stored ones (INV-24).
                    held = self.state.prealloc.held.get(child_ino, 0)
                    total += (c.extents.mapped_blocks + held) * self.bs
        return total

    def blocks_changed(self, ino: int, delta_blocks: int) -> None:
        """State callback: a file's stored blocks changed by delta (never awaits)."""
        if not self.quotas or self.stale:
            return
        for anc in self._ancestors(ino):
            q = self.quotas.get(anc)
            if q is not None:
                q[1] += delta_blocks * self.bs

    def _ancestors(self, ino: int) -> list[int]:
        out = []
        inode = self.state.inodes.get(ino)
        cur = inode.parent if inode is not None else 0
        for _ in range(MAX_DEPTH):
            if not cur:
                break
            out.append(cur)
            if cur == ROOT_INO:
                break
            d = self.state.inodes.get(cur)
            if d is None or d.parent == cur:
                break
            cur = d.parent
        return out

    # -- checks and tenants ------------------------------------------------------------
    def check(self, inode: Inode, extra_bytes: int) -> None:
        """Raise QuotaExceeded if `inode` growing by extra_bytes breaks a quota above it."""
        if not self.quotas and not self.stale:
            return
        if self.stale:
            self.reload()
        if not self.quotas:
            return
        extra = -(-extra_bytes // self.bs) * self.bs
        for anc in self._ancestors(inode.ino):
            q = self.quotas.get(anc)
            if q is not None and q[1] + extra > q[0]:
                raise errors.QuotaExceeded(
                    f"quota of directory {anc} ({q[0]} bytes) would be exceeded "
                    f"({q[1]} used, {extra} more)")

    def tenant_of(self, ino: int) -> int | None:
        """The top-level directory above ino (None for files directly in the root)."""
        anc = self._ancestors(ino)
        if len(anc) >= 2 and anc[-1] == ROOT_INO:
            return anc[-2]
        return None

    def count_written(self, inode: Inode, nbytes: int) -> None:
        tenant = self.tenant_of(inode.ino)
        if tenant is not None:
            st = self.state.tenant_written
            st[tenant] = st.get(tenant, 0) + nbytes
            self.dirty_tenants.add(tenant)

    def tenant_report(self) -> dict[str, dict[str, int | None]]:
        """The top-level directories (tenants): bytes written below each, stored
        below each, and its quota. At most TENANTS_SHOWN of them, those that
        wrote most first (the status document must fit an xattr: 64 KiB). A
        lazy State (format 5) gives the bytes stored only of quota directories,
        whose usage is tracked; the others' would read their whole subtree."""
        if self.stale:
            self.reload()
        root = self.state.inodes.get(ROOT_INO)
        out: dict[str, dict[str, int | None]] = {}
        if root is None or not root.entries:
            return out
        lazy = self.state.lazy
        written = self.state.tenant_written
        shown = set(self.quotas) | set(sorted(written, key=lambda i: -written[i])[:TENANTS_SHOWN])
        for name, ino in root.entries.items():
            if (lazy or len(written) > TENANTS_SHOWN) and ino not in shown:
                continue
            d = self.state.inodes.get(ino)
            if d is None or not d.is_dir:
                continue
            q = self.quotas.get(ino)
            out[name.decode(errors="replace")] = {
                "bytes_written": written.get(ino, 0),
                "bytes_stored": (q[1] if q else None) if lazy else self.subtree_bytes(ino),
                "quota_bytes": q[0] if q else None,
            }
            if len(out) >= TENANTS_SHOWN + len(self.quotas):
                break
        return out
