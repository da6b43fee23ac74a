"""Requests on open files and directories of ZoneFS (a mixin): open, create,
read, write, flush, release, fsync, fallocate, copy_file_range, and the
directory handles (opendir, readdir, releasedir, fsyncdir).

Split from fs/filesystem.py to keep modules small; `ZoneFS` inherits these and
provides the members listed in `HandleOps`. A file handle is an index into
`files` (fh -> ino) and counts in `Inode.opens`, so an unlinked file keeps its
blocks until its last release (`_free_if_unused`).
"""

from __future__ import annotations

import logging
import os
import stat as statmod
import time
from typing import TYPE_CHECKING

import trio

from zonefs_py import errors
from zonefs_py.alloc.allocator import Allocator
from zonefs_py.drain.manager import DrainManager
from zonefs_py.format.constants import FLAG_STREAM_SET
from zonefs_py.format.ops import Op
from zonefs_py.fs.api import (
    FILE_SIZE_MAX,
    ROOT_CTX,
    ROOT_INO,
    Attr,
    Ctx,
    DirEntry,
    FallocFlags,
)
from zonefs_py.fs.clock import now_ns
from zonefs_py.fs.cstreams import CStreamEngine
from zonefs_py.fs.data.datapath import CHUNK_BYTES, DataPath
from zonefs_py.fs.inline import InlineData, drop_idle_lock
from zonefs_py.fs.latency import Histogram
from zonefs_py.fs.options import FsOptions
from zonefs_py.fs.prealloc import Fallocator
from zonefs_py.fs.quota import QuotaTracker
from zonefs_py.fs.reflink import Copier
from zonefs_py.fs.spacegate import SpaceGate
from zonefs_py.fs.tenantspace import TenantSpace
from zonefs_py.journal.journal import Journal
from zonefs_py.journal.nsindex import NotCached
from zonefs_py.model.lazy import LazyEntries
from zonefs_py.model.state import Inode, State

log = logging.getLogger(__name__)


class DirHandle:
    """An open directory: its inode and the names it held at opendir (or the
    last rewind), which readdir offsets index. A directory of a lazy State
    (LazyEntries) is listed in name order a batch at a time instead, never
    whole: `names` is None, and `marks` maps the offset of each entry of the
    last batch given to its name, where a readdir at that offset goes on from."""

    __slots__ = ("ino", "marks", "names")

    def __init__(self, ino: int, names: list[bytes] | None) -> None:
        self.ino = ino
        self.names = names
        self.marks: dict[int, bytes] = {}


#: Entries one readdir of a lazy directory returns at most.
READDIR_BATCH = 1024
#: A write this large (the engine's streaming chunk) may arm the file's C write stream.
STREAM_MIN_BYTES = CHUNK_BYTES


