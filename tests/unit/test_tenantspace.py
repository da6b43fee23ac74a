"""A declared tenant's cap at write admission and in the write gate (issue 45,
fs/tenantspace.py, fs/spacegate.py, writegate.py).

The engine tests mount an emulated image (no FUSE) and end with fsck (INV-27);
the gate tests fake the C side as tests/unit/test_spacegate.py does.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from engine_helpers import CTX, MiB, mounted, pattern, read_file, resolve, write_file
from test_spacegate import FakeC, Invalidations, Space

from zonefs_py import errors
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.fs.spacegate import SpaceGate
from zonefs_py.writegate import WriteGate

KiB = 1 << 10
STEP = 256 * KiB


async def _mkdir(fs: ZoneFS, path: str) -> int:
    parent = await resolve(fs, "/")
    return (await fs.mkdir(parent, path.lstrip("/").encode(), 0o755, CTX)).ino


async def _fill_without_fsync(fs: ZoneFS, dir_ino: int, name: str, seed: int,
                              most: int) -> tuple[int, int, errors.ZoneFSError | None]:
    """Write `STEP` bytes at a time to a new file until a write fails; return the
    handle, the bytes acknowledged and the error (the file stays open)."""
    fh, attr = await fs.create(dir_ino, name.encode(), 0o644, os.O_WRONLY, CTX)
    fs.forget([(attr.ino, 1)])
    data = pattern(seed, most)
    written = 0
    while written < most:
        try:
            written += await fs.write(fh, written, data[written:written + STEP])
        except errors.ZoneFSError as exc:
            return fh, written, exc
    return fh, written, None


async def test_a_write_past_a_tenants_cap_is_refused_at_admission(tmp_path: Path) -> None:
    """ENOSPC from the write request itself, before any byte is accepted: what the
    writes before it acknowledged lands (fsync reports nothing), and the other
    tenant still writes; the bytes are there after a remount."""
    image = tmp_path / "fs.img"
    async with mounted(image, create=True) as fs:
        a = await _mkdir(fs, "/a")
        b = await _mkdir(fs, "/b")
        ta = fs.tenants.declare(a, 0, 3)
        fs.tenants.declare(b, 0, 0)
        cap = fs.tenant_space.capacity_bytes(ta)
        assert cap == 3 * fs.tenant_space.zone_data_bytes()
        fh, written, error = await _fill_without_fsync(fs, a, "big", 1, 4 * cap)
        assert isinstance(error, errors.NoSpace)
        assert "cap" in str(error)
        assert cap - STEP < written <= cap
        await fs.fsync(fh, False)  # nothing lost behind the writer's back
        await fs.release(fh)
        assert fs.tenant_space.admitted == {}
        assert fs.tenant_space.avail_bytes(ta) == cap - written
        await write_file(fs, "/b/other", pattern(9, 3 * MiB))
        assert len(fs.alloc.tenant_zones(ta)) <= 3 + 1
        # The recorded ownership it walks is the allocator's.
        assert sorted(fs.tenant_space._zones(ta)) == sorted(
            dz.idx for dz in fs.alloc.tenant_zones(ta))
    async with mounted(image) as fs:
        assert await read_file(fs, "/a/big") == pattern(1, 4 * cap)[:written]
        assert await read_file(fs, "/b/other") == pattern(9, 3 * MiB)


async def test_room_left_in_another_streams_zone_is_not_admitted(tmp_path: Path) -> None:
    """Streams never share a zone: with a log file and a dataset file each holding a
    zone of a 3-zone cap, a default-stream writer has one zone, and is refused at
    admission when it is full, not at writeback (its fsync reports nothing)."""
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        a = await _mkdir(fs, "/a")
        ta = fs.tenants.declare(a, 0, 3)
        zone = fs.tenant_space.zone_data_bytes()
        await write_file(fs, "/a/x.log", pattern(1, 300 * KiB))
        await write_file(fs, "/a/y.tar", pattern(2, 300 * KiB))
        assert fs.tenant_space.lost_bytes(ta, None) > 0
        fh, written, error = await _fill_without_fsync(fs, a, "big", 3, 4 * zone)
        assert isinstance(error, errors.NoSpace)
        assert zone - STEP < written <= zone
        # The gate sees the tenant as the stream being written does (the default
        # stream's room only), not by the stream with the most room.
        assert fs.data.writes.pending_bytes_of(fs.files[fh]) > 0  # being written
        assert fs.tenant_space.writing_streams(ta) == {0}
        gate_view = fs.tenant_space.avail_within(ta, 1 << 40)
        assert gate_view is not None
        assert gate_view < fs.tenant_space.avail_bytes(ta) - 2 * STEP
        await fs.fsync(fh, False)
        await fs.release(fh)
        assert await read_file(fs, "/a/big") == pattern(3, 4 * zone)[:written]
        assert await read_file(fs, "/a/x.log") == pattern(1, 300 * KiB)


async def test_deleting_within_a_tenant_admits_its_writes_again(tmp_path: Path) -> None:
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        a = await _mkdir(fs, "/a")
        ta = fs.tenants.declare(a, 0, 2)
        cap = fs.tenant_space.capacity_bytes(ta)
        assert cap is not None
        fh, written, error = await _fill_without_fsync(fs, a, "one", 2, 2 * cap)
        assert isinstance(error, errors.NoSpace)
        await fs.release(fh)
        await fs.unlink(a, b"one")
        await fs.sync()
        assert fs.tenant_space.avail_bytes(ta) == cap
        await write_file(fs, "/a/two", pattern(3, cap // 2))
        assert written > cap // 2


async def test_a_tenant_without_a_cap_is_held_to_the_device_only(tmp_path: Path) -> None:
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        b = await _mkdir(fs, "/b")
        tb = fs.tenants.declare(b, 0, 0)
        assert fs.tenant_space.capacity_bytes(tb) is None
        assert fs.tenant_space.over_bytes(tb, 1 << 40) == 0
        await write_file(fs, "/b/x", pattern(4, 5 * MiB))


# -- the gate, per tenant -------------------------------------------------------------

class Tenants:
    """Free bytes under the caps of tenants the test moves (TenantSpace.avail_within)."""

    def __init__(self, **avail: int) -> None:
        self.avail = {int(k[1:]): v for k, v in avail.items()}

    def __call__(self, tid: int, within: int) -> int | None:
        a = self.avail.get(tid)
        return a if a is not None and a < within else None


def tenant_gate(tenants: Tenants, default: int = 48 * MiB) -> SpaceGate:
    gate = SpaceGate(Space(10_000 * MiB), tenant_avail=tenants)
    gate.configure(default, True)
    return gate


def test_a_writing_tenant_near_its_cap_is_refused_alone_and_lowers_the_limit() -> None:
    tenants = Tenants(t1=1000 * MiB, t2=1000 * MiB)
    gate = tenant_gate(tenants)
    gate.tenant_writer(1, +1)
    gate.tenant_writer(2, +1)
    gate.check()
    assert not gate.refusing_tenants
    # Near tenant 1's cap: the mount's dirty limit follows its free space down.
    tenants.avail[1] = 200 * MiB
    gate.check()
    assert gate.limit_change_due()
    assert gate.wanted_limit_bytes == 25 * MiB
    gate.limit_applied(gate.wanted_limit_bytes)
    tenants.avail[1] = 64 * MiB
    gate.check()
    assert gate.wanted_limit_bytes == 8 * MiB
    gate.limit_applied(gate.wanted_limit_bytes)
    assert not gate.refusing_tenants
    tenants.avail[1] = gate.refuse_below_bytes - 1
    gate.check()
    assert gate.refusing_tenants == {1}
    assert not gate.refusing  # the device, and tenant 2, still pass
    assert gate.near
    # Hysteresis, then open again.
    tenants.avail[1] = gate.refuse_below_bytes + 1
    gate.check()
    assert gate.refusing_tenants == {1}
    tenants.avail[1] = gate.refuse_below_bytes + gate.RESUME_BYTES
    gate.check()
    assert not gate.refusing_tenants
    assert gate.tenant_closed_count == 1


def test_a_tenant_nobody_writes_neither_closes_nor_lowers_the_limit() -> None:
    gate = tenant_gate(Tenants(t1=0))
    gate.check()
    assert not gate.refusing_tenants
    assert gate.wanted_limit_bytes == 48 * MiB
    gate.tenant_writer(1, +1)
    gate.check()
    assert gate.refusing_tenants == {1}
    gate.tenant_writer(1, -1)
    assert not gate.refusing_tenants


async def test_only_the_tenants_handles_are_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    c = FakeC(monkeypatch)
    tenants = Tenants(t1=1000 * MiB)
    gate = tenant_gate(tenants)
    inval = Invalidations()
    tenant_of = {10: 1, 11: 1, 20: 2, 30: 0}
    wg = WriteGate(gate, inval, tenant_of=tenant_of.__getitem__)
    await wg.opened(1, 10, created=False)
    await wg.opened(2, 20, created=False)
    await wg.opened(3, 30, created=False)
    assert c.listed == set()
    tenants.avail[1] = 0
    gate.check()
    await wg.apply()
    assert wg.closed_tenants == {1}
    assert not wg.closed
    assert c.listed == {1}
    assert inval.inodes == [10]
    assert wg.gated(10)
    assert not wg.gated(20)
    assert not wg.gated(30)
    # A new handle of the full tenant is listed before its open is answered.
    assert wg.gated(10)
    await wg.opened(4, 11, created=True)
    assert c.listed == {1, 4}
    # The device gate closing and opening again leaves the tenant's handles listed.
    gate.refusing = True
    await wg._close()
    assert c.listed == {1, 2, 3, 4}
    gate.refusing = False
    wg._open()
    assert c.listed == {1, 4}
    # Room again under the cap: the tenant's handles pass (space_may_be_back).
    tenants.avail[1] = 1000 * MiB
    wg.space_may_be_back()
    assert c.listed == set()
    assert not wg.closed_tenants
    wg.released(1)
    wg.released(4)
    assert gate.writing_tenants == {2: 1}


async def test_a_tenants_first_writer_lowers_the_limit_before_it_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant nobody wrote had no say in the dirty limit: its first writer must not
    be refused only because the limit in effect is the kernel's default."""
    c = FakeC(monkeypatch)
    tenants = Tenants(t1=40 * MiB)
    gate = tenant_gate(tenants)
    wg = WriteGate(gate, Invalidations(), tenant_of=lambda ino: 1)
    limits: list[int] = []
    wg.set_limit = lambda wanted: limits.append(wanted) or wanted
    assert gate.refuse_below_bytes > 40 * MiB  # at the default limit it would be refused
    await wg.opened(1, 10, created=True)
    assert limits == [5 * MiB]
    assert not wg.closed_tenants
    assert c.listed == set()
    # Really near the cap: refused from the first write(2).
    tenants.avail[2] = 1 * MiB
    wg2 = WriteGate(gate, Invalidations(), tenant_of=lambda ino: 2)
    wg2.set_limit = lambda wanted: wanted
    await wg2.opened(7, 70, created=True)
    assert wg2.closed_tenants == {2}
    assert c.listed == {7}


async def test_fallocate_is_held_to_the_cap_and_writes_into_it_pass(tmp_path: Path) -> None:
    """A reservation past the cap is refused at the fallocate; one within it is kept
    for its file: writing into it near the cap passes (its bytes counted once)."""
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        a = await _mkdir(fs, "/a")
        ta = fs.tenants.declare(a, 0, 2)
        cap = fs.tenant_space.capacity_bytes(ta)
        assert cap is not None
        fh, attr = await fs.create(a, b"pre", 0o644, os.O_WRONLY, CTX)
        fs.forget([(attr.ino, 1)])
        with pytest.raises(errors.NoSpace, match="cap"):
            await fs.fallocate(fh, 0, 0, cap + 1 * MiB)
        reserve = cap - 512 * KiB
        await fs.fallocate(fh, 0, 0, reserve)
        assert fs.tenant_space.avail_bytes(ta) == cap - reserve
        data = pattern(5, reserve)
        for off in range(0, reserve, STEP):
            await fs.write(fh, off, data[off:off + STEP])
            assert fs.tenant_space.avail_bytes(ta) >= cap - reserve - STEP
        await fs.fsync(fh, False)
        await fs.release(fh)
        assert await read_file(fs, "/a/pre") == data
