"""Declared tenants (issue 45): zone ownership in the allocator, the cleaner and the engine.

The allocator tests run on a synthetic zone report (no device); the engine tests
mount an emulated image (no FUSE) and end with fsck, which checks INV-27 (no zone
holds live data of two tenants, a tenant's data only in zones it owns).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from engine_helpers import (
    CTX,
    KiB,
    MiB,
    assert_fsck_clean,
    fsck,
    mounted,
    pattern,
    read_file,
    resolve,
    write_file,
)
from test_allocator import BS, make_alloc

from zonefs_py import errors
from zonefs_py.alloc.allocator import Allocator, NeedCleaning, TenantFull
from zonefs_py.format.constants import C_TENANT_CLEANER_BASE, C_TENANT_RESETS_BASE, OpType, Stream
from zonefs_py.format.ops import Op, decode_ops, encode_ops
from zonefs_py.fs.api import ROOT_INO
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.model.snapshot import snapshot_ops
from zonefs_py.model.state import State, StateError


def declare(state: State, tid: int, dir_ino: int, min_zones: int = 0,
            max_zones: int = 0, max_active: int = 0) -> None:
    state.apply((OpType.TENANT, tid, 0, dir_ino, min_zones, max_zones, max_active))


# -- format and model -----------------------------------------------------------------

def test_tenant_ops_round_trip_and_rebuild_from_a_checkpoint() -> None:
    ops: list[Op] = [(OpType.TENANT, 3, 0, 42, 2, 5, 1), (OpType.TENANT_DEL, 3),
                     (OpType.ZONE_TENANT, 17, 3)]
    assert decode_ops(encode_ops(ops)) == ops
    state = State(BS, 1 << 20)
    declare(state, 3, 42, 2, 5, 4)
    state.apply((OpType.ZONE_STATE, 17, Stream.DEFAULT, 0, 0))
    state.apply((OpType.ZONE_TENANT, 17, 3))
    again = State(BS, 1 << 20)
    for op in snapshot_ops(state):
        again.apply(op)
    assert again.tenants.by_id[3].op() == (OpType.TENANT, 3, 0, 42, 2, 5, 4)
    assert again.zone_tenant == {17: 3}


def test_tenant_bandwidth_policy_round_trips_and_old_ops_still_decode() -> None:
    """The long TENANT layout (a bandwidth policy) and the first one side by side;
    a policy without bandwidth is written in the first layout, byte for byte."""
    long_op = (OpType.TENANT, 3, 0, 42, 2, 5, 1, 30_000, 0, 70)
    short = (OpType.TENANT, 4, 0, 43, 0, 0, 0)
    blob = encode_ops([long_op, short])
    assert decode_ops(blob) == [long_op, short]
    # The first layout's bytes, as a build before bandwidth policies wrote them.
    old = bytes([OpType.TENANT]) + (24).to_bytes(4, "little") + struct.pack(
        "<HHQIII", 4, 0, 43, 0, 0, 0)
    assert encode_ops([short]) == old
    assert decode_ops(old) == [short]
    assert len(encode_ops([long_op])) == 5 + 32
    state = State(BS, 1 << 20)
    state.apply(long_op)
    state.apply(short)
    policy = state.tenants.by_id[3]
    assert (policy.write_cap_kbs, policy.write_share, policy.read_share) == (30_000, 0, 70)
    assert state.tenants.by_id[4].op() == short
    again = State(BS, 1 << 20)
    for op in decode_ops(encode_ops(list(snapshot_ops(state)))):
        again.apply(op)
    assert again.tenants.by_id[3].op() == long_op
    assert again.tenants.by_id[4].op() == short


@pytest.mark.parametrize("bad", [(1, 30, 0), (0, 101, 0), (0, 0, 101)])
def test_recovery_refuses_an_impossible_bandwidth_policy(bad: tuple[int, int, int]) -> None:
    state = State(BS, 1 << 20)
    with pytest.raises(StateError, match="bandwidth policy"):
        state.apply((OpType.TENANT, 3, 0, 42, 0, 0, 0, *bad))


def test_a_zone_state_ends_ownership_and_a_removal_frees_the_zones() -> None:
    state = State(BS, 1 << 20)
    declare(state, 1, 42)
    state.apply((OpType.ZONE_TENANT, 5, 1))
    state.apply((OpType.ZONE_TENANT, 6, 1))
    state.apply((OpType.ZONE_STATE, 5, Stream.DEFAULT, 0, 1))  # reset
    assert state.zone_tenant == {6: 1}
    state.apply((OpType.TENANT_DEL, 1))
    assert state.zone_tenant == {}
    with pytest.raises(StateError, match="unknown tenant"):
        state.apply((OpType.ZONE_TENANT, 6, 1))


# -- allocator ------------------------------------------------------------------------

def test_each_tenant_writes_only_into_zones_it_owns() -> None:
    alloc = make_alloc(nr_data=12)
    declare(alloc.state, 1, 100)
    declare(alloc.state, 2, 200)
    ops: list[Op] = []
    shared, _ = alloc.reserve(Stream.DEFAULT, 0, 8 * BS, ops, [])
    a, _ = alloc.reserve(Stream.DEFAULT, 0, 8 * BS, ops, [], tenant=1)
    b, _ = alloc.reserve(Stream.DEFAULT, 0, 8 * BS, ops, [], tenant=2)
    assert len({shared, a, b}) == 3
    assert (alloc.zones[a].tenant, alloc.zones[b].tenant, alloc.zones[shared].tenant) == (1, 2, 0)
    assert (OpType.ZONE_TENANT, a, 1) in ops
    assert alloc.state.zone_tenant == {a: 1, b: 2}
    # Scarce empty zones: a tenant shares only a head of its own.
    for dz in alloc.empty_zones()[alloc.reserve_zones + 1:]:
        dz.reserved = dz.capacity
    again, _ = alloc.reserve(Stream.DEFAULT, 0, 8 * BS, ops, [], tenant=2)
    assert again == b


def test_a_tenant_at_its_cap_gets_tenant_full_while_others_still_write() -> None:
    alloc = make_alloc(nr_data=12)
    declare(alloc.state, 1, 100, max_zones=2)
    ops: list[Op] = []
    cap = alloc.zones[1].capacity
    first, _ = alloc.reserve(Stream.DEFAULT, 0, cap, ops, [], tenant=1)
    alloc.append_done(first, ok=True)
    second, _ = alloc.reserve(Stream.CHECKPOINT, 7, cap, ops, [], tenant=1)
    alloc.append_done(second, ok=True)
    with pytest.raises(TenantFull) as info:
        alloc.reserve(Stream.DEFAULT, 0, BS, ops, [], tenant=1)
    assert info.value.tenant == 1
    assert isinstance(info.value, errors.NoSpace)
    other, _ = alloc.reserve(Stream.DEFAULT, 0, BS, ops, [])
    assert alloc.zones[other].tenant == 0
    # Its cleaner may take one zone more, to clean within the tenant.
    copy, _ = alloc.reserve(Stream.CLEANER, 0, BS, ops, [], tenant=1)
    assert alloc.zones[copy].tenant == 1


def test_zones_reserved_for_a_tenant_are_not_taken_by_others() -> None:
    alloc = make_alloc(nr_data=12)
    declare(alloc.state, 1, 100, min_zones=3)
    ops: list[Op] = []
    empty = len(alloc.empty_zones())
    # Leave the cleaner's reserve and the tenant's three: nothing for others.
    for dz in alloc.empty_zones()[alloc.reserve_zones + 3:]:
        dz.reserved = dz.capacity
    assert len(alloc.empty_zones()) == alloc.reserve_zones + 3 < empty
    with pytest.raises(NeedCleaning, match="tenants"):
        alloc.reserve(Stream.DATASET, 0, BS, ops, [])
    taken = set()
    for stream in (Stream.DEFAULT, Stream.DATASET, Stream.LOG):
        zone, _ = alloc.reserve(stream, 0, BS, ops, [], tenant=1)
        taken.add(zone)
    assert len(taken) == 3
    assert alloc.owed_zones() == 0
    assert len(alloc.empty_zones()) == alloc.reserve_zones


def test_a_tenant_at_its_active_zone_count_finishes_its_own_zones_only() -> None:
    alloc = make_alloc(nr_data=16)
    declare(alloc.state, 1, 100, max_active=2)
    ops: list[Op] = []
    finish: list[int] = []
    other, _ = alloc.reserve(Stream.DEFAULT, 0, 8 * BS, ops, finish)  # shared, active
    alloc.append_done(other, ok=True)
    zones = []
    for owner, stream in ((11, Stream.CHECKPOINT), (12, Stream.CHECKPOINT)):
        zone, _ = alloc.reserve(stream, owner, 8 * BS, ops, finish, tenant=1)
        alloc.append_done(zone, ok=True)
        zones.append(zone)
    assert not finish
    third, _ = alloc.reserve(Stream.LOG, 0, 8 * BS, ops, finish, tenant=1)
    assert finish == [zones[0]] or finish == [zones[1]]  # one of its own, never `other`
    assert alloc.zones[third].tenant == 1
    mine = [dz for dz in alloc.active_zones() if dz.tenant == 1]
    assert len(mine) == 2
    assert alloc.zones[other] in alloc.active_zones()


def test_a_tenant_goes_over_its_count_rather_than_fail_when_all_are_busy() -> None:
    alloc = make_alloc(nr_data=16)
    declare(alloc.state, 1, 100, max_active=1)
    ops: list[Op] = []
    busy, _ = alloc.reserve(Stream.DEFAULT, 0, 8 * BS, ops, [], tenant=1)  # in flight
    second, _ = alloc.reserve(Stream.LOG, 0, 8 * BS, ops, [], tenant=1)
    assert second != busy
    assert alloc.zones[second].tenant == 1


def _leave_a_spare(alloc: Allocator, stream: int, owner: int, tenant: int) -> int:
    """File `owner` of `tenant` writes 8 blocks to a head of its own and closes:
    the zone is a spare of its stream (issue 44), still the tenant's."""
    ops: list[Op] = []
    zone, _ = alloc.reserve(stream, owner, 8 * BS, ops, [], tenant=tenant)
    alloc.append_done(zone, ok=True)
    alloc.state.zone_live_blocks[zone] = 8  # the file's extents (not applied here)
    alloc.release_owner(owner, [])
    assert alloc.zones[zone].head_of is None
    assert alloc.zones[zone].tenant == tenant
    return zone


