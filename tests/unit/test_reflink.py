"""copy_file_range by sharing extents (issue 28): accounting, copy-on-write,
the cleaner moving a shared range once, resets, remounts, the fallback copy.

Every test ends with an fsck of the image (the `mounted` helper), whose INV-6
check compares the blocks several extents reference with the shared-block map.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from engine_helpers import CTX, KiB, MiB, mounted, pattern

from zonefs_py import errors
from zonefs_py.fs.api import ROOT_INO, XattrFlags
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.model.shared import SharedBlocks

BS = 4096
C_DATA_BYTES = 2  # counter id: data bytes appended (SPEC "Counter ids")


async def new_file(fs: ZoneFS, name: bytes, data: bytes = b"") -> tuple[int, int]:
    fh, attr = await fs.create(ROOT_INO, name, 0o644, os.O_RDWR, CTX)
    fs.forget([(attr.ino, 1)])
    if data:
        await fs.write(fh, 0, data)
        await fs.fsync(fh, False)
    return fh, attr.ino


async def content(fs: ZoneFS, fh: int) -> bytes:
    size = (await fs.getattr(fs.files[fh])).size
    return bytes(await fs.read(fh, 0, size + BS))


def appended(fs: ZoneFS) -> int:
    return fs.state.counters.get(C_DATA_BYTES, 0)


async def test_copy_shares_extents_writes_no_data_and_costs_no_space(tmp_path: Path) -> None:
    data = pattern(1, 4 * MiB + 1234)
    async with mounted(tmp_path / "a.img", create=True) as fs:
        src, _ = await new_file(fs, b"src", data)
        dst, dst_ino = await new_file(fs, b"dst")
        free0 = (await fs.statfs()).free_blocks
        refs0 = fs.state.live_blocks_total
        before = appended(fs)
        n = await fs.copy_file_range(src, 0, dst, 0, 10 * MiB, 0)
        assert n == len(data)
        await fs.fsync(dst, False)
        assert appended(fs) == before  # metadata only
        assert await content(fs, dst) == data
        assert (await fs.statfs()).free_blocks == free0
        blocks = -(-len(data) // BS)
        assert fs.state.live_blocks_total == refs0 + blocks
        assert fs.state.shared.extra_total == blocks
        assert fs.copier.shared_copies == 1
        # Copy-on-write: overwrite half of each file, both stay exact.
        d_src, d_dst = bytearray(data), bytearray(data)
        half = pattern(2, 2 * MiB)
        await fs.write(src, 0, half)
        d_src[:len(half)] = half
        other = pattern(3, 2 * MiB)
        await fs.write(dst, 2 * MiB, other)
        d_dst[2 * MiB:4 * MiB] = other
        await fs.fsync(src, False)
        await fs.fsync(dst, False)
        assert await content(fs, src) == bytes(d_src)
        assert await content(fs, dst) == bytes(d_dst)
        await fs.release(src)
        await fs.release(dst)
    async with mounted(tmp_path / "a.img") as fs:  # journal replay
        assert fs.state.shared.extra_total > 0
        await fs.checkpoint()
    async with mounted(tmp_path / "a.img") as fs:  # from the checkpoint
        fh = await fs.open(dst_ino, os.O_RDONLY)
        assert await content(fs, fh) == bytes(d_dst)
        await fs.release(fh)


async def test_deleting_the_source_frees_nothing_until_the_copy_goes(tmp_path: Path) -> None:
    async with mounted(tmp_path / "a.img", create=True) as fs:
        data = pattern(4, 6 * MiB)  # a private zone or more of its own
        src, src_ino = await new_file(fs, b"src", data)
        dst, _ = await new_file(fs, b"dst")
        await fs.copy_file_range(src, 0, dst, 0, len(data), 0)
        await fs.release(src)
        await fs.release(dst)
        zones = {e.dev // fs.state.zone_size for e in fs.state.inodes[src_ino].extents or []}
        free0 = (await fs.statfs()).free_blocks
        await fs.unlink(ROOT_INO, b"src")
        await fs.reclaim.commit_and_reset()
        assert (await fs.statfs()).free_blocks == free0
        assert all(fs.state.zone_live_blocks.get(z) for z in zones)
        dst_attr = await fs.lookup(ROOT_INO, b"dst")
        fs.forget([(dst_attr.ino, 1)])
        fh = await fs.open(dst_attr.ino, os.O_RDONLY)
        assert await content(fs, fh) == data
        await fs.release(fh)
        await fs.unlink(ROOT_INO, b"dst")
        await fs.reclaim.commit_and_reset()
        assert (await fs.statfs()).free_blocks - free0 >= len(data) // BS
        assert fs.state.shared.extra_total == 0
        assert not any(fs.state.zone_live_blocks.get(z) for z in zones)


async def test_the_cleaner_moves_a_shared_range_once_and_both_files_follow(
        tmp_path: Path) -> None:
    async with mounted(tmp_path / "a.img", create=True) as fs:
        files = {}
        for i in range(4):  # fill a 2 MiB zone: four files, one of them deleted
            files[i] = pattern(10 + i, 600 * KiB)
            fh, _ = await new_file(fs, f"k{i}".encode(), files[i])
            await fs.release(fh)
        k0 = await fs.lookup(ROOT_INO, b"k0")
        fs.forget([(k0.ino, 1)])
        src = await fs.open(k0.ino, os.O_RDONLY)
        dst, dst_ino = await new_file(fs, b"copy")
        await fs.copy_file_range(src, 0, dst, 0, 600 * KiB, 0)
        await fs.release(src)
        await fs.release(dst)
        await fs.unlink(ROOT_INO, b"k1")
        await fs.sync()
        victim = fs.cleaner.pick_victim()
        assert victim is not None
        distinct = fs.alloc.live_bytes(victim.zone_idx)
        references = fs.state.zone_live_blocks[victim.zone_idx] * BS
        assert references - distinct == 600 * KiB  # the copy's references
        copied = await fs.cleaner.clean_zone(victim.zone_idx, throttle=False)
        await fs.reclaim.commit_and_reset()
        # Each live block once: the copy's blocks are k0's, not copied again.
        assert copied == distinct
        assert fs.state.shared.extra_total == 600 * KiB // BS
        assert fs.alloc.zones[victim.zone_idx].reserved == 0, "the victim must be reset"
        fh = await fs.open(dst_ino, os.O_RDONLY)
        assert await content(fs, fh) == files[0]
        await fs.release(fh)
        for i in (0, 2, 3):
            attr = await fs.lookup(ROOT_INO, f"k{i}".encode())
            fs.forget([(attr.ino, 1)])
            fh = await fs.open(attr.ino, os.O_RDONLY)
            assert await content(fs, fh) == files[i]
            await fs.release(fh)


async def test_unaligned_and_partial_copies_are_copied_by_the_daemon(tmp_path: Path) -> None:
    async with mounted(tmp_path / "a.img", create=True) as fs:
        data = pattern(5, 300 * KiB + 7)
        src, _ = await new_file(fs, b"src", data)
        dst, _ = await new_file(fs, b"dst", pattern(6, 100 * KiB))
        want = bytearray(pattern(6, 100 * KiB))
        n = await fs.copy_file_range(src, 1000, dst, 5000, 50 * KiB, 0)
        assert n == 50 * KiB
        want[5000:5000 + n] = data[1000:1000 + n]
        # Aligned, but a partial block in the middle of the destination: copied.
        n = await fs.copy_file_range(src, 0, dst, 8 * BS, 3 * BS + 5, 0)
        want[8 * BS:8 * BS + n] = data[:n]
        assert fs.copier.shared_copies == 0
        # Past the source's EOF: nothing.
        assert await fs.copy_file_range(src, len(data), dst, 0, 10, 0) == 0
        assert await content(fs, dst) == bytes(want)
        with pytest.raises(errors.InvalidArgument):
            await fs.copy_file_range(src, 0, src, 4 * BS, 8 * BS, 0)  # overlapping
        with pytest.raises(errors.InvalidArgument):
            await fs.copy_file_range(src, 0, dst, 0, BS, 1)  # flags
        await fs.release(src)
        await fs.release(dst)


async def test_copies_of_copies_with_holes_and_overwrites(tmp_path: Path) -> None:
    """Random aligned copies between three files (holes included), overwrites and
    deletes, against models; then every zone with dead data is cleaned."""
    rng = random.Random(28)
    async with mounted(tmp_path / "a.img", create=True) as fs:
        names = [b"a", b"b", b"c"]
        fhs, models = {}, {}
        for i, name in enumerate(names):
            data = bytearray(pattern(20 + i, 64 * BS))
            data[10 * BS:20 * BS] = bytes(10 * BS)
            fhs[name], _ = await new_file(fs, name)
            await fs.write(fhs[name], 0, bytes(data[:10 * BS]))
            await fs.write(fhs[name], 20 * BS, bytes(data[20 * BS:]))
            models[name] = data
        for step in range(40):
            a, b = rng.sample(names, 2)
            if rng.random() < 0.6:
                off_in = rng.randrange(0, 64) * BS
                off_out = rng.randrange(0, 64) * BS
                n = rng.randrange(1, 32) * BS
                got = await fs.copy_file_range(fhs[a], off_in, fhs[b], off_out, n, 0)
                src = bytes(models[a][off_in:off_in + got])
                dst = models[b]
                if off_out + got > len(dst):
                    dst += bytes(off_out + got - len(dst))
                dst[off_out:off_out + got] = src
            else:
                off = rng.randrange(0, 70 * BS)
                data = pattern(100 + step, rng.randrange(1, 5 * BS))
                await fs.write(fhs[b], off, data)
                dst = models[b]
                if off + len(data) > len(dst):
                    dst += bytes(off + len(data) - len(dst))
                dst[off:off + len(data)] = data
            for name in names:
                assert await content(fs, fhs[name]) == bytes(models[name]), (step, name)
        assert fs.copier.shared_copies > 0
        await fs.sync()
        for _ in range(5):
            victim = fs.cleaner.pick_victim()
            if victim is None:
                break
            await fs.cleaner.clean_zone(victim.zone_idx, throttle=False)
            await fs.reclaim.commit_and_reset()
        for name in names:
            assert await content(fs, fhs[name]) == bytes(models[name]), name
            await fs.release(fhs[name])


def test_shared_block_map_against_per_block_counts() -> None:
    rng = random.Random(1)
    shared = SharedBlocks(BS, 1 << 20)
    refs = [1] * 256
    for _ in range(3000):
        lo = rng.randrange(0, 256)
        n = rng.randrange(1, 257 - lo)
        if rng.random() < 0.5:
            shared.add(lo * BS, n)
            for b in range(lo, lo + n):
                refs[b] += 1
        else:
            shared.release(lo * BS, n)
            for b in range(lo, lo + n):
                refs[b] = max(1, refs[b] - 1)
        assert shared.extra_total == sum(r - 1 for r in refs)
        got = [0] * 256
        for a, b, extra in shared.ranges.get(0, []):
            assert extra > 0
            assert a < b
            got[a:b] = [extra] * (b - a)
        assert got == [r - 1 for r in refs]


async def test_copies_may_reference_more_than_the_device_holds(tmp_path: Path) -> None:
    """References past the capacity are fine: space, status and fsck count the
    distinct blocks (fsck runs at the end)."""
    async with mounted(tmp_path / "a.img", create=True) as fs:
        data = pattern(7, 24 * MiB)
        src, _ = await new_file(fs, b"src", data)
        for i in range(3):
            dst, _ = await new_file(fs, f"copy{i}".encode())
            assert await fs.copy_file_range(src, 0, dst, 0, len(data), 0) == len(data)
            await fs.release(dst)
        await fs.release(src)
        assert fs.state.live_blocks_total * BS > fs.alloc.user_capacity_bytes()
        assert fs.alloc.live_total_bytes() == len(data)
        assert fs.status()["space"]["live_bytes"] == len(data)  # type: ignore[index]


async def test_copies_are_charged_to_the_destinations_quota(tmp_path: Path) -> None:
    async with mounted(tmp_path / "a.img", create=True) as fs:
        src, _ = await new_file(fs, b"src", pattern(8, 768 * KiB))
        d = (await fs.mkdir(ROOT_INO, b"q", 0o755, CTX)).ino
        fs.forget([(d, 1)])
        await fs.setxattr(d, b"user.zonefs.quota", b"1048576", XattrFlags.NONE, CTX)
        fhs = []
        for name in (b"c1", b"c2"):
            fh, attr = await fs.create(d, name, 0o644, os.O_RDWR, CTX)
            fs.forget([(attr.ino, 1)])
            fhs.append(fh)
        assert await fs.copy_file_range(src, 0, fhs[0], 0, 768 * KiB, 0) == 768 * KiB
        with pytest.raises(errors.QuotaExceeded):
            await fs.copy_file_range(src, 0, fhs[1], 0, 768 * KiB, 0)
        for fh in (src, *fhs):
            await fs.release(fh)
