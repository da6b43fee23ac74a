"""Zone summaries (issue 19, DISK_VERSION 4): the checksums of a full data zone live
in the zone, not in memory (format/zonesum.py, fs/data/zonesums.py).

Layer by layer: the block codec, then the engine (sealing, reads through the
summary cache, remount, checkpoint, cleaner, fsck), a damaged summary block
(EIO for exactly the blocks it covers, the mount stays writable), and cache
eviction under pressure while readers, writers and the cleaner run.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import trio
from engine_helpers import (
    TEST_OPTIONS,
    Geometry,
    MiB,
    corrupt_image,
    fsck,
    mounted,
    pattern,
    read_file,
    resolve,
    write_file,
)
from hypothesis import given
from hypothesis import strategies as st

from zonefs_py import errors
from zonefs_py.format import zonesum
from zonefs_py.fs.api import ROOT_INO
from zonefs_py.fs.filesystem import ZoneFS

BS = 4096
ZONE = 2 * MiB  # engine_helpers.SMALL


# -- codec ---------------------------------------------------------------------------

@given(st.integers(1, 1 << 20), st.sampled_from([512, 4096]))
def test_room_holds_the_summary_of_a_full_data_room(zone_blocks: int, bs: int) -> None:
    room = zonesum.room_blocks(zone_blocks, bs)
    assert zonesum.sum_blocks(zone_blocks - room, bs) <= room
    # and it is not wasteful: one block less would not do for some data size
    assert room == 0 or zonesum.sum_blocks(zone_blocks - room + 1, bs) >= room - 1


def test_summary_blocks_round_trip_and_refuse_anything_else() -> None:
    per = zonesum.per_block(BS)
    data_blocks = 2 * per + 5
    csums = os.urandom(data_blocks * 4)
    blob = zonesum.encode(7, 3, csums, BS)
    assert len(blob) == 3 * BS
    got = b"".join(zonesum.decode_block(blob[k * BS:(k + 1) * BS], 7, 3, k, data_blocks) or b"!"
                   for k in range(3))
    assert got == csums
    block = blob[BS:2 * BS]
    assert zonesum.decode_block(block, 7, 4, 1, data_blocks) is None  # another generation
    assert zonesum.decode_block(block, 8, 3, 1, data_blocks) is None  # another zone
    assert zonesum.decode_block(block, 7, 3, 0, data_blocks) is None  # another position
    assert zonesum.decode_block(block, 7, 3, 1, data_blocks + 1) is None  # another seal
    for pos in (0, 30, 100, BS - 1):
        bad = bytearray(block)
        bad[pos] ^= 0x10
        assert zonesum.decode_block(bytes(bad), 7, 3, 1, data_blocks) is None, pos


# -- engine --------------------------------------------------------------------------

def sealed_extents(fs: ZoneFS, ino: int) -> int:
    inode = fs.state.inodes[ino]
    assert inode.extents is not None
    return sum(1 for e in inode.extents if e.csums is None)


async def test_full_zones_are_sealed_and_read_through_their_summaries(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    big = pattern(1, 7 * MiB + 1234)
    async with mounted(image, create=True) as fs:
        await write_file(fs, "/big", big)
        await fs.data.sealer.wait_idle()
        ino = await resolve(fs, "/big")
        assert len(fs.state.zone_seals) >= 3
        assert sealed_extents(fs, ino) >= 3
        assert await read_file(fs, "/big") == big
        assert fs.data.sums.misses > 0
        await fs.checkpoint()  # sealed extents go into it without checksums
    async with mounted(image) as fs:
        ino = await resolve(fs, "/big")
        assert sealed_extents(fs, ino) >= 3  # from the checkpoint: no checksums loaded
        assert await read_file(fs, "/big") == big
        # an overwrite inside sealed data lands elsewhere; both read right
        fh = await fs.open(ino, os.O_RDWR)
        await fs.write(fh, MiB + 100, b"x" * 9000)
        await fs.fsync(fh, False)
        await fs.release(fh)
        want = big[:MiB + 100] + b"x" * 9000 + big[MiB + 9100:]
        assert await read_file(fs, "/big") == want
    async with mounted(image) as fs:
        assert await read_file(fs, "/big") == want
    report = fsck(image)
    assert report.clean
    assert report.data_blocks_checked > 7 * MiB // BS


async def test_a_zone_finished_early_for_a_token_is_sealed_at_its_write_pointer(
        tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    # 6 active zones: a budget of 2 data heads.
    geo = Geometry(max_active=6)
    async with mounted(image, geo=geo, create=True) as fs:
        assert fs.alloc.head_budget == 2
        # A checkpoint-stream file leaves its second zone 3/4 full: a spare of
        # its stream (not finished on close, DESIGN 3.7)...
        data = pattern(2, 3 * MiB + 700 * 1024)
        await write_file(fs, "/ckpt.pt", data)
        await write_file(fs, "/small", b"s" * 5000)  # the default stream's head
        # ...until a third stream needs a head: the spare gives up its token,
        # sealed where its data ends, not at the zone's end.
        await write_file(fs, "/train.log", b"l" * 5000)
        await fs.data.sealer.wait_idle()
        half = [z for z, (_r, n) in fs.state.zone_seals.items() if n < ZONE // BS - 1]
        assert half, fs.state.zone_seals
        assert fs.alloc.wasted_bytes > 0
        assert await read_file(fs, "/ckpt.pt") == data
    assert fsck(image).clean


async def test_the_cleaner_copies_out_of_a_sealed_zone(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True) as fs:
        files = {f"/f{i}": pattern(10 + i, 300_000 + i) for i in range(12)}
        for path, data in files.items():
            await write_file(fs, path, data)
        await fs.data.sealer.wait_idle()
        for path, data in files.items():  # fills the summary cache
            assert await read_file(fs, path) == data
        for i in range(0, 12, 2):
            await fs.unlink(ROOT_INO, f"f{i}".encode())
            del files[f"/f{i}"]
        await fs.sync()
        victim = fs.cleaner.pick_victim()
        assert victim is not None
        assert victim.zone_idx in fs.state.zone_seals
        cached = fs.data.sums._by_zone  # noqa: SLF001 - what the cache holds, per zone
        assert victim.zone_idx in cached
        copied = await fs.cleaner.clean_zone(victim.zone_idx, throttle=False)
        assert copied == victim.live_bytes
        before = fs.data.sums.used_bytes
        await fs.reclaim.commit_and_reset()
        assert victim.zone_idx not in fs.state.zone_seals  # reset: the seal is gone
        # ...and so are its cached checksums (they could never be looked up again).
        assert victim.zone_idx not in cached
        assert all(key[0] != victim.zone_idx for key in fs.data.sums._lru)  # noqa: SLF001
        assert fs.data.sums.used_bytes < before
        for path, data in files.items():
            assert await read_file(fs, path) == data
    async with mounted(image) as fs:
        for path, data in files.items():
            assert await read_file(fs, path) == data


@pytest.mark.expect_log("zonefs_py.fs.data.zonesums", "ERROR", "damaged checksum block in /big")
async def test_a_damaged_summary_block_fails_exactly_the_blocks_it_covers(
        tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    big = pattern(3, 6 * MiB)
    async with mounted(image, create=True) as fs:
        await write_file(fs, "/big", big)
        await fs.data.sealer.wait_idle()
        ino = await resolve(fs, "/big")
        inode = fs.state.inodes[ino]
        assert inode.extents is not None
        ext = next(e for e in inode.extents if e.csums is None)
        zone = ext.dev // ZONE
        _resets, data_blocks = fs.state.zone_seals[zone]
        file_lo = ext.fblock * BS  # the extent starts at zone block (ext.dev % ZONE) // BS
        first_block = (ext.dev % ZONE) // BS
    # 2 MiB zones hold 511 data blocks: one summary block covers all of them.
    assert zonesum.sum_blocks(data_blocks, BS) == 1
    corrupt_image(image, zone * ZONE + data_blocks * BS + 40)
    async with mounted(image, fsck_after=False) as fs:
        covered_lo = file_lo - first_block * BS
        covered_hi = covered_lo + data_blocks * BS
        ino = await resolve(fs, "/big")
        fh = await fs.open(ino, os.O_RDONLY)
        with pytest.raises(errors.IOFailure):
            await fs.read(fh, covered_lo + 5 * BS, 100)
        with pytest.raises(errors.IOFailure):
            await fs.read(fh, covered_hi - 10, 20)  # straddles into the next zone
        if covered_lo > 0:
            assert await fs.read(fh, covered_lo - BS, BS) == big[covered_lo - BS:covered_lo]
        assert await fs.read(fh, covered_hi, BS) == big[covered_hi:covered_hi + BS]
        await fs.release(fh)
        assert fs.failsafe is None  # one file's data: EIO, the mount stays writable
        await write_file(fs, "/after", b"still writable")
    report = fsck(image)
    found = {f.invariant for f in report.findings}
    assert found == {"INV-12", "INV-23"}, report.findings


async def test_cache_eviction_under_readers_writers_and_the_cleaner(tmp_path: Path) -> None:
    """A cache of a few summary blocks: every read misses and evicts, while files are
    written, deleted and zones cleaned; every byte read is checked."""
    image = tmp_path / "fs.img"
    rnd = random.Random(5)
    async with mounted(image, create=True, options=TEST_OPTIONS) as fs:
        fs.data.sums.cache_bytes = 3 * (BS + 300)
        files: dict[str, bytes] = {}
        for i in range(6):
            files[f"/d{i}"] = pattern(20 + i, rnd.randrange(1, 3 * MiB))
            await write_file(fs, f"/d{i}", files[f"/d{i}"])
        await fs.data.sealer.wait_idle()
        assert fs.state.zone_seals
        done = trio.Event()

        async def reader(seed: int) -> None:
            r = random.Random(seed)
            while not done.is_set():
                path = r.choice(sorted(files))
                data = files[path]
                ino = await resolve(fs, path)
                fh = await fs.open(ino, os.O_RDONLY)
                try:
                    off = r.randrange(0, len(data))
                    n = r.randrange(1, 2 * MiB)
                    assert await fs.read(fh, off, n) == data[off:off + n], (path, off, n)
                finally:
                    await fs.release(fh)
                await trio.lowlevel.checkpoint()

        async def writer() -> None:
            for i in range(6, 14):
                data = pattern(40 + i, rnd.randrange(100_000, 2 * MiB))
                await write_file(fs, f"/w{i}", data)
                files[f"/w{i}"] = data
                if i % 3 == 0:
                    victim = sorted(files)[0]
                    del files[victim]
                    await fs.unlink(ROOT_INO, victim[1:].encode())
                    await fs.sync()
                    zone = fs.cleaner.pick_victim()
                    if zone is not None:
                        await fs.cleaner.clean_zone(zone.zone_idx, throttle=False)
                        await fs.reclaim.commit_and_reset()
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader, 1)
            nursery.start_soon(reader, 2)
            nursery.start_soon(writer)
        assert fs.data.sums.used_bytes <= fs.data.sums.cache_bytes
        assert fs.data.sums.misses > 10
        for path, data in files.items():
            assert await read_file(fs, path) == data


async def test_a_zone_written_into_the_summary_room_is_finished_at_mount_unsealed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An image of format 3 or older used whole zones: a zone it wrote past today's
    data room can never be sealed. The mount finishes it (its active-zone token
    back), keeps its checksums in memory, and it reads and checks clean."""
    from zonefs_py.alloc import allocator as allocator_mod
    from zonefs_py.device.base import ZoneCond

    image = tmp_path / "fs.img"
    files = {f"/s{i}": pattern(60 + i, 73 * BS) for i in range(7)}  # 511 blocks
    with monkeypatch.context() as m:
        m.setattr(allocator_mod, "room_blocks", lambda _zone_blocks, _bs: 0)
        async with mounted(image, create=True) as fs:
            fs.data.sealer.enabled = False  # the old layout had no summaries
            for path, data in files.items():
                await write_file(fs, path, data)
            zone = next(iter(fs.state.inodes[await resolve(fs, "/s0")].extents or ())).dev // ZONE
            assert fs.alloc.zones[zone].reserved == 511 * BS  # the old layout's head
    async with mounted(image) as fs:
        dz = fs.alloc.zones[zone]
        assert dz.reserved == dz.capacity
        assert not dz.sealed
        assert zone not in fs.state.zone_seals
        assert next(z for z in fs.dev.report_zones() if z.index == zone).cond == ZoneCond.FULL
        for path, data in files.items():
            assert await read_file(fs, path) == data
        await write_file(fs, "/new", pattern(70, 5000))  # lands in another zone
        assert await resolve(fs, "/new")
    assert fsck(image).clean


