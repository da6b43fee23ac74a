"""Space written once, not wasted (issue 44): placement of round-sized files and of
sharded checkpoint saves, through the engine (no FUSE).

Files of round sizes (a whole number of zones) spill a few blocks past their
zones, since every zone keeps room for its summary (DESIGN 3.11); those blocks
must not cost a zone finished nearly empty. The shards of one checkpoint step,
written at once, must share few zones (an active-zone budget) and free them
whole when the step is deleted (DESIGN 3.7).
"""

from __future__ import annotations

import os
from pathlib import Path

import trio
from engine_helpers import CTX, Geometry, MiB, mounted, pattern, read_file, write_file

from zonefs_py.fs.api import ROOT_INO
from zonefs_py.fs.filesystem import ZoneFS

ZONE = 2 * MiB


def zones_of(fs: ZoneFS, ino: int) -> set[int]:
    zsize = fs.dev.info.zone_size_bytes
    return {e.dev // zsize for e in fs.state.inodes[ino].extents or []}


def data_zones_used(fs: ZoneFS) -> int:
    return sum(1 for dz in fs.alloc.zones.values() if dz.reserved)


async def test_round_sized_files_waste_nothing_and_fill_their_zones(tmp_path: Path) -> None:
    """Four files of exactly two zones each (dd's 1 MiB writes): no zone is finished
    early, and they take the zones their bytes need, not three each."""
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        data = {f"/f{i}": pattern(i, 2 * ZONE) for i in range(4)}
        for path, content in data.items():
            await write_file(fs, path, content, chunk=MiB)
        written = sum(len(c) for c in data.values())
        assert fs.alloc.wasted_bytes <= written * 2 // 100
        capacity = max(dz.capacity for dz in fs.alloc.zones.values())
        assert data_zones_used(fs) == -(-written // capacity)
        for path, content in data.items():
            assert await read_file(fs, path) == content


async def test_deleting_a_round_sized_file_resets_the_zones_it_fills_alone(
        tmp_path: Path) -> None:
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        for i in range(3):
            await write_file(fs, f"/f{i}", pattern(i, 2 * ZONE), chunk=MiB)
        ino = fs.state.inodes[ROOT_INO].entries[b"f1"]  # type: ignore[index]
        middle = zones_of(fs, ino)
        alone = {z for z in middle if len(fs.state.zone_owners.get(z, ())) == 1}
        assert alone  # the zone between its spilled-into neighbours
        await fs.unlink(ROOT_INO, b"f1")
        await fs.sync()
        await fs.background_step()
        assert fs.cleaner.stats.bytes_copied == 0
        assert all(fs.alloc.zones[z].reserved == 0 for z in alone)
        assert await read_file(fs, "/f2") == pattern(2, 2 * ZONE)


#: 14 active zones (the issue's drive): a budget of 10 data heads; 128 zones of 2 MiB.
SHARDED = Geometry(size_bytes=256 * MiB, zone_size_bytes=ZONE, max_active=14)
RANKS, SHARDS, SHARD_BYTES = 8, 4, 3 * MiB // 2


async def save_step(fs: ZoneFS, ckpt_ino: int, step: int) -> tuple[int, dict[bytes, bytes]]:
    """8 ranks write their 4 shards at once (as torch.distributed.checkpoint does),
    each in 256 KiB writes, fsync and close; return the step directory and its files."""
    name = f"step_{step}".encode()
    step_ino = (await fs.mkdir(ckpt_ino, name, 0o755, CTX)).ino
    fs.forget([(step_ino, 1)])
    files: dict[bytes, bytes] = {}

    async def rank(r: int) -> None:
        for s in range(SHARDS):
            shard = f"__{r}_{s}.distcp".encode()
            content = files[shard] = pattern(step * 100 + r * 10 + s, SHARD_BYTES)
            fh, attr = await fs.create(step_ino, shard, 0o644, os.O_WRONLY, CTX)
            fs.forget([(attr.ino, 1)])  # the kernel's lookup reference, dropped
            for off in range(0, SHARD_BYTES, 256 * 1024):
                await fs.write(fh, off, content[off:off + 256 * 1024])
                await trio.lowlevel.checkpoint()  # let the other ranks interleave
            await fs.fsync(fh, False)
            await fs.release(fh)

    async with trio.open_nursery() as nursery:
        for r in range(RANKS):
            nursery.start_soon(rank, r)
    return step_ino, files


async def delete_step(fs: ZoneFS, ckpt_ino: int, step: int, step_ino: int,
                      files: dict[bytes, bytes]) -> None:
    for shard in files:
        await fs.unlink(step_ino, shard)
    await fs.rmdir(ckpt_ino, f"step_{step}".encode())
    await fs.sync()
    await fs.background_step()


async def test_a_sharded_save_shares_zones_within_the_active_budget(tmp_path: Path) -> None:
    async with mounted(tmp_path / "fs.img", geo=SHARDED, create=True) as fs:
        assert fs.alloc.head_budget == 10
        ckpt = (await fs.mkdir(ROOT_INO, b"checkpoints", 0o755, CTX)).ino
        step_ino, files = await save_step(fs, ckpt, 0)
        written = RANKS * SHARDS * SHARD_BYTES
        assert fs.alloc.wasted_bytes <= written * 2 // 100
        # The step's shards share its lanes' zones: no more zones than its bytes need
        # (plus one partly filled per lane), whatever 32 files at once would take alone.
        capacity = max(dz.capacity for dz in fs.alloc.zones.values())
        assert data_zones_used(fs) <= -(-written // capacity) + fs.alloc.group_lanes
        assert len(fs.alloc.active_zones()) <= fs.alloc.head_budget
        for shard, content in list(files.items())[:3]:
            assert await read_file(fs, f"/checkpoints/step_0/{shard.decode()}") == content
        del step_ino


async def test_deleting_a_step_resets_its_zones_without_copying(tmp_path: Path) -> None:
    """Rotation: step 1 is saved after step 0; deleting step 0 resets every zone
    only step 0 used, copies nothing, and leaves at most one zone per lane (the
    boundary, shared with step 1) holding step 0's dead bytes."""
    async with mounted(tmp_path / "fs.img", geo=SHARDED, create=True) as fs:
        ckpt = (await fs.mkdir(ROOT_INO, b"checkpoints", 0o755, CTX)).ino
        step0, files0 = await save_step(fs, ckpt, 0)
        step1, files1 = await save_step(fs, ckpt, 1)
        used_before = data_zones_used(fs)
        await delete_step(fs, ckpt, 0, step0, files0)
        step_bytes = RANKS * SHARDS * SHARD_BYTES
        capacity = max(dz.capacity for dz in fs.alloc.zones.values())
        assert fs.cleaner.stats.bytes_copied == 0
        freed = used_before - data_zones_used(fs)
        assert freed >= step_bytes // capacity - fs.alloc.group_lanes
        assert fs.alloc.dead_bytes_reset >= step_bytes - (fs.alloc.group_lanes + 1) * capacity
        for shard, content in list(files1.items())[:3]:
            assert await read_file(fs, f"/checkpoints/step_1/{shard.decode()}") == content
        del step1
