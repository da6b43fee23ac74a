"""Fetching an evicted file's object back: ranged GETs in flight, hashed in order.

`ObjectFetcher.fetch_and_place` reads the object of a drain record in parts
of `drain_part_mb` (`drain_parts` in flight, in worker threads), checks
its size and xxh3 as the parts arrive in order, and appends it to fresh
zones through the engine (`DrainHost.place_file_data`). It returns the
placed EXTENT ops unapplied: DrainManager.restore applies them in the
transaction that marks the file restored, or gives them back if the file
changed meanwhile. A corrupt or missing object is IOFailure (EIO), and the
file stays evicted. While a move is in flight (DESIGN 6.3) the object is
fetched from its destination once the old key is gone.
"""

from __future__ import annotations

import logging

import trio
import xxhash

from zonefs_py import errors
from zonefs_py.drain.host import DrainHost, Placed
from zonefs_py.drain.store import ObjectStore, StoreError, parse_url
from zonefs_py.model.drain import DrainRecord
from zonefs_py.model.state import Inode

# Logged as the manager always did (restore is its operation).
log = logging.getLogger("zonefs_py.drain.manager")


class ObjectFetcher:
    """Reads drained objects back into a file's zones (module docstring)."""

    def __init__(self, host: DrainHost, store: ObjectStore, part_bytes: int,
                 parts_in_flight: int) -> None:
        self.host = host
        self.store = store
        self.part_bytes = part_bytes
        self.parts_in_flight = parts_in_flight

    async def _restore_source(self, rec: DrainRecord) -> tuple[str, str]:
        """(bucket, key) to fetch from: the record's object, or, while a move is in
        flight (DESIGN 6.3), its destination once the old key is gone. Raises
        IOFailure if the store cannot say."""
        bucket, key = parse_url(rec.url.decode())
        if not rec.moving_to:
            return bucket, key
        try:
            await trio.to_thread.run_sync(self.store.head, bucket, key)
            return bucket, key
        except StoreError as exc:
            if exc.kind != "missing":
                raise errors.IOFailure(f"restore from {rec.url.decode()} failed: {exc}") from None
        return parse_url(rec.moving_to.decode())

    async def fetch_and_place(self, inode: Inode, rec: DrainRecord) -> Placed:
        """GET the object in parts (several in flight), hash in order, append to zones.

        Returns the placed (unapplied) EXTENT ops; on any failure the placed
        pieces are given back as garbage and IOFailure is raised.
        """
        bucket, key = await self._restore_source(rec)
        size, part = rec.size, self.part_bytes
        nparts = (size + part - 1) // part
        results: dict[int, bytes | StoreError] = {}
        ready = [trio.Event() for _ in range(nparts)]
        limiter = trio.CapacityLimiter(self.parts_in_flight)
        placed: Placed = []
        hasher = xxhash.xxh3_64()
        path = self.host.path_of(inode.ino)

        async def get(i: int) -> None:
            start = i * part
            try:
                results[i] = await trio.to_thread.run_sync(
                    self.store.get_range, bucket, key, start, min(size, start + part),
                    limiter=limiter)
            except StoreError as exc:
                results[i] = exc
            ready[i].set()

        ok = False
        failure: list[errors.ZoneFSError] = []
        try:
            async with trio.open_nursery() as nursery:
                window = self.parts_in_flight + 1
                for i in range(min(window, nparts)):
                    nursery.start_soon(get, i)
                for i in range(nparts):
                    await ready[i].wait()
                    if i + window < nparts:
                        nursery.start_soon(get, i + window)
                    data = results.pop(i)
                    try:
                        if isinstance(data, StoreError):
                            raise errors.IOFailure(f"restore of {path} failed: {data}")
                        hasher.update(data)
                        bs = self.host.bs
                        if len(data) % bs:
                            data += bytes(bs - len(data) % bs)  # INV-10: zeros past EOF
                        placed += await self.host.place_file_data(inode, i * part // bs, data)
                    except errors.ZoneFSError as exc:
                        # Raised here it would leave the nursery in an ExceptionGroup.
                        failure.append(exc)
                        nursery.cancel_scope.cancel()
                        break
            if failure:
                log.error("drain: %s", failure[0])
                raise failure[0]
            if hasher.intdigest() != rec.xxh3:
                log.error("drain: restore of %s from %s: checksum mismatch (object xxh3 "
                          "%016x, recorded %016x); the file stays evicted", path,
                          rec.url.decode(), hasher.intdigest(), rec.xxh3)
                raise errors.IOFailure(f"restored object of {path} fails its checksum")
            ok = True
            return placed
        finally:
            if not ok:
                self.host.discard_placed(placed)
