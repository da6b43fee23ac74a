"""The namespace API that the FUSE adapter calls: inode-based, async, errno-free.

`zonefs_py.fs.filesystem.ZoneFS` implements `FileSystemAPI`. The methods mirror
the FUSE low-level operations so that `fuse_ops.py` stays a thin translation
layer: it converts `Attr` to `pyfuse3.EntryAttributes` and the domain errors of
`zonefs_py.errors` to errno. Names are `bytes` (any bytes but b"/" and NUL,
at most 255). Times are integer nanoseconds since the epoch.

Lookup counting follows FUSE: every method that returns an `Attr` for a
directory entry (lookup, mknod, mkdir, symlink, link, create, readdir entries
that the adapter hands to the kernel) increments the inode's lookup count by
one; `forget` decrements it. An inode with nlink == 0 lives on while its lookup
count or an open handle holds it.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import trio

from zonefs_py import errors

# On-disk, so defined in format/; re-exported here for the engine's callers.
from zonefs_py.format.constants import ROOT_INO as ROOT_INO
from zonefs_py.model.state import CAPABILITY_XATTR as CAPABILITY_XATTR

NAME_MAX = 255
XATTR_NAME_MAX = 255
XATTR_SIZE_MAX = 65536
#: Largest file size (offsets at or past it are EFBIG): 2**63 - 1 like ext4's s_maxbytes.
FILE_SIZE_MAX = (1 << 63) - 1


class RenameFlags(enum.IntFlag):
    """renameat2(2) flags."""

    NONE = 0
    NOREPLACE = 1
    EXCHANGE = 2


class FallocFlags(enum.IntFlag):
    """fallocate(2) modes (linux/falloc.h); fs/prealloc.py says which are supported."""

    NONE = 0
    KEEP_SIZE = 0x01
    PUNCH_HOLE = 0x02
    NO_HIDE_STALE = 0x04
    COLLAPSE_RANGE = 0x08
    ZERO_RANGE = 0x10
    INSERT_RANGE = 0x20
    UNSHARE_RANGE = 0x40


class XattrFlags(enum.IntFlag):
    """setxattr(2) flags."""

    NONE = 0
    CREATE = 1
    REPLACE = 2


@dataclass(slots=True)
class Attr:
    """Attributes of one inode, as stat(2) shows them."""

    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    rdev: int
    size: int
    blocks: int  # 512-byte units actually stored
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    blksize: int = 4096
    #: Export handles carry it with the inode number (DESIGN 4.2a).
    generation: int = 0


@dataclass(frozen=True, slots=True)
class Ctx:
    """Who is asking: from the FUSE request context."""

    uid: int = 0
    gid: int = 0
    pid: int = 0
    umask: int = 0o022
    groups: tuple[int, ...] = ()
    #: Reads (supplementary groups, holds CAP_FSETID) of the caller when a rule needs
    #: them (FUSE sends neither: `zonefs_py.caller`); None: `groups` as given, and
    #: uid 0 holds CAP_FSETID.
    creds: Callable[[], tuple[tuple[int, ...], bool]] | None = field(
        default=None, compare=False, repr=False)

    def credentials(self) -> tuple[tuple[int, ...], bool]:
        """Return (the groups the caller is in, whether it holds CAP_FSETID)."""
        if self.creds is not None:
            return self.creds()
        return (self.gid, *self.groups), self.uid == 0


#: The context of a request the engine makes itself, or a test: root, holding
#: every capability.
ROOT_CTX = Ctx()


@dataclass(slots=True)
class StatFs:
    """statfs(2) figures; the over-provisioning reserve is excluded."""

    block_size: int
    total_blocks: int
    free_blocks: int
    avail_blocks: int
    total_inodes: int
    free_inodes: int
    name_max: int = NAME_MAX


@dataclass(slots=True)
class DirEntry:
    """One readdir entry: its name, attributes, and the offset that resumes after it."""

    name: bytes
    attr: Attr
    next_offset: int


@dataclass(slots=True)
class SetAttrRequest:
    """Fields to change; None leaves a field unchanged."""

    size: int | None = None
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None
    ctime_ns: int | None = None
    extra: dict[str, object] = field(default_factory=dict)

    def is_empty(self) -> bool:
        """Whether no field changes: the kernel's kill-priv notice (DESIGN 4.1a)."""
        return (self.size is None and self.mode is None and self.uid is None
                and self.gid is None and self.atime_ns is None and self.mtime_ns is None
                and self.ctime_ns is None)


