"""Namespace-changing operations and extended attributes of ZoneFS (a mixin).

Split from fs/filesystem.py to keep modules small; `ZoneFS` inherits these.
Every method follows the engine's one pattern (see ZoneFS): validate against
the State, build the ops, apply them and queue them as one journal
transaction, with no `await` in between, so each operation is atomic and a
crash keeps all of its ops or none (rename included).
"""

from __future__ import annotations

import logging
import secrets
import stat as statmod
from typing import TYPE_CHECKING

from zonefs_py import errors
from zonefs_py.alloc.streams import STREAM_XATTR, classify, parse_stream_name
from zonefs_py.drain.manager import DrainManager
from zonefs_py.drain.policy import STATE_XATTR, check_policy_xattr
from zonefs_py.format.constants import FLAG_STREAM_SET, QUOTA_XATTR, OpType
from zonefs_py.format.ops import Op
from zonefs_py.fs import tenants
from zonefs_py.fs.api import (
    NAME_MAX,
    ROOT_INO,
    XATTR_NAME_MAX,
    XATTR_SIZE_MAX,
    Attr,
    Ctx,
    RenameFlags,
    XattrFlags,
)
from zonefs_py.fs.clock import now_ns
from zonefs_py.fs.quota import QuotaTracker
from zonefs_py.journal.journal import Journal
from zonefs_py.model.state import Inode, State

log = logging.getLogger(__name__)

LINK_MAX = 65000
#: The xattr namespaces stored; system.* (POSIX ACLs) is not: ACLs are off.
XATTR_PREFIXES = (b"user.", b"trusted.", b"security.")


