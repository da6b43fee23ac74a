"""Where index pages live: the `PageStore` protocol and two stores.

A store appends whole pages and hands back their address, a u64 byte offset
it chose (append-only: a page is never overwritten in place). `flush()` makes
every page appended so far durable; the B+tree calls it at the end of a commit,
before the caller may record the new root anywhere (docs/DESIGN.md 3.14,
"Checkpoint, walked" and "Crash argument").

* `MemoryPageStore`: a dict, with read/append/flush counters and an optional
  power cut after N appends, for tests.
* `ZonePageStore`: pages appended to a list of zones of a `ZoneAppender` (the
  small slice of a zoned device the index needs), filled in order; it keeps
  which pages of each zone are live so a cleaner can relocate them (B+tree
  `relocate`) and reset the zone.

Caveats: liveness in `ZonePageStore` is in memory only; after a restart the
owner rebuilds it with `adopt(btree.page_addresses())` (a full walk). Zone
capacity is taken to equal the zone size. Nothing here awaits: the B+tree is
synchronous code, to be run in `trio.to_thread` or kept small per step once
wired in.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable, Sequence
from typing import Protocol

from zonefs_py.errors import NoSpace
from zonefs_py.index.errors import IndexCorrupt
from zonefs_py.index.page import DEFAULT_PAGE_SIZE_BYTES


class PageStore(Protocol):
    """Append-only storage of fixed-size pages addressed by byte offset."""

    def append(self, page_bytes: bytes) -> int:
        """Store one page; return its address (u64 byte offset)."""
        ...

    def read(self, address: int) -> bytes:
        """Return the page stored at `address` (not verified: `page.decode` does that)."""
        ...

    def flush(self) -> None:
        """Make every page appended so far durable."""
        ...


class MemoryPageStore:
    """A `PageStore` in a dict, counting reads, appends and flushes (for tests).

    `stop_after_appends=N` makes every append after the N-th raise
    OSError(EIO), as a power cut would; `release()` deletes pages, so a read
    of a page the tree wrongly called obsolete fails loudly.
    """

    def __init__(self, page_size_bytes: int = DEFAULT_PAGE_SIZE_BYTES,
                 stop_after_appends: int | None = None) -> None:
        self.page_size_bytes = page_size_bytes
        self.pages: dict[int, bytes] = {}
        self.reads = 0
        self.appends = 0
        self.flushes = 0
        self.stop_after_appends = stop_after_appends
        self._next_address = 0

    def append(self, page_bytes: bytes) -> int:
        if len(page_bytes) != self.page_size_bytes:
            raise ValueError(f"page of {len(page_bytes)} bytes, store takes "
                             f"{self.page_size_bytes}")
        if self.stop_after_appends is not None and self.appends >= self.stop_after_appends:
            raise OSError(errno.EIO, "power cut (MemoryPageStore)")
        address = self._next_address
        self._next_address += self.page_size_bytes
        self.pages[address] = bytes(page_bytes)
        self.appends += 1
        return address

    def read(self, address: int) -> bytes:
        self.reads += 1
        try:
            return self.pages[address]
        except KeyError:
            raise IndexCorrupt(address, "no page stored at this address") from None

    def flush(self) -> None:
        self.flushes += 1

    def release(self, addresses: Iterable[int]) -> None:
        """Forget the pages at `addresses` (they are obsolete)."""
        for address in addresses:
            del self.pages[address]


class ZoneAppender(Protocol):
    """The slice of a zoned device the index needs (zone k starts at k * zone_size_bytes)."""

    @property
    def zone_size_bytes(self) -> int: ...

    def append(self, zone_idx: int, data: bytes) -> int:
        """Append `data` at the zone's write pointer; return its device byte offset."""
        ...

    def read(self, offset_bytes: int, length_bytes: int) -> bytes: ...

    def reset_zone(self, zone_idx: int) -> None: ...

    def write_pointer(self, zone_idx: int) -> int:
        """Return the zone's write pointer as a device byte offset."""
        ...

    def flush(self) -> None: ...


