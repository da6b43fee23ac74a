"""Lookups and attribute requests of ZoneFS (a mixin): lookup, forget, getattr,
setattr, readlink, access, and what the FUSE adapter asks about xattrs.

Split from fs/filesystem.py to keep modules small; `ZoneFS` inherits these and
provides the members listed in `AttrOps`. Lookup counting (DESIGN 4.2): every
entry handed to the kernel counts in `Inode.lookups` until its FORGET, and an
inode with no link, lookup or open is freed (`_free_if_unused`).
"""

from __future__ import annotations

import os
import stat as statmod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from zonefs_py import errors
from zonefs_py.drain.manager import DrainManager
from zonefs_py.format.ops import Op
from zonefs_py.fs.api import FILE_SIZE_MAX, NAME_MAX, ROOT_INO, Attr, Ctx, SetAttrRequest
from zonefs_py.fs.clock import now_ns
from zonefs_py.fs.datapath import DataPath
from zonefs_py.fs.inline import InlineData
from zonefs_py.fs.lazyio import fault_in
from zonefs_py.fs.namespace import XATTR_PREFIXES
from zonefs_py.journal.journal import Journal
from zonefs_py.model.lazy import LazyEntries
from zonefs_py.model.state import Inode, State


class AttrOps:
    """Lookup and attribute requests, for ZoneFS (see the module docstring)."""

    # Provided by ZoneFS:
    state: State
    data: DataPath
    inline: InlineData
    journal: Journal
    drain: DrainManager

    if TYPE_CHECKING:  # the rest of ZoneFS, for the type checker only
        def _writable(self) -> None: ...
        def inode(self, ino: int) -> Inode: ...
        def _dir(self, ino: int) -> Inode: ...
        def attr(self, inode: Inode) -> Attr: ...
        def _free_if_unused(self, inode: Inode) -> None: ...
        def _check_quota(self, inode: Inode, extra_bytes: int) -> None: ...

    # -- lookups and attributes ------------------------------------------------------
    async def lookup(self, parent_ino: int, name: bytes) -> Attr:
        if name == b".":
            # Of any inode, not only directories: the kernel resolves an export
            # handle (open_by_handle_at, NFS) whose inode it no longer caches by
            # looking up "." in the handle's node id (DESIGN 4.2a).
            inode = self.inode(parent_ino)
            inode.lookups += 1
            return self.attr(inode)
        d = self._dir(parent_ino)
        if name == b"..":
            ino = d.parent or ROOT_INO
        else:
            if len(name) > NAME_MAX:
                raise errors.NameTooLong(f"name of {len(name)} bytes")
            assert d.entries is not None
            if isinstance(d.entries, LazyEntries):
                await fault_in(self.state, d.entries, name)
            child = d.entries.get(name)
            if child is None:
                raise errors.NotFound(f"{name!r} not in directory {parent_ino}")
            ino = child
        inode = self.inode(ino)
        inode.lookups += 1
        return self.attr(inode)

    def add_lookup(self, ino: int) -> None:
        """Count one kernel reference handed out by readdirplus."""
        self.inode(ino).lookups += 1

    def xattr_namespaces(self) -> tuple[bytes, ...]:
        return XATTR_PREFIXES

    def capability_xattrs_present(self) -> bool:
        return bool(self.state.caps_inos)

    def forget(self, forgets: Sequence[tuple[int, int]]) -> None:
        for ino, n in forgets:
            inode = self.state.inodes.get(ino)
            if inode is None:
                continue
            inode.lookups = max(0, inode.lookups - n)
            self._free_if_unused(inode)
        # A lazy State evicts what the kernel let go of, down to its cache
        # (no await here: nobody holds an Inode across one at this point).
        self.state.trim()

    async def getattr(self, ino: int) -> Attr:
        return self.attr(self.inode(ino))

    async def setattr(self, ino: int, req: SetAttrRequest, ctx: Ctx) -> Attr:
        self._writable()
        inode = self.inode(ino)
        now = now_ns()
        ops: list[Op] = []
        if req.size is not None:
            if inode.is_dir:
                raise errors.IsDirectory("cannot truncate a directory")
            if not inode.is_reg:
                raise errors.InvalidArgument("can only truncate regular files")
            if req.size < 0 or req.size > FILE_SIZE_MAX:
                raise errors.FileTooBig(f"size {req.size} out of range")
            if req.size > self.data.visible_size(inode):
                self._check_quota(inode, req.size - self.data.visible_size(inode))
            await self.drain.before_truncate(inode, req.size)
            ops += await self.data.truncate(inode, req.size, now)
            ops += self.inline.truncate_ops(inode, req.size)
        changes: dict[str, int] = {}
        if req.mode is not None:
            changes["mode"] = statmod.S_IFMT(inode.mode) | (req.mode & 0o7777)
        if req.uid is not None:
            changes["uid"] = req.uid
        if req.gid is not None:
            changes["gid"] = req.gid
        if (req.uid is not None or req.gid is not None) and not inode.is_dir \
                and "mode" not in changes:
            # chown clears set-user-ID and set-group-ID on files (like the kernel does).
            changes["mode"] = inode.mode & ~(statmod.S_ISUID | statmod.S_ISGID)
        if req.atime_ns is not None:
            changes["atime"] = req.atime_ns
        if req.mtime_ns is not None:
            changes["mtime"] = req.mtime_ns
            self.data.times_set(ino)
        if changes or req.size is not None:
            changes["ctime"] = req.ctime_ns if req.ctime_ns is not None else now
            op = inode.op(**changes)
            self.state.apply(op)
            ops.append(op)
        if ops:
            self.journal.add(ops)
        return self.attr(inode)

    async def readlink(self, ino: int) -> bytes:
        inode = self.inode(ino)
        if inode.target is None:
            raise errors.InvalidArgument("not a symbolic link")
        return inode.target

    async def access(self, ino: int, mode: int, ctx: Ctx) -> None:
        inode = self.inode(ino)
        if mode == os.F_OK or ctx.uid == 0:
            if ctx.uid == 0 and mode & os.X_OK and not inode.is_dir \
                    and not inode.mode & 0o111:
                raise errors.PermissionDenied("no execute bit set")
            return
        if ctx.uid == inode.uid:
            perm = (inode.mode >> 6) & 7
        elif ctx.gid == inode.gid or inode.gid in ctx.groups:
            perm = (inode.mode >> 3) & 7
        else:
            perm = inode.mode & 7
        if mode & ~perm & 7:
            raise errors.PermissionDenied(f"mode {mode:o} denied on inode {ino}")
