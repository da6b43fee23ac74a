"""The drain's policy: which files drain where, and how many stay local.

Policy, per directory, inherited by everything below it (like streams):
  * `user.zonefs.drain` = s3://bucket/prefix: files below drain to
    prefix/<path relative to that directory> (`policy_of`).
  * `user.zonefs.keep` = N (newest N by mtime) or `N:number` (newest N by
    the last number in the name, e.g. step-1200.pt): of the regular files
    of one directory, the newest N stay local, older *drained* ones are
    evicted (`keep_of`; eviction in manager.py, `DrainManager.evict`). A file that is not drained is
    never evicted.

Both are ordinary xattrs, stored in the metadata like any other
(`check_policy_xattr` refuses malformed values before they are set). Pure
functions of the State: no I/O, no await.
"""

from __future__ import annotations

import re

from zonefs_py import errors
from zonefs_py.drain.store import META_SIZE, META_XXH3, join_url, object_key, parse_url
from zonefs_py.format.constants import ROOT_INO
from zonefs_py.model.drain import STATE_XATTR as STATE_XATTR
from zonefs_py.model.state import Inode, State

DRAIN_XATTR = b"user.zonefs.drain"
KEEP_XATTR = b"user.zonefs.keep"
MAX_DEPTH = 64
#: A run of digits in a name (`N:number` ranks by the last one).
NUMBER = re.compile(rb"(\d+)")


def parse_keep(value: bytes) -> tuple[int, bool]:
    """`N` or `N:number` -> (N, rank by the number in the name). Raises ValueError."""
    text = value.strip().decode("ascii", errors="replace")
    count, _, how = text.partition(":")
    n = int(count)
    if n < 0 or how not in ("", "mtime", "number"):
        raise ValueError(f"user.zonefs.keep must be N, N:mtime or N:number, not {text!r}")
    return n, how == "number"


def check_policy_xattr(name: bytes, value: bytes, is_dir: bool) -> None:
    """Validate a drain policy xattr before it is set. Raises errors.InvalidArgument."""
    if name not in (DRAIN_XATTR, KEEP_XATTR):
        return
    if not is_dir:
        raise errors.InvalidArgument(f"{name.decode()} is set on directories")
    try:
        if name == DRAIN_XATTR:
            parse_url(value.decode("utf-8", errors="strict"))
        else:
            parse_keep(value)
    except (ValueError, UnicodeDecodeError) as exc:
        raise errors.InvalidArgument(str(exc)) from None


def snapshot_inode(inode: Inode) -> Inode:
    """A detached copy of a file's size and extent map (the version to upload)."""
    from zonefs_py.model.extents import Extent, ExtentMap

    snap = Inode(inode.ino, inode.mode, size=inode.size, flags=inode.flags)
    snap.inline = inode.inline
    if inode.extents is not None and len(inode.extents):
        m = ExtentMap()
        m.exts = [Extent(e.fblock, e.nblocks, e.dev, e.csums) for e in inode.extents]
        m.mapped_blocks = inode.extents.mapped_blocks
        snap.extents = m
    return snap


def name_in(d: Inode, ino: int) -> bytes | None:
    """The name of `ino` in directory `d`, or None."""
    for name, child in (d.entries or {}).items():
        if child == ino:
            return name
    return None


def policy_of(state: State, inode: Inode) -> tuple[str, str] | None:
    """(bucket, key) the file drains to, from the nearest `user.zonefs.drain`; or None."""
    parts: list[bytes] = []
    cur = inode
    for _ in range(MAX_DEPTH):
        parent = state.inodes.get(cur.parent) if cur.parent else None
        if parent is None:
            return None
        name = name_in(parent, cur.ino)
        if name is None:
            return None
        parts.append(name)
        url = (parent.xattrs or {}).get(DRAIN_XATTR)
        if url is not None:
            try:
                bucket, prefix = parse_url(url.decode("utf-8", errors="replace"))
            except ValueError:
                return None
            rel = b"/".join(reversed(parts)).decode("utf-8", errors="surrogateescape")
            return bucket, object_key(prefix, rel)
        if parent.ino == ROOT_INO:
            return None
        cur = parent
    return None

def keep_of(state: State, d: Inode) -> tuple[int, bool] | None:
    """The `user.zonefs.keep` that applies to directory d (nearest ancestor's)."""
    cur: Inode | None = d
    for _ in range(MAX_DEPTH):
        if cur is None:
            return None
        value = (cur.xattrs or {}).get(KEEP_XATTR)
        if value is not None:
            try:
                return parse_keep(value)
            except ValueError:
                return None
        if cur.ino == ROOT_INO:
            return None
        cur = state.inodes.get(cur.parent)
    return None


def object_metadata(size: int, xxh3: int) -> dict[str, str]:
    """The user metadata an uploaded object carries: its size and xxh3."""
    return {META_XXH3: f"{xxh3:016x}", META_SIZE: str(size)}


def object_url(bucket: str, key: str) -> bytes:
    """s3://bucket/key, as drain records hold it."""
    return join_url(bucket, key).encode()