class NamespaceOps:
    """mknod/mkdir/symlink/link/unlink/rmdir/rename and xattrs, for ZoneFS."""

    # Provided by ZoneFS:
    state: State
    quota: QuotaTracker
    drain: DrainManager
    journal: Journal
    #: Whether the "meta area full" warning was logged (once per mount).
    _meta_full_logged = False
    #: The generation of the inodes this mount creates, once its first create
    #: recorded it (DESIGN 4.2a).
    _mount_generation: int | None = None

    if TYPE_CHECKING:  # the rest of ZoneFS, for the type checker only
        def _txn(self, ops: list[Op]) -> None: ...
        def _writable(self) -> None: ...
        def inode(self, ino: int) -> Inode: ...
        def _dir(self, ino: int) -> Inode: ...
        def attr(self, inode: Inode) -> Attr: ...
        def _free_if_unused(self, inode: Inode) -> None: ...

    @staticmethod
    def _check_name(name: bytes) -> None:
        if len(name) > NAME_MAX:
            raise errors.NameTooLong(f"name of {len(name)} bytes (at most {NAME_MAX})")
        if not name or b"/" in name or b"\0" in name:
            raise errors.InvalidArgument(f"invalid name {name!r}")
        if name in (b".", b".."):
            raise errors.Exists(f"{name!r} always exists")

    def _new_inode_op(self, mode: int, ctx: Ctx, parent: Inode, nlink: int, rdev: int = 0,
                      size: int = 0, flags: int = 0) -> Op:
        now = now_ns()
        gid = ctx.gid
        if parent.mode & statmod.S_ISGID:
            gid = parent.gid
            if statmod.S_ISDIR(mode):
                mode |= statmod.S_ISGID
        ino = self.state.next_ino
        return (OpType.INODE, ino, mode, ctx.uid, gid, nlink, rdev, size, now, now, now, flags)

    def _new_generation(self) -> int:
        """Draw the generation of the inodes this mount creates: random, nonzero, not
        the last mount's (DESIGN 4.2a). It goes to the journal with the mount's first
        new inode, in the same record: an inode that survives a crash survives with
        its generation, and a number a crash lost is handed out again under another
        generation, so the kernel refuses the old handle (ESTALE)."""
        gens = self.state.ino_generations
        last = gens[-1][1] if gens else 0
        generation = 0
        while generation in (0, last):
            generation = secrets.randbits(32)
        return generation

    def _touch_dir(self, d: Inode, nlink_delta: int = 0) -> Op:
        now = now_ns()
        return d.op(mtime=now, ctime=now, nlink=d.nlink + nlink_delta)

    # -- namespace changes ---------------------------------------------------------------
    async def _check_meta_room(self) -> None:
        """Refuse a new name with NoSpace (ENOSPC) when the namespace's checkpoint
        would outgrow what the meta area can rotate (Journal.checkpoint_budget_bytes):
        past it the log would run out of empty zones and the mount turn read-only.

        The estimate scales from the newest checkpoint; past half the budget, a
        namespace that grew by more than 5% since that one is measured by a new
        checkpoint first (a few extra checkpoints as the limit nears).
        Called through `_admit_create`, between the request's own checks and
        their repetition (the checkpoint awaits; the state may change meanwhile).
        """
        self._writable()
        j = self.journal
        n = self.state.inode_count + 1
        budget = j.checkpoint_budget_bytes()
        if j.estimated_checkpoint_bytes(n) <= budget // 2:
            return
        if j.checkpoint_sample[1] < n * 0.95:
            # Past half the budget, measure again at every 5% of growth: an estimate
            # off by half still leaves the measuring checkpoint room to be written.
            await j.checkpoint()
            n = self.state.inode_count + 1
        if j.estimated_checkpoint_bytes(n) <= budget:
            return
        if not self._meta_full_logged and j.zone_lender is not None:
            self._meta_full_logged = True
            log.warning("the metadata area is full: %d files and directories, index ~%d "
                        "bytes of the %d its %d meta zones and %d data zones (lent to it "
                        "or free) hold; new names get ENOSPC until files are deleted",
                        n - 1, j.estimated_checkpoint_bytes(n - 1), budget,
                        len(j.log.zones), j.lent_zone_room())
        if not self._meta_full_logged:
            self._meta_full_logged = True
            log.warning("the metadata area is full: %d files and directories, checkpoint "
                        "~%d bytes of the %d its %d meta zones can rotate; new names get "
                        "ENOSPC (mkfs --meta-zones makes a larger area)", n - 1,
                        j.estimated_checkpoint_bytes(n - 1), budget, len(j.log.zones))
        raise errors.NoSpace("no room for more files in the metadata area "
                             "(mkfs --meta-zones sizes it)")

    def _prepare_create(self, parent_ino: int, name: bytes) -> Inode:
        self._writable()
        self._check_name(name)
        d = self._dir(parent_ino)
        if d.nlink == 0:
            raise errors.NotFound("directory was removed")
        assert d.entries is not None
        if name in d.entries:
            raise errors.Exists(f"{name!r} exists")
        return d

    async def _admit_create(self, parent_ino: int, name: bytes) -> Inode:
        """`_prepare_create`, after the meta area's admission: the request's own
        errors (EEXIST, ENOENT, ...) first, ENOSPC only for a name that could be made."""
        self._prepare_create(parent_ino, name)
        await self._check_meta_room()
        return self._prepare_create(parent_ino, name)

    def _create_node(self, d: Inode, name: bytes, op: Op, extra: list[Op] | None = None,
                     is_dir: bool = False) -> Inode:
        ino = op[1]
        ops = [op, *(extra or []), (OpType.DIRENT_ADD, d.ino, ino, name),
               self._touch_dir(d, 1 if is_dir else 0)]
        generation = self._mount_generation
        if generation is None:
            generation = self._new_generation()
            ops.insert(0, (OpType.INO_GENERATION, ino, generation))
        self._txn(ops)
        self._mount_generation = generation
        inode = self.state.inodes[ino]
        inode.lookups += 1
        return inode

    async def mknod(self, parent_ino: int, name: bytes, mode: int, rdev: int, ctx: Ctx) -> Attr:
        d = await self._admit_create(parent_ino, name)
        fmt = statmod.S_IFMT(mode) or statmod.S_IFREG
        if fmt not in (statmod.S_IFREG, statmod.S_IFIFO, statmod.S_IFSOCK, statmod.S_IFCHR,
                       statmod.S_IFBLK):
            raise errors.InvalidArgument(f"mknod of file type {fmt:o}")
        flags = self._stream_flags(d, name) if fmt == statmod.S_IFREG else 0
        op = self._new_inode_op(fmt | (mode & 0o7777), ctx, d, 1, rdev=rdev, flags=flags)
        return self.attr(self._create_node(d, name, op))

    async def mkdir(self, parent_ino: int, name: bytes, mode: int, ctx: Ctx) -> Attr:
        d = await self._admit_create(parent_ino, name)
        op = self._new_inode_op(statmod.S_IFDIR | (mode & 0o7777), ctx, d, 2)
        if d.nlink >= LINK_MAX:
            raise errors.TooManyLinks("too many subdirectories")
        return self.attr(self._create_node(d, name, op, is_dir=True))

    async def symlink(self, parent_ino: int, name: bytes, target: bytes, ctx: Ctx) -> Attr:
        d = await self._admit_create(parent_ino, name)
        if not target or len(target) > 4095:
            raise errors.NameTooLong("symlink target must be 1 to 4095 bytes")
        op = self._new_inode_op(statmod.S_IFLNK | 0o777, ctx, d, 1, size=len(target))
        return self.attr(self._create_node(d, name, op, [(OpType.SYMLINK, op[1], target)]))

    async def link(self, ino: int, new_parent_ino: int, new_name: bytes) -> Attr:
        d = await self._admit_create(new_parent_ino, new_name)
        inode = self.inode(ino)
        if inode.is_dir:
            raise errors.NotPermitted("hard links to directories are not allowed")
        if inode.nlink >= LINK_MAX:
            raise errors.TooManyLinks(f"inode {ino} has {inode.nlink} links")
        if inode.nlink == 0:
            raise errors.NotFound("cannot link an unlinked file")
        tenants.check_link(self.state, inode, d.ino)
        now = now_ns()
        self._txn([inode.op(nlink=inode.nlink + 1, ctime=now),
                   (OpType.DIRENT_ADD, d.ino, ino, new_name), self._touch_dir(d)])
        inode.lookups += 1
        return self.attr(inode)

    async def unlink(self, parent_ino: int, name: bytes) -> None:
        self._writable()
        d = self._dir(parent_ino)
        assert d.entries is not None
        child_ino = d.entries.get(name)
        if child_ino is None:
            raise errors.NotFound(f"{name!r} not found")
        child = self.inode(child_ino)
        if child.is_dir:
            raise errors.IsDirectory(f"{name!r} is a directory")
        now = now_ns()
        self._txn([(OpType.DIRENT_DEL, d.ino, name),
                   child.op(nlink=child.nlink - 1, ctime=now), self._touch_dir(d)])
        self._free_if_unused(child)

    async def rmdir(self, parent_ino: int, name: bytes) -> None:
        self._writable()
        d = self._dir(parent_ino)
        assert d.entries is not None
        if name == b".":
            raise errors.InvalidArgument("cannot remove '.'")
        if name == b"..":
            raise errors.NotEmpty("cannot remove '..'")
        child_ino = d.entries.get(name)
        if child_ino is None:
            raise errors.NotFound(f"{name!r} not found")
        child = self.inode(child_ino)
        if not child.is_dir:
            raise errors.NotDirectory(f"{name!r} is not a directory")
        if child.entries:
            raise errors.NotEmpty(f"{name!r} is not empty")
        tenants.check_remove_dir(self.state, child_ino)
        now = now_ns()
        self._txn([(OpType.DIRENT_DEL, d.ino, name), child.op(nlink=0, ctime=now),
                   self._touch_dir(d, -1)])
        self._free_if_unused(child)

    def _is_ancestor(self, anc_ino: int, ino: int) -> bool:
        """True if directory anc_ino is ino or one of its ancestors."""
        cur = ino
        for _ in range(1 << 20):
            if cur == anc_ino:
                return True
            if cur == ROOT_INO:
                return False
            nxt = self.state.inodes[cur].parent
            if not nxt or nxt == cur:
                return False
            cur = nxt
        raise errors.IOFailure("directory tree has a loop")

    async def rename(self, old_parent_ino: int, old_name: bytes, new_parent_ino: int,
                     new_name: bytes, flags: RenameFlags) -> None:
        self._writable()
        if flags & RenameFlags.EXCHANGE and flags & RenameFlags.NOREPLACE:
            raise errors.InvalidArgument("RENAME_EXCHANGE with RENAME_NOREPLACE")
        if flags & ~(RenameFlags.EXCHANGE | RenameFlags.NOREPLACE):
            raise errors.InvalidArgument(f"unsupported rename flags {int(flags):#x}")
        self._check_name(new_name)
        if old_name in (b".", b".."):
            raise errors.InvalidArgument("cannot rename . or ..")
        src_dir = self._dir(old_parent_ino)
        dst_dir = self._dir(new_parent_ino)
        assert src_dir.entries is not None
        assert dst_dir.entries is not None
        src_ino = src_dir.entries.get(old_name)
        if src_ino is None:
            raise errors.NotFound(f"{old_name!r} not found")
        src = self.inode(src_ino)
        dst_ino = dst_dir.entries.get(new_name)
        dst = self.state.inodes[dst_ino] if dst_ino is not None else None
        if flags & RenameFlags.NOREPLACE and dst is not None:
            raise errors.Exists(f"{new_name!r} exists")
        if flags & RenameFlags.EXCHANGE and dst is None:
            raise errors.NotFound(f"{new_name!r} not found")
        if dst_ino == src_ino:
            return  # same inode (hard links or same entry): POSIX says do nothing
        if src.is_dir and self._is_ancestor(src_ino, new_parent_ino):
            raise errors.LoopDetected("cannot move a directory into itself")
        if flags & RenameFlags.EXCHANGE:
            assert dst is not None
            if dst.is_dir and self._is_ancestor(dst.ino, old_parent_ino):
                raise errors.LoopDetected("cannot move a directory into itself")
        elif dst is not None:
            if src.is_dir and not dst.is_dir:
                raise errors.NotDirectory(f"{new_name!r} is not a directory")
            if not src.is_dir and dst.is_dir:
                raise errors.IsDirectory(f"{new_name!r} is a directory")
            if dst.is_dir and dst.entries:
                raise errors.NotEmpty(f"{new_name!r} is not empty")
        tenants.check_rename(self.state, src, old_parent_ino, new_parent_ino, dst,
                             bool(flags & RenameFlags.EXCHANGE))
        now = now_ns()
        nlink_delta: dict[int, int] = {old_parent_ino: 0, new_parent_ino: 0}
        ops: list[Op] = []
        if flags & RenameFlags.EXCHANGE:
            assert dst is not None
            ops += [(OpType.DIRENT_ADD, old_parent_ino, dst.ino, old_name),
                    (OpType.DIRENT_ADD, new_parent_ino, src_ino, new_name)]
            if src.is_dir != dst.is_dir:
                moved = 1 if src.is_dir else -1
                nlink_delta[old_parent_ino] -= moved
                nlink_delta[new_parent_ino] += moved
            ops += [src.op(ctime=now), dst.op(ctime=now)]
        else:
            ops += [(OpType.DIRENT_ADD, new_parent_ino, src_ino, new_name),
                    (OpType.DIRENT_DEL, old_parent_ino, old_name)]
            if src.is_dir:
                nlink_delta[old_parent_ino] -= 1
                nlink_delta[new_parent_ino] += 1
            ops.append(src.op(ctime=now))
            if dst is not None:
                if dst.is_dir:
                    ops.append(dst.op(nlink=0, ctime=now))
                    nlink_delta[new_parent_ino] -= 1
                else:
                    ops.append(dst.op(nlink=dst.nlink - 1, ctime=now))
        for pino, delta in nlink_delta.items():
            p = self.state.inodes[pino]
            ops.append(p.op(nlink=p.nlink + delta, mtime=now, ctime=now))
        self._txn(ops)
        if old_parent_ino != new_parent_ino and self.quota.quotas:
            self.quota.invalidate()
        if dst is not None and not flags & RenameFlags.EXCHANGE:
            self._free_if_unused(dst)
        self.drain.on_rename(src)

    # -- quotas and streams ----------------------------------------------------------
    def _stream_flags(self, d: Inode, name: bytes) -> int:
        return classify(self.state, d.ino, name) | FLAG_STREAM_SET

    def _check_quota(self, inode: Inode, extra_bytes: int) -> None:
        """Raise QuotaExceeded if growing `inode` breaks a user.zonefs.quota above it."""
        self.quota.check(inode, extra_bytes)

    # -- extended attributes -----------------------------------------------------------------
    @staticmethod
    def _check_xattr_name(name: bytes) -> None:
        if not name:
            raise errors.InvalidArgument("empty xattr name")
        if len(name) > XATTR_NAME_MAX:
            raise errors.NameTooLong(f"xattr name of {len(name)} bytes")
        if not name.startswith(XATTR_PREFIXES):
            raise errors.NotSupported(f"xattr namespace of {name!r} is not supported")

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        inode = self.inode(ino)
        self._check_xattr_name(name)
        if name == STATE_XATTR and inode.is_reg:
            return self.drain.state_value(inode)
        if not inode.xattrs or name not in inode.xattrs:
            raise errors.NoAttribute(f"no attribute {name!r}")
        return inode.xattrs[name]

    async def setxattr(self, ino: int, name: bytes, value: bytes, flags: XattrFlags,
                       ctx: Ctx) -> None:
        self._writable()
        inode = self.inode(ino)
        self._check_xattr_name(name)
        if len(value) > XATTR_SIZE_MAX:
            raise errors.ValueTooLarge(f"xattr value of {len(value)} bytes (at most 64 KiB)")
        exists = bool(inode.xattrs) and name in inode.xattrs  # type: ignore[operator]
        if flags & XattrFlags.CREATE and exists:
            raise errors.Exists(f"attribute {name!r} exists")
        if flags & XattrFlags.REPLACE and not exists:
            raise errors.NoAttribute(f"no attribute {name!r}")
        if name.startswith(b"user.") and not (inode.is_reg or inode.is_dir):
            raise errors.NotPermitted("user.* attributes only on files and directories")
        if name == STATE_XATTR:
            await self.drain.set_state(inode, value)  # evict or fetch (not stored)
            return
        check_policy_xattr(name, value, inode.is_dir)
        if name == STREAM_XATTR:
            if not inode.is_dir:
                raise errors.InvalidArgument(f"{name.decode()} is set on directories")
            try:
                parse_stream_name(value)
            except ValueError as exc:
                raise errors.InvalidArgument(str(exc)) from None
        if name == QUOTA_XATTR:
            if not inode.is_dir:
                raise errors.InvalidArgument(f"{name.decode()} is set on directories")
            try:
                if int(value.strip()) < 0:
                    raise ValueError
            except ValueError:
                raise errors.InvalidArgument("quota must be a byte count") from None
        self._txn([(OpType.XATTR_SET, ino, name, bytes(value)),
                   inode.op(ctime=now_ns())])
        if name == QUOTA_XATTR:
            self.quota.invalidate()

    async def listxattr(self, ino: int) -> list[bytes]:
        inode = self.inode(ino)
        return list(inode.xattrs) if inode.xattrs else []

    async def removexattr(self, ino: int, name: bytes, ctx: Ctx) -> None:
        self._writable()
        inode = self.inode(ino)
        self._check_xattr_name(name)
        if not inode.xattrs or name not in inode.xattrs:
            raise errors.NoAttribute(f"no attribute {name!r}")
        self._txn([(OpType.XATTR_DEL, ino, name), inode.op(ctime=now_ns())])
        if name == QUOTA_XATTR:
            self.quota.invalidate()
