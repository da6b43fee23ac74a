#!/usr/bin/env python3
"""Plain pyfuse3 passthrough filesystem: the Python FUSE peer for the benchmark.

It mirrors a source directory (in the benchmark: ext4 on a loop device) the way
pyfuse3's own `examples/passthroughfs.py` does, i.e. what a user would write in
an afternoon: FUSE inodes are the source's inode numbers, an inode → path map
is kept with lookup counts, and every handler makes blocking `os` calls directly
in the trio loop (no threads, no caching of its own).

Usage: passthroughfs.py SOURCE MOUNTPOINT  (always foreground)

Caveats:
- Hard links and files renamed while open keep the first path seen.
- O_DIRECT is passed down to the source file (through page-aligned buffers), so
  direct I/O benchmarks reach the disk instead of the source's page cache; an
  fd shared by two opens keeps the flags of the first.
- No writeback cache; the kernel's page cache still serves buffered reads.
- Blocking calls stall the whole loop, as in the example; that is the point of
  a peer that is easy to write rather than fast.
"""

from __future__ import annotations

import argparse
import errno
import mmap
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager

import pyfuse3
import trio


@contextmanager
def _errno_from_oserror() -> Iterator[None]:
    """Turn OSError into the FUSEError pyfuse3 expects."""
    try:
        yield
    except OSError as exc:
        raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None