def test_a_spare_is_taken_only_by_a_head_of_its_own_tenant() -> None:
    alloc = make_alloc(nr_data=12)
    declare(alloc.state, 1, 100)
    declare(alloc.state, 2, 200)
    spare = _leave_a_spare(alloc, Stream.DATASET, 10, tenant=1)
    ops: list[Op] = []
    shared, _ = alloc.reserve(Stream.DATASET, 11, 8 * BS, ops, [])
    other, _ = alloc.reserve(Stream.DATASET, 12, 8 * BS, ops, [], tenant=2)
    assert spare not in (shared, other)
    assert (alloc.zones[shared].tenant, alloc.zones[other].tenant) == (0, 2)
    mine, _ = alloc.reserve(Stream.DATASET, 13, 8 * BS, ops, [], tenant=1)
    assert mine == spare
    # A tenant's group of checkpoint files (one directory) writes its lanes as
    # heads of that tenant: the lane's zone is the tenant's.
    owner = alloc.owner_for(50, group=77)
    lane, _ = alloc.reserve(Stream.CHECKPOINT, owner, 8 * BS, ops, [], tenant=2)
    assert alloc.zones[lane].tenant == 2
    assert alloc.zones[lane].head_of == (Stream.CHECKPOINT, owner, 2)


def test_a_tenant_at_its_cap_takes_its_own_spare_rather_than_fail() -> None:
    alloc = make_alloc(nr_data=12)
    declare(alloc.state, 1, 100, max_zones=1)
    spare = _leave_a_spare(alloc, Stream.DATASET, 10, tenant=1)
    assert alloc.tenant_at_cap(1)
    ops: list[Op] = []
    zone, _ = alloc.reserve(Stream.DATASET, 11, 8 * BS, ops, [], tenant=1)
    assert zone == spare
    assert not ops  # no zone opened
    alloc.append_done(zone, ok=True)
    alloc.release_owner(11, [])
    # Another stream has no spare of the tenant: that is its cap.
    with pytest.raises(TenantFull):
        alloc.reserve(Stream.LOG, 12, 8 * BS, ops, [], tenant=1)


