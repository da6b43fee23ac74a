"""The data plane: READs of settled files answered in C (issue 43, DESIGN 4.10).

native/zonefs_dispatch.c runs one C thread, the only reader of /dev/fuse: it
answers a READ of a file whose read map is published, from the device,
verified against the blocks' checksums, without the trio thread or the GIL;
every other request (and every READ it cannot serve) goes to pyfuse3's
unchanged loop in arrival order. This package is its Python side:

* `arm(...)` before `pyfuse3.init` (the dispatcher starts inside it when
  pyfuse3 asks for the session's fd); `started()` / `why_not()` after;
* `ReadMaps`: publishes a file's map after a READ of it that Python served,
  when the file is settled (no write state, no write arriving, not inline, not
  evicted by the drain), and revokes it before any change to the file's bytes or size
  is applied (`revoke`, wired to the State's data and layout events);
* `ReadMaps.zone_pins(zone)`: reads in C of the zone (INV-8: the allocator
  resets no zone while it has any);
* `ReadMaps.stats()`: READs served in C and handed to Python, by reason, and
  the latencies of C reads (the QoS controller samples them: `qos_samples`).

What Python promises C: a published map holds only pieces that stay as they
are while published (written data in a sequential zone, `direct_read_target`
of the device), with their checksums when at hand (pieces without them are
handed back); it is revoked, synchronously, before the op that changes the
file's bytes, size or placement is applied (EXTENT: writes landing, cleaner
relocation, copies; TRUNCATE, PUNCH, PREALLOC, INLINE, INODE, DRAIN,
INODE_FREE). What C promises Python: DESIGN 4.10 and the C file's header.

Caveats: one mount per process (as pyfuse3 and fuseext). Only the device's
O_DIRECT fd is read (io_uring, one submit per batch of READs; pread when the
ring cannot be set up, `io_mode()` says which); a device without
`direct_read_target` (or with faults armed) publishes nothing.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import trio

from zonefs_py import fuseext
from zonefs_py.device.base import capabilities
from zonefs_py.model.drain import DrainState
from zonefs_py.model.tenants import tenant_of

log = logging.getLogger(__name__)

#: Why a READ went to Python, in the C side's order (zdp_stats).
REASONS = ("not_published", "mutated", "no_checksums", "checksum_mismatch",
           "device_error", "too_large", "no_memory")
#: Latency histogram buckets (bucket b: [2**b, 2**(b+1)) ns).
LAT_BUCKETS = 32
ZDP_HOLE = 1
ZDP_PYTHON = 2


def _ext() -> Any:
    return fuseext.extension()


def arm(nzones: int, block_size: int) -> bool:
    """Start the dispatcher at the next `pyfuse3.init`; False if unavailable."""
    ext = _ext()
    if ext is None:
        return False
    rc = ext.lib.zdp_configure(nzones, block_size)
    if rc < 0:
        log.warning("C reads off: the read map could not be configured (%d)", rc)
        return False
    ext.lib.zdp_arm(1)
    return True


def disarm() -> None:
    ext = _ext()
    if ext is not None:
        ext.lib.zdp_arm(0)


def started() -> bool:
    """Whether the dispatcher runs (after `pyfuse3.init`)."""
    ext = _ext()
    return ext is not None and bool(ext.lib.zdp_running_flag())


def why_not() -> str:
    """Why the dispatcher did not start ("" when it did, or was not armed)."""
    ext = _ext()
    if ext is None:
        return "zonefs_py._fuseext is not built"
    return str(ext.ffi.string(ext.lib.zdp_why_not()).decode(errors="replace"))


def io_mode() -> str:
    """"io_uring", or "pread: why" (how the dispatcher reads the device)."""
    ext = _ext()
    if ext is None:
        return "pread: zonefs_py._fuseext is not built"
    return str(ext.ffi.string(ext.lib.zdp_io_mode()).decode(errors="replace"))


def raw_stats() -> list[int]:
    """The C counters (zdp_stats order), [] without the extension."""
    ext = _ext()
    if ext is None:
        return []
    n = 4 + len(REASONS) + LAT_BUCKETS + 3
    out = ext.ffi.new("uint64_t[]", n)
    got = ext.lib.zdp_stats(out, n)
    return [int(out[i]) for i in range(got)]


class ReadMaps:
    """Publishes and revokes read maps (module docstring); the engine's only door to C."""

    #: Whether a C write stream is armed for an inode (None without C writes: set by
    #: dataplane/wiring.py).
    c_streamed: Callable[[int], bool] | None = None

    def __init__(self, dev: Any, state: Any, writes: Any, sums: Any,
                 alloc: Any = None) -> None:
        ext = _ext()
        assert ext is not None
        self._ffi, self._lib = ext.ffi, ext.lib
        self.dev = dev
        self.state = state
        self.writes = writes
        self.sums = sums
        self.bs: int = dev.info.block_size
        self.zone_size: int = dev.info.zone_size_bytes
        self._target: Callable[[int, int], tuple[int, int] | None] | None = (
            capabilities(dev).direct_read_target)
        #: Inodes with a map published (a superset after the dispatcher's own
        #: revocations: revoke() of one not in C is a no-op).
        self.published: set[int] = set()
        self.publishes = 0
        self.refused = 0
        self._lat_seen = [0] * LAT_BUCKETS
        #: Pins zones while their summaries are read (`warm_checksums`; INV-8).
        self.alloc = alloc
        #: Inodes published with pieces whose checksums were not cached (a cold
        #: mount: sealed zones' summaries not read yet), for `warm_checksums`.
        self._cold: dict[int, Any] = {}
        self._cold_tx, self._cold_rx = trio.open_memory_channel[int](math.inf)
        self.warmed = 0

    # -- revoking (synchronous: no await) ------------------------------------------------
    def revoke(self, ino: int) -> None:
        """No READ of `ino` is served from its map once this returns (State hook)."""
        if ino in self.published:
            self.published.discard(ino)
            self._lib.zdp_revoke(ino)

    def revoke_all(self) -> None:
        self.published.clear()
        self._lib.zdp_revoke_all()

    def zone_pins(self, zone: int) -> int:
        return int(self._lib.zdp_zone_pins(zone))

    # -- publishing --------------------------------------------------------------------------
    def settled(self, inode: Any) -> bool:
        """Whether nothing can change the file's bytes now (no await)."""
        ino = inode.ino
        if inode.extents is None or inode.inline or self.writes.has_state(ino) \
                or self.writes.writes_arriving(ino):
            return False
        if self.c_streamed is not None and self.c_streamed(ino):
            return False  # C takes its WRITEs (dataplane/cwrites.py)
        # Queued, uploading and drained files hold their bytes here (the upload only
        # reads them); an evicted one holds none (its restore lands as EXTENT ops,
        # each revoking, before the DRAIN op that makes it DRAINED again).
        rec = self.state.drain.get(ino)
        return rec is None or rec.state is not DrainState.EVICTED

    def after_python_read(self, inode: Any) -> None:
        """A READ of `inode` was served in Python: publish its map if it is settled."""
        if self._target is None or not self.settled(inode):
            return
        self.publish(inode)

    def after_open(self, inode: Any) -> None:
        """A file was opened for reading: publish its map if it is settled and not
        published already. A file read once (a DataLoader's one file per sample)
        otherwise had its only READ in Python, which published the map too late."""
        if self._target is None or inode.ino in self.published or not self.settled(inode):
            return
        self.publish(inode)

    def publish(self, inode: Any) -> bool:
        """Build and publish the map of a settled file (no await between the look-up and
        the C call). False when C refused it (a mutating request not handed on yet)."""
        bs, zsize, target = self.bs, self.zone_size, self._target
        assert target is not None
        size = inode.size
        nblocks = (size + bs - 1) // bs
        pieces = inode.extents.lookup(0, nblocks, bs) if nblocks else []
        arr = self._ffi.new("struct zdp_piece[]", max(1, len(pieces)))
        sums: list[bytes] = []
        nsums = 0
        cold = False
        for i, p in enumerate(pieces):
            c = arr[i]
            c.file_off = p.fblock * bs
            c.length = p.nblocks * bs
            if p.dev is None:
                c.flags = ZDP_HOLE
                continue
            nbytes = p.nblocks * bs
            zone = p.dev // zsize
            where = target(p.dev, nbytes) if (p.dev + nbytes - 1) // zsize == zone else None
            csums = p.csums if p.csums is not None else self.sums.cached(p.dev, p.nblocks)
            if where is None or csums is None or len(csums) != p.nblocks * 4:
                c.flags = ZDP_PYTHON
                cold = cold or (where is not None and csums is None)
                continue
            c.fd, c.dev_off = where
            c.zone = zone
            c.csum_idx = nsums
            sums.append(bytes(csums))
            nsums += p.nblocks
        blob = b"".join(sums)
        # Its tenant: C counts the bytes it serves per tenant (`tenant_served`).
        tenant = tenant_of(self.state, inode)
        rc = self._lib.zdp_publish_tenant(inode.ino, size, arr, len(pieces), blob, nsums,
                                          tenant)
        if rc < 0:
            self.refused += 1
            return False
        self.published.add(inode.ino)
        self.publishes += 1
        if cold and self.alloc is not None and inode.ino not in self._cold:
            self._cold[inode.ino] = inode
            self._cold_tx.send_nowait(inode.ino)
        return True

    # -- warming: the checksums a published map lacks -----------------------------------
    async def warm_checksums(self) -> None:
        """Forever: for each file published with pieces whose checksums were not cached
        (a cold mount), read those summaries into the cache (`SumCache.checksums`,
        zones pinned from the look-up on) and publish the map again, so that the
        file's READs stop going to Python one per summary block (`no_checksums`)."""
        async for ino in self._cold_rx:
            inode = self._cold.pop(ino, None)
            if inode is None or not self.settled(inode):
                continue
            try:
                await self._load_checksums(inode)
            except Exception as exc:  # noqa: BLE001 - the READ path reports it, not this
                log.debug("C reads: checksums of inode %d not warmed: %s", ino, exc)
                continue
            if self.settled(inode) and self.publish(inode):
                self.warmed += 1

    async def _load_checksums(self, inode: Any) -> None:
        bs, zsize = self.bs, self.zone_size
        nblocks = (inode.size + bs - 1) // bs
        pieces = [p for p in (inode.extents.lookup(0, nblocks, bs) if nblocks else [])
                  if p.dev is not None and p.csums is None
                  and (p.dev + p.nblocks * bs - 1) // zsize == p.dev // zsize]
        zones = [p.dev // zsize for p in pieces]
        for z in zones:  # pinned with the look-up, no await between (INV-8)
            self.alloc.pin_read(z)
        try:
            for p in pieces:
                if self.sums.cached(p.dev, p.nblocks) is None:
                    await self.sums.checksums(inode.ino, p.fblock, p.dev, p.nblocks)
        finally:
            for z in zones:
                self.alloc.unpin_read(z)

    # -- counters --------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """READs served in C and handed to Python by reason, C read latency, maps."""
        raw = raw_stats()
        if not raw:
            return {}
        served, nbytes, lat_ns, requests = raw[:4]
        handed = dict(zip(REASONS, raw[4:4 + len(REASONS)], strict=True))
        submits, submitted, inline = raw[4 + len(REASONS) + LAT_BUCKETS:][:3] or (0, 0, 0)
        return {
            "running": started(),
            "reads_c": served,
            "reads_c_bytes": nbytes,
            "reads_c_mean_us": round(lat_ns / served / 1000, 1) if served else 0.0,
            "reads_python": handed,
            "requests_read": requests,
            "io": io_mode(),
            "uring_submits": submits,
            "uring_reads": submitted,
            "lone_reads": inline,
            "maps_published": len(self.published),
            "publishes": self.publishes,
            "publishes_refused": self.refused,
            "maps_warmed": self.warmed,
        }

    def tenant_served(self, tenants: Iterable[int]) -> dict[int, int]:
        """Bytes C served from maps of each tenant (0: files of none) since the module
        was loaded, for the tenants' read activity (fs/data/tenantqos.py)."""
        served = self._lib.zdp_tenant_served
        return {t: int(served(t)) for t in tenants}

    def qos_samples(self) -> list[float]:
        """Latencies (seconds) of C reads since the last call, one per read (bucket
        midpoints, at most 256 per bucket), for the QoS controller."""
        raw = raw_stats()
        if not raw:
            return []
        lat = raw[4 + len(REASONS):4 + len(REASONS) + LAT_BUCKETS]
        out: list[float] = []
        for b, count in enumerate(lat):
            new = count - self._lat_seen[b]
            if new > 0:
                self._lat_seen[b] = count
                out.extend([1.5 * (1 << b) / 1e9] * min(new, 256))
        return out
