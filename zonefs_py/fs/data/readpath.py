"""The read path: a file's bytes from its extents, chunks in flight and buffer.

Reads merge the extent map (device reads, every block checked against its
xxh3 checksum; a mismatch is `errors.IOFailure` and a log line naming the
file and offset) with the file's write state (`fs/data/writestate.py`). Reads of
a file without write state take no lock, so dataset reads never queue behind
another file's writes; readers of a file with write state take its lock and
see extents, then in-flight chunks, then the buffer, newest last.

Fast path (`fast_read`, on unless `-o fast_read=off`): a read of a file
without write state whose range is one mapped piece (or one hole) in one
zone, below the file's size, with its checksums at hand (in the extent map,
or in the summary cache for a sealed zone), is one call into C that submits
the device read with the blocks' checksums and one await for its
completion, verified in C when it is reaped (`device/aread.py`). Everything
else (several pieces: zone appends scatter a chunk; a summary block not
cached; no io_uring) takes the general path, `_read_view`, which reads every
piece (all in flight at once through the ring) and verifies them on the
trio thread. Both give the same bytes and the same errors (a damaged block
is EIO for exactly the reads that cover it; tests/unit/test_fast_read.py).

INV-8 (no zone reset under a read): the mapping is looked up and every zone
it touches pinned in one step (no await between), on both paths, so the read
is of the file as it was at that instant however the map changes while the
device reads run (chunks landing, the cleaner re-pointing).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NoReturn, Protocol

import trio

from zonefs_py import errors
from zonefs_py.alloc.allocator import Allocator
from zonefs_py.device.aread import AsyncReader, BadChecksum
from zonefs_py.device.base import ZonedDevice
from zonefs_py.format.checksum import Data, first_bad_block
from zonefs_py.fs.data.prefetch import Prefetcher
from zonefs_py.fs.data.writestate import FileWrites
from zonefs_py.fs.data.zonesums import SumCache
from zonefs_py.fs.tasks import MountTasks
from zonefs_py.model.extents import Piece
from zonefs_py.model.state import Inode, State
from zonefs_py.model.tenants import tenant_of

log = logging.getLogger(__name__)


class ReadMaps(Protocol):
    """What the engine asks of the data plane's read maps (zonefs_py/dataplane,
    DESIGN 4.10): the engine calls these, the data plane implements them, so no
    engine module imports the layer above it."""

    def revoke(self, ino: int) -> None:
        """No READ of `ino` is served from a published map once this returns."""

    def after_python_read(self, inode: Inode) -> None:
        """A READ of `inode` was served in Python: publish its map if it is settled."""

    def after_open(self, inode: Inode) -> None:
        """`inode` was opened for reading: publish its map now if it is settled and not
        published, so that its first READ is answered in C too."""


class ReadPath:
    """Reads of file data (module docstring)."""

    def __init__(self, dev: ZonedDevice, state: State, alloc: Allocator, writes: FileWrites,
                 sums: SumCache, read_limiter: trio.CapacityLimiter,
                 path_of: Callable[[int], str], tasks: MountTasks, *,
                 reader: AsyncReader | None = None,
                 prefetch_bytes: int = 0, fast: bool = True) -> None:
        self.dev = dev
        #: The mount's task group: read-ahead segments run in it.
        self.tasks = tasks
        self.state = state
        self.alloc = alloc
        self.writes = writes
        self.sums = sums
        self.read_limiter = read_limiter
        self.path_of = path_of
        self.bs = dev.info.block_size
        self.zone_size = dev.info.zone_size_bytes
        #: Thread-free reads (io_uring) when the device allows, else None.
        self.reader = reader
        #: Sequential read-ahead (None: off, `prefetch_mb=0`).
        self.prefetch: Prefetcher | None = None
        if prefetch_bytes:
            self.enable_prefetch(prefetch_bytes)
        #: The fast path (module docstring); False: every read takes the general path.
        self.fast = fast
        #: The data plane's read maps (zonefs_py/dataplane) when READs are served in
        #: C: revoked before every change to a file's bytes, published after reads.
        self.maps: ReadMaps | None = None
        #: Reads served by the fast path, and by the general one.
        self.fast_reads = 0
        self.general_reads = 0

    def enable_prefetch(self, window_bytes: int) -> None:
        """Read files that are read sequentially ahead of their requests (fs/data/prefetch.py)."""
        async def read_stored(ino: int, offset: int, length: int) -> bytes | memoryview:
            return await self._stored(self.state.inodes[ino], offset, length)

        self.prefetch = Prefetcher(read_stored, self.tasks, window_bytes)

    def data_changed(self, ino: int) -> None:
        """State hook: the file's stored bytes change now; read-ahead of it is stale."""
        if self.prefetch is not None:
            self.prefetch.forget(ino)
        if self.maps is not None:
            self.maps.revoke(ino)

    def layout_changed(self, ino: int) -> None:
        """State hook: the file's size or placement changes now; its read map goes."""
        if self.maps is not None:
            self.maps.revoke(ino)

    # -- read ------------------------------------------------------------------------
    async def read(self, inode: Inode, offset: int, length: int) -> bytes | memoryview:
        """The file's bytes; a read-only view when one device read served it."""
        bandwidth = self.writes.bandwidth
        tenant = tenant_of(self.state, inode)
        bandwidth.read_started(tenant)
        nbytes = 0
        try:
            out = await self._read(inode, offset, length)
            nbytes = len(out)
            return out
        finally:
            bandwidth.read_done(tenant, nbytes)

    async def _read(self, inode: Inode, offset: int, length: int) -> bytes | memoryview:
        ino = inode.ino
        writes = self.writes
        qos = writes.qos
        if ino in writes.buffers or ino in writes.inflight:
            size = writes.visible_size(inode)
            if offset >= size or length <= 0:
                return b""
            length = min(length, size - offset)
            token = qos.read_started()
            try:
                # The writer may hold the lock while its chunks wait at the gate:
                # release them rather than make this read wait for the allowance.
                with qos.expedited(ino):
                    async with writes.lock(ino):
                        return await self.read_locked(inode, offset, length)
            finally:
                qos.read_done(token)
        size = inode.size
        if offset >= size or length <= 0:
            return b""
        if length > size - offset:
            length = size - offset
        token = qos.read_started()
        try:
            if self.prefetch is not None:
                ahead = await self.prefetch.read(ino, offset, length, size)
                if ahead is not None:
                    return ahead
            return await self._stored(inode, offset, length)
        finally:
            qos.read_done(token)

    async def _stored(self, inode: Inode, offset: int, length: int) -> bytes | memoryview:
        """`_read_view` through the fast path where it applies."""
        if self.fast and self.reader is not None and offset + length <= inode.size:
            out = await self._read_fast(inode, offset, length)
            if out is not None:
                return out
        self.general_reads += 1
        return await self._read_view(inode, offset, length)

    async def _read_fast(self, inode: Inode, offset: int, length: int
                         ) -> bytes | memoryview | None:
        """[offset, offset+length) (within the size) as one verified device read, or
        None when the range is not one piece in one zone with its checksums at hand."""
        bs = self.bs
        fb0 = offset // bs
        assert inode.extents is not None
        pieces = inode.extents.lookup(fb0, (offset + length + bs - 1) // bs - fb0, bs)
        if len(pieces) != 1:
            return None
        p = pieces[0]
        dev_off = p.dev
        if dev_off is None:
            self.fast_reads += 1
            return bytes(length)
        nbytes = p.nblocks * bs
        zone = dev_off // self.zone_size
        if (dev_off + nbytes - 1) // self.zone_size != zone:
            return None
        csums = p.csums
        if csums is None:
            csums = self.sums.cached(dev_off, p.nblocks)
            if csums is None:
                return None
        if len(csums) != p.nblocks * 4:
            return None  # the general path reports the inconsistent mapping
        reader = self.reader
        assert reader is not None
        self.fast_reads += 1
        self.alloc.pin_read(zone)
        try:
            data = await reader.read(dev_off, nbytes, csums)
        except BadChecksum as exc:
            self._bad_block(inode.ino, p.fblock, dev_off, exc.block)
        except OSError as exc:
            self._read_failed(inode.ino, p.fblock, exc)
        finally:
            self.alloc.unpin_read(zone)
        skip = offset - fb0 * bs
        if skip == 0 and nbytes == length:
            return data
        return data[skip:skip + length]

    async def read_locked(self, inode: Inode, offset: int, length: int
                           ) -> bytes | memoryview:
        """The file's bytes as readers see them: extents, then in-flight chunks, then
        the buffer, newest last (the caller holds the file's lock)."""
        # Snapshot the in-flight chunks first: one that lands while the extents
        # are read leaves the in-flight list but may be missing from the extent
        # map as it was looked up (that read would see a hole).
        layers: list[tuple[int, bytes | bytearray]] = [
            (c.fblock * self.bs, c.data) for c in self.writes.inflight.get(inode.ino, ())]
        data = await self._stored(inode, offset, length)
        buf = self.writes.buffers.get(inode.ino)
        if buf is not None:
            layers.append((buf.start, buf.data))
        out: bytearray | None = None
        for start, blob in layers:
            lo = max(offset, start)
            hi = min(offset + length, start + len(blob))
            if lo >= hi:
                continue
            if out is None:
                out = bytearray(data)
                if len(out) < length:
                    out += bytes(length - len(out))
            out[lo - offset:hi - offset] = blob[lo - start:hi - start]
        return data if out is None else bytes(out)

    async def read_stored(self, inode: Inode, offset: int, length: int) -> bytes:
        """Read [offset, offset+length) from the extents only (holes are zeros)."""
        data = await self._stored(inode, offset, length)
        return data if isinstance(data, bytes) else bytes(data)

    async def _read_view(self, inode: Inode, offset: int, length: int) -> bytes | memoryview:
        """`read_stored`, but a single device read comes back as the reader's
        read-only view (no copy): for `read()`, whose result goes straight to
        the reply.

        The mapping is looked up and every zone it touches pinned in one step
        (no await between): the read is of the file as it was at that instant,
        however the map changes while the device reads run (chunks landing,
        the cleaner re-pointing), and no zone it reads is reset under it
        (INV-8).
        """
        assert inode.extents is not None
        bs = self.bs
        end = min(offset + length, max(inode.size, offset))
        if end <= offset:
            return bytes(length)
        fb0 = offset // bs
        fb1 = (end + bs - 1) // bs
        pieces = inode.extents.lookup(fb0, fb1 - fb0, bs)
        zsize = self.zone_size
        pinned = [z for p in pieces if p.dev is not None
                  for z in range(p.dev // zsize, (p.dev + p.nblocks * bs - 1) // zsize + 1)]
        for z in pinned:
            self.alloc.pin_read(z)
        parts: list[bytes | memoryview] = []
        try:
            if any(p.csums is None for p in pieces if p.dev is not None):
                pieces = await self._with_checksums(inode.ino, pieces)
            scattered = sum(1 for p in pieces if p.dev is not None) > 1
            if scattered and self.reader is not None and self.reader.uses_ring:
                # Scattered pieces (zone append): all device reads in flight at once.
                parts = await self._read_pieces(inode.ino, pieces)
            else:
                for p in pieces:
                    if p.dev is None:
                        parts.append(bytes(p.nblocks * bs))
                    else:
                        parts.append(await self._read_extent(inode.ino, p.fblock, p.dev,
                                                             p.nblocks * bs, p.csums))
        finally:
            for z in pinned:
                self.alloc.unpin_read(z)
        blob = b"".join(parts) if len(parts) != 1 else parts[0]
        skip = offset - fb0 * bs
        out = blob[skip:skip + (end - offset)]
        if len(out) < length:
            return bytes(out) + bytes(length - len(out))
        return out

    async def _with_checksums(self, ino: int, pieces: list[Piece]) -> list[Piece]:
        """The pieces, those of sealed zones with their checksums from the zone
        summaries (`SumCache`; the caller pinned their zones)."""
        out: list[Piece] = []
        for p in pieces:
            if p.dev is not None and p.csums is None:
                p = p._replace(csums=await self.sums.checksums(ino, p.fblock, p.dev, p.nblocks))
            out.append(p)
        return out

    async def _read_pieces(self, ino: int, pieces: list[Piece]) -> list[bytes | memoryview]:
        """Every piece's bytes (holes as zeros), the device reads in flight at once
        through the ring reader, each verified against its own checksums."""
        assert self.reader is not None
        bs = self.bs
        spans = [(p.dev, p.nblocks * bs) for p in pieces if p.dev is not None]
        try:
            datas = iter(await self.reader.read_many(spans))
        except OSError as exc:
            self._read_failed(ino, next(p.fblock for p in pieces if p.dev is not None), exc)
        parts: list[bytes | memoryview] = []
        for p in pieces:
            if p.dev is None:
                parts.append(bytes(p.nblocks * bs))
                continue
            data = next(datas)
            self._verify(ino, p.fblock, p.dev, data, p.csums)
            parts.append(data)
        return parts

    async def _read_extent(self, ino: int, fblock: int, dev_off: int, nbytes: int,
                           csums: bytes | None) -> bytes | memoryview:
        if self.reader is not None and self.reader.uses_ring:
            # Read without a worker thread; verify here (C, ~0.1 ms per MiB).
            try:
                data = await self.reader.read(dev_off, nbytes)
            except OSError as exc:
                self._read_failed(ino, fblock, exc)
            self._verify(ino, fblock, dev_off, data, csums)
            return data
        data = await trio.to_thread.run_sync(self._read_verify, ino, fblock, dev_off, nbytes,
                                             csums, limiter=self.read_limiter)
        return data

    def _read_verify(self, ino: int, fblock: int, dev_off: int, nbytes: int,
                     csums: bytes | None) -> bytes:
        """Worker thread: read device blocks and check every checksum."""
        try:
            data = self.dev.read(dev_off, nbytes)
        except OSError as exc:
            self._read_failed(ino, fblock, exc)
        self._verify(ino, fblock, dev_off, data, csums)
        return data

    def _read_failed(self, ino: int, fblock: int, exc: OSError) -> NoReturn:
        log.error("read error in %s at file offset %d: %s", self.path_of(ino),
                  fblock * self.bs, exc)
        raise errors.IOFailure(f"device read failed: {exc}") from exc

    def _verify(self, ino: int, fblock: int, dev_off: int, data: Data,
                csums: bytes | None) -> None:
        """Check every block of `data` against `csums`; a mismatch (or a mapping whose
        checksums do not cover its blocks) is an `IOFailure` for this file alone."""
        nblocks = len(data) // self.bs
        if csums is None or len(csums) != nblocks * 4:
            # An inconsistency of this file's mapping, not of the device or the
            # metadata as a whole: EIO for this read, the mount stays writable.
            log.error("internal error in %s at file offset %d: %d checksums for %d blocks "
                      "(device offset %d); the read fails with EIO", self.path_of(ino),
                      fblock * self.bs, len(csums or b"") // 4, nblocks, dev_off)
            raise errors.IOFailure(f"inconsistent mapping at file offset {fblock * self.bs}")
        bad = first_bad_block(data, self.bs, csums)
        if bad is not None:
            self._bad_block(ino, fblock, dev_off, bad)

    def _bad_block(self, ino: int, fblock: int, dev_off: int, bad: int) -> NoReturn:
        file_off = (fblock + bad) * self.bs
        log.error("checksum mismatch in %s at file offset %d (device offset %d)",
                  self.path_of(ino), file_off, dev_off + bad * self.bs)
        raise errors.IOFailure(f"checksum mismatch at file offset {file_off}")