class HandleOps:
    """File and directory handle requests, for ZoneFS (see the module docstring)."""

    # Provided by ZoneFS:
    state: State
    options: FsOptions
    data: DataPath
    inline: InlineData
    journal: Journal
    alloc: Allocator
    drain: DrainManager
    falloc: Fallocator
    copier: Copier
    quota: QuotaTracker
    space_gate: SpaceGate
    tenant_space: TenantSpace
    files: dict[int, int]
    dirs: dict[int, DirHandle]
    failsafe: str | None
    bytes_read: int
    read_latency: Histogram
    write_latency: Histogram
    _next_fh: int

    if TYPE_CHECKING:  # the rest of ZoneFS, for the type checker only
        def _writable(self) -> None: ...
        def path_of(self, ino: int) -> str: ...
        def inode(self, ino: int) -> Inode: ...
        def _dir(self, ino: int) -> Inode: ...
        def attr(self, inode: Inode) -> Attr: ...
        def _free_if_unused(self, inode: Inode) -> None: ...
        def wake_background(self) -> None: ...
        def _check_quota(self, inode: Inode, extra_bytes: int) -> None: ...
        async def _flush_file(self, inode: Inode, wait: bool = True) -> None: ...
        async def _admit_create(self, parent_ino: int, name: bytes) -> Inode: ...
        def _drop_privileges(self, inode: Inode, ctx: Ctx, now: int) -> list[Op]: ...
        def _new_inode_op(self, mode: int, ctx: Ctx, parent: Inode, nlink: int,
                          rdev: int = 0, size: int = 0, flags: int = 0) -> Op: ...
        def _stream_flags(self, d: Inode, name: bytes) -> int: ...
        def _create_node(self, d: Inode, name: bytes, op: Op,
                         extra: list[Op] | None = None, is_dir: bool = False) -> Inode: ...

    #: The engine's side of C write streams (fs/cstreams.py), None without them.
    c_streams: CStreamEngine | None = None

    # -- files ---------------------------------------------------------------------------
    def _new_fh(self, ino: int) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self.files[fh] = ino
        self.state.inodes[ino].opens += 1
        return fh

    def _fh_inode(self, fh: int) -> Inode:
        try:
            return self.state.inodes[self.files[fh]]
        except KeyError:
            raise errors.InvalidArgument(f"bad file handle {fh}") from None

    async def open(self, ino: int, flags: int, ctx: Ctx = ROOT_CTX) -> int:
        inode = self.inode(ino)
        if inode.is_dir:
            raise errors.IsDirectory("use opendir for directories")
        writing = flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
        if writing or flags & os.O_TRUNC:
            self._writable()
        await self.drain.before_open(inode, flags)
        fh = self._new_fh(ino)
        maps = self.data.reads.maps
        if maps is not None and not writing and not flags & os.O_TRUNC and inode.is_reg:
            maps.after_open(inode)  # the first READ answered in C too (DESIGN 4.10)
        if flags & os.O_TRUNC and inode.is_reg:
            try:
                now = now_ns()
                ops: list[Op] = []
                if self.data.visible_size(inode) > 0:
                    ops += await self.data.truncate(inode, 0, now)
                    ops += self.inline.truncate_ops(inode, 0)
                # The kernel leaves an O_TRUNC to us (atomic_o_trunc), kill-priv too.
                ops += self._drop_privileges(inode, ctx, now)
                if ops:
                    self.journal.add(ops)
            except BaseException:
                await self.release(fh)
                raise
        return fh

    async def create(self, parent_ino: int, name: bytes, mode: int, flags: int,
                     ctx: Ctx) -> tuple[int, Attr]:
        d = await self._admit_create(parent_ino, name)
        op = self._new_inode_op(statmod.S_IFREG | (mode & 0o7777), ctx, d, 1,
                                flags=self._stream_flags(d, name))
        inode = self._create_node(d, name, op)
        return self._new_fh(inode.ino), self.attr(inode)

    async def read(self, fh: int, offset: int, length: int) -> bytes | memoryview:
        inode = self._fh_inode(fh)
        if offset < 0:
            raise errors.InvalidArgument("negative offset")
        t0 = time.perf_counter_ns()
        if self.data.writes_arriving(inode.ino):
            # Served after the writes that reached us first (DataPath.write_arriving).
            await self.data.after_earlier_writes(inode.ino)
        if inode.inline:
            small = self.inline.read(inode, self.data.visible_size(inode), offset, length)
            self.bytes_read += len(small)
            return small
        data = await self.data.reads.read(inode, offset, length)
        maps = self.data.reads.maps
        if maps is not None:
            # Served here, not in C: publish the map if nothing can change the file.
            maps.after_python_read(inode)
        self.read_latency.record(time.perf_counter_ns() - t0)
        self.bytes_read += len(data)
        return data

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        self._writable()
        inode = self._fh_inode(fh)
        with self.data.write_arriving(inode.ino, offset + len(data)):
            return await self._write(inode, offset, data)

    async def _write(self, inode: Inode, offset: int, data: bytes) -> int:
        if offset < 0:
            raise errors.InvalidArgument("negative offset")
        if offset + len(data) > FILE_SIZE_MAX:
            raise errors.FileTooBig(f"write past the largest file size at {offset}")
        end = offset + len(data)
        visible = self.data.visible_size(inode)
        # New bytes: those past the visible end. A hole before them takes no space,
        # and blocks reserved by fallocate were charged already (INV-24).
        grow = min(end - visible, len(data))
        tenant = 0
        if grow > 0:
            start = max(offset, visible)
            grow -= self.falloc.held_bytes_in(inode, start, end - start)
        if grow > 0:
            self._check_quota(inode, grow)
            over = self.falloc.used_bytes() + grow - self.alloc.user_capacity_bytes()
            if over > 0 and self.c_streams is not None and self.c_streams.give_back():
                # Credit admitted ahead for C write streams is space nobody wrote yet.
                over = self.falloc.used_bytes() + grow - self.alloc.user_capacity_bytes()
            if over > 0 and not await self.drain.relieve_space(over):
                raise errors.NoSpace("the live data would not fit on the device")
            tenant = await self._admit_tenant(inode, grow)
        # From the check (no await since) until the bytes are pending: counted as
        # used, so that a concurrent request's check sees them (FileWrites.admit),
        # for the device and for the file's tenant (fs/tenantspace.py).
        admitted = self.data.writes.admit(
            max(0, grow), self.tenant_space.admit(tenant, grow) if grow > 0 else None)
        try:
            self.drain.on_write(inode)
            if inode.inline:
                await self.inline.convert(inode)
            t0 = time.perf_counter_ns()
            n = await self.data.write(inode, offset, data, admitted)
        finally:
            admitted.settle()
        self.write_latency.record(time.perf_counter_ns() - t0)
        self.quota.count_written(inode, n)
        if self.c_streams is not None:  # C may take the file's next WRITEs (issue 44)
            self.c_streams.after_write(inode, offset, n, n >= STREAM_MIN_BYTES)
        self.space_gate.check()  # the write gate (fs/spacegate.py) may close now
        if self.journal.pending_bytes > (4 << 20):
            self.wake_background()
        return n

    async def _admit_tenant(self, inode: Inode, grow: int) -> int:
        """Hold a write of `grow` new bytes to the cap of the file's tenant, as the
        device's admission does (issue 45): raise NoSpace when its live and pending
        bytes would exceed what its `max_zones` hold, after evicting drained files
        of that tenant. Returns the tenant (0: none). Never awaits unless over."""
        if not self.state.tenants:
            return 0
        tenant = self.tenant_space.tenant_of(inode)
        if not tenant:
            return 0
        # The file's stream: room in the tenant's zones of other streams is not its.
        stream = inode.stream if inode.flags & FLAG_STREAM_SET else None
        over = self.tenant_space.over_bytes(tenant, grow, stream)
        if over > 0 and not (await self.drain.relieve_space(over, tenant=tenant)
                             and self.tenant_space.over_bytes(tenant, grow, stream) <= 0):
            policy = self.state.tenants.get(tenant)
            where = self.path_of(policy.dir_ino) if policy is not None else f"#{tenant}"
            raise errors.NoSpace(f"tenant {where} is at its cap (--max-zones)")
        return tenant

    async def flush(self, fh: int) -> None:
        inode = self._fh_inode(fh)
        if self.failsafe is None and not self.options.read_only:
            # A close: the data goes to the device without the caller waiting for it
            # (close(2) promises no durability; fsync does, DESIGN 4.3). RELEASE, which
            # the kernel sends without making anyone wait, waits for it.
            await self._flush_file(inode, wait=False)

    async def release(self, fh: int) -> None:
        ino = self.files.pop(fh, None)
        if ino is None:
            return
        inode = self.state.inodes.get(ino)
        if inode is None:
            return
        inode.opens -= 1
        if inode.opens == 0:
            if self.failsafe is None and not self.options.read_only:
                await self._flush_file(inode, wait=False)
                # The chunk a close sent lands before the file's zones and drain
                # state are let go; its error, if any, stays for the next fsync or
                # close of the file (write_errors), as a writeback error would.
                await self.data.wait_written(inode)
                err = self.data.writes.write_errors.get(ino)
                if err is not None:
                    log.error("writing inode %d after its last close failed: %s (the "
                              "next fsync or close of the file reports it)", ino, err)
                drop_idle_lock(self.data, ino)
                to_finish: list[int] = []
                self.alloc.release_owner(ino, to_finish)
                if to_finish:
                    try:
                        await self.data.sealer.close_zones(to_finish)
                    except OSError as exc:
                        log.error("finishing zones %s failed: %s", to_finish, exc)
                self.drain.on_release(inode)
            self._free_if_unused(inode)

    async def fsync(self, fh: int, datasync: bool) -> None:
        inode = self._fh_inode(fh)
        if self.options.read_only:
            return
        self._writable()
        with self.journal.urgent():  # a checkpoint encoding meanwhile makes room for it
            await self._flush_file(inode)
            self.drain.on_fsync(inode)
            await self.journal.commit()

    async def fallocate(self, fh: int, mode: FallocFlags, offset: int, length: int) -> None:
        self._writable()
        inode = self._fh_inode(fh)
        with self.data.write_arriving(inode.ino):
            await self.falloc.fallocate(inode, mode, offset, length)
        self.space_gate.check()

    async def copy_file_range(self, fh_in: int, off_in: int, fh_out: int, off_out: int,
                              length: int, flags: int) -> int:
        self._writable()
        if flags:
            raise errors.InvalidArgument(f"copy_file_range flags {flags:#x}")
        src = self._fh_inode(fh_in)
        dst = self._fh_inode(fh_out)
        with self.data.write_arriving(dst.ino) as arrival:
            copied = await self.copier.copy(src, off_in, dst, off_out, length, arrival)
        self.space_gate.check()
        return copied

    async def _read_inode(self, inode: Inode, offset: int, length: int,
                          before: int | None = None) -> bytes | memoryview:
        """Read an inode's bytes (inline or in blocks), as `read` does for a handle,
        after the write requests that arrived before now (or before request
        `before`: `WriteState.after_earlier_writes`)."""
        if self.data.writes_arriving(inode.ino):
            await self.data.after_earlier_writes(inode.ino, before)
        if inode.inline:
            return self.inline.read(inode, self.data.visible_size(inode), offset, length)
        return await self.data.read(inode, offset, length)

    # -- directories -------------------------------------------------------------------------
    async def opendir(self, ino: int) -> int:
        d = self._dir(ino)
        assert d.entries is not None
        fh = self._next_fh
        self._next_fh += 1
        self.dirs[fh] = DirHandle(
            ino, None if isinstance(d.entries, LazyEntries) else list(d.entries))
        d.opens += 1
        return fh

    async def readdir(self, dh: int, offset: int) -> list[DirEntry]:
        """Entries from position `offset` of the snapshot taken at opendir (0 refreshes it).

        Offsets index the snapshot, so they stay valid however the directory
        changes; names removed since are skipped; names added since show up
        after a rewind (offset 0), as POSIX allows.
        """
        h = self.dirs.get(dh)
        if h is None:
            raise errors.InvalidArgument(f"bad directory handle {dh}")
        d = self.inode(h.ino)
        assert d.entries is not None
        if isinstance(d.entries, LazyEntries):
            reader = self.state.inodes.reader
            try:
                with reader.cached_only():
                    return self._readdir_streamed(h, d, d.entries, offset)
            except NotCached:
                # The names and their inodes read in a worker thread first.
                after = h.marks.get(offset)
                await trio.to_thread.run_sync(reader.warm_names, d.ino, after, READDIR_BATCH)
                return self._readdir_streamed(h, d, d.entries, offset)
        if offset == 0:
            h.names = list(d.entries)
        assert h.names is not None
        out: list[DirEntry] = []
        specials = [(b".", d.ino), (b"..", d.parent or ROOT_INO)]
        for i in range(offset, len(h.names) + 2):
            if i < 2:
                name, ino = specials[i]
            else:
                name = h.names[i - 2]
                child = d.entries.get(name)
                if child is None:
                    continue
                ino = child
            inode = self.state.inodes.get(ino)
            if inode is None:
                continue
            out.append(DirEntry(name, self.attr(inode), i + 1))
            if len(out) >= 1024:
                break
        return out

    def _readdir_streamed(self, h: DirHandle, d: Inode, entries: LazyEntries,
                          offset: int) -> list[DirEntry]:
        """readdir of a lazy directory: entries in name order from `offset`, the
        offset of the last entry given (entry k of the listing has offset k + 1;
        "." and ".." are 1 and 2). A directory changed meanwhile: names added or
        removed may or may not show, every other name shows once (POSIX)."""
        out: list[DirEntry] = []
        if offset < 1:
            out.append(DirEntry(b".", self.attr(d), 1))
        if offset < 2:
            parent = self.state.inodes.get(d.parent or ROOT_INO)
            out.append(DirEntry(b"..", self.attr(parent if parent is not None else d), 2))
        pos = max(offset, 2)
        if pos == 2:
            after: bytes | None = None
        elif pos in h.marks:
            after = h.marks[pos]
        else:
            # A seek elsewhere (telldir/seekdir): count from the first name.
            after, skip = None, pos - 2
            while skip > 0:
                batch = entries.names_after(after, min(skip, 1024))
                if not batch:
                    return out
                take = batch[:skip]
                skip -= len(take)
                after = take[-1][0]
        marks: dict[int, bytes] = {}
        for name, ino in entries.names_after(after, READDIR_BATCH):
            inode = self.state.inodes.get(ino)
            if inode is None:
                continue
            pos += 1
            out.append(DirEntry(name, self.attr(inode), pos))
            marks[pos] = name
            if len(out) >= READDIR_BATCH:
                break
        if marks:
            h.marks = marks  # only once done (a NotCached above leaves them as they were)
        return out

    async def releasedir(self, dh: int) -> None:
        h = self.dirs.pop(dh, None)
        if h is not None:
            d = self.state.inodes.get(h.ino)
            if d is not None:
                d.opens -= 1
                self._free_if_unused(d)

    async def fsyncdir(self, dh: int, datasync: bool) -> None:
        if dh not in self.dirs:
            raise errors.InvalidArgument(f"bad directory handle {dh}")
        if not self.options.read_only:
            self._writable()
            await self.journal.commit()
