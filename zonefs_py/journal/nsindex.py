"""The namespace index of a format-5 filesystem: a B+tree whose pages live in meta zones.

Blocking code (worker threads, and recovery). The tree (zonefs_py/index) holds
every inode record, directory entry and data zone's owner list
(format/nsindex.py); a checkpoint applies the entries changed since the last
one (`apply`), copies the live pages of sparse index zones forward (`clean`),
commits (children first, then a flush: every page below the new root is
durable before the CHECKPOINT_INDEX record that names it), and the engine
releases the zones left with no live page once the superblock points past
them (`take_empty_zones`). A lazy mount reads the published tree through an
`IndexReader` (DESIGN.md 3.15); an eager one (fsck, `inode_cache=0`, a tree
of an older format 5) loads it into the State (`load_into`).

Index zones come from the meta zones' free pool (`MetaLog.take_zone`) and go
back to it by a reset (`MetaLog.reset_zones`); the CHECKPOINT_INDEX record
lists them with their live page counts, so recovery tells them from garbage
and needs no walk to know what is live (DESIGN.md 3.14).

Caveats: reads are batched while mount loads the tree and while cleaning
reads a victim zone (1 MiB at a time); a reader reads one page at a time
(its internal pages pinned in its cache after a mount). The writer's tree
and the reader have a page cache each.
"""

from __future__ import annotations

import contextlib
import errno
import threading
from collections.abc import Callable, Iterator

from zonefs_py import errors
from zonefs_py.device.base import ZonedDevice
from zonefs_py.format.constants import OpType
from zonefs_py.format.nsindex import (
    DIRENT_PREFIX,
    FLAG_SELF_CONTAINED,
    INODE_PREFIX,
    NO_ZONE,
    IndexRecordError,
    IndexRoot,
    child_value,
    decode_child,
    decode_owners,
    dirent_key,
    encode_owners,
    inode_key,
    inode_key_range,
    key_group,
    owners_key,
    owners_key_range,
    split_dirent_key,
    split_inode_key,
    split_parts,
)
from zonefs_py.format.ops import Op, OpDecodeError, decode_ops
from zonefs_py.index.btree import BTree
from zonefs_py.index.cache import PageCache
from zonefs_py.index.errors import IndexCorrupt
from zonefs_py.index.page import DEFAULT_PAGE_SIZE_BYTES, InternalPage, Page, PageLimits
from zonefs_py.journal.log import MetaLog
from zonefs_py.model.state import State

#: Decoded pages kept by the index's cache (clean pages; dirty ones until commit).
CACHE_PAGES = 2048
#: Index zones at most, as a multiple of the zones its live pages fill (+2):
#: past it, a checkpoint copies the live pages of the sparsest zones forward.
SPACE_FACTOR = 1.5
#: Inode records decoded in one call at mount.
LOAD_BATCH_RECORDS = 1024
#: Index pages written to the device in one append at most (a commit's pages are
#: batched until its flush).
WRITE_BATCH_BYTES = 1 << 20
#: Bytes read at a time while mount loads the tree (pages lie mostly in order).
LOAD_READ_AHEAD_BYTES = 1 << 20
#: A scan's prefetch reads pages at most this many pages apart in one read
#: (the pages between are read and dropped).
PREFETCH_GAP_PAGES = 8
#: Internal pages an IndexReader pins at most (~12 KiB each decoded: ~100 MiB; a
#: tree of 10 million small files has more than 4,096, bench/namespace_scale).
PINNED_PAGES = 8192
#: Names and records an IndexReader keeps decoded (each), until a new tree.
RESULTS_KEPT = 256
#: Zones one checkpoint cleans at most.
CLEAN_ZONES_PER_CHECKPOINT = 2
#: Empty meta zones the index leaves to the log when data zones are lent to it
#: (format 6): the log's next zone, a checkpoint's fresh one, and the one kept
#: for a mount after a crash (DESIGN.md 3.3).
LOG_KEEP_ZONES = 3
_END_OF_DIRENTS = bytes([DIRENT_PREFIX[0] + 1])


def index_page_size(block_size: int) -> int:
    """The page size of a device: 4 KiB, or its block size if larger."""
    return max(DEFAULT_PAGE_SIZE_BYTES, block_size)


