"""How full the meta area may grow: the checkpoint trigger and the bound on files.

Every meta zone count is in device bytes of the newest checkpoint (records
are compressed): `checkpoint_needed` asks for a checkpoint once the journal
since the last one is as large as it (or meta zones run short),
`checkpoint_budget_bytes` is the largest checkpoint the meta area can keep
rotating, and `estimated_checkpoint_bytes` / `inodes_room` say how many more
files the namespace may take (admission: `NamespaceOps._check_meta_room`;
`df -i`). `MetaRoom` is a base class of `Journal`, which keeps its figures up
to date as it adds ops and writes checkpoints. Memory only, on the trio
thread.
"""

from __future__ import annotations

from typing import Protocol

from zonefs_py.format.constants import OpType
from zonefs_py.journal.log import MetaLog
from zonefs_py.journal.nsindex import LOG_KEEP_ZONES
from zonefs_py.journal.nsindex import SPACE_FACTOR as INDEX_SPACE_FACTOR
from zonefs_py.model.state import State

#: Checkpoint bytes per inode assumed before any checkpoint was measured (an empty
#: file in a directory of 1000: ~130 bytes; with 256 bytes inline: ~380).
NOMINAL_CHECKPOINT_BYTES_PER_INODE = 256
#: Inodes a checkpoint must hold for its bytes per inode to be used instead
#: (mkfs's holds only the root: 93 bytes, below what a file costs).
SAMPLE_MIN_INODES = 64
#: Inodes to come are estimated at this many times (num / den) the device bytes
#: per inode of the newest checkpoint (records are compressed, format 3), plus
#: their metadata-only payloads, uncompressed (`_NEW_INODE_CONTENT`).
GROWTH_MARGIN = (5, 4)
#: Ops whose bytes count, uncompressed, toward the estimate of the next
#: checkpoint when they concern an inode made since the newest checkpoint's
#: snapshot: the payloads only metadata holds (inline bytes, targets, xattrs,
#: drain records, long names). A namespace of small files that compress well
#: can be followed by files whose payloads do not compress at all, and the
#: bytes per inode measured are then many times too low: the meta area ran
#: out in a test (5,000 empty files, then files of 500 random inline bytes, 4
#: meta zones), and random 255-byte names after short ones made a checkpoint
#: of 200 KiB where 128 KiB can rotate. A DIRENT_ADD counts only beyond
#: DIRENT_ALLOWANCE_BYTES: shorter names are left to the bytes per inode (one
#: such op per file would otherwise count twice, and `df -i` fall by two or
#: three per file between checkpoints). Extents are left out: their checksums
#: grow with the data stored, 4 bytes per 4 KiB block, far below the 3% of the
#: device the meta area gets. Value: where the op's subject inode sits.
_NEW_INODE_CONTENT = {OpType.INLINE: 1, OpType.SYMLINK: 1, OpType.XATTR_SET: 1,
                      OpType.DRAIN: 1, OpType.DIRENT_ADD: 2}
DIRENT_ALLOWANCE_BYTES = 64


#: Format 5: device bytes per inode assumed before a checkpoint measured
#: SAMPLE_MIN_INODES: a file of 256 inline bytes in a directory of 500-1,000
#: measures 443-445 (bench/namespace_scale, test_meta_lending). What `df -i`
#: divides the room by on an empty filesystem, so that it predicts how many such
#: files fit (issue 42 item 5; format 4's figure, 256, made it say 1.8x too many).
NOMINAL_INDEX_BYTES_PER_INODE = 450


class ZoneLender(Protocol):
    """Where the namespace index borrows data zones when the meta zones run short
    (format 6; the filesystem's allocator, `fs/filesystem.py`). Trio thread."""

    def lendable_zones(self) -> int:
        """Empty data zones the index could borrow now (the cleaner's reserve and
        the space users were promised left out)."""
        ...

    def lend_zones(self, count: int) -> list[int]:
        """Take up to `count` empty data zones out of the data zones' use."""
        ...

    def take_back_zones(self, zones: list[int]) -> None:
        """Lent zones still empty (the commit did not need them) are data zones again."""
        ...

    def zone_returned(self, zone: int) -> None:
        """A lent zone the index no longer uses was reset: a data zone again."""
        ...


#: Format 5: index page bytes one changed entry may cost a checkpoint, at most
#: (an entry of ~100-250 bytes in a page half full; `_meta_short`).
DIRTY_ENTRY_BYTES = 512


