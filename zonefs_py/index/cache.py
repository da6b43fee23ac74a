"""A bounded LRU cache of decoded index pages, keyed by page address.

Clean pages (written, at an address) live in the LRU and count against the
budget: `capacity_pages`, `capacity_bytes`, or both (a page counts as the
size given to `put`, the page size for the B+tree). Dirty pages, changed
since the last commit and not written yet, have no address: they are held in
a separate table under negative ids until the commit writes them, outside the
budget (evicting one would lose the change). So memory is bounded by the
budget plus the pages dirtied since the last commit; the owner bounds the
latter by committing often enough (docs/DESIGN.md 3.14, "The tree").

Counters: `hits`, `misses`, `evictions`. Values are shared, not copied: a
caller must not change a page it got from the clean LRU (the B+tree copies a
page before changing it; that is the copy-on-write).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

T = TypeVar("T")


class PageCache(Generic[T]):
    """LRU of clean pages within `capacity_pages` / `capacity_bytes`, plus the dirty table."""

    def __init__(self, capacity_pages: int | None = None,
                 capacity_bytes: int | None = None) -> None:
        if capacity_pages is None and capacity_bytes is None:
            raise ValueError("give capacity_pages or capacity_bytes")
        if (capacity_pages is not None and capacity_pages < 0) or \
                (capacity_bytes is not None and capacity_bytes < 0):
            raise ValueError("negative cache capacity")
        self.capacity_pages = capacity_pages
        self.capacity_bytes = capacity_bytes
        self._clean: OrderedDict[int, tuple[T, int]] = OrderedDict()
        self._clean_bytes = 0
        self._dirty: dict[int, T] = {}
        self._next_dirty_id = -1
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    # -- clean pages (the LRU) ---------------------------------------------------------

    def get(self, address: int) -> T | None:
        """Return the clean page at `address` (now most recently used), or None."""
        entry = self._clean.get(address)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._clean.move_to_end(address)
        return entry[0]

    def holds(self, address: int) -> bool:
        """Whether the clean page at `address` is cached (no hit, miss or LRU change)."""
        return address in self._clean

    def put(self, address: int, page: T, size_bytes: int) -> None:
        """Insert a clean page, then evict least recently used pages down to the budget."""
        old = self._clean.pop(address, None)
        if old is not None:
            self._clean_bytes -= old[1]
        self._clean[address] = (page, size_bytes)
        self._clean_bytes += size_bytes
        self._evict()

    def discard(self, address: int) -> None:
        """Drop the page at `address` if cached (it became obsolete); not an eviction."""
        old = self._clean.pop(address, None)
        if old is not None:
            self._clean_bytes -= old[1]

    def _over_budget(self) -> bool:
        return (self.capacity_pages is not None and len(self._clean) > self.capacity_pages) \
            or (self.capacity_bytes is not None and self._clean_bytes > self.capacity_bytes)

    def _evict(self) -> None:
        while self._clean and self._over_budget():
            _, (_, size_bytes) = self._clean.popitem(last=False)
            self._clean_bytes -= size_bytes
            self.evictions += 1

    @property
    def clean_pages(self) -> int:
        return len(self._clean)

    @property
    def clean_bytes(self) -> int:
        return self._clean_bytes

    def clear(self) -> None:
        """Drop every clean page (counters kept); dirty pages stay."""
        self._clean.clear()
        self._clean_bytes = 0

    # -- dirty pages (outside the budget) ----------------------------------------------

    def add_dirty(self, page: T) -> int:
        """Hold a dirty page; return its id (negative, never an address)."""
        dirty_id = self._next_dirty_id
        self._next_dirty_id -= 1
        self._dirty[dirty_id] = page
        return dirty_id

    def dirty(self, dirty_id: int) -> T:
        """Return the dirty page `dirty_id` (KeyError if there is none)."""
        return self._dirty[dirty_id]

    def drop_dirty(self, dirty_id: int) -> T:
        """Remove and return the dirty page `dirty_id` (written, or merged away)."""
        return self._dirty.pop(dirty_id)

    @property
    def dirty_pages(self) -> int:
        return len(self._dirty)
