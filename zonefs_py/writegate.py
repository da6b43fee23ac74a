"""The write gate, the adapter's half: ENOSPC from write(2) on a nearly full filesystem.

The engine decides (`zonefs_py.fs.spacegate.SpaceGate`: when write(2) must be
refused, and the kernel's dirty limit for the mount); this module makes the
kernel do it (DESIGN 4.3, "ENOSPC from write(2)").

With the writeback cache, write(2) asks the daemon nothing, with one exception
the gate uses: it first refreshes the inode's size and mode
(`fuse_update_attributes(STATX_SIZE | STATX_MODE)`), and sends a GETATTR
carrying the file handle when the mode was invalidated or the attributes
expired. An error answer to that GETATTR is write(2)'s error, before any byte
enters the page cache. read(2) and lseek(2) ask only for the size, which the
kernel owns under the writeback cache, so an invalidation of the attributes
alone makes write(2) ask and nothing else (Linux 6.18, checked by experiment).

So, when the gate closes: every handle open for writing is listed in the C
side (`fuseext.gate_add`), which answers ENOSPC to a GETATTR naming it, then
the kernel's attributes of their inodes are invalidated
(`pyfuse3.invalidate_inode(ino, attr_only=True)`, from a worker thread). A
handle opened for writing while the gate is closed is listed before the open
is answered; an OPEN invalidates the inode before its answer, a CREATE's
entry carries an attribute timeout of 0 (its first write then asks). Every
attribute or entry answer for an inode with a listed handle carries timeout
0 too (`gated`), so a stat(2) meanwhile (answered: it names no handle) does
not let the next write(2) through without asking. When the gate opens, the
list is emptied; the next GETATTR is answered and the attributes cached as
before.

Per declared tenant (issue 45): a handle open for writing records its
file's tenant; when the engine says a tenant is near its cap
(`SpaceGate.refusing_tenants`), only that tenant's handles are listed
(`closed_tenants`), and unlisted again when it has room (the device gate
opening leaves them listed). A tenant's first writer may lower the dirty
limit before its open is answered, so that it is refused only when really
near its cap.

The loop (`run`) also sets the kernel's dirty limit the engine wants
(`set_limit`, a sysfs write given by the daemon). It wakes when the engine's
`SpaceGate.check` found something to do, and polls every `POLL_S` while the
gate is near. Requests that may give space back (unlink, rename, truncate,
release, forget, fallocate, statfs) reopen a closed gate before they are
answered (`space_may_be_back`): a write(2) right after an unlink passes, as
on ext4.

Caveats:
  * A read(2) on a handle open for reading and writing may also send a
    GETATTR with the handle (when its attributes expired): while the gate is
    closed, that read(2) gets ENOSPC too. Write-only handles (dd, `open(...,
    "wb")`) never do.
  * Writes through a shared mmap are not write(2): their pages are written
    back like any, and a refused WRITE is reported at msync/fsync.
  * Handles of a file holding blocks reserved by fallocate are never listed
    (writes into the reservation must not fail, INV-24): their write(2) past
    the reservation, near full, can be refused at writeback only.
  * Without the C extension (`fuseext.installed()` False) nothing can be
    refused: the gate logs a warning once and stays open.
  * A handle's tenant is taken at its open: a file opened before its
    directory was declared a tenant is not refused by that tenant's gate
    (its WRITEs are still held to the cap by the engine, reported at
    fsync/close).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from zonefs_py import fuseext
from zonefs_py.fs.spacegate import SpaceGate

log = logging.getLogger(__name__)

#: Seconds between checks while the gate is near (see `SpaceGate.near`).
POLL_S = 0.1


class WriteGate:
    """Handles open for writing, and the kernel side of `SpaceGate`'s decisions."""

    def __init__(self, gate: SpaceGate | None,
                 invalidate: Callable[[list[int]], Awaitable[None]],
                 reserved: Callable[[int], bool] = lambda ino: False,
                 tenant_of: Callable[[int], int] = lambda ino: 0) -> None:
        self.gate = gate
        self._invalidate = invalidate
        #: The declared tenant of an inode (0: none), taken when a handle opens.
        self._tenant_of = tenant_of
        #: Handle -> its inode's tenant, for the handles of declared tenants.
        self._fh_tenant: dict[int, int] = {}
        #: Inode -> its tenant, while it has handles open for writing in a tenant.
        self._ino_tenant: dict[int, int] = {}
        #: Tenants whose handles the C side refuses (near their cap; issue 45).
        self.closed_tenants: set[int] = set()
        #: Whether an inode holds blocks reserved by fallocate: its handles are never
        #: listed (writes into a reservation must not get ENOSPC; INV-24).
        self._reserved = reserved
        #: Handle -> inode of every handle open for writing.
        self._writable: dict[int, int] = {}
        #: Inode -> number of its handles open for writing.
        self._by_ino: dict[int, int] = {}
        #: Whether the C side refuses the listed handles (the gate as applied).
        self.closed = False
        #: Sets the kernel's dirty limit for the mount (blocking: run in a worker
        #: thread); returns the bound now in effect, or None if it could not.
        self.set_limit: Callable[[int], int | None] | None = None
        #: One dirty-limit change at a time, its wanted value computed under it: two
        #: at once (the run loop's, computed before a tenant's first writer counted,
        #: and that writer's) landed in either order, and the stale one left the
        #: limit at the device's figure with the tenant refused from its first write.
        self._limit_lock = trio.Lock()
        self._warned = False

    # -- handles (from the request handlers) -------------------------------------------
    def _refused(self, ino: int) -> bool:
        """Whether handles of `ino` are listed now (the gate, or its tenant's, closed)."""
        if self._reserved(ino):
            return False
        return self.closed or self._ino_tenant.get(ino, 0) in self.closed_tenants

    def gated(self, ino: int) -> bool:
        """Whether `ino`'s attributes must not be cached (a listed handle is open)."""
        return ino in self._by_ino and self._refused(ino)

    async def opened(self, fh: int, ino: int, *, created: bool) -> None:
        """A handle open for writing, before the OPEN or CREATE is answered."""
        self._writable[fh] = ino
        self._by_ino[ino] = self._by_ino.get(ino, 0) + 1
        tenant = self._tenant_of(ino) if self.gate is not None else 0
        if tenant:
            self._fh_tenant[fh] = tenant
            self._ino_tenant[ino] = tenant
            assert self.gate is not None
            first = tenant not in self.gate.writing_tenants
            self.gate.tenant_writer(tenant, +1)
            self.gate.check()  # a tenant at its cap: refused from its first write(2)
            if first and tenant in self.gate.refusing_tenants:
                # Its first writer: the dirty limit did not follow its free space
                # yet (it had none), so the threshold is the default limit's.
                # Lower the limit first; refused only if still near its cap then.
                await self._apply_limit()
                if tenant not in self.gate.refusing_tenants and tenant in self.closed_tenants:
                    # The run loop closed it meanwhile, on a limit this lowered since.
                    self._open_tenant(tenant)
            if tenant in self.gate.refusing_tenants and tenant not in self.closed_tenants:
                # Every handle of the tenant, this one with them, before the answer.
                await self._close_tenants({tenant})
                return
        if not self._refused(ino):
            return
        self._list(fh)
        if not created:
            # The kernel may hold valid attributes: drop them before it gets the
            # handle, so that its first write(2) asks (a CREATE's entry carries 0).
            await self._invalidate([ino])

    def released(self, fh: int) -> None:
        """A handle was released."""
        ino = self._writable.pop(fh, None)
        if ino is None:
            return
        left = self._by_ino[ino] - 1
        if left:
            self._by_ino[ino] = left
        else:
            del self._by_ino[ino]
            self._ino_tenant.pop(ino, None)
        tenant = self._fh_tenant.pop(fh, 0)
        if tenant and self.gate is not None:
            self.gate.tenant_writer(tenant, -1)
            if tenant not in self.gate.writing_tenants:
                self.closed_tenants.discard(tenant)
        fuseext.gate_remove(fh)

    async def reservation_changed(self, ino: int) -> None:
        """A fallocate changed `ino`'s reservation: while closed, its handles are
        unlisted if it now holds reserved blocks, listed again if it holds none."""
        if not self.closed and self._ino_tenant.get(ino, 0) not in self.closed_tenants:
            return
        fhs = [fh for fh, i in self._writable.items() if i == ino]
        if self._reserved(ino):
            for fh in fhs:
                fuseext.gate_remove(fh)
        elif fhs:
            for fh in fhs:
                self._list(fh)
            await self._invalidate([ino])

    def space_may_be_back(self) -> None:
        """A request that may have freed space finished (unlink, truncate, release,
        forget, a hole punched, rename, statfs): if the gate is closed and the space
        is back, open it now, so the next write(2) passes (never awaits)."""
        if (not self.closed and not self.closed_tenants) or self.gate is None:
            return
        self.gate.check()
        if self.closed and not self.gate.refusing:
            self._open()
        for tenant in self.closed_tenants - self.gate.refusing_tenants:
            self._open_tenant(tenant)

    def _open(self) -> None:
        assert self.gate is not None
        self.closed = False
        fuseext.gate_clear()
        # The handles of tenants near their caps stay refused.
        for fh, tenant in self._fh_tenant.items():
            if tenant in self.closed_tenants and not self._reserved(self._writable[fh]):
                self._list(fh)
        log.info("space is back (%d MiB free): write(2) passes again",
                 self.gate.avail_bytes() >> 20)

    def _open_tenant(self, tenant: int) -> None:
        """Stop refusing the tenant's handles (unless the whole gate is closed)."""
        self.closed_tenants.discard(tenant)
        if not self.closed:
            for fh, t in self._fh_tenant.items():
                if t == tenant:
                    fuseext.gate_remove(fh)
        self._log_tenant(tenant, closed=False)

    async def _close_tenants(self, tenants: set[int]) -> None:
        """Refuse write(2) on the handles of `tenants` (near their caps)."""
        self.closed_tenants |= tenants
        listed: set[int] = set()
        for fh, t in self._fh_tenant.items():
            ino = self._writable[fh]
            if t in tenants and not self._reserved(ino):
                self._list(fh)
                listed.add(ino)
        for tenant in tenants:
            self._log_tenant(tenant, closed=True)
        await self._invalidate(sorted(listed))

    def _log_tenant(self, tenant: int, *, closed: bool) -> None:
        if closed:
            log.info("tenant %d is near its cap: write(2) on its files gets ENOSPC", tenant)
        else:
            log.info("tenant %d has room again under its cap: write(2) passes", tenant)

    def _list(self, fh: int) -> None:
        if not fuseext.gate_add(fh) and not self._warned:
            self._warned = True
            log.warning("the filesystem is nearly full, but write(2) cannot be refused "
                        "(zonefs_py._fuseext missing): writes past the free space fail "
                        "at fsync/close only")

    # -- the loop --------------------------------------------------------------------
    async def run(self) -> None:
        """Apply the engine's decisions for the mount's life."""
        gate = self.gate
        if gate is None:
            return
        while True:
            if gate.near:
                with trio.move_on_after(POLL_S):
                    await gate.wait_changed()
                gate.check()
                if gate.refusing:
                    await gate.relieve()  # files drained meanwhile may be evicted
            else:
                await gate.wait_changed()
            await self.apply()

    async def apply(self) -> None:
        """Close or open the gate, and set the dirty limit, as the engine wants now."""
        gate = self.gate
        if gate is None:
            return
        if (gate.refusing and not self.closed) or gate.refusing_tenants - self.closed_tenants:
            await gate.relieve()
        if gate.refusing and not self.closed:
            await self._close()
        elif not gate.refusing and self.closed:
            self._open()
        for tenant in self.closed_tenants - gate.refusing_tenants:
            self._open_tenant(tenant)
        if gate.refusing_tenants - self.closed_tenants:
            await self._close_tenants(gate.refusing_tenants - self.closed_tenants)
        await self._apply_limit()

    async def _apply_limit(self) -> None:
        """Set the kernel's dirty limit the engine wants, if it is due (one change at a
        time, each computed from the figures after the one before it)."""
        gate = self.gate
        assert gate is not None
        async with self._limit_lock:
            if gate.limit_change_due() and self.set_limit is not None:
                wanted = gate.wanted_limit_bytes
                applied = await trio.to_thread.run_sync(self.set_limit, wanted)
                if applied is None:
                    gate.tunable = False
                    gate.limit_applied(gate.default_limit_bytes)
                else:
                    gate.limit_applied(applied)

    async def _close(self) -> None:
        gate = self.gate
        assert gate is not None
        self.closed = True
        listed = {ino for ino in self._by_ino if not self._reserved(ino)}
        for fh, ino in list(self._writable.items()):
            if ino in listed:
                self._list(fh)
        log.info("nearly full (%d MiB free, threshold %d MiB): write(2) gets ENOSPC",
                 gate.avail_bytes() >> 20, gate.refuse_below_bytes >> 20)
        # Listed first, invalidated then: a write(2) between the two passes unasked
        # (its bytes fit: the threshold keeps MARGIN_BYTES beyond what the kernel holds).
        await self._invalidate(sorted(listed))

    def status(self) -> dict[str, object]:
        """The gate for `zonefs-py stat`: the engine's thresholds and what was refused."""
        doc: dict[str, object] = dict(self.gate.status()) if self.gate is not None else {}
        doc.update(closed=self.closed, closed_tenants=sorted(self.closed_tenants),
                   writable_handles=len(self._writable),
                   writes_refused=fuseext.gate_refused())
        return doc


__all__ = ["POLL_S", "WriteGate"]
