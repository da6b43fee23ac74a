"""When write(2) through the kernel's page cache must be refused (issue 42, DESIGN 4.3).

With the FUSE writeback cache the kernel takes a write(2) into its page cache
without asking the daemon; the WRITE requests come later, at writeback, and a
WRITE refused there for space is reported by the next fsync or close only
(the page is dropped, the kernel's file size stays past it). So the bytes the
kernel holds for the mount and has not yet sent (dirty pages and pages under
writeback: "held") must always fit into the free space, and write(2) must be
refused before they would not.

What bounds the held bytes is the kernel's per-device dirty limit (the FUSE
bdi is `strictlimit`: a writer past its limit waits in balance_dirty_pages
until writeback brings the mount under it). `SpaceGate` decides, from the
free space and that limit, two things the adapter carries out
(`zonefs_py/writegate.py`):

* `refusing`: once the free space falls below `refuse_below_bytes` (what the
  kernel may hold at the limit in effect, `held_bound`, plus `MARGIN_BYTES`),
  write(2) on every handle open for writing gets ENOSPC before any byte enters
  the page cache; it passes again once the free space is `RESUME_BYTES` above
  that (a file deleted, a reservation given back). Before it closes, the drain
  is asked to evict files already in the object store (`relieve`), as the
  engine's admission of a WRITE does. Writes the kernel sends
  meanwhile (writeback of what it holds) are admitted as always: they fit.
* `wanted_limit_bytes`: the dirty limit the adapter should set for the mount,
  one eighth of the free space between `FLOOR_BYTES` and the kernel's own
  default, so the held bytes shrink as the device fills and write(2) is
  refused only `refuse_below_bytes` (a few MiB) before the device is full.
  Far from full the limit stays the kernel's (nothing changes then). When the
  limit cannot be set (a mount by a user who is not root), it stays the
  kernel's default and refusal starts that much earlier.

`held_bound` is measured, not derived: held bytes stayed within 1.22x the
limit plus 1 MiB (a writer's last 1 MiB write) at limits of 1 MiB to 48 MiB
on Linux 6.18 (DESIGN 4.3). A writer that overshoots that bound (a write(2) of
more than the margin in one call, made just as the gate closes) can still
have its last pages refused at writeback (error at fsync/close, as before).

Pure policy: no I/O, no FUSE; `check()` never awaits (it runs inside the
engine's write admission). Disabled (never refusing) until `configure` is
called: without the writeback cache every write(2) is a WRITE request and
gets ENOSPC from the engine's admission directly.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

MiB = 1 << 20


class SpaceGate:
    """The engine's half of the write gate: thresholds and the wanted dirty limit."""

    #: Smallest dirty limit the adapter sets (a writer near full then goes at the
    #: speed of small writebacks; below this it would wait on every page).
    FLOOR_BYTES = 2 * MiB
    #: Free space kept beyond what the kernel may hold when write(2) is refused
    #: (what one write(2) may add between the gate closing and the kernel seeing it).
    MARGIN_BYTES = 4 * MiB
    #: Free space above `refuse_below_bytes` at which write(2) passes again.
    RESUME_BYTES = 4 * MiB
    #: The wanted limit is this fraction of the free space (1/8).
    LIMIT_SHARE = 8
    #: The wanted limit is changed only when it differs from the one in effect by
    #: more than this factor (each change is a sysfs write).
    STEP = 1.5

    def __init__(self, avail_bytes: Callable[[], int],
                 relieve: Callable[[int], Awaitable[bool]] | None = None) -> None:
        self._avail = avail_bytes
        #: Frees space on demand before the gate closes (the drain's eviction of
        #: files already in the object store, as the engine's admission does).
        self._relieve = relieve
        #: The kernel's own dirty limit for the mount (an upper bound), 0 = disabled.
        self.default_limit_bytes = 0
        #: Whether the adapter can set the limit (else it stays the default).
        self.tunable = False
        #: The dirty limit in effect (as the adapter last applied it).
        self.limit_bytes = 0
        self.refusing = False
        #: Times the gate closed since the mount.
        self.closed_count = 0
        self._changed = trio.Event()

    # -- configuration (the adapter) ---------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.default_limit_bytes > 0

    def configure(self, default_limit_bytes: int, tunable: bool) -> None:
        """Enable the gate: the kernel's dirty limit for the mount, and whether the
        adapter may lower it. Evaluates at once."""
        self.default_limit_bytes = max(0, default_limit_bytes)
        self.tunable = tunable
        self.limit_bytes = self.default_limit_bytes
        self.check()
        self._changed.set()  # the adapter applies the first decision at once

    def limit_applied(self, limit_bytes: int) -> None:
        """The adapter set the kernel's dirty limit to (at most) `limit_bytes`."""
        self.limit_bytes = limit_bytes
        self.check()

    def avail_bytes(self) -> int:
        """Free space now (statfs's)."""
        return max(0, self._avail())

    # -- the bounds --------------------------------------------------------------------
    @staticmethod
    def held_bound(limit_bytes: int) -> int:
        """Most bytes the kernel may hold (dirty or under writeback) at a dirty limit."""
        return limit_bytes + limit_bytes // 4 + MiB

    @property
    def refuse_below_bytes(self) -> int:
        """Free space under which write(2) through the page cache is refused."""
        return self.held_bound(self.limit_bytes) + self.MARGIN_BYTES

    @property
    def full_refuse_below_bytes(self) -> int:
        """`refuse_below_bytes` once the device is nearly full (the limit lowered as
        far as it goes): the bound stated in DESIGN 4.3."""
        return self.held_bound(self.wanted_limit(0)) + self.MARGIN_BYTES

    def wanted_limit(self, avail_bytes: int) -> int:
        """The dirty limit for this much free space."""
        if not self.tunable:
            return self.default_limit_bytes
        share = avail_bytes // self.LIMIT_SHARE
        return max(min(self.FLOOR_BYTES, self.default_limit_bytes),
                   min(share, self.default_limit_bytes))

    @property
    def wanted_limit_bytes(self) -> int:
        return self.wanted_limit(max(0, self._avail()))

    def limit_change_due(self, avail_bytes: int | None = None) -> bool:
        """Whether the wanted limit is far enough from the one in effect to apply it:
        lowered by `STEP`, or raised by `STEP` (or back to the default)."""
        if not self.enabled or not self.tunable:
            return False
        avail = self.avail_bytes() if avail_bytes is None else max(0, avail_bytes)
        wanted, now = self.wanted_limit(avail), self.limit_bytes
        if wanted < now:
            return wanted * self.STEP <= now or wanted == self.FLOOR_BYTES
        if wanted > now:
            return wanted >= now * self.STEP or wanted == self.default_limit_bytes
        return False

    # -- evaluation --------------------------------------------------------------------
    def check(self) -> None:
        """Re-evaluate after the free space changed (never awaits); wake the adapter if
        it has something to do."""
        if not self.enabled:
            return
        avail = self._avail()
        below = self.refuse_below_bytes
        if self.refusing:
            refusing = avail < below + self.RESUME_BYTES
        else:
            refusing = avail < below
        if refusing != self.refusing:
            self.refusing = refusing
            self.closed_count += refusing
            self._changed.set()
        elif self.limit_change_due(avail):
            self._changed.set()

    @property
    def near(self) -> bool:
        """Whether the adapter should poll `check`: while refusing or with the limit
        lowered, space comes back through paths that do not call it (unlinks, zone
        resets), and near the threshold fallocate and copies take space without it."""
        if not self.enabled:
            return False
        return (self.refusing or self.limit_bytes < self.default_limit_bytes
                or self._avail() < 2 * self.refuse_below_bytes)

    async def relieve(self) -> bool:
        """Before closing, or while closed: ask for the space that would keep the gate
        open (`relieve`); re-evaluate and return True if anything was freed."""
        if self._relieve is None or not self.enabled:
            return False
        need = self.refuse_below_bytes + self.RESUME_BYTES - self.avail_bytes()
        if need <= 0 or not await self._relieve(need):
            return False
        self.check()
        return True

    async def wait_changed(self) -> None:
        """Wait until `check` found something to do (returns at once if it had)."""
        await self._changed.wait()
        self._changed = trio.Event()

    def status(self) -> dict[str, object]:
        """The gate's state for `zonefs-py stat`."""
        return {"enabled": self.enabled, "refusing": self.refusing,
                "refuse_below_bytes": self.refuse_below_bytes if self.enabled else 0,
                "full_refuse_below_bytes": self.full_refuse_below_bytes if self.enabled else 0,
                "kernel_dirty_limit_bytes": self.limit_bytes,
                "kernel_default_limit_bytes": self.default_limit_bytes,
                "tunable": self.tunable, "times_closed": self.closed_count}


__all__ = ["SpaceGate"]
