"""`CleanerHost`: the one interface between the cleaner and the filesystem it cleans.

The cleaner (cleaner.py) decides which zone to clean and when: victim policy,
watermarks, copy rate, zones it gave up on. Everything it needs from the
filesystem goes through this protocol, so `cleaner/` imports nothing above
itself (docs/DESIGN.md §1). `zonefs_py.fs.reclaim.SpaceReclaim` implements it
for ZoneFS; tests/unit/test_cleaner.py also implements it in memory.

What a host promises (DESIGN §3.8):
  * `candidate_zones` lists data zones that are written, not being written
    (no write head, no append in flight), not waiting for a reset, usable
    (or unusable only because an append failed) and hold some dead and some
    live data.
  * `live_pieces` is taken without awaiting, so it is one consistent view.
  * `relocate` appends the copy to the cleaner's own stream and re-points
    only the blocks still mapped to the old copy (INV-15: a newer write of
    the same blocks wins), with no await between reading the mapping and
    queueing the EXTENT ops. The old zone is reset only once that change is
    durable (`commit_and_reset`, INV-8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ZoneUsage:
    """A data zone as the cleaner sees it."""

    zone_idx: int
    capacity_bytes: int
    #: Bytes handed out in the zone so far (written or being written).
    written_bytes: int
    live_bytes: int
    #: When data was last appended (mount time for zones written before it).
    last_write_ns: int
    #: The declared tenant owning it (0: none); its copies stay in that tenant's zones.
    tenant: int = 0

    @property
    def dead_bytes(self) -> int:
        return self.written_bytes - self.live_bytes


@dataclass(frozen=True, slots=True, order=True)
class LivePiece:
    """Live blocks of one file, contiguous on the device; ordered by device offset."""

    dev_offset_bytes: int
    ino: int
    #: First file block the piece holds.
    fblock: int
    nblocks: int
    #: The blocks' checksums (4 bytes each), as the file's extent map has them;
    #: None when they are in the summary of the (sealed) zone: `read_verified`
    #: fetches them.
    csums: bytes | None


class CleanerHost(Protocol):
    """What the cleaner needs from the filesystem (see the module docstring)."""

    @property
    def block_size(self) -> int: ...

    @property
    def reserve_zones(self) -> int:
        """Empty zones held back for the cleaner (users get ENOSPC before these, INV-14)."""

    def data_zone_count(self) -> int:
        """Data zones of the filesystem."""

    def empty_zone_count(self) -> int:
        """Zones that can take new data now (empty, usable, not awaiting a reset)."""

    def cleaner_room_bytes(self) -> int:
        """Bytes the cleaner can still append: its write head's room plus empty zones."""

    def tenant_cleaner_room_bytes(self, tenant: int) -> int:
        """Bytes the cleaner can still append for a declared tenant (in its zones)."""

    def tenant_full(self, tenant: int) -> bool:
        """True while the tenant owns as many zones as its cap lets its users own."""

    def tenants_near_cap(self) -> list[int]:
        """Declared tenants within one zone of their cap (background cleaning)."""

    def candidate_zones(self) -> list[ZoneUsage]:
        """Zones worth cleaning (see the module docstring)."""

    def live_pieces(self, zone_idx: int, max_bytes: int) -> list[LivePiece]:
        """The zone's live data now, in pieces of at most `max_bytes`."""

    async def warm_zone(self, zone_idx: int) -> None:
        """Read ahead, off the event loop, what `live_pieces` of the zone will look
        up (format 5's lazy namespace: its owners and their inodes)."""

    def pin_zone(self, zone_idx: int) -> None:
        """Keep the zone from being reset (its data may die while the cleaner copies
        it; a reset under the copy would fail its checksums) until `unpin_zone`."""

    def unpin_zone(self, zone_idx: int) -> None:
        """Undo one `pin_zone`."""

    async def read_verified(self, piece: LivePiece) -> bytes | None:
        """Read the piece; None if the read fails or a block fails its checksum."""

    async def relocate(self, piece: LivePiece, data: bytes) -> int:
        """Append `data` (the piece's verified bytes) to the cleaner's stream, in zones
        of the tenant owning the piece's zone (INV-27), and re-point
        the blocks still mapped to the piece; return the bytes appended.

        Raises errors.IOFailure when the append fails, errors.NoSpace when no
        zone can take it.
        """

    def count_cleaned(self, nbytes: int) -> None:
        """Add a cleaned zone's copied bytes to the persisted cleaner counter."""

    async def commit_and_reset(self) -> None:
        """Make queued changes durable, then reset the zones they left dead."""
