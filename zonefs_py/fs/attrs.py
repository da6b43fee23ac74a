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
from zonefs_py.format.ops import Op, OpType
from zonefs_py.fs.api import FILE_SIZE_MAX, NAME_MAX, ROOT_INO, Attr, Ctx, SetAttrRequest
from zonefs_py.fs.clock import now_ns
from zonefs_py.fs.data.datapath import DataPath
from zonefs_py.fs.inline import InlineData
from zonefs_py.fs.lazyio import fault_in
from zonefs_py.fs.namespace import XATTR_PREFIXES
from zonefs_py.journal.journal import Journal
from zonefs_py.model.lazy import LazyEntries
from zonefs_py.model.state import CAPABILITY_XATTR, Inode, State


def setid_bits_to_drop(inode: Inode, ctx: Ctx, *, chown: bool = False) -> int:
    """Return the set-ID bits of `inode` that a change by `ctx` clears (DESIGN 4.1a).

    The data change rule (write, truncate, fallocate, copy destination, open with
    O_TRUNC) is Linux's `setattr_should_drop_suidgid` (fs/attr.c): on a regular
    file, setuid always and setgid when the group may execute or when the caller is
    not in the file's group, unless the caller holds CAP_FSETID (then nothing).
    With `chown`, the rule of `chown_common` (fs/open.c): on anything but a
    directory, setuid always, whoever the caller, and setgid as above. The
    caller's groups and capability are read only for a file with a set-ID bit.
    """
    mode = inode.mode
    if not mode & (statmod.S_ISUID | statmod.S_ISGID):
        return 0
    if statmod.S_ISDIR(mode) if chown else not statmod.S_ISREG(mode):
        return 0
    kill = mode & statmod.S_ISUID
    groups, capable = ctx.credentials()
    if mode & statmod.S_ISGID and (mode & statmod.S_IXGRP
                                   or not (capable or inode.gid in groups)):
        kill |= statmod.S_ISGID
    return kill if chown or not capable else 0


def may_keep_setgid(ctx: Ctx, gid: int) -> bool:
    """Whether `ctx` may leave setgid on a file of group `gid` when it sets the mode:
    in that group, or holding CAP_FSETID (Linux's `in_group_or_capable`, fs/attr.c)."""
    groups, capable = ctx.credentials()
    return capable or gid in groups


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
            if inode.nlink == 0:
                # Deleted: the kernel asks only for inodes it no longer caches, and an
                # open file stays cached, so this one is kept only until a FORGET
                # still on its way frees it. Its handle is stale (as ext4's is).
                raise errors.NotFound(f"inode {parent_ino} has no name left")
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
            mode = statmod.S_IFMT(inode.mode) | (req.mode & 0o7777)
            if mode & statmod.S_ISGID and not may_keep_setgid(
                    ctx, inode.gid if req.gid is None else req.gid):
                # Linux's setattr_prepare: also what the kernel's own kill-priv
                # recomputation (a write to a setuid+setgid file) leaves us to do.
                mode &= ~statmod.S_ISGID
            changes["mode"] = mode
        if req.uid is not None:
            changes["uid"] = req.uid
        if req.gid is not None:
            changes["gid"] = req.gid
        # Kill-priv (DESIGN 4.1a): a truncate, and the empty SETATTR the kernel sends
        # for a write, fallocate or copy whose caller its own FUSE rule lets keep a
        # set-ID bit; a chown. Computed on the mode before this request's change.
        if req.uid is not None or req.gid is not None:
            kill = setid_bits_to_drop(inode, ctx, chown=True)
        elif req.size is not None or req.is_empty():
            kill = setid_bits_to_drop(inode, ctx)
        else:
            kill = 0
        if kill:
            changes["mode"] = changes.get("mode", inode.mode) & ~kill
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

    def _drop_privileges(self, inode: Inode, ctx: Ctx, now: int) -> list[Op]:
        """Apply the kill-priv rule for a data change by `ctx` that the kernel does not
        announce (an open with O_TRUNC, done here under atomic_o_trunc): clear the
        set-ID bits `setid_bits_to_drop` names and remove security.capability, as the
        kernel's `file_remove_privs` does (DESIGN 4.1a). Return the ops applied, for
        the caller's journal transaction."""
        ops: list[Op] = []
        if inode.xattrs and CAPABILITY_XATTR in inode.xattrs:
            op: Op = (OpType.XATTR_DEL, inode.ino, CAPABILITY_XATTR)
            self.state.apply(op)
            ops.append(op)
        kill = setid_bits_to_drop(inode, ctx)
        if kill or ops:
            op = inode.op(mode=inode.mode & ~kill, ctime=now)
            self.state.apply(op)
            ops.append(op)
        return ops

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