class ZonePageStore:
    """A `PageStore` on the zones `zone_idxs` of a `ZoneAppender`, filled in list order.

    Appends go to the current zone until a page no longer fits, then to the
    next empty zone of the list (wrapping round to zones reset since). Every
    appended page counts as live until `release()`d, which the owner does
    with a commit's obsolete addresses once the new root is durably recorded.
    `reset_zone()` refuses a zone that still holds live pages (INV-8's rule
    for the index: reset only what nothing references). Raises NoSpace when
    no zone of the list has room.
    """

    def __init__(self, dev: ZoneAppender, zone_idxs: Sequence[int],
                 page_size_bytes: int = DEFAULT_PAGE_SIZE_BYTES) -> None:
        if not zone_idxs or len(set(zone_idxs)) != len(zone_idxs):
            raise ValueError("zone_idxs must be a non-empty list of distinct zones")
        if dev.zone_size_bytes % page_size_bytes:
            raise ValueError("zone size is not a multiple of the page size")
        self.dev = dev
        self.zone_idxs = list(zone_idxs)
        self.page_size_bytes = page_size_bytes
        self._live: dict[int, set[int]] = {z: set() for z in self.zone_idxs}
        self._cursor = self._initial_cursor()

    def _zone_start(self, zone_idx: int) -> int:
        return zone_idx * self.dev.zone_size_bytes

    def _used_bytes(self, zone_idx: int) -> int:
        return self.dev.write_pointer(zone_idx) - self._zone_start(zone_idx)

    def _has_room(self, zone_idx: int) -> bool:
        return self._used_bytes(zone_idx) + self.page_size_bytes <= self.dev.zone_size_bytes

    def _initial_cursor(self) -> int:
        """The first partly written zone, else the first empty one, else the first."""
        for pos, zone_idx in enumerate(self.zone_idxs):
            if self._has_room(zone_idx) and self._used_bytes(zone_idx) > 0:
                return pos
        for pos, zone_idx in enumerate(self.zone_idxs):
            if self._used_bytes(zone_idx) == 0:
                return pos
        return 0

    def _zone_for_append(self) -> int:
        n = len(self.zone_idxs)
        current = self.zone_idxs[self._cursor]
        if self._has_room(current):
            return current
        for step in range(1, n + 1):
            pos = (self._cursor + step) % n
            if self._used_bytes(self.zone_idxs[pos]) == 0:
                self._cursor = pos
                return self.zone_idxs[pos]
        raise NoSpace(f"index zones {self.zone_idxs} are full")

    @property
    def current_zone_idx(self) -> int:
        """The zone appends go to now; a cleaner must not pick it (its copies would land there)."""
        return self.zone_idxs[self._cursor]

    def zone_of(self, address: int) -> int:
        """Return the zone index holding `address`."""
        return address // self.dev.zone_size_bytes

    def append(self, page_bytes: bytes) -> int:
        if len(page_bytes) != self.page_size_bytes:
            raise ValueError(f"page of {len(page_bytes)} bytes, store takes "
                             f"{self.page_size_bytes}")
        zone_idx = self._zone_for_append()
        address = self.dev.append(zone_idx, page_bytes)
        self._live[zone_idx].add(address)
        return address

    def read(self, address: int) -> bytes:
        zone_idx = self.zone_of(address)
        if zone_idx not in self._live or address % self.page_size_bytes \
                or address + self.page_size_bytes > self.dev.write_pointer(zone_idx):
            raise IndexCorrupt(address, "address outside the written part of the index zones")
        return self.dev.read(address, self.page_size_bytes)

    def flush(self) -> None:
        self.dev.flush()

    def release(self, addresses: Iterable[int]) -> None:
        """Count the pages at `addresses` as obsolete; ValueError if one is not live."""
        for address in addresses:
            live = self._live.get(self.zone_of(address))
            if live is None or address not in live:
                raise ValueError(f"page {address:#x} is not a live page of this store")
            live.remove(address)

    def adopt(self, addresses: Iterable[int]) -> None:
        """Count the pages at `addresses` as live (rebuilding liveness after a restart)."""
        for address in addresses:
            self._live[self.zone_of(address)].add(address)

    def live_pages(self, zone_idx: int) -> list[int]:
        """Addresses of the live pages in `zone_idx`, ascending."""
        return sorted(self._live[zone_idx])

    def zones_holding_live_pages(self) -> list[int]:
        """Zones of the list that hold at least one live page, in list order."""
        return [z for z in self.zone_idxs if self._live[z]]

    def live_bytes(self, zone_idx: int) -> int:
        """Bytes of live pages in `zone_idx` (for a cleaner's choice of victim)."""
        return len(self._live[zone_idx]) * self.page_size_bytes

    def reset_zone(self, zone_idx: int) -> None:
        """Reset `zone_idx`; ValueError if it still holds live pages.

        The caller must also know that no reader still uses an older root
        whose pages lie there (the checkpoint that obsoleted them is durable).
        """
        if self._live[zone_idx]:
            raise ValueError(f"zone {zone_idx} still holds {len(self._live[zone_idx])} "
                             f"live index pages")
        self.dev.reset_zone(zone_idx)
