"""A copy-on-write B+tree of byte keys and values over an append-only `PageStore`.

A committed page is never changed: to change it the tree copies it into a
dirty page (held by the cache outside its budget, under a negative id) and
copies its ancestors up to the root the same way. `commit()` appends the dirty
pages children first, parents after (a parent holds its children's
addresses, known only once they are written), flushes the store, and returns
the new root's address. Until the caller records that address (a
checkpoint's CHECKPOINT_INDEX record), the previous root and every page
under it are untouched, so a crash anywhere in a commit leaves the previous
tree whole (docs/DESIGN.md 3.14, "Crash argument"). The pages the commit
made obsolete are in `last_commit.obsolete`; they may be released once the
new root is recorded.

Balance: a page that overflows splits in two by bytes (page.py's limits make
two always enough); when the put inserted at the leaf's end, the left page is
left full instead (all but the last entry; of an internal page, all but the
last two children: `_rebalance(tail=True)`), so keys put in ascending order
pack pages. With `key_group` (the length of a key's group prefix: the
namespace index's inodes, or one directory's names), a put that inserted
after the last key of its group in the leaf counts as at the end too: the
leaf is cut right after the new key (when that half fits), so a group
growing in ascending order packs its pages although the next group's keys
share its last leaf (they halved every inode leaf before). Puts never
merge. After a delete, a page whose body falls under a quarter of the page
(an empty leaf, an internal page with one child included) is merged with a
sibling when the two fit in one page, else the two are repacked evenly (a
borrow). A root with one child is replaced by that child.

Caveats: single-threaded and synchronous (no `await` anywhere; to be run in
`trio.to_thread` or in small steps once wired in); a `scan` raises
RuntimeError if the tree changes under it; after a failed commit (the store
raised) the tree can commit again, but the pages the failed attempt wrote
are unreferenced until then; keys are stored whole (no prefix compression).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from zonefs_py.errors import ValueTooLarge
from zonefs_py.index.cache import PageCache
from zonefs_py.index.errors import IndexCorrupt
from zonefs_py.index.page import (
    DEFAULT_PAGE_SIZE_BYTES,
    InternalPage,
    LeafPage,
    Page,
    PageLimits,
    body_bytes,
    decode,
    encode,
    leaf_entry_bytes,
    separator_bytes,
)
from zonefs_py.index.store import PageStore

#: A reference to a page: >= 0 is a store address, < 0 the id of a dirty page in the cache.
Ref = int


@dataclass
class CommitResult:
    """What one commit did: the new root, pages written (in order), pages made obsolete."""

    root_address: int
    written: list[int] = field(default_factory=list)
    obsolete: list[int] = field(default_factory=list)


@dataclass
class _Frame:
    ref: Ref
    page: Page
    idx_in_parent: int


def _clone(page: Page) -> Page:
    if isinstance(page, LeafPage):
        return LeafPage(list(page.keys), list(page.values))
    return InternalPage(page.level, list(page.keys), list(page.children))


def _leaf_split_point(page: LeafPage) -> int:
    """Entries of the left half when the leaf is cut in two halves of even bytes."""
    sizes = [leaf_entry_bytes(k, v) for k, v in zip(page.keys, page.values, strict=True)]
    total = sum(sizes)
    best_m, best_max, left = 1, total, 0
    for m in range(1, len(sizes)):
        left += sizes[m - 1]
        worst = max(left, total - left)
        if worst < best_max:
            best_m, best_max = m, worst
    return best_m


def _internal_split_point(page: InternalPage) -> int:
    """Children of the left half; separator `m - 1` moves up, each half keeps >= 2 children."""
    sizes = [separator_bytes(k) for k in page.keys]
    total = sum(sizes)
    best_m, best_max = 2, total
    left = sizes[0]  # separators 0 .. m-2 stay left; m-1 moves up
    for m in range(2, len(page.children) - 1):
        right = total - left - sizes[m - 1]
        worst = max(left, right)
        if worst < best_max:
            best_m, best_max = m, worst
        left += sizes[m - 1]
    return best_m


class BTree:
    """A copy-on-write B+tree over `store`, caching decoded pages in `cache`.

    `root` is the address a previous `commit()` returned (None: a new, empty
    tree). Keys and values are bytes; a key is at most `limits.max_key_bytes`,
    key plus value at most `limits.max_entry_bytes` (page.py), else
    ValueTooLarge. Reads raise IndexCorrupt for a damaged page, never return a
    wrong value from one.
    """

    def __init__(self, store: PageStore, cache: PageCache[Page], root: int | None = None,
                 page_size_bytes: int = DEFAULT_PAGE_SIZE_BYTES,
                 key_group: Callable[[bytes], int] | None = None) -> None:
        self.store = store
        #: Length of a key's group prefix (module docstring, "Balance"); None: one group.
        self.key_group = key_group
        self.cache = cache
        self.limits = PageLimits.for_page_size(page_size_bytes)
        self.page_size_bytes = page_size_bytes
        self._root: Ref | None = root
        self._obsolete: list[int] = []
        self._mutations = 0
        self.last_commit: CommitResult | None = None

    # -- loading pages ------------------------------------------------------------------

    def _load(self, ref: Ref) -> Page:
        if ref < 0:
            return self.cache.dirty(ref)
        page = self.cache.get(ref)
        if page is None:
            page = decode(self.store.read(ref), ref, self.page_size_bytes)
            self.cache.put(ref, page, self.page_size_bytes)
        return page

    def load_page(self, ref: Ref) -> Page:
        """The page at `ref` (an address, or a dirty page's id), through the cache."""
        return self._load(ref)

    def _load_child(self, parent: InternalPage, idx: int) -> Page:
        """Load child `idx`, checking its level and that its keys lie between the separators."""
        ref = parent.children[idx]
        child = self._load(ref)
        if child.level != parent.level - 1:
            raise IndexCorrupt(ref, f"page of level {child.level} under one of {parent.level}")
        if child.keys:
            if idx > 0 and child.keys[0] < parent.keys[idx - 1]:
                raise IndexCorrupt(ref, "keys below the parent's separator")
            if idx < len(parent.keys) and child.keys[-1] >= parent.keys[idx]:
                raise IndexCorrupt(ref, "keys above the parent's separator")
        return child

    # -- reading ------------------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        """Return the value of `key`, or None if absent."""
        if self._root is None:
            return None
        page = self._load(self._root)
        while isinstance(page, InternalPage):
            page = self._load_child(page, bisect_right(page.keys, key))
        i = bisect_left(page.keys, key)
        if i < len(page.keys) and page.keys[i] == key:
            return page.values[i]
        return None

    def scan(self, start: bytes = b"", end: bytes | None = None, *,
             prefetch: bool = False) -> Iterator[tuple[bytes, bytes]]:
        """Yield (key, value) for start <= key < end in key order, one leaf at a time.

        Holds one page per level (not the tree); raises RuntimeError if the
        tree is changed before the scan ends. `prefetch` (a long scan: mount,
        fsck): on reaching the leaves under an internal page, a store that can
        reads them all at once (`_prefetch`).
        """
        if self._root is None:
            return
        mutations = self._mutations
        stack: list[tuple[InternalPage, int]] = []
        page = self._load(self._root)
        while isinstance(page, InternalPage):
            idx = bisect_right(page.keys, start)
            stack.append((page, idx))
            if prefetch and page.level == 1:
                self._prefetch(page.children[idx:])
            page = self._load_child(page, idx)
        i = bisect_left(page.keys, start)
        while True:
            for key, value in zip(page.keys[i:], page.values[i:], strict=True):
                if end is not None and key >= end:
                    return
                yield key, value
                if self._mutations != mutations:
                    raise RuntimeError("index changed during scan")
            while stack and stack[-1][1] + 1 >= len(stack[-1][0].children):
                stack.pop()
            if not stack:
                return
            parent, idx = stack.pop()
            if end is not None and parent.keys[idx] >= end:
                return
            stack.append((parent, idx + 1))
            page = self._load_child(parent, idx + 1)
            while isinstance(page, InternalPage):
                stack.append((page, 0))
                if prefetch and page.level == 1:
                    self._prefetch(page.children)
                page = self._load_child(page, 0)
            i = 0

    def _prefetch(self, refs: list[Ref]) -> None:
        """A scan reaches the leaves under one internal page: a store that can
        (`prefetch`) reads those not cached at once, in device order."""
        prefetch = getattr(self.store, "prefetch", None)
        if prefetch is not None:
            prefetch([r for r in refs if r >= 0 and not self.cache.holds(r)])

    def page_addresses(self) -> Iterator[int]:
        """Yield the address of every written page the current tree references, root first.

        A depth-first walk holding one page per level; dirty pages are walked
        but not yielded (they have no address yet).
        """
        if self._root is None:
            return
        todo: list[Ref] = [self._root]
        while todo:
            ref = todo.pop()
            if ref >= 0:
                yield ref
            page = self._load(ref)
            if isinstance(page, InternalPage):
                todo.extend(reversed(page.children))

    # -- changing -----------------------------------------------------------------------

    def _cow(self, ref: Ref, page: Page) -> tuple[Ref, Page]:
        """Return a dirty page to change in place of `ref` (a copy if `ref` is written)."""
        if ref < 0:
            return ref, page
        copy = _clone(page)
        self._obsolete.append(ref)
        self.cache.discard(ref)
        return self.cache.add_dirty(copy), copy

    def _forget(self, ref: Ref) -> None:
        """`ref` left the tree (merged away, or a collapsed root)."""
        if ref < 0:
            self.cache.drop_dirty(ref)
        else:
            self._obsolete.append(ref)
            self.cache.discard(ref)

    def _write_path(self, key: bytes, stop_level: int = 0) -> list[_Frame]:
        """Make dirty every page from the root down to `key`'s page at `stop_level`."""
        assert self._root is not None
        ref, page = self._cow(self._root, self._load(self._root))
        self._root = ref
        frames = [_Frame(ref, page, -1)]
        while isinstance(page, InternalPage) and page.level > stop_level:
            idx = bisect_right(page.keys, key)
            ref, child = self._cow(page.children[idx], self._load_child(page, idx))
            page.children[idx] = ref
            frames.append(_Frame(ref, child, idx))
            page = child
        return frames

    def put(self, key: bytes, value: bytes) -> None:
        """Set `key` to `value` (insert or replace); ValueTooLarge beyond the limits."""
        if len(key) > self.limits.max_key_bytes:
            raise ValueTooLarge(f"index key of {len(key)} bytes > {self.limits.max_key_bytes}")
        if len(key) + len(value) > self.limits.max_entry_bytes:
            raise ValueTooLarge(f"index entry of {len(key) + len(value)} bytes > "
                                f"{self.limits.max_entry_bytes}")
        key, value = bytes(key), bytes(value)
        if self._root is None:
            self._root = self.cache.add_dirty(LeafPage())
        frames = self._write_path(key)
        leaf = frames[-1].page
        assert isinstance(leaf, LeafPage)
        i = bisect_left(leaf.keys, key)
        tail: bool | int = False
        if i < len(leaf.keys) and leaf.keys[i] == key:
            leaf.values[i] = value
        else:
            leaf.keys.insert(i, key)
            leaf.values.insert(i, value)
            if i == len(leaf.keys) - 1:
                tail = True
            elif self.key_group is not None:
                g = self.key_group(key)
                if leaf.keys[i + 1][:g] != key[:g]:
                    tail = i + 1  # the end of its group: cut after it
        self._mutations += 1
        # Puts never merge: an underfull page only comes from a tail split, and
        # merging it back would borrow half of its full left sibling each time.
        self._rebalance(frames, tail=tail, merge=False)

    def delete(self, key: bytes) -> bool:
        """Remove `key`; return whether it was present (an absent key dirties nothing)."""
        if self.get(key) is None:
            return False
        frames = self._write_path(key)
        leaf = frames[-1].page
        assert isinstance(leaf, LeafPage)
        i = bisect_left(leaf.keys, key)
        del leaf.keys[i]
        del leaf.values[i]
        self._mutations += 1
        self._rebalance(frames)
        return True

    def relocate(self, addresses: Iterable[int]) -> int:
        """Make the live pages among `addresses` dirty, so the next commit copies them forward.

        For each address the page is read (verified) and found again by its
        first key and level from the root; it is live only if the tree still
        points at that address there (copying it copies its ancestors too).
        Returns how many of `addresses` the next commit leaves unreferenced
        (live ones copied forward, or already replaced since the last commit).
        After that commit (and its root recorded) a zone holding only these
        pages can be reset.
        """
        wanted = list(dict.fromkeys(addresses))
        obsolete = set(self._obsolete)
        for address in wanted:
            if self._root is None:
                break
            if address in obsolete:  # already copied with a page relocated before
                continue
            page = decode(self.store.read(address), address, self.page_size_bytes)
            if not page.keys:
                if self._root == address:  # an empty leaf lives only as the root
                    self._write_path(b"")
            elif self._ref_at_level(page.keys[0], page.level) == address:
                self._write_path(page.keys[0], stop_level=page.level)
            obsolete.update(self._obsolete[len(obsolete):])  # entries are distinct
        self._mutations += 1
        return sum(1 for address in wanted if address in obsolete)

    def _ref_at_level(self, key: bytes, level: int) -> Ref | None:
        assert self._root is not None
        ref = self._root
        page = self._load(ref)
        while page.level > level and isinstance(page, InternalPage):
            idx = bisect_right(page.keys, key)
            ref = page.children[idx]
            page = self._load_child(page, idx)
        return ref if page.level == level else None

    # -- balance ------------------------------------------------------------------------

    def _underfull(self, page: Page) -> bool:
        if isinstance(page, InternalPage) and len(page.children) < 2:
            return True
        return body_bytes(page) < self.limits.body_bytes // 4

    def _rebalance(self, frames: list[_Frame], *, tail: bool | int = False,
                   merge: bool = True) -> None:
        """Split or merge the changed pages of `frames`, bottom up, then fix the root.

        `tail`: the change appended an entry at the end of the leaf. A page that
        then overflows at its end is split leaving the left page full (all but
        its last entry; of an internal page, all but two children), so keys
        inserted in ascending order (new inodes, a directory filled in name
        order) pack pages instead of leaving them half full. An int: the leaf
        entry its group ends before (`key_group`); the leaf is cut there.
        Above the leaves only the end of a page counts."""
        for depth in range(len(frames) - 1, 0, -1):
            parent = frames[depth - 1].page
            assert isinstance(parent, InternalPage)
            frame = frames[depth]
            if body_bytes(frame.page) > self.limits.body_bytes:
                self._split_child(parent, frame.idx_in_parent, tail)
                # The separator went in at the split child's place: the parent's
                # end only if that child was its last.
                tail = tail is True and frame.idx_in_parent == len(parent.children) - 2
            else:
                tail = False
                if merge and self._underfull(frame.page):
                    self._merge_child(parent, frame.idx_in_parent)
        assert self._root is not None
        root = self._load(self._root)
        if body_bytes(root) > self.limits.body_bytes:
            new_root = InternalPage(root.level + 1, [], [self._root])
            self._split_child(new_root, 0, tail)  # (an int only if the root is a leaf)
            self._root = self.cache.add_dirty(new_root)
        while isinstance(root, InternalPage) and len(root.children) == 1:
            self._forget(self._root)
            self._root = root.children[0]
            root = self._load(self._root)

    def _split_child(self, parent: InternalPage, idx: int, tail: bool | int = False) -> None:
        """Cut the dirty child `idx` of `parent` in two; the right half is a new dirty page
        (at the end of the left one's entries when `tail`, or of its group's: see
        `_rebalance`)."""
        page = self.cache.dirty(parent.children[idx])
        right: Page
        if isinstance(page, LeafPage):
            if tail is True:
                m = len(page.keys) - 1
            elif tail is not False and 0 < tail < len(page.keys) and body_bytes(
                    LeafPage(page.keys[:tail], page.values[:tail])) <= self.limits.body_bytes:
                m = tail
            else:
                m = _leaf_split_point(page)
            right = LeafPage(page.keys[m:], page.values[m:])
            del page.keys[m:], page.values[m:]
            separator = right.keys[0]
        else:
            m = (len(page.children) - 2 if tail and len(page.children) >= 4
                 else _internal_split_point(page))
            separator = page.keys[m - 1]
            right = InternalPage(page.level, page.keys[m:], page.children[m:])
            del page.keys[m - 1:], page.children[m:]
        assert max(body_bytes(page), body_bytes(right)) <= self.limits.body_bytes
        parent.keys.insert(idx, separator)
        parent.children.insert(idx + 1, self.cache.add_dirty(right))

    def _merge_child(self, parent: InternalPage, idx: int) -> None:
        """Merge the underfull dirty child `idx` with a sibling, or share their entries evenly."""
        li = idx - 1 if idx > 0 else idx
        ri = li + 1
        left, right = self._load_child(parent, li), self._load_child(parent, ri)
        combined: Page
        if isinstance(left, LeafPage):
            assert isinstance(right, LeafPage)
            combined = LeafPage(left.keys + right.keys, left.values + right.values)
        else:
            assert isinstance(right, InternalPage)
            combined = InternalPage(left.level, left.keys + [parent.keys[li]] + right.keys,
                                    left.children + right.children)
        keep_i, drop_i = (ri, li) if li != idx else (li, ri)  # keep the dirty page of the path
        if body_bytes(combined) <= self.limits.body_bytes:
            keeper = self.cache.dirty(parent.children[keep_i])
            _assign(keeper, combined)
            self._forget(parent.children[drop_i])
            parent.children[li] = parent.children[keep_i]
            del parent.children[ri]
            del parent.keys[li]
            return
        other_ref, _ = self._cow(parent.children[drop_i], self._load_child(parent, drop_i))
        parent.children[drop_i] = other_ref
        new_left = self.cache.dirty(parent.children[li])
        new_right = self.cache.dirty(parent.children[ri])
        if isinstance(combined, LeafPage):
            m = _leaf_split_point(combined)
            _assign(new_left, LeafPage(combined.keys[:m], combined.values[:m]))
            _assign(new_right, LeafPage(combined.keys[m:], combined.values[m:]))
            parent.keys[li] = combined.keys[m]
        else:
            m = _internal_split_point(combined)
            _assign(new_left, InternalPage(combined.level, combined.keys[:m - 1],
                                           combined.children[:m]))
            _assign(new_right, InternalPage(combined.level, combined.keys[m:],
                                            combined.children[m:]))
            parent.keys[li] = combined.keys[m - 1]
        assert max(body_bytes(new_left), body_bytes(new_right)) <= self.limits.body_bytes

    # -- commit -------------------------------------------------------------------------

    def commit(self) -> int:
        """Write every dirty page (children before parents), flush, return the root address.

        `last_commit` then says which pages were written and which pages of
        earlier commits are no longer referenced. If the store raises, the
        previous root is intact and the tree can commit again.
        """
        if self._root is None:
            self._root = self.cache.add_dirty(LeafPage())
        written: list[int] = []
        self._root = self._write(self._root, written)
        self.store.flush()
        self.last_commit = CommitResult(self._root, written, self._obsolete)
        self._obsolete = []
        return self._root

    def _write(self, ref: Ref, written: list[int]) -> int:
        if ref >= 0:
            return ref
        page = self.cache.dirty(ref)
        if isinstance(page, InternalPage):
            for i, child in enumerate(page.children):
                if child < 0:
                    page.children[i] = self._write(child, written)
        address = self.store.append(encode(page, self.page_size_bytes))
        written.append(address)
        self.cache.drop_dirty(ref)
        self.cache.put(address, page, self.page_size_bytes)
        return address

    @property
    def root(self) -> Ref | None:
        """The root reference: the last commit's address, or a dirty id if changed since."""
        return self._root

    @property
    def dirty(self) -> bool:
        """Whether a commit would write anything (a change, or a new tree never committed)."""
        return self._root is None or self._root < 0


def _assign(target: Page, source: Page) -> None:
    """Give the dirty page `target` the entries of `source` (same kind and level)."""
    target.keys[:] = source.keys
    if isinstance(target, LeafPage):
        assert isinstance(source, LeafPage)
        target.values[:] = source.values
    else:
        assert isinstance(source, InternalPage)
        target.children[:] = source.children