def test_a_tenant_at_its_active_zone_count_finishes_its_own_spare_first() -> None:
    alloc = make_alloc(nr_data=16)
    declare(alloc.state, 1, 100, max_active=1)
    declare(alloc.state, 2, 200)
    others = _leave_a_spare(alloc, Stream.DATASET, 20, tenant=2)
    spare = _leave_a_spare(alloc, Stream.DATASET, 10, tenant=1)
    finish: list[int] = []
    zone, _ = alloc.reserve(Stream.LOG, 11, 8 * BS, [], finish, tenant=1)
    assert finish == [spare]  # its own spare's token, never the other tenant's
    assert alloc.zones[zone].tenant == 1
    assert alloc.zones[others] in alloc.active_zones()


def test_a_reset_ends_ownership_and_counts_toward_the_tenants_wear() -> None:
    alloc = make_alloc(nr_data=8)
    declare(alloc.state, 1, 100)
    ops: list[Op] = []
    zone, granted = alloc.reserve(Stream.DEFAULT, 0, 8 * BS, ops, [], tenant=1)
    alloc.append_done(zone, ok=True)
    alloc.zone_was_reset(zone, ops)
    assert alloc.zones[zone].tenant == 0
    assert zone not in alloc.state.zone_tenant
    assert alloc.state.counters[C_TENANT_RESETS_BASE + 1] == 1