async def test_a_sealed_zone_whose_summary_leaves_room_is_finished(tmp_path: Path) -> None:
    """Zone capacity 1,018 blocks: 2 blocks kept, 1,016 of data need one summary
    block, so the summary leaves the zone one block short of FULL; the sealer
    finishes it (an open zone would hold an active-zone token for good)."""
    from zonefs_py.device.base import ZoneCond
    from zonefs_py.device.emulated import EmulatedZonedDevice
    from zonefs_py.fs.mkfs import make_filesystem

    image = tmp_path / "fs.img"
    dev = EmulatedZonedDevice.create(image, size_bytes=128 * MiB, zone_size_bytes=8 * MiB,
                                     zone_capacity_bytes=1018 * BS, max_active=8)
    try:
        make_filesystem(dev)
    finally:
        dev.close()
    assert zonesum.room_blocks(1018, BS) == 2
    assert zonesum.sum_blocks(1016, BS) == 1
    data = pattern(80, 9 * MiB)
    async with mounted(image) as fs:
        await write_file(fs, "/big", data)
        await fs.data.sealer.wait_idle()
        assert len(fs.state.zone_seals) >= 2
        conds = {z.index: z.cond for z in fs.dev.report_zones()}
        for zone in fs.state.zone_seals:
            assert conds[zone] == ZoneCond.FULL, zone
        assert await read_file(fs, "/big") == data
    async with mounted(image) as fs:
        assert await read_file(fs, "/big") == data