class PassthroughOperations(pyfuse3.Operations):
    """Forward every request to the matching path under a source directory."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, source: str) -> None:
        super().__init__()
        self._inode_path: dict[int, str] = {pyfuse3.ROOT_INODE: source}
        self._lookup_count: dict[int, int] = {}
        self._fd_inode: dict[int, int] = {}
        self._inode_fd: dict[int, int] = {}
        self._fd_open_count: dict[int, int] = {}
        #: fds opened with O_DIRECT: their I/O goes through page-aligned buffers.
        self._direct_fds: set[int] = set()

    # -- helpers ---------------------------------------------------------
    def _path(self, inode: int) -> str:
        try:
            return self._inode_path[inode]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    def _child(self, parent_inode: int, name: bytes) -> str:
        return os.path.join(self._path(parent_inode), os.fsdecode(name))

    def _remember(self, path: str, attr: pyfuse3.EntryAttributes) -> None:
        self._inode_path.setdefault(attr.st_ino, path)
        self._lookup_count[attr.st_ino] = self._lookup_count.get(attr.st_ino, 0) + 1

    def _stat(self, path: str | None = None, fd: int | None = None) -> pyfuse3.EntryAttributes:
        with _errno_from_oserror():
            st = os.fstat(fd) if fd is not None else os.lstat(path)  # type: ignore[arg-type]
        attr = pyfuse3.EntryAttributes()
        for name in ("st_ino", "st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev",
                     "st_size", "st_atime_ns", "st_mtime_ns", "st_ctime_ns"):
            setattr(attr, name, getattr(st, name))
        attr.st_blksize = st.st_blksize
        attr.st_blocks = st.st_blocks
        attr.generation = 0
        attr.entry_timeout = 0
        attr.attr_timeout = 0
        return attr

    # -- namespace -------------------------------------------------------
    async def lookup(self, parent_inode: int, name: bytes,
                     ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        path = self._child(parent_inode, name)
        attr = self._stat(path)
        if name not in (b".", b".."):
            self._remember(path, attr)
        return attr

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for inode, nlookup in inode_list:
            left = self._lookup_count.get(inode, 0) - nlookup
            if left > 0:
                self._lookup_count[inode] = left
                continue
            self._lookup_count.pop(inode, None)
            if inode not in self._inode_fd:
                self._inode_path.pop(inode, None)

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        fd = self._inode_fd.get(inode)
        return self._stat(fd=fd) if fd is not None else self._stat(self._path(inode))

    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes,
                      fields: pyfuse3.SetattrFields, fh: int | None,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        path = self._path(inode)
        with _errno_from_oserror():
            if fields.update_size:
                if fh is not None:
                    os.ftruncate(fh, attr.st_size)
                else:
                    os.truncate(path, attr.st_size)
            if fields.update_mode:
                os.chmod(path, stat.S_IMODE(attr.st_mode))
            if fields.update_uid or fields.update_gid:
                uid = attr.st_uid if fields.update_uid else -1
                gid = attr.st_gid if fields.update_gid else -1
                os.chown(path, uid, gid, follow_symlinks=False)
            if fields.update_atime or fields.update_mtime:
                st = os.lstat(path)
                atime = attr.st_atime_ns if fields.update_atime else st.st_atime_ns
                mtime = attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns
                os.utime(path, None, ns=(atime, mtime), follow_symlinks=False)
        return await self.getattr(inode, ctx)

    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        path = self._child(parent_inode, name)
        with _errno_from_oserror():
            os.mkdir(path, mode & ~ctx.umask)
        attr = self._stat(path)
        self._remember(path, attr)
        return attr

    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        with _errno_from_oserror():
            os.unlink(self._child(parent_inode, name))

    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        with _errno_from_oserror():
            os.rmdir(self._child(parent_inode, name))

    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: pyfuse3.RequestContext) -> None:
        if flags != 0:
            raise pyfuse3.FUSEError(errno.EINVAL)
        old = self._child(parent_inode_old, name_old)
        new = self._child(parent_inode_new, name_new)
        with _errno_from_oserror():
            inode = os.lstat(old).st_ino
            os.rename(old, new)
        if inode in self._inode_path:
            self._inode_path[inode] = new

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        path = self._path(fh)
        with _errno_from_oserror():
            entries = sorted((e.inode(), e.name) for e in os.scandir(path))
        for ino, name in entries:
            if ino <= start_id:
                continue
            child = os.path.join(path, name)
            attr = self._stat(child)
            if not pyfuse3.readdir_reply(token, os.fsencode(name), attr, ino):
                break
            self._remember(child, attr)

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        with _errno_from_oserror():
            st = os.statvfs(self._path(pyfuse3.ROOT_INODE))
        data = pyfuse3.StatvfsData()
        for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail",
                     "f_files", "f_ffree", "f_favail", "f_namemax"):
            setattr(data, name, getattr(st, name))
        return data

    # -- data ------------------------------------------------------------
    def _track_fd(self, inode: int, fd: int, flags: int) -> pyfuse3.FileInfo:
        if flags & os.O_DIRECT:
            self._direct_fds.add(fd)
        self._inode_fd[inode] = fd
        self._fd_inode[fd] = inode
        self._fd_open_count[fd] = 1
        return pyfuse3.FileInfo(fh=fd)

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        fd = self._inode_fd.get(inode)
        if fd is not None:
            self._fd_open_count[fd] += 1
            return pyfuse3.FileInfo(fh=fd)
        with _errno_from_oserror():
            # One fd serves every open of the inode, so open it read-write.
            fd = os.open(self._path(inode), (flags & ~(os.O_CREAT | os.O_ACCMODE)) | os.O_RDWR)
        return self._track_fd(inode, fd, flags)

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext
                     ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        path = self._child(parent_inode, name)
        with _errno_from_oserror():
            fd = os.open(path, (flags & ~os.O_ACCMODE) | os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode)
        attr = self._stat(fd=fd)
        self._remember(path, attr)
        return self._track_fd(attr.st_ino, fd, flags), attr

    async def read(self, fh: int, off: int, size: int) -> bytes:
        with _errno_from_oserror():
            if fh not in self._direct_fds:
                return os.pread(fh, size, off)
            with mmap.mmap(-1, max(size, 1)) as buf:  # page-aligned, as O_DIRECT needs
                got = os.preadv(fh, [buf], off)
                return buf[:got]

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        with _errno_from_oserror():
            if fh not in self._direct_fds:
                return os.pwrite(fh, buf, off)
            with mmap.mmap(-1, max(len(buf), 1)) as aligned:
                aligned[: len(buf)] = buf
                return os.pwritev(fh, [memoryview(aligned)[: len(buf)]], off)

    async def flush(self, fh: int) -> None:
        return None

    async def fsync(self, fh: int, datasync: bool) -> None:
        with _errno_from_oserror():
            if datasync:
                os.fdatasync(fh)
            else:
                os.fsync(fh)

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        with _errno_from_oserror():
            fd = os.open(self._path(fh), os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    async def release(self, fh: int) -> None:
        self._fd_open_count[fh] -= 1
        if self._fd_open_count[fh] > 0:
            return
        del self._fd_open_count[fh]
        self._direct_fds.discard(fh)
        inode = self._fd_inode.pop(fh)
        del self._inode_fd[inode]
        if inode not in self._lookup_count:
            self._inode_path.pop(inode, None)
        with _errno_from_oserror():
            os.close(fh)

    async def releasedir(self, fh: int) -> None:
        return None


def main() -> None:
    """Mount SOURCE at MOUNTPOINT in the foreground until unmounted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("mountpoint")
    args = parser.parse_args()
    options = set(pyfuse3.default_options)
    options.add("fsname=bench-passthroughfs")
    pyfuse3.init(PassthroughOperations(os.path.abspath(args.source)), args.mountpoint, options)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    main()