# -- engine ---------------------------------------------------------------------------

async def _mkdir(fs: ZoneFS, path: str) -> int:
    parent = await resolve(fs, path.rsplit("/", 1)[0] or "/")
    return (await fs.mkdir(parent, path.rsplit("/", 1)[1].encode(), 0o755, CTX)).ino


def _tenant_zones(fs: ZoneFS) -> dict[int, int]:
    return dict(fs.state.zone_tenant)


def _zones_of(fs: ZoneFS, path_ino: int) -> set[int]:
    inode = fs.state.inodes[path_ino]
    assert inode.extents is not None
    return {e.dev // fs.state.zone_size for e in inode.extents}


async def test_two_tenants_never_share_a_zone_and_it_survives_remount(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    files: dict[str, bytes] = {}
    async with mounted(image, create=True) as fs:
        a = await _mkdir(fs, "/a")
        jobs = await _mkdir(fs, "/jobs")
        b = await _mkdir(fs, "/jobs/b")
        ta = fs.tenants.declare(a, 0, 0)
        tb = fs.tenants.declare(b, 0, 0)
        await _mkdir(fs, "/a/sub")
        for i, (path, size) in enumerate([("/a/small", 20 * KiB), ("/a/sub/big", 5 * MiB),
                                          ("/a/model.ckpt", 300 * KiB),
                                          ("/jobs/b/small", 24 * KiB),
                                          ("/jobs/b/big.tar", 3 * MiB),
                                          ("/jobs/shared", 40 * KiB), ("/top", 40 * KiB)]):
            files[path] = pattern(i, size)
            await write_file(fs, path, files[path])
        owners = _tenant_zones(fs)
        for path in files:
            tid = ta if path.startswith("/a/") else tb if path.startswith("/jobs/b/") else 0
            for zone in _zones_of(fs, await resolve(fs, path)):
                assert owners.get(zone, 0) == tid, (path, zone)
        report = fs.status()["tenants"]
        assert isinstance(report, dict)
        assert report["a"]["declared"]
        assert report["jobs/b"]["tenant_id"] == tb
        assert sorted(report["a"]["zones"]) == sorted(z for z, t in owners.items() if t == ta)
        assert report["jobs/b"]["bytes_stored"] >= 3 * MiB
        assert report["a"]["device_bytes_written_users"] >= 5 * MiB
        assert "jobs" in report
        assert "declared" not in report["jobs"]
        del jobs
        await fs.checkpoint()
    async with mounted(image) as fs:  # the table and ownership came back (fsck clean too)
        assert _tenant_zones(fs) == owners
        assert set(fs.state.tenants.by_dir) == {a, b}
        for path, data in files.items():
            assert await read_file(fs, path) == data


async def test_checkpoint_groups_and_spares_stay_within_their_tenant(tmp_path: Path) -> None:
    """Issue 44's placement within tenants: a checkpoint directory's shards write
    their group's heads in their tenant's zones, the spill of a closed shard is a
    spare only a later shard of the same tenant fills, and a shared checkpoint
    directory beside it never takes that spare (INV-27; fsck at the end)."""
    image = tmp_path / "fs.img"
    zone = 2 * MiB
    files: dict[str, bytes] = {}
    async with mounted(image, create=True) as fs:
        a = await _mkdir(fs, "/a")
        ta = fs.tenants.declare(a, 0, 0)
        await _mkdir(fs, "/a/ckpt")
        await _mkdir(fs, "/ckpt")
        for i, path in enumerate(["/a/ckpt/s0.distcp", "/ckpt/s0.distcp",
                                  "/a/ckpt/s1.distcp", "/ckpt/s1.distcp"]):
            files[path] = pattern(i, zone * 3 // 2)
            await write_file(fs, path, files[path], chunk=256 * KiB)
        owners = _tenant_zones(fs)
        zones = {p: _zones_of(fs, await resolve(fs, p)) for p in files}
        for path, zs in zones.items():
            tid = ta if path.startswith("/a/") else 0
            assert {owners.get(z, 0) for z in zs} == {tid}, path
        # s0's last zone (its spill) is where s1 of the same directory starts.
        assert zones["/a/ckpt/s0.distcp"] & zones["/a/ckpt/s1.distcp"]
        assert zones["/ckpt/s0.distcp"] & zones["/ckpt/s1.distcp"]
        assert not (zones["/a/ckpt/s0.distcp"] | zones["/a/ckpt/s1.distcp"]) & (
            zones["/ckpt/s0.distcp"] | zones["/ckpt/s1.distcp"])
        await fs.checkpoint()
    async with mounted(image) as fs:
        for path, data in files.items():
            assert await read_file(fs, path) == data


async def test_declaring_refuses_data_nesting_and_the_root(tmp_path: Path) -> None:
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        a = await _mkdir(fs, "/a")
        await write_file(fs, "/a/f", pattern(1, 16 * KiB))
        with pytest.raises(errors.NotEmpty, match="shared zones"):
            fs.tenants.declare(a, 0, 0)
        b = await _mkdir(fs, "/b")
        inner = await _mkdir(fs, "/b/inner")
        await write_file(fs, "/b/tiny", b"x" * 100)  # inline: no zone, fine
        fs.tenants.declare(b, 0, 0)
        with pytest.raises(errors.InvalidArgument, match="inside tenant"):
            fs.tenants.declare(inner, 0, 0)
        with pytest.raises(errors.InvalidArgument, match="root"):
            fs.tenants.declare(ROOT_INO, 0, 0)
        with pytest.raises(errors.Exists):
            fs.tenants.declare(b, 0, 0)
        with pytest.raises(errors.InvalidArgument, match="below"):
            fs.tenants.change(b, 4, 2)
        with pytest.raises(errors.NoSpace, match="reservations"):
            fs.tenants.change(b, 10_000, 0)
        outer = await _mkdir(fs, "/c")
        c_in = await _mkdir(fs, "/c/d")
        fs.tenants.declare(c_in, 0, 0)
        with pytest.raises(errors.InvalidArgument, match="holds tenant"):
            fs.tenants.declare(outer, 0, 0)


async def test_renames_and_links_across_a_boundary_are_exdev(tmp_path: Path) -> None:
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        a = await _mkdir(fs, "/a")
        b = await _mkdir(fs, "/b")
        plain = await _mkdir(fs, "/plain")
        fs.tenants.declare(a, 0, 0)
        fs.tenants.declare(b, 0, 0)
        await write_file(fs, "/a/f", pattern(2, 16 * KiB))
        f = await resolve(fs, "/a/f")
        with pytest.raises(errors.CrossDevice):
            await fs.rename(a, b"f", b, b"f", 0)  # type: ignore[arg-type]
        with pytest.raises(errors.CrossDevice):
            await fs.rename(a, b"f", plain, b"f", 0)  # type: ignore[arg-type]
        with pytest.raises(errors.CrossDevice):
            await fs.link(f, b, b"g")
        with pytest.raises(errors.CrossDevice):  # a tenant into a tenant
            await fs.rename(ROOT_INO, b"b", a, b"b", 0)  # type: ignore[arg-type]
        await fs.mkdir(a, b"sub", 0o755, CTX)
        await fs.rename(a, b"f", await resolve(fs, "/a/sub"), b"f", 0)  # type: ignore[arg-type]
        await fs.link(f, a, b"f2")
        await fs.rename(ROOT_INO, b"b", plain, b"b", 0)  # type: ignore[arg-type]
        assert await read_file(fs, "/a/sub/f") == pattern(2, 16 * KiB)
        empty = await _mkdir(fs, "/e")
        fs.tenants.declare(empty, 0, 0)
        with pytest.raises(errors.Busy):
            await fs.rmdir(ROOT_INO, b"e")
        fs.tenants.remove(empty)
        await fs.rmdir(ROOT_INO, b"e")


async def test_copy_file_range_between_tenants_copies_the_bytes(tmp_path: Path) -> None:
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        a = await _mkdir(fs, "/a")
        b = await _mkdir(fs, "/b")
        fs.tenants.declare(a, 0, 0)
        fs.tenants.declare(b, 0, 0)
        data = pattern(3, 256 * KiB)
        await write_file(fs, "/a/src", data)
        await write_file(fs, "/b/dst", b"")
        fin = await fs.open(await resolve(fs, "/a/src"), os.O_RDONLY)
        fout = await fs.open(await resolve(fs, "/b/dst"), os.O_WRONLY)
        assert await fs.copy_file_range(fin, 0, fout, 0, len(data), 0) == len(data)
        await fs.fsync(fout, False)
        await fs.release(fin)
        await fs.release(fout)
        assert fs.copier.shared_copies == 0
        assert await read_file(fs, "/b/dst") == data
        owners = _tenant_zones(fs)
        assert {owners[z] for z in _zones_of(fs, await resolve(fs, "/b/dst"))} == \
            {fs.state.tenants.by_dir[b]}


async def test_a_full_tenant_gets_enospc_while_another_still_writes(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True) as fs:
        a = await _mkdir(fs, "/a")
        b = await _mkdir(fs, "/b")
        fs.tenants.declare(a, 1, 3)
        fs.tenants.declare(b, 2, 0)
        n = 0
        while True:
            try:
                await write_file(fs, f"/a/f{n}", pattern(n, 1 * MiB))
            except errors.NoSpace:
                break
            n += 1
            assert n < 64, "tenant a never reached its cap"
        tid = fs.state.tenants.by_dir[a]
        assert len(fs.alloc.tenant_zones(tid)) <= 3 + 1
        assert 3 <= n < 10
        await write_file(fs, "/b/after", pattern(99, 3 * MiB))
        assert await read_file(fs, "/b/after") == pattern(99, 3 * MiB)
        # Deleting within the tenant makes room again (its cleaner or resets).
        for i in range(n):
            await fs.unlink(a, f"f{i}".encode())
        await fs.sync()
        await write_file(fs, "/a/again", pattern(7, 1 * MiB))


async def test_cleaning_within_a_tenant_moves_none_of_the_others_data(tmp_path: Path) -> None:
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        a = await _mkdir(fs, "/a")
        b = await _mkdir(fs, "/b")
        fs.tenants.declare(a, 0, 4)
        tb = fs.tenants.declare(b, 0, 0)
        ta = fs.state.tenants.by_dir[a]
        for i in range(6):
            await write_file(fs, f"/b/keep{i}", pattern(50 + i, 300 * KiB))
        b_zones = {z for z, t in _tenant_zones(fs).items() if t == tb}
        keep: dict[str, bytes] = {}
        # Churn in a: every fourth file of 200 KiB stays, the others die after the
        # next write; 12 MiB written through a cap of 4 zones (2 MiB each).
        for i in range(60):
            data = pattern(i, 200 * KiB)
            await write_file(fs, f"/a/c{i}", data)
            keep[f"/a/c{i}"] = data
            if i and i % 4 != 1:  # c{i-1} dies unless it is a fourth one
                await fs.unlink(a, f"c{i - 1}".encode())
                del keep[f"/a/c{i - 1}"]
        await fs.sync()
        report = fs.status()["tenants"]
        assert isinstance(report, dict)
        assert report["a"]["device_bytes_written_cleaner"] > 0  # it had to clean
        assert report["a"]["write_amplification"] > 1
        assert report["b"]["device_bytes_written_cleaner"] == 0
        assert report["a"]["zones_owned"] <= 4 + 1
        assert {z for z, t in _tenant_zones(fs).items() if t == tb} == b_zones
        for path, data in keep.items():
            assert await read_file(fs, path) == data
        for i in range(6):
            assert await read_file(fs, f"/b/keep{i}") == pattern(50 + i, 300 * KiB)
        assert ta != tb


async def test_removing_a_tenant_leaves_its_data_and_zones_shared(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True) as fs:
        a = await _mkdir(fs, "/a")
        fs.tenants.declare(a, 1, 2)
        await write_file(fs, "/a/f", pattern(4, 600 * KiB))
        fs.tenants.remove(a)
        assert not fs.state.zone_tenant
        await write_file(fs, "/a/g", pattern(5, 64 * KiB))
        await write_file(fs, "/elsewhere", pattern(6, 64 * KiB))
        await fs.rename(ROOT_INO, b"elsewhere", a, b"moved", 0)  # type: ignore[arg-type]
    async with mounted(image) as fs:
        assert not fs.state.tenants
        assert await read_file(fs, "/a/f") == pattern(4, 600 * KiB)


async def test_fsck_flags_a_zone_holding_data_of_two_tenants(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True, fsck_after=False) as fs:
        a = await _mkdir(fs, "/a")
        fs.tenants.declare(a, 0, 0)
        await write_file(fs, "/a/f", pattern(8, 64 * KiB))
        await write_file(fs, "/g", pattern(9, 64 * KiB))
        # Forge: the zone of /g (shared) given to tenant a.
        zone = next(iter(_zones_of(fs, await resolve(fs, "/g"))))
        fs.txn([(OpType.ZONE_TENANT, zone, fs.state.tenants.by_dir[a])])
    findings = [f for f in fsck(image).findings if f.invariant == "INV-27"]
    assert findings
    assert "holds data of no tenant" in findings[0].message


async def test_fsck_is_clean_with_tenants_on_a_fresh_image(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True) as fs:
        a = await _mkdir(fs, "/a")
        fs.tenants.declare(a, 2, 5)
    assert_fsck_clean(image)


def test_prometheus_shows_the_declared_tenants_figures() -> None:
    from zonefs_py.metrics import render

    doc = {"tenants": {"jobs/b": {"declared": True, "zones_owned": 3, "zones_reserved": 2,
                                  "zones_max": None, "device_bytes_written_users": 100,
                                  "device_bytes_written_cleaner": 7, "zone_resets": 4,
                                  "wear": {"max": 2, "mean": 1.5}},
                       "plain": {"bytes_written": 5, "bytes_stored": 5, "quota_bytes": None}}}
    text = render(doc)
    assert 'zonefs_tenant_zones{kind="owned",tenant="jobs/b"} 3.0' in text
    assert 'zonefs_tenant_device_written_bytes_total{tenant="jobs/b",writer="cleaner"} 7.0' \
        in text
    assert 'zonefs_tenant_zone_wear_resets{stat="mean",tenant="jobs/b"} 1.5' in text
    assert 'tenant="plain",' not in text.split("zonefs_tenant_zones")[1].split("# HELP")[0]


async def test_control_commands_declare_change_and_remove(tmp_path: Path) -> None:
    from zonefs_py import control
    from zonefs_py.fs.api import Ctx

    async with mounted(tmp_path / "fs.img", create=True) as fs:
        a = await _mkdir(fs, "/a")
        await control.command(fs, control.CTL_XATTR, f"tenant-add {a} 1 3".encode(), CTX)
        policy = fs.state.tenants.by_id[fs.state.tenants.by_dir[a]]
        assert (policy.min_zones, policy.max_zones) == (1, 3)
        await control.command(fs, control.CTL_XATTR, f"tenant-set {a} - 5\n".encode(), CTX)
        policy = fs.state.tenants.by_id[fs.state.tenants.by_dir[a]]
        assert (policy.min_zones, policy.max_zones) == (1, 5)
        await control.command(fs, control.CTL_XATTR, f"tenant-set {a} - - 3".encode(), CTX)
        policy = fs.state.tenants.by_id[fs.state.tenants.by_dir[a]]
        assert (policy.min_zones, policy.max_zones, policy.max_active) == (1, 5, 3)
        figures = fs.tenants.report()["a"]
        assert (figures["active_zones"], figures["active_zones_max"]) == (0, 3)
        with pytest.raises(errors.InvalidArgument, match="malformed"):
            await control.command(fs, control.CTL_XATTR, f"tenant-add {a} 1".encode(), CTX)
        with pytest.raises(errors.InvalidArgument, match="not a number"):
            await control.command(fs, control.CTL_XATTR, f"tenant-set {a} x 1".encode(), CTX)
        with pytest.raises(errors.Exists):
            await control.command(fs, control.CTL_XATTR, f"tenant-add {a} 0 0".encode(), CTX)
        assert "tenant already" in control.DAEMON_INFO["last_control_error"]
        with pytest.raises(errors.NotPermitted):
            await control.command(fs, control.CTL_XATTR, f"tenant-remove {a}".encode(),
                                  Ctx(uid=1000, gid=1000, pid=1, umask=0))
        await control.command(fs, control.CTL_XATTR, f"tenant-remove {a}".encode(), CTX)
        assert "last_control_error" not in control.DAEMON_INFO
        assert not fs.state.tenants


async def test_background_cleaning_cleans_a_tenant_near_its_cap(tmp_path: Path) -> None:
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        a = await _mkdir(fs, "/a")
        ta = fs.tenants.declare(a, 0, 3)
        for i in range(8):  # 8 x 600 KiB: three zones' worth, then every other one dies
            await write_file(fs, f"/a/f{i}", pattern(i, 600 * KiB))
        for i in range(0, 8, 2):
            await fs.unlink(a, f"f{i}".encode())
        await fs.sync()
        assert fs.reclaim.tenants_near_cap() == [ta]
        assert fs.cleaner.host.empty_zone_count() >= fs.cleaner.low_watermark
        copied = await fs.cleaner.background_pass()
        assert copied > 0
        assert fs.state.counters[C_TENANT_CLEANER_BASE + ta] == copied
        for i in range(1, 8, 2):
            assert await read_file(fs, f"/a/f{i}") == pattern(i, 600 * KiB)