class MetaPageStore:
    """Index pages appended to meta zones taken from the log's free pool (a `PageStore`).

    Keeps each index zone's live page count (pages the newest committed tree
    references) and its write pointer; `release` takes obsolete pages off the
    counts. A zone is left (finished, giving its active token back) when a page
    no longer fits its capacity.
    """

    def __init__(self, dev: ZonedDevice, mlog: MetaLog, page_size_bytes: int,
                 root: IndexRoot | None) -> None:
        self.dev = dev
        self.mlog = mlog
        self.page_size_bytes = page_size_bytes
        self.zone_size = dev.info.zone_size_bytes
        # A zone listed with no live page may have been reset and reused since
        # (by the log, even): it is no index zone (DESIGN.md 3.14).
        self.live: dict[int, int] = {z: n for z, n in root.zones.items() if n} if root else {}
        self.current: int | None = None
        self._wp: dict[int, int] = {}
        if self.live:
            for z in dev.report_zones(min(self.live), max(self.live) - min(self.live) + 1):
                if z.index in self.live:
                    self._wp[z.index] = z.start_bytes + z.written_bytes
            missing = set(self.live) - set(self._wp)
            if missing:
                raise IndexCorrupt(0, f"index zones {sorted(missing)} are not on the device")
        if root is not None and root.current_zone in self.live:
            self.current = root.current_zone
        #: Bytes one device read takes while scanning (`set_read_ahead`), and the
        #: (address, bytes) read ahead last.
        self.read_ahead_bytes = 0
        self._ahead: tuple[int, bytes] = (0, b"")
        #: Pages `prefetch` read, each served once; device reads it made.
        self._prefetched: dict[int, bytes] = {}
        self.prefetch_reads = 0
        #: Pages appended but not yet written, from address `_pending_at` on.
        self._pending: list[bytes] = []
        self._pending_at = 0
        self.pages_written = 0
        #: Index zones reset (given back to the log's pool) since this store was made.
        self.zones_reset = 0
        #: Empty data zones lent for the commit under way (format 6): taken once the
        #: meta zones are down to LOG_KEEP_ZONES empty (`_next_zone`); the journal
        #: gives them (trio thread, before the commit's worker thread) and takes
        #: back those left unused.
        self.lent: list[int] = []
        #: Called (worker thread) before the first page goes to a lent zone: the
        #: journal's rewrite of a version 5 superblock as version 6, so that only
        #: an image whose index really holds a data zone changes version.
        self.before_lent_use: Callable[[], None] | None = None

    def _zone_end(self, zone: int) -> int:
        return zone * self.zone_size + self.mlog.capacity_bytes(zone)

    def append(self, page_bytes: bytes) -> int:
        ps = self.page_size_bytes
        if len(page_bytes) != ps:
            raise ValueError(f"page of {len(page_bytes)} bytes, store takes {ps}")
        zone = self.current
        if zone is None or self._wp[zone] + ps > self._zone_end(zone):
            zone = self._next_zone()
        # Written in batches (`_write_pending`): the address is the write pointer
        # once the pages before it are out, which the batch's append checks.
        address = self._wp[zone]
        if not self._pending:
            self._pending_at = address
        self._pending.append(page_bytes)
        self._wp[zone] = address + ps
        self.live[zone] += 1
        self.pages_written += 1
        if len(self._pending) * ps >= WRITE_BATCH_BYTES:
            self._write_pending()
        return address

    def _write_pending(self) -> None:
        """Append the batched pages (one device write); they must land where
        `append` said (the zone has no other writer)."""
        if not self._pending:
            return
        data = b"".join(self._pending)
        expected = self._pending_at
        zone = expected // self.zone_size
        self._pending = []
        landed = self.dev.append(zone, data)
        if landed != expected:
            raise OSError(errno.EIO, f"index pages for zone {zone} landed at {landed}, "
                          f"not at {expected}")

    def _next_zone(self) -> int:
        self._write_pending()
        old = self.current
        if old is not None and self._wp[old] < self._zone_end(old):
            self.dev.finish_zone(old)  # its active token back; nothing more goes there
            self._wp[old] = self._zone_end(old)
        if self.lent and self.mlog.free_zone_count() <= LOG_KEEP_ZONES:
            first_use, self.before_lent_use = self.before_lent_use, None
            if first_use is not None:
                first_use()  # the superblock as version 6 (raises: the zone stays lent)
            zone = self.lent.pop(0)
        else:
            zone = self.mlog.take_zone()
        self.live[zone] = 0
        self._wp[zone] = zone * self.zone_size
        self.current = zone
        return zone

    def read(self, address: int) -> bytes:
        zone = address // self.zone_size
        ps = self.page_size_bytes
        if zone not in self._wp or address % ps or address + ps > self._wp[zone]:
            raise IndexCorrupt(address, "address outside the written part of the index zones")
        if self._pending and address >= self._pending_at \
                and address // self.zone_size == self._pending_at // self.zone_size:
            return self._pending[(address - self._pending_at) // ps]
        page = self._prefetched.pop(address, None)
        if page is not None:
            return page
        start, ahead = self._ahead
        if start <= address and address + ps <= start + len(ahead):
            return ahead[address - start:address - start + ps]
        if not self.read_ahead_bytes:
            return self.dev.read(address, ps)
        # A scan (mount): pages were appended in commit order, children first,
        # so a leaf's neighbours mostly follow it in the zone.
        length = min(self.read_ahead_bytes, self._wp[zone] - address)
        self._ahead = (address, self.dev.read(address, length))
        return self._ahead[1][:ps]

    def prefetch(self, addresses: list[int]) -> None:
        """A scan is about to read these pages (the leaves under one internal page,
        BTree.scan): read them now in device order, pages at most PREFETCH_GAP
        apart in one read of at most LOAD_READ_AHEAD_BYTES, and serve `read` of
        each once from memory. Replaces the previous prefetch; addresses outside
        the written index are left to `read` (which refuses them)."""
        self._write_pending()
        ps = self.page_size_bytes
        wanted = sorted({a for a in addresses if a % ps == 0 and a // self.zone_size in self._wp
                         and a + ps <= self._wp[a // self.zone_size]})
        got: dict[int, bytes] = {}
        i = 0
        while i < len(wanted):
            first = last = wanted[i]
            j = i + 1
            while j < len(wanted) and wanted[j] - last <= PREFETCH_GAP_PAGES * ps \
                    and wanted[j] // self.zone_size == first // self.zone_size \
                    and wanted[j] + ps - first <= LOAD_READ_AHEAD_BYTES:
                last = wanted[j]
                j += 1
            data = self.dev.read(first, last + ps - first)
            for a in wanted[i:j]:
                got[a] = data[a - first:a - first + ps]
            self.prefetch_reads += 1
            i = j
        self._prefetched = got

    def preload(self, address: int, pages: int) -> None:
        """Read `pages` pages from `address` at once; reads of them are then served
        from memory until `set_read_ahead` (cleaning a zone)."""
        self._write_pending()
        self._ahead = (address, self.dev.read(address, pages * self.page_size_bytes))

    def set_read_ahead(self, nbytes: int) -> None:
        """Read `nbytes` at a time from now on (0: one page a time) and drop what
        was read ahead."""
        self.read_ahead_bytes = nbytes
        self._ahead = (0, b"")
        self._prefetched = {}

    def flush(self) -> None:
        self._write_pending()
        self.dev.flush()

    def release(self, addresses: list[int]) -> None:
        """Take obsolete pages off their zones' live counts."""
        for address in addresses:
            zone = address // self.zone_size
            if self.live.get(zone, 0) <= 0:
                raise IndexCorrupt(address, f"page released twice (zone {zone} has no live page)")
            self.live[zone] -= 1

    def page_addresses(self, zone: int) -> Iterator[int]:
        """Every page slot written in `zone` (live, obsolete or garbage)."""
        return iter(range(zone * self.zone_size, self._wp[zone], self.page_size_bytes))

    def empty_zones(self) -> list[int]:
        """Index zones no live page is left in (not the one appended to)."""
        return [z for z, n in self.live.items() if n == 0 and z != self.current]

    def forget_zone(self, zone: int) -> None:
        """`zone` was reset: it is no index zone any more (nothing read of it stays)."""
        del self.live[zone]
        del self._wp[zone]
        self._ahead = (0, b"")
        self._prefetched = {}
        self.zones_reset += 1

    def live_pages(self) -> int:
        return sum(self.live.values())

    def data_zones(self) -> list[int]:
        """Index zones outside the meta zones: data zones lent to the index (format 6)."""
        meta = self.mlog.zones
        lo, hi = meta[0], meta[-1]
        return [z for z in self.live if not lo <= z <= hi]


class NamespaceIndex:
    """The format-5 namespace in its B+tree (module docstring)."""

    def __init__(self, dev: ZonedDevice, mlog: MetaLog, root: IndexRoot | None,
                 cache_pages: int | None = None) -> None:
        page_size = index_page_size(dev.info.block_size)
        if root is not None and root.page_size_bytes != page_size:
            raise IndexCorrupt(root.root_address, f"index pages of {root.page_size_bytes} "
                               f"bytes, this device takes {page_size}")
        self.store = MetaPageStore(dev, mlog, page_size, root)
        self.tree = BTree(self.store, PageCache[Page](
            capacity_pages=CACHE_PAGES if cache_pages is None else cache_pages),
                          None if root is None else root.root_address, page_size,
                          key_group=key_group)
        limits = PageLimits.for_page_size(page_size)
        #: Bytes of an inode record per tree entry (the key is 11 bytes).
        self.part_bytes = limits.max_entry_bytes - 16
        self.root_record = root
        #: The tree holds what a lazy mount needs (inode records with their parent,
        #: zone owners): its commits carry FLAG_SELF_CONTAINED. False for a tree
        #: of an older format 5 until a checkpoint rewrote every entry.
        self.self_contained = root is None or root.self_contained
        #: The published tree, as lazy States read it (`open_reader`).
        self.reader: IndexReader | None = None
        #: Pages written and made obsolete by the last commit (figures).
        self.last_written = 0
        self.last_obsolete = 0
        self.last_relocated = 0
        #: Pages copied forward by cleaning since this index was opened.
        self.pages_relocated = 0

    # -- mount ---------------------------------------------------------------------------
    def load_into(self, state: State) -> int:
        """Apply every inode record, then every directory entry, to `state`
        (which has the checkpoint's other ops already). Return the ops applied.

        Raises IndexCorrupt for a damaged page or record (recovery turns it into
        CorruptionError naming fsck), StateError for records that do not fit.
        """
        self.store.set_read_ahead(LOAD_READ_AHEAD_BYTES)
        try:
            return self._load_into(state)
        finally:
            self.store.set_read_ahead(0)

    def _load_into(self, state: State) -> int:
        count = 0
        parents: list[Op] = []
        for inos, blobs in self.record_batches():
            count += self._apply_records(state, inos, blobs, parents)
        for parent, name, child in self.dirents():
            state.apply((OpType.DIRENT_ADD, parent, child, name))
            count += 1
        # A file of several names: its record says which directory is its primary
        # parent (the names above gave it the last one in key order).
        state.apply_all(parents)
        return count

    def dirents(self) -> Iterator[tuple[int, bytes, int]]:
        """The tree's directory entries in key order: (parent, name, child), for the
        mount's load and the bounded fsck. Raises IndexCorrupt for one that does
        not decode."""
        for key, value in self.tree.scan(DIRENT_PREFIX, _END_OF_DIRENTS, prefetch=True):
            try:
                parent, name = split_dirent_key(key)
                child = decode_child(value)
            except IndexRecordError as exc:
                raise IndexCorrupt(0, str(exc)) from None
            yield parent, name, child

    def record_batches(self) -> Iterator[tuple[list[int], list[bytes]]]:
        """The tree's inode records in key order, LOAD_BATCH_RECORDS at a time:
        (inos, their parts' bytes), for `checked_records`. Raises IndexCorrupt
        for parts out of order."""
        inos: list[int] = []
        blobs: list[bytes] = []
        part_of = -1
        for key, value in self.tree.scan(INODE_PREFIX, DIRENT_PREFIX, prefetch=True):
            ino, part = _inode_key(key)
            if inos and ino == inos[-1]:
                if part != part_of + 1:
                    raise IndexCorrupt(0, f"inode {ino}: record part {part} after {part_of}")
            else:
                if part != 0:
                    raise IndexCorrupt(0, f"inode {ino}: record starts with part {part}")
                if len(inos) >= LOAD_BATCH_RECORDS:
                    yield inos, blobs
                    inos, blobs = [], []
                inos.append(ino)
            part_of = part
            blobs.append(value)
        if inos:
            yield inos, blobs

    @staticmethod
    def _apply_records(state: State, inos: list[int], blobs: list[bytes],
                       parents: list[Op]) -> int:
        """Decode consecutive inode records at once (one call for many: mount time)
        and apply them; PARENT ops of files of several names go to `parents`."""
        ops = checked_records(inos, blobs)
        state.apply_all(ops)
        nlink = 0
        for op in ops:
            if op[0] == OpType.INODE:
                nlink = op[4]
            elif op[0] == OpType.PARENT and nlink > 1:
                parents.append(op)
        return len(ops)

    # -- checkpoint (worker thread) ------------------------------------------------------
    def apply(self, inodes: dict[int, bytes | None],
              dirents: dict[tuple[int, bytes], int | None],
              owners: dict[int, list[int] | None] | None = None) -> None:
        """Put the changed entries into the tree (not committed)."""
        tree = self.tree
        for zone in sorted(owners or ()):
            if not 0 <= zone <= 0xFFFFFFFF:
                continue  # (no zone: a forged extent's device offset)
            inos = owners[zone]  # type: ignore[index]
            start, end = owners_key_range(zone)
            old = [k for k, _ in tree.scan(start, end)]
            per_part = self.part_bytes // 8
            new = [] if not inos else [encode_owners(inos[i:i + per_part])
                                       for i in range(0, len(inos), per_part)]
            for part, chunk in enumerate(new):
                tree.put(owners_key(zone, part), chunk)
            for key in old[len(new):]:
                tree.delete(key)
        for ino in sorted(inodes):
            record = inodes[ino]
            start, end = inode_key_range(ino)
            old = [k for k, _ in tree.scan(start, end)]
            new = [] if record is None else split_parts(record, self.part_bytes)
            for part, chunk in enumerate(new):
                tree.put(inode_key(ino, part), chunk)
            for key in old[len(new):]:
                tree.delete(key)
        for (parent, name) in sorted(dirents):
            child = dirents[(parent, name)]
            key = dirent_key(parent, name)
            if child is None:
                tree.delete(key)
            else:
                tree.put(key, child_value(child))

    def clean(self, zone_capacity_bytes: int) -> int:
        """Copy the live pages of the sparsest index zones forward (they become dirty
        and go out with the next commit) while the index takes more than
        SPACE_FACTOR x what its live pages fill, + 2 zones. Return pages relocated."""
        store = self.store
        per_zone = max(1, zone_capacity_bytes // store.page_size_bytes)
        allowed = int(store.live_pages() * SPACE_FACTOR) // per_zone + 2
        victims = sorted((n, z) for z, n in store.live.items()
                         if n > 0 and z != store.current)
        excess = len(store.live) - allowed
        relocated = 0
        for _, zone in victims[:max(0, min(excess, CLEAN_ZONES_PER_CHECKPOINT))]:
            addresses = list(store.page_addresses(zone))
            step = LOAD_READ_AHEAD_BYTES // store.page_size_bytes
            try:
                for i in range(0, len(addresses), step):
                    # The victim's pages in one device read per MiB, not one each.
                    store.preload(addresses[i], min(step, len(addresses) - i))
                    for address in addresses[i:i + step]:
                        try:
                            relocated += self.tree.relocate([address])
                        except IndexCorrupt:
                            # A torn page of a commit cut by a crash (garbage), or
                            # damage: a live page there keeps the zone's count up,
                            # so the zone is never reset.
                            continue
            finally:
                store.set_read_ahead(0)
        self.last_relocated = relocated
        self.pages_relocated += relocated
        return relocated

    def commit(self) -> IndexRoot:
        """Write the dirty pages (flushed) and return the CHECKPOINT_INDEX to record.

        The live counts it carries already leave out the pages this commit made
        obsolete; nothing is reset before the record is durable (the caller's
        `take_empty_zones`, after the superblock points at the checkpoint).
        """
        root = self.tree.commit()
        result = self.tree.last_commit
        assert result is not None
        self.store.release(result.obsolete)
        self.last_written = len(result.written)
        self.last_obsolete = len(result.obsolete)
        store = self.store
        self.root_record = IndexRoot(store.page_size_bytes, root,
                                     NO_ZONE if store.current is None else store.current,
                                     dict(store.live),
                                     FLAG_SELF_CONTAINED if self.self_contained else 0)
        return self.root_record

    # -- the published tree (lazy States read it) ------------------------------------------
    def open_reader(self, next_ino: int, cache_pages: int | None = None) -> IndexReader:
        """The reader lazy States fault in from: the tree of `root_record`, whose
        checkpoint's NEXT_INO is `next_ino`."""
        root = self.root_record
        self.reader = IndexReader(self.store.dev, self.store.page_size_bytes,
                                  None if root is None else root.root_address, next_ino,
                                  CACHE_PAGES if cache_pages is None else cache_pages)
        return self.reader

    def publish(self, next_ino: int) -> None:
        """The superblock points at the checkpoint of `root_record`: readers read
        its tree from now on (the trio thread, before any zone it frees is reset)."""
        if self.reader is not None and self.root_record is not None:
            self.reader.publish(self.root_record.root_address, next_ino)

    def take_empty_zones(self) -> list[int]:
        """Index zones to reset now that the newest checkpoint does not use them;
        the caller resets them (`MetaLog.reset_zones`) then calls `forget_zone`."""
        return self.store.empty_zones()

    def live_bytes(self) -> int:
        return self.store.live_pages() * self.store.page_size_bytes

    # -- point reads (what lazy loading will ask; not used by the engine yet) -------------
    def lookup(self, parent: int, name: bytes) -> int | None:
        """The inode `name` in directory `parent` names in the committed tree, or None.

        One leaf read when the internal pages are cached (DESIGN.md 3.14)."""
        value = self.tree.get(dirent_key(parent, name))
        if value is None:
            return None
        try:
            return decode_child(value)
        except IndexRecordError as exc:
            raise IndexCorrupt(0, str(exc)) from None

    def inode_ops(self, ino: int) -> list[Op] | None:
        """The ops of inode `ino`'s record in the committed tree (INODE first), or None."""
        start, end = inode_key_range(ino)
        blobs = [value for _, value in self.tree.scan(start, end)]
        if not blobs:
            return None
        return checked_records([ino], blobs)


def _inode_key(key: bytes) -> tuple[int, int]:
    try:
        return split_inode_key(key)
    except IndexRecordError as exc:
        raise IndexCorrupt(0, str(exc)) from None


#: Ops an inode record may hold after its INODE op (SPEC "Namespace index").
_RECORD_OPS = frozenset({OpType.SYMLINK, OpType.XATTR_SET, OpType.DRAIN, OpType.INLINE,
                         OpType.EXTENT, OpType.PREALLOC, OpType.PARENT})


class NotCached(Exception):
    """A read under `IndexReader.cached_only` needed a page not in the cache."""


class IndexReader:
    """The published tree, read by lazy States (model/lazy.py) from any thread.

    Pages of a published tree are never changed and stay where they are until
    a later tree is published and their zone reset; `lock` covers every read
    and the switch to a new tree (`publish`) and the resets (`zones_reset`),
    so a reader never reads a zone being reset. Its page cache is its own (the
    checkpoint's worker thread has the writer's).

    The trio thread reads through it under `cached_only()`: a page not in the
    cache raises NotCached, and the caller reads it in a worker thread
    (`warm`) and tries again, so the event loop never waits for the device.
    """

    def __init__(self, dev: ZonedDevice, page_size_bytes: int, root_address: int | None,
                 next_ino: int, cache_pages: int = CACHE_PAGES) -> None:
        self.lock = threading.Lock()
        self.next_ino = next_ino
        self.page_size_bytes = page_size_bytes
        self._local = threading.local()
        self._store = _DevicePages(dev, page_size_bytes, self._local)
        self._cache = _PinningCache(capacity_pages=cache_pages)
        self._tree = BTree(self._store, self._cache, root_address, page_size_bytes)
        #: The last names looked up and records decoded in this tree (a request
        #: asks twice: `fs/lazyio.fault_in`, then the engine), up to
        #: RESULTS_KEPT each; dropped whenever another tree is published.
        self._names: dict[tuple[int, bytes], int | None] = {}
        self._records: dict[int, list[Op] | None] = {}

    @property
    def device_reads(self) -> int:
        return self._store.reads

    @property
    def cache(self) -> PageCache[Page]:
        return self._cache

    def publish(self, root_address: int, next_ino: int) -> None:
        with self.lock:
            self._tree = BTree(self._store, self._cache, root_address, self.page_size_bytes)
            self.next_ino = next_ino
            self._names = {}
            self._records = {}

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """Hold the lock for one read (under `cached_only`, only if it is free:
        a worker thread holding it may be reading the device)."""
        if getattr(self._local, "cached_only", False):
            if not self.lock.acquire(blocking=False):
                raise NotCached(-1)
        else:
            self.lock.acquire()
        try:
            yield
        finally:
            self.lock.release()

    @contextlib.contextmanager
    def cached_only(self) -> Iterator[None]:
        """Reads in this thread raise NotCached instead of reading the device."""
        self._local.cached_only = True
        try:
            yield
        finally:
            self._local.cached_only = False

    def warm(self, parent: int, name: bytes | None, ino: int | None = None) -> None:
        """Worker thread: read into the cache the pages that looking up `name` in
        `parent` (if given) and the named inode's record (or `ino`'s) take."""
        if name is not None:
            ino = self.lookup(parent, name)
        if ino is not None:
            self.inode_ops(ino)

    def warm_zone(self, zone: int, inos: list[int]) -> None:
        """Worker thread: read into the cache `zone`'s owner list and the records
        of its owners and of `inos` (a zone the cleaner or the sealer reads)."""
        for ino in [*self.zone_owners(zone), *inos]:
            self.inode_ops(ino)

    def warm_names(self, parent: int, after: bytes | None, limit: int,
                   inodes: bool = True) -> None:
        """Worker thread: read into the cache a batch of `parent`'s names after
        `after` and (with `inodes`) their inodes' records (readdir)."""
        for _, child in self.names_after(parent, after, limit):
            if inodes:
                self.inode_ops(child)

    def zones_reset(self, zones: list[int], zone_size: int) -> None:
        """Index `zones` were reset: drop the cached pages there (an address may be
        reused)."""
        with self.lock:
            self._cache.discard_zones(set(zones), zone_size)

    def pin_internal_pages(self, max_pages: int = PINNED_PAGES) -> int:
        """Worker thread: read the published tree's internal pages (all levels but
        the leaves, breadth first, up to `max_pages`) into the cache for good, so
        that a cold lookup or record reads its leaf only (issue 32: a cold stat
        in at most 3 device reads). Return the pages pinned."""
        with self._reading():
            tree = self._tree
            root = tree.root
        todo = [] if root is None else [root]
        pinned = 0
        while todo and pinned < max_pages:
            ref = todo.pop(0)
            with self._reading():
                if self._tree is not tree:
                    break  # another tree was published meanwhile: its paths differ
                page = tree.load_page(ref)
                if not isinstance(page, InternalPage):
                    continue
                self._cache.pin(ref, page)
            pinned += 1
            if page.level > 1:
                todo.extend(page.children)
        return pinned

    def inode_ops(self, ino: int) -> list[Op] | None:
        records = self._records
        if ino in records:
            return records[ino]
        start, end = inode_key_range(ino)
        with self._reading():
            blobs = [value for _, value in self._tree.scan(start, end)]
        ops = checked_records([ino], blobs) if blobs else None  # (pure decoding)
        if len(records) >= RESULTS_KEPT:
            records.clear()
        records[ino] = ops
        return ops

    def lookup(self, parent: int, name: bytes) -> int | None:
        names = self._names
        key = (parent, name)
        if key in names:
            return names[key]
        with self._reading():
            value = self._tree.get(dirent_key(parent, name))
        try:
            child = None if value is None else decode_child(value)
        except IndexRecordError as exc:
            raise IndexCorrupt(0, str(exc)) from None
        if len(names) >= RESULTS_KEPT:
            names.clear()
        names[key] = child
        return child

    def names_after(self, parent: int, after: bytes | None,
                    limit: int) -> list[tuple[bytes, int]]:
        start = dirent_key(parent, b"") if after is None else dirent_key(parent, after) + b"\0"
        end = dirent_key(parent + 1, b"")
        out: list[tuple[bytes, int]] = []
        try:
            with self._reading():
                for key, value in self._tree.scan(start, end):
                    out.append((split_dirent_key(key)[1], decode_child(value)))
                    if len(out) >= limit:
                        break
        except IndexRecordError as exc:
            raise IndexCorrupt(0, str(exc)) from None
        return out

    def zone_owners(self, zone: int) -> list[int]:
        if not 0 <= zone <= 0xFFFFFFFF:
            return []  # (no zone: a forged device offset asked)
        start, end = owners_key_range(zone)
        with self._reading():
            values = [value for _, value in self._tree.scan(start, end)]
        out: list[int] = []
        try:
            for value in values:
                out.extend(decode_owners(value))
        except IndexRecordError as exc:
            raise IndexCorrupt(0, str(exc)) from None
        return out


class _PinningCache(PageCache[Page]):
    """The reader's page cache: an LRU, plus pages pinned for good (internal pages,
    `IndexReader.pin_internal_pages`) until their zone is reset."""

    def __init__(self, capacity_pages: int) -> None:
        super().__init__(capacity_pages=capacity_pages)
        self.pinned: dict[int, Page] = {}

    def get(self, address: int) -> Page | None:
        page = self.pinned.get(address)
        if page is not None:
            self.hits += 1
            return page
        return super().get(address)

    def holds(self, address: int) -> bool:
        return address in self.pinned or super().holds(address)

    def pin(self, address: int, page: Page) -> None:
        self.pinned[address] = page
        self.discard(address)

    def discard_zones(self, zones: set[int], zone_size: int) -> None:
        for address in [a for a in self.pinned if a // zone_size in zones]:
            del self.pinned[address]
        for address in [a for a in self._clean if a // zone_size in zones]:
            self.discard(address)

    def clear(self) -> None:
        super().clear()
        self.pinned.clear()


class _DevicePages:
    """Read-only page access for an IndexReader (no read-ahead state to share)."""

    def __init__(self, dev: ZonedDevice, page_size_bytes: int, local: threading.local) -> None:
        self.dev = dev
        self.page_size_bytes = page_size_bytes
        self.reads = 0
        self._local = local

    def append(self, page_bytes: bytes) -> int:
        raise RuntimeError("the published index tree is read-only")

    def read(self, address: int) -> bytes:
        if address % self.page_size_bytes or address < 0 \
                or address + self.page_size_bytes > self.dev.info.size_bytes:
            raise IndexCorrupt(address, "page address outside the device")
        if getattr(self._local, "cached_only", False):
            raise NotCached(address)
        self.reads += 1
        try:
            return self.dev.read(address, self.page_size_bytes)
        except OSError as exc:
            # A domain error (EIO to the kernel; the failsafe for background work),
            # as a failed data read is: faults happen on any path (DESIGN.md 3.15).
            raise errors.IOFailure(f"namespace index page at {address} could not be "
                                   f"read: {exc}") from exc

    def flush(self) -> None:
        pass


def checked_records(inos: list[int], blobs: list[bytes]) -> list[Op]:
    """Decode the records of `inos` (consecutive, their parts in `blobs`) and check
    them: each is one INODE op of its key's inode, then only ops of that inode an
    inode record may hold (SPEC "Namespace index"). Raises IndexCorrupt."""
    try:
        ops = decode_ops(b"".join(blobs))
    except OpDecodeError as exc:
        raise IndexCorrupt(0, f"inode records from {inos[0]} on do not decode: "
                           f"{exc}") from None
    expect = iter(inos)
    cur = None
    for op in ops:
        if op[0] == OpType.INODE:
            cur = next(expect, None)
            if op[1] != cur:
                raise IndexCorrupt(0, f"inode record of {cur} holds inode {op[1]}")
        elif op[1] != cur or op[0] not in _RECORD_OPS:
            raise IndexCorrupt(0, f"inode record of {cur} holds a "
                               f"{OpType(op[0]).name} op of {op[1]}")
    missing = next(expect, None)
    if missing is not None:
        raise IndexCorrupt(0, f"inode record of {missing} holds no INODE op")
    return ops
