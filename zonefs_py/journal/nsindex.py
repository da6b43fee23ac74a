"""The namespace index of a format-5 filesystem: a B+tree whose pages live in meta zones.

Blocking code (worker threads, and recovery). The tree (zonefs_py/index) holds
every inode record and directory entry (format/nsindex.py); a checkpoint
applies the entries changed since the last one (`apply`), copies the live pages
of sparse index zones forward (`clean`), commits (children first, then a
flush: every page below the new root is durable before the CHECKPOINT_INDEX
record that names it), and the engine releases the zones left with no live
page once the superblock points past them (`take_empty_zones`). Mount
loads the tree into the State (`load_into`).

Index zones come from the meta zones' free pool (`MetaLog.take_zone`) and go
back to it by a reset (`MetaLog.reset_zones`); the CHECKPOINT_INDEX record
lists them with their live page counts, so recovery tells them from garbage
and needs no walk to know what is live (DESIGN.md 3.14).

Caveats: the whole namespace is still loaded at mount and held in memory
(the State); only checkpoints follow what changed so far. Reads are batched
while mount loads the tree and while cleaning reads a victim zone (1 MiB at
a time); any other page read is one device read. `lookup` and `inode_ops`
(point reads for lazy loading) are not used by the engine yet.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator

from zonefs_py.device.base import ZonedDevice
from zonefs_py.format.constants import OpType
from zonefs_py.format.nsindex import (
    DIRENT_PREFIX,
    INODE_PREFIX,
    NO_ZONE,
    IndexRecordError,
    IndexRoot,
    child_value,
    decode_child,
    dirent_key,
    inode_key,
    inode_key_range,
    split_dirent_key,
    split_inode_key,
    split_parts,
)
from zonefs_py.format.ops import Op, OpDecodeError, decode_ops
from zonefs_py.index.btree import BTree
from zonefs_py.index.cache import PageCache
from zonefs_py.index.errors import IndexCorrupt
from zonefs_py.index.page import DEFAULT_PAGE_SIZE_BYTES, Page, PageLimits
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
#: Zones one checkpoint cleans at most.
CLEAN_ZONES_PER_CHECKPOINT = 2
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
        #: Pages appended but not yet written, from address `_pending_at` on.
        self._pending: list[bytes] = []
        self._pending_at = 0
        self.pages_written = 0
        #: Index zones reset (given back to the log's pool) since this store was made.
        self.zones_reset = 0

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
        """`zone` was reset: it is no index zone any more."""
        del self.live[zone]
        del self._wp[zone]
        self.zones_reset += 1

    def live_pages(self) -> int:
        return sum(self.live.values())


class NamespaceIndex:
    """The format-5 namespace in its B+tree (module docstring)."""

    def __init__(self, dev: ZonedDevice, mlog: MetaLog, root: IndexRoot | None,
                 cache_pages: int = CACHE_PAGES) -> None:
        page_size = index_page_size(dev.info.block_size)
        if root is not None and root.page_size_bytes != page_size:
            raise IndexCorrupt(root.root_address, f"index pages of {root.page_size_bytes} "
                               f"bytes, this device takes {page_size}")
        self.store = MetaPageStore(dev, mlog, page_size, root)
        self.tree = BTree(self.store, PageCache[Page](capacity_pages=cache_pages),
                          None if root is None else root.root_address, page_size)
        limits = PageLimits.for_page_size(page_size)
        #: Bytes of an inode record per tree entry (the key is 11 bytes).
        self.part_bytes = limits.max_entry_bytes - 16
        self.root_record = root
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
        inos: list[int] = []
        blobs: list[bytes] = []
        part_of = -1
        for key, value in self.tree.scan(INODE_PREFIX, DIRENT_PREFIX):
            ino, part = _inode_key(key)
            if inos and ino == inos[-1]:
                if part != part_of + 1:
                    raise IndexCorrupt(0, f"inode {ino}: record part {part} after {part_of}")
            else:
                if part != 0:
                    raise IndexCorrupt(0, f"inode {ino}: record starts with part {part}")
                if len(inos) >= LOAD_BATCH_RECORDS:
                    count += self._apply_records(state, inos, blobs)
                    inos, blobs = [], []
                inos.append(ino)
            part_of = part
            blobs.append(value)
        if inos:
            count += self._apply_records(state, inos, blobs)
        for key, value in self.tree.scan(DIRENT_PREFIX, _END_OF_DIRENTS):
            try:
                parent, name = split_dirent_key(key)
                child = decode_child(value)
            except IndexRecordError as exc:
                raise IndexCorrupt(0, str(exc)) from None
            state.apply((OpType.DIRENT_ADD, parent, child, name))
            count += 1
        return count

    @staticmethod
    def _apply_records(state: State, inos: list[int], blobs: list[bytes]) -> int:
        """Decode consecutive inode records at once (one call for many: mount time)
        and apply them."""
        ops = _checked_records(inos, blobs)
        state.apply_all(ops)
        return len(ops)

    # -- checkpoint (worker thread) ------------------------------------------------------
    def apply(self, inodes: dict[int, bytes | None],
              dirents: dict[tuple[int, bytes], int | None]) -> None:
        """Put the changed entries into the tree (not committed)."""
        tree = self.tree
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
                                     dict(store.live))
        return self.root_record

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
        return _checked_records([ino], blobs)


def _inode_key(key: bytes) -> tuple[int, int]:
    try:
        return split_inode_key(key)
    except IndexRecordError as exc:
        raise IndexCorrupt(0, str(exc)) from None


#: Ops an inode record may hold after its INODE op (SPEC "Namespace index").
_RECORD_OPS = frozenset({OpType.SYMLINK, OpType.XATTR_SET, OpType.DRAIN, OpType.INLINE,
                         OpType.EXTENT, OpType.PREALLOC})


def _checked_records(inos: list[int], blobs: list[bytes]) -> list[Op]:
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
