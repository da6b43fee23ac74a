"""copy_file_range within one file (issue 42), in the engine without FUSE.

A copy is a write request of its destination (`write_arriving`) that also
reads its source; within one file it used to wait for its own unfinished
request and was never answered. Every call here runs under `trio.fail_after`,
so a regression fails instead of hanging. Each test ends with an fsck of the
image (the `mounted` helper), whose INV-6 check counts a file that maps some
device blocks twice.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
import trio.testing
from engine_helpers import CTX, KiB, MiB, mounted, pattern

from zonefs_py import errors
from zonefs_py.fs.api import ROOT_INO
from zonefs_py.fs.filesystem import ZoneFS

BS = 4096
C_DATA_BYTES = 2  # counter id: data bytes appended (SPEC "Counter ids")
#: Seconds any one copy may take here (they take milliseconds).
DEADLINE_S = 10


async def new_file(fs: ZoneFS, name: bytes, data: bytes, fsync: bool = True) -> int:
    fh, attr = await fs.create(ROOT_INO, name, 0o644, os.O_RDWR, CTX)
    fs.forget([(attr.ino, 1)])
    await fs.write(fh, 0, data)
    if fsync:
        await fs.fsync(fh, False)
    return fh


async def content(fs: ZoneFS, fh: int) -> bytes:
    size = (await fs.getattr(fs.files[fh])).size
    return bytes(await fs.read(fh, 0, size + BS))


async def copy(fs: ZoneFS, fh: int, off_in: int, off_out: int, length: int,
               model: bytearray) -> int:
    """Copy within file `fh` (bounded in time) and apply the same copy to `model`."""
    with trio.fail_after(DEADLINE_S):
        got = await fs.copy_file_range(fh, off_in, fh, off_out, length, 0)
    chunk = bytes(model[off_in:off_in + got])
    if off_out + got > len(model):
        model += bytes(off_out + got - len(model))
    model[off_out:off_out + got] = chunk
    return got


def appended(fs: ZoneFS) -> int:
    return fs.state.counters.get(C_DATA_BYTES, 0)


@pytest.mark.parametrize("fsync", [True, False], ids=["stored", "buffered"])
async def test_unaligned_copies_within_one_file_are_answered(tmp_path: Path,
                                                             fsync: bool) -> None:
    data = pattern(1, 300 * KiB + 7)
    async with mounted(tmp_path / "a.img", create=True) as fs:
        fh = await new_file(fs, b"f", data, fsync=fsync)
        model = bytearray(data)
        assert await copy(fs, fh, 1000, 200 * KiB + 3, 50 * KiB, model) == 50 * KiB  # forwards
        assert await copy(fs, fh, 250 * KiB + 5, 17, 40 * KiB, model) == 40 * KiB  # backwards
        end = len(model)
        assert await copy(fs, fh, 3, end + 999, 10 * KiB, model) == 10 * KiB  # past EOF
        assert fs.copier.shared_copies == 0
        assert await content(fs, fh) == bytes(model)
        await fs.release(fh)


@pytest.mark.parametrize("fsync", [True, False], ids=["stored", "buffered"])
async def test_aligned_copies_within_one_file_share_extents(tmp_path: Path,
                                                            fsync: bool) -> None:
    data = pattern(2, 2 * MiB + 1234)
    async with mounted(tmp_path / "a.img", create=True) as fs:
        fh = await new_file(fs, b"f", data, fsync=fsync)
        await fs.fsync(fh, False)
        before = appended(fs)
        model = bytearray(data)
        assert await copy(fs, fh, 0, MiB, 64 * KiB, model) == 64 * KiB  # forwards
        assert await copy(fs, fh, MiB, 0, 64 * KiB, model) == 64 * KiB  # backwards
        # The source's partial last block, to past EOF (zeros between, INV-10).
        end = len(model)
        tail = end - (end // BS) * BS + 3 * BS
        assert await copy(fs, fh, end - tail, 3 * MiB, MiB, model) == tail
        assert fs.copier.shared_copies == 3
        await fs.fsync(fh, False)
        assert appended(fs) == before  # metadata only
        assert await content(fs, fh) == bytes(model)
        # Copy-on-write: overwriting one of two mappings of a block leaves the other.
        new = pattern(3, 8 * KiB)
        with trio.fail_after(DEADLINE_S):
            await fs.write(fh, MiB + 4 * KiB, new)
        model[MiB + 4 * KiB:MiB + 12 * KiB] = new
        await fs.fsync(fh, False)
        assert await content(fs, fh) == bytes(model)
        await fs.release(fh)
    async with mounted(tmp_path / "a.img") as fs:  # journal replay
        attr = await fs.lookup(ROOT_INO, b"f")
        fs.forget([(attr.ino, 1)])
        fh = await fs.open(attr.ino, os.O_RDONLY)
        assert await content(fs, fh) == bytes(model)
        await fs.release(fh)


async def test_overlapping_ranges_of_one_file_are_invalid(tmp_path: Path) -> None:
    async with mounted(tmp_path / "a.img", create=True) as fs:
        fh = await new_file(fs, b"f", pattern(4, 256 * KiB))
        for off_in, off_out in ((0, 4 * BS), (4 * BS, 0), (1000, 3000)):
            with trio.fail_after(DEADLINE_S), pytest.raises(errors.InvalidArgument):
                await fs.copy_file_range(fh, off_in, fh, off_out, 8 * BS, 0)
        await fs.release(fh)


async def test_a_copy_waits_for_earlier_writes_of_its_source_only(tmp_path: Path) -> None:
    """`after_earlier_writes(ino, before)` waits for requests that arrived before
    `before`, never for `before` itself nor later ones."""
    async with mounted(tmp_path / "a.img", create=True) as fs:
        fh = await new_file(fs, b"f", b"x")
        ino = fs.files[fh]
        done: list[str] = []

        async def reader(before: int, tag: str) -> None:
            await fs.data.after_earlier_writes(ino, before)
            done.append(tag)

        async with trio.open_nursery() as nursery:
            with fs.data.write_arriving(ino) as first:
                with fs.data.write_arriving(ino) as second:
                    with trio.fail_after(DEADLINE_S):
                        await fs.data.after_earlier_writes(ino, first)  # nothing before it
                    nursery.start_soon(reader, second, "after-first")
                    await trio.testing.wait_all_tasks_blocked()
                    assert done == []  # `first` is unfinished
                await trio.testing.wait_all_tasks_blocked()
                assert done == []  # `second` finishing does not release it
            await trio.testing.wait_all_tasks_blocked()
            assert done == ["after-first"]
        await fs.release(fh)


async def test_the_cleaner_moves_a_range_one_file_maps_twice(tmp_path: Path) -> None:
    """A zone holding blocks that one file maps twice (a same-file copy) is cleaned:
    the range moves once, both mappings follow, the file stays exact."""
    async with mounted(tmp_path / "a.img", create=True) as fs:
        # Every file at most a quarter of the 2 MiB zone, so all of them share the
        # stream's head (a larger one gets zones of its own, DESIGN 3.7) and fill it.
        kept = pattern(5, 512 * KiB)
        fh = await new_file(fs, b"f", kept)
        for i in range(6):
            gone = await new_file(fs, b"gone%d" % i, pattern(6 + i, 256 * KiB))
            await fs.release(gone)
        model = bytearray(kept)
        assert await copy(fs, fh, 0, 1024 * KiB, 512 * KiB, model) == 512 * KiB
        assert fs.copier.shared_copies == 1
        for i in range(6):
            await fs.unlink(ROOT_INO, b"gone%d" % i)
        await fs.sync()
        victim = fs.cleaner.pick_victim()
        assert victim is not None
        distinct = fs.alloc.live_bytes(victim.zone_idx)
        assert fs.state.zone_live_blocks[victim.zone_idx] * BS - distinct == 512 * KiB
        copied = await fs.cleaner.clean_zone(victim.zone_idx, throttle=False)
        await fs.reclaim.commit_and_reset()
        assert copied == distinct  # each live block once
        assert fs.alloc.zones[victim.zone_idx].reserved == 0, "the victim must be reset"
        assert fs.state.shared.extra_total == 512 * KiB // BS
        assert await content(fs, fh) == bytes(model)
        await fs.release(fh)
