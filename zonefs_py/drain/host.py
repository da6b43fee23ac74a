"""`DrainHost`: the one interface between the drain and the engine it serves.

The drain (manager.py, drainer.py, mover.py) decides what to upload, evict
and restore, and when. Everything it needs of the filesystem goes through
this protocol, in the engine's public terms: "place these bytes for this
file", "read the stored bytes of this file", "run these ops as one
transaction", so `drain/` never reaches into the engine's private state
(tests/unit/test_layers.py checks that no module uses another package's
private names). `zonefs_py.fs.filesystem.ZoneFS` implements it; mypy checks
that it does where ZoneFS builds its DrainManager.

What a host promises:
  * `txn` applies the ops to the State and queues them as one journal
    transaction without awaiting (DESIGN §2: every operation is atomic); the
    caller checked `check_writable` first when it must refuse EROFS.
  * `place_file_data` appends bytes for file blocks from `fblock` and returns
    the EXTENT ops not yet applied, with their zones; the caller applies them
    (`apply_placed`, no await between its last check and that call) or gives
    them back (`discard_placed`: the bytes become garbage).
  * `read_stored` reads a file's (or a snapshot's) bytes as stored, inline
    or in blocks, verified against their checksums.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from zonefs_py.alloc.allocator import Allocator
    from zonefs_py.format.ops import Op
    from zonefs_py.fs.data.qos import ReadLatencyController
    from zonefs_py.fs.options import FsOptions
    from zonefs_py.journal.journal import Journal
    from zonefs_py.model.state import Inode, State

#: EXTENT ops placed but not applied, each with the zone it went to.
Placed = list[tuple["Op", int]]


class DrainHost(Protocol):
    """What the drain needs of the engine (see the module docstring)."""

    @property
    def options(self) -> FsOptions:
        """The mount's options (the drain_* ones, read_only)."""

    @property
    def state(self) -> State:
        """The namespace the drain reads and its ops change."""

    @property
    def journal(self) -> Journal:
        """For `commit()` (a move's step made durable first) and `add()` of ops
        the caller already applied."""

    @property
    def alloc(self) -> Allocator:
        """For `pin_read` / `unpin_read` of the zones an upload reads."""

    @property
    def failsafe(self) -> str | None:
        """Why the mount refuses changes (read-only failsafe), or None."""

    @property
    def bs(self) -> int:
        """The block size."""

    @property
    def qos(self) -> ReadLatencyController:
        """The read-latency controller that gates background device traffic."""

    def path_of(self, ino: int) -> str:
        """One path of the inode, for log lines."""

    def wake_background(self) -> None:
        """Have the background task run a round now (commit, reset, clean)."""

    def note_changed_behind_kernel(self, ino: int) -> None:
        """The drain changed `ino`'s attributes (eviction, restore) without a request:
        the FUSE adapter drops what the kernel caches of it (DESIGN 4.3)."""
        ...

    def check_writable(self) -> None:
        """Raise errors.ReadOnly if the mount takes no changes now."""

    def txn(self, ops: list[Op]) -> None:
        """Apply the ops and queue them as one transaction (never awaits)."""

    def has_unwritten_data(self, ino: int) -> bool:
        """True while the file has buffered bytes or chunks in flight."""

    def release_zones_of(self, ino: int) -> None:
        """The file stops writing: give back its private write head (sealed and
        finished later)."""

    async def place_file_data(self, inode: Inode, fblock: int, data: bytes) -> Placed:
        """Append `data` for file blocks from `fblock`; the ops are not applied."""

    def apply_placed(self, inode: Inode, placed: Placed) -> list[Op]:
        """Apply placed EXTENT ops (never awaits); return them for the journal."""

    def discard_placed(self, placed: Placed) -> None:
        """Give placed but unapplied pieces back (their bytes are garbage)."""

    async def read_stored(self, inode: Inode, offset: int, length: int) -> bytes:
        """The file's stored bytes [offset, offset + length), inline or in blocks."""
