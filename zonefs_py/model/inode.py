"""One file's metadata as the model holds it: `Inode`, and the ops that describe it.

An Inode is changed only by `State.apply` (model/state.py); `Inode.op()` and
`inline_op()` build the INODE and INLINE ops that live code journals and a
checkpoint writes. Memory matters here (one Inode per file, issue 15): the
class has slots, and the fields most files leave empty share one `_Rare`.
"""

from __future__ import annotations

import stat as statmod

from zonefs_py.format.constants import OpType
from zonefs_py.format.ops import Op
from zonefs_py.model.extents import EMPTY_EXTENTS, ExtentMap

#: The xattr the kernel looks for before every write(2) (file capabilities).
CAPABILITY_XATTR = b"security.capability"


class _Rare:
    """The fields of an Inode that almost every inode leaves empty (see Inode.rare)."""

    __slots__ = ("rdev", "target", "xattrs")

    def __init__(self) -> None:
        self.rdev = 0
        self.target: bytes | None = None
        self.xattrs: dict[bytes, bytes] | None = None


class Inode:
    """One file, directory, symlink or special file as the model holds it.

    The persistent fields (mode, ids, nlink, size, times, flags, rare) mirror
    the INODE op (docs/SPEC.md); `entries` (directories: name -> ino) and
    `extents` (regular files) hold what DIRENT and EXTENT ops built; `lookups`
    and `opens` count kernel references and open handles in memory only (an
    inode with no link, lookup or open is freed); `ckpt_gen` is the checkpoint
    snapshot bookkeeping (model/snapshot.py).
    """

    __slots__ = (
        "atime", "ckpt_gen", "ctime", "entries", "extents", "flags", "gid", "ino", "inline",
        "lookups", "mode", "mtime", "nlink", "opens", "parent", "rare", "size", "uid",
    )

    def __init__(self, ino: int, mode: int = 0, uid: int = 0, gid: int = 0, nlink: int = 0,
                 rdev: int = 0, size: int = 0, atime: int = 0, mtime: int = 0, ctime: int = 0,
                 flags: int = 0) -> None:
        self.ino = ino
        self.mode = mode
        self.uid = uid
        self.gid = gid
        self.nlink = nlink
        #: rdev, the symlink target and the xattrs, None while all three are empty:
        #: one slot instead of three puts every Inode in a 16-byte smaller
        #: allocation (176 bytes instead of 192, issue 15). Read and set them
        #: through the properties below.
        self.rare: _Rare | None = None
        if rdev:
            self.rdev = rdev
        self.size = size
        self.atime = atime
        self.mtime = mtime
        self.ctime = ctime
        self.flags = flags
        fmt = mode & 0o170000
        self.entries: dict[bytes, int] | None = {} if fmt == statmod.S_IFDIR else None
        #: Regular files only (the shared EMPTY_EXTENTS until their first extent).
        self.extents: ExtentMap | None = EMPTY_EXTENTS if fmt == statmod.S_IFREG else None
        #: Regular files: the file's bytes kept in the metadata (INLINE op), empty when
        #: its data is in blocks (or it has none). Bytes past it up to size are zeros.
        self.inline = b""
        self.parent = 0
        self.lookups = 0
        self.opens = 0
        #: Generation of the last Snapshot that encoded this inode (see Snapshot).
        self.ckpt_gen = 0

    def _rare_for_set(self, value: object) -> _Rare | None:
        """The _Rare to store a value in: made for a non-empty value, None (nothing
        to store) for an empty one when there is none."""
        rare = self.rare
        if rare is None and value:
            rare = self.rare = _Rare()
        return rare

    def _drop_rare_if_empty(self) -> None:
        rare = self.rare
        if rare is not None and not rare.rdev and rare.target is None and rare.xattrs is None:
            self.rare = None

    @property
    def rdev(self) -> int:
        rare = self.rare
        return 0 if rare is None else rare.rdev

    @rdev.setter
    def rdev(self, value: int) -> None:
        rare = self._rare_for_set(value)
        if rare is not None:
            rare.rdev = value
            self._drop_rare_if_empty()

    @property
    def target(self) -> bytes | None:
        """A symlink's target (None for other files)."""
        rare = self.rare
        return None if rare is None else rare.target

    @target.setter
    def target(self, value: bytes | None) -> None:
        rare = self._rare_for_set(value is not None)
        if rare is not None:
            rare.target = value
            self._drop_rare_if_empty()

    @property
    def xattrs(self) -> dict[bytes, bytes] | None:
        """Extended attributes, name -> value (None when there are none)."""
        rare = self.rare
        return None if rare is None else rare.xattrs

    @xattrs.setter
    def xattrs(self, value: dict[bytes, bytes] | None) -> None:
        rare = self._rare_for_set(value is not None)
        if rare is not None:
            rare.xattrs = value
            self._drop_rare_if_empty()

    @property
    def is_dir(self) -> bool:
        return statmod.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return statmod.S_ISREG(self.mode)

    @property
    def is_symlink(self) -> bool:
        return statmod.S_ISLNK(self.mode)

    @property
    def stream(self) -> int:
        return self.flags & 0xFF

    def op(self, **changes: int) -> Op:
        """Return an INODE op with this inode's attributes, some replaced."""
        g = changes.get
        return (OpType.INODE, self.ino, g("mode", self.mode), g("uid", self.uid),
                g("gid", self.gid), g("nlink", self.nlink), g("rdev", self.rdev),
                g("size", self.size), g("atime", self.atime), g("mtime", self.mtime),
                g("ctime", self.ctime), g("flags", self.flags))


def inline_op(inode: Inode, data: bytes, size: int | None = None, mtime: int | None = None,
              ctime: int | None = None) -> Op:
    """Return an INLINE op setting `inode`'s inline bytes (and size and times, by
    default the inode's own)."""
    return (OpType.INLINE, inode.ino, inode.size if size is None else size,
            inode.mtime if mtime is None else mtime, inode.ctime if ctime is None else ctime,
            data)