def index_budget_bytes(meta_zones: int, zone_capacity_bytes: int) -> int:
    """Format 5's file bound: the index page bytes a meta area of `meta_zones`
    zones holds (`MetaRoom.checkpoint_budget_bytes` in index mode): the index
    may take SPACE_FACTOR x its live pages' zones + 2 before cleaning
    (journal/nsindex.py), beside the log's current zone, a checkpoint's fresh
    one and a spare; 80% of that, as admission compares an estimate."""
    cap = zone_capacity_bytes
    return max(cap // 4, int((meta_zones - 5) * cap / INDEX_SPACE_FACTOR)) * 4 // 5


class MetaRoom:
    """The meta area's figures and the estimates made from them (module docstring)."""

    log: MetaLog
    state: State
    #: Format 6: where the index borrows data zones (None: the meta zones alone).
    zone_lender: ZoneLender | None = None

    def __init__(self, state: State, checkpoint_bytes: int, checkpoint_disk_bytes: int,
                 index_live_bytes: int | None = None) -> None:
        #: JOURNAL payload bytes (as encoded, before compression) written since
        #: the newest checkpoint's BEGIN, by this mount.
        self.journal_bytes_since_checkpoint = 0
        #: Payload bytes (before compression) of the newest checkpoint written (or
        #: loaded at mount).
        self.last_checkpoint_bytes = checkpoint_bytes
        #: What the newest checkpoint (written, or loaded at mount) took of the
        #: meta area: its records as stored, compressed, with the zone header and
        #: the tails of the zones it filled. The unit of everything that counts
        #: meta zones (`_meta_short`, the checkpoint trigger,
        #: `estimated_checkpoint_bytes`).
        self.last_checkpoint_disk_bytes = checkpoint_disk_bytes
        #: (device bytes, inodes) of the newest checkpoint written (or loaded at
        #: mount): what `estimated_checkpoint_bytes` scales from.
        self.checkpoint_sample: tuple[int, int] = (
            checkpoint_disk_bytes + (index_live_bytes or 0), state.inode_count)
        #: Format 5 (the namespace in the index): a checkpoint writes what changed,
        #: so its trigger is the journal's size alone, and the meta area holds the
        #: index's live pages (counted in `checkpoint_sample`) instead of two
        #: rotating checkpoints.
        self.index_mode = index_live_bytes is not None
        #: Bytes of `_NEW_INODE_CONTENT` ops added for inodes numbered from
        #: `_new_ino_floor` on (the next inode number at the newest snapshot), and
        #: their count when the newest checkpoint's snapshot was taken.
        self._new_content_bytes = 0
        self._new_content_base = 0
        self._new_ino_floor = state.next_ino

    def checkpoint_needed(self, journal_limit: int) -> bool:
        """True when the journal grew past the limit or meta zones run short.

        The limit is `journal_limit` or the size of the newest checkpoint on the
        device, whichever is larger: a checkpoint then costs at most about as
        many bytes as the journal written since the one before, so metadata
        writes stay within ~2x the journal however large the namespace (with a
        fixed limit they grew with the square of the bytes stored). Meta zones
        running short (`_meta_short`) still ask for one earlier. Memory only:
        called on the trio thread.
        """
        limit = journal_limit if self.index_mode else max(journal_limit,
                                                          self.last_checkpoint_disk_bytes)
        if self.journal_bytes_since_checkpoint >= limit:
            return True
        return self._meta_short() and self.journal_bytes_since_checkpoint > 0

    def _meta_short(self) -> bool:
        cap = self.log.zone_capacity_bytes
        if self.index_mode:
            # Format 5: the next checkpoint writes the index pages its changed
            # entries dirty (each at most DIRTY_ENTRY_BYTES of pages half full)
            # beside the log's fresh zone: asked for before the zones run out.
            dirty = self.state.dirty
            pending = 0 if dirty is None else len(dirty) * DIRTY_ENTRY_BYTES
            needed = (2 * (self.last_checkpoint_disk_bytes + pending)) // max(cap, 1) + 3
            free = self.log.free_zone_count()
            if self.zone_lender is None or free >= needed:
                return free < needed
            # Format 6: the index's pages may go to data zones lent to it, the
            # log's records never. The log keeps its own LOG_KEEP_ZONES meta zones
            # whatever the lender holds (its fresh zone for the checkpoint, the
            # journal meanwhile, the one kept for a mount after a crash that tore
            # it); and while a checkpoint would give meta zones back (the log holds
            # zones before its current one) it is asked for as without a lender, so
            # that the index borrows data zones only where the meta zones are short
            # of it, not of a journal that ran them down.
            if free < LOG_KEEP_ZONES or len(self.log.zone_first_seq) > 1:
                return True
            return free + self.zone_lender.lendable_zones() < needed
        # Twice the newest checkpoint as stored: the next one, grown by what the
        # journal meanwhile added (since `checkpoint_needed` lets the journal
        # reach the checkpoint's own size, it may be up to twice as large); +3:
        # its fresh first zone, room for the journal meanwhile, and one zone kept
        # spare so that a mount after a crash that tore this checkpoint can
        # write its own.
        needed = (self.last_checkpoint_disk_bytes * 2) // max(cap, 1) + 3
        return self.log.free_zone_count() < needed

    def checkpoint_budget_bytes(self) -> int:
        """The largest checkpoint the meta area can keep rotating.

        A checkpoint starts in a fresh meta zone and the previous one stays until
        it is complete; one more zone holds the journal meanwhile, and one is
        kept for a mount after a crash that tore a checkpoint (`checkpoint_needed`).
        So two checkpoints and two zones must fit: ceil(C / zone) <= (M - 2) / 2,
        C in device bytes (`last_checkpoint_disk_bytes`). Past that, checkpoints
        run back to back and then the log runs out of empty zones (LogFull: the
        mount turns read-only). Admission (`NamespaceOps._check_meta_room`)
        stops namespace growth at 80% of it, as the estimate it compares
        (`estimated_checkpoint_bytes`) is not exact.
        """
        cap = self.log.zone_capacity_bytes
        if self.index_mode:
            return index_budget_bytes(len(self.log.zones) + self.lent_zone_room(), cap)
        return max(1, (len(self.log.zones) - 2) // 2) * cap * 4 // 5

    def lent_zone_room(self) -> int:
        """Format 6: the data zones the index holds (lent to it) and those it could
        borrow now: what the index's share of the device may grow by beyond the
        meta zones (`checkpoint_budget_bytes`, so `df -i`)."""
        lender = self.zone_lender
        if lender is None:
            return 0
        index = getattr(self, "index", None)
        # The zones lent for a checkpoint under way (`MetaPageStore.lent`, the
        # need's worst case) count too: out of the lender's empty zones until the
        # commit gives back what it did not take, they are no less room; without
        # them a create racing a checkpoint got ENOSPC that `df -i` then denied.
        held = (len(index.store.data_zones()) + len(index.store.lent)
                if index is not None else 0)
        return held + lender.lendable_zones()

    def estimated_checkpoint_bytes(self, inodes: int) -> int:
        """The device bytes of a checkpoint of a namespace of `inodes` inodes: the
        newest checkpoint's, plus for each inode since its device bytes per
        inode with GROWTH_MARGIN (NOMINAL_CHECKPOINT_BYTES_PER_INODE, an
        uncompressed figure, while it held fewer than SAMPLE_MIN_INODES), plus
        the payloads of the new inodes that only metadata holds, uncompressed
        (`_NEW_INODE_CONTENT`). Device bytes, as the budget: records are
        compressed, and inflated sizes made creates fail at a sixth of what
        the meta area holds. An estimate: extents and inline bytes of older
        inodes grow without new inodes (too low lets growth run into the old
        read-only failure); the first checkpoint holds little more than the
        root (too high: the caller checkpoints to measure before refusing).
        """
        c, n = self.checkpoint_sample
        return (c + max(0, inodes - n) * self._checkpoint_bytes_per_inode()
                + self._new_content_bytes - self._new_content_base)

    def inodes_room(self, inodes: int) -> int:
        """How many more inodes the estimate lets a namespace of `inodes` add
        (each at the bytes per inode measured, with GROWTH_MARGIN: what `df -i`
        shows)."""
        spare = self.checkpoint_budget_bytes() - self.estimated_checkpoint_bytes(inodes)
        if self.index_mode:
            # The files to come at what a file measured (no GROWTH_MARGIN: that is
            # the estimate's margin for the files since the newest checkpoint, and
            # a fill checkpoints as it goes), so that `df -i` says what fits.
            c, n = self.checkpoint_sample
            per_inode = (NOMINAL_INDEX_BYTES_PER_INODE if n < SAMPLE_MIN_INODES
                         else max(1, -(-c // n)))
            return max(0, spare // per_inode)
        return max(0, spare // self._checkpoint_bytes_per_inode())

    def _checkpoint_bytes_per_inode(self) -> int:
        c, n = self.checkpoint_sample
        if n < SAMPLE_MIN_INODES:
            return (NOMINAL_INDEX_BYTES_PER_INODE * GROWTH_MARGIN[0] // GROWTH_MARGIN[1]
                    if self.index_mode else NOMINAL_CHECKPOINT_BYTES_PER_INODE)
        num, den = GROWTH_MARGIN
        return max(1, -(-c * num // (n * den)))
