#!/usr/bin/env python3
"""No-op pyfuse3 filesystem: the Python FUSE ceiling for the benchmark.

It keeps a namespace (directories, file names, sizes, modes) in memory so fio,
torch and the metadata workload can run on it, but it stores no data: writes
are accepted and only grow the file size, reads return zeros up to the size.
Whatever a Python FUSE filesystem does, it cannot be faster than this one on
the same machine, so it is the ceiling that zonefs-py is compared with.

Usage: noopfs.py MOUNTPOINT [--census FILE]
       (always foreground; unmount with fusermount3 -u)

--census FILE: count every FUSE request by opcode (zonefs-py's request
census, `zonefs_py.fuseext`, the same C counters the daemon uses) and write
the counts as JSON to FILE on each SIGUSR1, so bench/metadata compares
requests per file with zonefs-py's in one run.

Caveats:
- Like pyfuse3's examples it runs every handler in the trio loop without
  threads; there is no I/O to wait for anyway.
- Readahead window 4 MiB (set after FUSE INIT, as zonefs-py's daemon does), so
  that it stays an upper bound for zonefs-py's reads. No writeback cache (its
  namespace does not keep up with what the kernel caches then): buffered
  writes through zonefs-py's writeback cache can beat it. No permission
  checks beyond `default_permissions`.
- torch.load of a checkpoint written here fails (the bytes read back are zeros).
- No extended attributes: pyfuse3 answers GETXATTR with ENOSYS, so the kernel
  stops asking after the first (zonefs-py serves xattrs, and so gets the
  kernel's security.capability probe on every write(2)).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# zonefs_py before pyfuse3: its request census hooks libfuse's fuse_session_new
# (zonefs_py/fuseext.py says why the order matters).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
try:
    from zonefs_py import fuseext
except ImportError:  # zonefs-py not built here: no census, the ceiling still runs
    fuseext = None  # type: ignore[assignment]

import pyfuse3  # noqa: E402
import trio  # noqa: E402

#: Largest read reply we build; bigger requests are capped (the kernel asks for
#: at most max_read bytes, 128 KiB by default, anyway).
_ZEROS = bytes(1 << 20)


@dataclass(slots=True)
class _Node:
    """One inode: attributes and, for directories, the name → inode map."""

    inode: int
    mode: int
    size_bytes: int = 0
    nlink: int = 1
    mtime_ns: int = field(default_factory=time.time_ns)
    children: dict[bytes, int] | None = None


class NoopOperations(pyfuse3.Operations):
    """Accept every write, return zeros on read, keep only the namespace."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self) -> None:
        super().__init__()
        root = _Node(pyfuse3.ROOT_INODE, stat.S_IFDIR | 0o755, nlink=2, children={})
        self._nodes: dict[int, _Node] = {root.inode: root}
        self._next_inode = pyfuse3.ROOT_INODE + 1

    # -- helpers ---------------------------------------------------------
    def _attr(self, node: _Node) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = node.inode
        attr.st_mode = node.mode
        attr.st_nlink = node.nlink
        attr.st_size = node.size_bytes
        attr.st_blocks = (node.size_bytes + 511) // 512
        attr.st_blksize = 1 << 20
        attr.st_uid = os.getuid()
        attr.st_gid = os.getgid()
        attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = node.mtime_ns
        attr.attr_timeout = 1.0
        attr.entry_timeout = 1.0
        attr.generation = 0
        return attr

    def _dir(self, inode: int) -> dict[bytes, int]:
        node = self._nodes.get(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if node.children is None:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return node.children

    def _new(self, parent_inode: int, name: bytes, mode: int) -> _Node:
        children = self._dir(parent_inode)
        if name in children:
            raise pyfuse3.FUSEError(errno.EEXIST)
        is_dir = stat.S_ISDIR(mode)
        node = _Node(self._next_inode, mode, nlink=2 if is_dir else 1,
                     children={} if is_dir else None)
        self._next_inode += 1
        self._nodes[node.inode] = node
        children[name] = node.inode
        return node

    # -- namespace -------------------------------------------------------
    async def lookup(self, parent_inode: int, name: bytes,
                     ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if name == b".":
            return self._attr(self._nodes[parent_inode])
        inode = self._dir(parent_inode).get(name)
        if inode is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(self._nodes[inode])

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = self._nodes.get(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(node)

    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes,
                      fields: pyfuse3.SetattrFields, fh: int | None,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = self._nodes[inode]
        if fields.update_size:
            node.size_bytes = attr.st_size
        if fields.update_mode:
            node.mode = (node.mode & ~0o7777) | (attr.st_mode & 0o7777)
        if fields.update_mtime:
            node.mtime_ns = attr.st_mtime_ns
        return self._attr(node)

    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = self._new(parent_inode, name, stat.S_IFDIR | (mode & 0o7777))
        self._nodes[parent_inode].nlink += 1
        return self._attr(node)

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext
                     ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        node = self._new(parent_inode, name, stat.S_IFREG | (mode & 0o7777))
        return pyfuse3.FileInfo(fh=node.inode), self._attr(node)

    async def _remove(self, parent_inode: int, name: bytes, want_dir: bool) -> None:
        children = self._dir(parent_inode)
        inode = children.get(name)
        if inode is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        node = self._nodes[inode]
        if want_dir != (node.children is not None):
            raise pyfuse3.FUSEError(errno.ENOTDIR if want_dir else errno.EISDIR)
        if want_dir and node.children:
            raise pyfuse3.FUSEError(errno.ENOTEMPTY)
        del children[name]
        del self._nodes[inode]
        if want_dir:
            self._nodes[parent_inode].nlink -= 1

    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self._remove(parent_inode, name, want_dir=False)

    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self._remove(parent_inode, name, want_dir=True)

    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: pyfuse3.RequestContext) -> None:
        old_children = self._dir(parent_inode_old)
        new_children = self._dir(parent_inode_new)
        inode = old_children.pop(name_old, None)
        if inode is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        replaced = new_children.get(name_new)
        if replaced is not None:
            self._nodes.pop(replaced, None)
        new_children[name_new] = inode

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        self._dir(inode)
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        entries = sorted(self._dir(fh).items())
        for idx, (name, inode) in enumerate(entries[start_id:], start_id + 1):
            if not pyfuse3.readdir_reply(token, name, self._attr(self._nodes[inode]), idx):
                break

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        data = pyfuse3.StatvfsData()
        data.f_bsize = data.f_frsize = 4096
        data.f_blocks = data.f_bfree = data.f_bavail = 1 << 30
        data.f_files = data.f_ffree = data.f_favail = 1 << 30
        data.f_namemax = 255
        return data

    # -- data ------------------------------------------------------------
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if inode not in self._nodes:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if flags & os.O_TRUNC:
            self._nodes[inode].size_bytes = 0
        return pyfuse3.FileInfo(fh=inode)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        node = self._nodes[fh]
        size = max(0, min(size, node.size_bytes - off, len(_ZEROS)))
        return _ZEROS[:size]

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        node = self._nodes[fh]
        node.size_bytes = max(node.size_bytes, off + len(buf))
        return len(buf)

    async def flush(self, fh: int) -> None:
        return None

    async def fsync(self, fh: int, datasync: bool) -> None:
        return None

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None

    async def release(self, fh: int) -> None:
        return None

    async def releasedir(self, fh: int) -> None:
        return None


async def serve(mountpoint: str, census_file: str | None) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(set_readahead, mountpoint, 4096)
        if census_file is not None:
            nursery.start_soon(write_census_on_signal, census_file)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


async def write_census_on_signal(path: str) -> None:
    """On every SIGUSR1, write the request counts since the mount to `path` (atomically)."""
    with trio.open_signal_receiver(signal.SIGUSR1) as signals:
        async for _ in signals:
            counts = fuseext.census() if fuseext is not None else {}
            await trio.to_thread.run_sync(_write_json, path, counts)


def _write_json(path: str, doc: dict[str, int]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


async def set_readahead(mountpoint: str, kib: int) -> None:
    """Widen the mount's readahead window once FUSE INIT is done (as zonefs-py does)."""
    await trio.to_thread.run_sync(os.statvfs, mountpoint, abandon_on_cancel=True)
    await trio.to_thread.run_sync(write_readahead, mountpoint, kib)


def write_readahead(mountpoint: str, kib: int) -> None:
    with open("/proc/self/mountinfo") as f:
        devs = [line.split()[2] for line in f if line.split()[4] == mountpoint]
    if devs:
        with open(f"/sys/class/bdi/{devs[-1]}/read_ahead_kb", "w") as f:
            f.write(str(kib))


def main() -> None:
    """Mount the no-op filesystem in the foreground until unmounted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mountpoint")
    parser.add_argument("--census", metavar="FILE",
                        help="count requests by opcode; write them to FILE on SIGUSR1")
    args = parser.parse_args()
    options = set(pyfuse3.default_options)
    options.add("fsname=bench-noopfs")
    if args.census is not None and (fuseext is None or not fuseext.census_arm()):
        sys.exit("noopfs: --census needs zonefs-py's FUSE extension (zonefs_py._fuseext)")
    pyfuse3.init(NoopOperations(), args.mountpoint, options)
    try:
        trio.run(serve, os.path.abspath(args.mountpoint), args.census)
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    main()
