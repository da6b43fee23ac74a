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

Per declared tenant (issue 45, DESIGN 3.9a): a tenant with `--max-zones`
has free space of its own under its cap (`tenant_avail`, fs/tenantspace.py).
While the adapter has handles open for writing in it (`writing_tenants`),
the same thresholds apply to it alone: below `refuse_below_bytes` it is in
`refusing_tenants` and only its handles are refused, the others keep the
writeback cache. The dirty limit being the mount's, `wanted_limit_bytes`
follows the smallest free space of the device and of those tenants.

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
                 relieve: Callable[..., Awaitable[bool]] | None = None,
                 tenant_avail: Callable[[int, int], int | None] | None = None) -> None:
        self._avail = avail_bytes
        #: Frees space on demand before the gate closes (the drain's eviction of
        #: files already in the object store, as the engine's admission does);
        #: called as relieve(need_bytes) for the device, relieve(need_bytes,
        #: tenant=tid) for a declared tenant's files.
        self._relieve = relieve
        #: tenant_avail(tid, within) -> a capped tenant's free bytes under its cap
        #: when they may be below `within`, else None (TenantSpace.avail_within).
        self._tenant_avail = tenant_avail
        #: Declared tenant -> its handles open for writing (kept by the adapter): the
        #: tenants whose free space under their cap the gate watches (issue 45).
        self.writing_tenants: dict[int, int] = {}
        #: Tenants whose handles' write(2) is refused (near their cap), per tenant:
        #: the other tenants keep the writeback cache.
        self.refusing_tenants: set[int] = set()
        #: Times a tenant's gate closed since the mount.
        self.tenant_closed_count = 0
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

    # -- tenants (issue 45) ------------------------------------------------------------
    def tenant_writer(self, tenant: int, delta: int) -> None:
        """The adapter opened (+1) or released (-1) a handle for writing in `tenant`."""
        if not tenant:
            return
        left = self.writing_tenants.get(tenant, 0) + delta
        if left > 0:
            self.writing_tenants[tenant] = left
        else:
            self.writing_tenants.pop(tenant, None)
            self.refusing_tenants.discard(tenant)

    def _tenant_watch_bytes(self) -> int:
        """Free space under a cap below which a tenant's exact figure matters: its gate,
        or (tunable) the dirty limit it would lower."""
        watch = 2 * self.refuse_below_bytes + self.RESUME_BYTES
        if self.tunable:
            watch = max(watch, self.default_limit_bytes * self.LIMIT_SHARE)
        return watch

    def tenant_avails(self) -> dict[int, int]:
        """Free bytes under their caps of the writing tenants near enough to matter."""
        if self._tenant_avail is None or not self.writing_tenants:
            return {}
        within = self._tenant_watch_bytes()
        out: dict[int, int] = {}
        for tid in self.writing_tenants:
            avail = self._tenant_avail(tid, within)
            if avail is not None:
                out[tid] = max(0, avail)
        return out

    def _limit_avail(self, avail: int, tenants: dict[int, int]) -> int:
        """The free space the dirty limit follows: the device's, or less under the cap
        of a tenant being written (the limit is the mount's, one for all tenants)."""
        return min(avail, *tenants.values()) if tenants else avail

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
        return self.wanted_limit(self._limit_avail(max(0, self._avail()),
                                                   self.tenant_avails()))

    def limit_change_due(self, avail_bytes: int | None = None) -> bool:
        """Whether the wanted limit is far enough from the one in effect to apply it:
        lowered by `STEP`, or raised by `STEP` (or back to the default)."""
        if not self.enabled or not self.tunable:
            return False
        avail = (self._limit_avail(self.avail_bytes(), self.tenant_avails())
                 if avail_bytes is None else max(0, avail_bytes))
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
        tenants = self.tenant_avails()
        refusing_tenants = {
            tid for tid, t_avail in tenants.items()
            if t_avail < below + (self.RESUME_BYTES if tid in self.refusing_tenants else 0)}
        if refusing != self.refusing:
            self.refusing = refusing
            self.closed_count += refusing
            self._changed.set()
        if refusing_tenants != self.refusing_tenants:
            self.tenant_closed_count += len(refusing_tenants - self.refusing_tenants)
            self.refusing_tenants = refusing_tenants
            self._changed.set()
        elif self.limit_change_due(self._limit_avail(avail, tenants)):
            self._changed.set()

    @property
    def near(self) -> bool:
        """Whether the adapter should poll `check`: while refusing or with the limit
        lowered, space comes back through paths that do not call it (unlinks, zone
        resets), and near the threshold fallocate and copies take space without it."""
        if not self.enabled:
            return False
        return (self.refusing or bool(self.refusing_tenants)
                or self.limit_bytes < self.default_limit_bytes
                or self._avail() < 2 * self.refuse_below_bytes
                or any(a < 2 * self.refuse_below_bytes
                       for a in self.tenant_avails().values()))

    async def relieve(self) -> bool:
        """Before closing, or while closed: ask for the space that would keep the gate
        open (`relieve`); re-evaluate and return True if anything was freed."""
        if self._relieve is None or not self.enabled:
            return False
        freed = False
        need = self.refuse_below_bytes + self.RESUME_BYTES - self.avail_bytes()
        if need > 0 and await self._relieve(need):
            freed = True
        for tid, t_avail in self.tenant_avails().items():
            need = self.refuse_below_bytes + self.RESUME_BYTES - t_avail
            if need > 0 and await self._relieve(need, tenant=tid):
                freed = True
        if freed:
            self.check()
        return freed

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
                "tunable": self.tunable, "times_closed": self.closed_count,
                "refusing_tenants": sorted(self.refusing_tenants),
                "times_closed_for_tenants": self.tenant_closed_count}


__all__ = ["SpaceGate"]