class FileSystemAPI(abc.ABC):
    """Inode-level operations. Every method may raise a `zonefs_py.errors` class."""

    # -- lookups and attributes ------------------------------------------
    @abc.abstractmethod
    async def lookup(self, parent_ino: int, name: bytes) -> Attr: ...

    @abc.abstractmethod
    def add_lookup(self, ino: int) -> None:
        """Count one kernel reference handed out by READDIRPLUS (an accepted entry)."""

    def xattr_namespaces(self) -> tuple[bytes, ...]:
        """Name prefixes of the xattrs this filesystem stores (others: NotSupported)."""
        return (b"user.", b"trusted.", b"security.", b"system.")

    def capability_xattrs_present(self) -> bool:
        """Whether any file may have a security.capability xattr (False: none has)."""
        return True

    @abc.abstractmethod
    def forget(self, forgets: Sequence[tuple[int, int]]) -> None:
        """Drop lookup counts: a list of (ino, nlookup). Never awaits, never raises."""

    @abc.abstractmethod
    async def getattr(self, ino: int) -> Attr: ...

    @abc.abstractmethod
    async def setattr(self, ino: int, req: SetAttrRequest, ctx: Ctx) -> Attr: ...

    @abc.abstractmethod
    async def readlink(self, ino: int) -> bytes: ...

    @abc.abstractmethod
    async def access(self, ino: int, mode: int, ctx: Ctx) -> None:
        """Raise PermissionDenied unless ctx may access ino with mode (R_OK|W_OK|X_OK)."""

    # -- namespace changes --------------------------------------------------
    @abc.abstractmethod
    async def mknod(self, parent_ino: int, name: bytes, mode: int, rdev: int, ctx: Ctx) -> Attr:
        ...

    @abc.abstractmethod
    async def mkdir(self, parent_ino: int, name: bytes, mode: int, ctx: Ctx) -> Attr: ...

    @abc.abstractmethod
    async def symlink(self, parent_ino: int, name: bytes, target: bytes, ctx: Ctx) -> Attr: ...

    @abc.abstractmethod
    async def link(self, ino: int, new_parent_ino: int, new_name: bytes) -> Attr: ...

    @abc.abstractmethod
    async def unlink(self, parent_ino: int, name: bytes) -> None: ...

    @abc.abstractmethod
    async def rmdir(self, parent_ino: int, name: bytes) -> None: ...

    @abc.abstractmethod
    async def rename(self, old_parent_ino: int, old_name: bytes, new_parent_ino: int,
                     new_name: bytes, flags: RenameFlags) -> None: ...

    # -- files ---------------------------------------------------------------
    @abc.abstractmethod
    async def open(self, ino: int, flags: int, ctx: Ctx = ROOT_CTX) -> int:
        """Open ino (O_TRUNC truncates, and clears set-ID bits as a write by `ctx`
        would); return a file handle."""

    @abc.abstractmethod
    async def create(self, parent_ino: int, name: bytes, mode: int, flags: int,
                     ctx: Ctx) -> tuple[int, Attr]: ...

    @abc.abstractmethod
    async def read(self, fh: int, offset: int, length: int) -> bytes | memoryview:
        """Up to `length` bytes at `offset`; may be a read-only view of a pooled
        buffer that is reused once the caller drops it (copy it to keep it)."""

    @abc.abstractmethod
    async def write(self, fh: int, offset: int, data: bytes) -> int: ...

    @abc.abstractmethod
    async def flush(self, fh: int) -> None: ...

    @abc.abstractmethod
    async def release(self, fh: int) -> None: ...

    @abc.abstractmethod
    async def fsync(self, fh: int, datasync: bool) -> None: ...

    async def fallocate(self, fh: int, mode: FallocFlags, offset: int, length: int) -> None:
        """Reserve, punch or zero [offset, offset+length) of an open file (fallocate(2))."""
        raise errors.NotSupported("fallocate is not supported")

    async def copy_file_range(self, fh_in: int, off_in: int, fh_out: int, off_out: int,
                              length: int, flags: int) -> int:
        """Copy up to `length` bytes between open files; return how many were copied."""
        raise errors.NotSupported("copy_file_range is not supported")

    # -- directories ---------------------------------------------------------
    @abc.abstractmethod
    async def opendir(self, ino: int) -> int: ...

    @abc.abstractmethod
    async def readdir(self, dh: int, offset: int) -> list[DirEntry]:
        """Entries after `offset` (0 = start). Offsets stay valid while the directory changes."""

    @abc.abstractmethod
    async def releasedir(self, dh: int) -> None: ...

    @abc.abstractmethod
    async def fsyncdir(self, dh: int, datasync: bool) -> None: ...

    # -- extended attributes ------------------------------------------------
    @abc.abstractmethod
    async def getxattr(self, ino: int, name: bytes) -> bytes: ...

    @abc.abstractmethod
    async def setxattr(self, ino: int, name: bytes, value: bytes, flags: XattrFlags,
                       ctx: Ctx) -> None: ...

    @abc.abstractmethod
    async def listxattr(self, ino: int) -> list[bytes]: ...

    @abc.abstractmethod
    async def removexattr(self, ino: int, name: bytes, ctx: Ctx) -> None: ...

    # -- whole filesystem ------------------------------------------------------
    @abc.abstractmethod
    async def statfs(self) -> StatFs: ...

    @abc.abstractmethod
    async def sync(self) -> None:
        """Make everything acknowledged so far durable (journal commit + device flush)."""

    @abc.abstractmethod
    async def checkpoint(self) -> None:
        """Write a metadata checkpoint now (buffers flushed, journal folded in)."""

    # -- daemon lifecycle --------------------------------------------------------
    @abc.abstractmethod
    async def serve_background(self) -> None:
        """Run periodic commits, checkpoints, resets and cleaning until `close()`."""

    async def changed_behind_kernel(self) -> list[int]:
        """Wait for, and return, inodes whose attributes the engine changed on its own
        (not in answer to a request: drain eviction and restore), so that the adapter
        drops what the kernel caches of them. The default never returns."""
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    def take_changed_behind_kernel(self) -> list[int]:
        """`changed_behind_kernel` without waiting: what is pending now (maybe [])."""
        return []

    @abc.abstractmethod
    async def close(self) -> None:
        """Clean unmount: everything durable, checkpoint written. Leaves the device open."""

    @abc.abstractmethod
    def enter_failsafe(self, reason: str) -> None:
        """Refuse every later change (ReadOnly) until remount; reads go on."""

    @abc.abstractmethod
    def status(self) -> dict[str, object]:
        """Figures for `zonefs-py stat`: zones by condition, space, write amplification,
        streams, journal state. JSON-serialisable."""
