"""Sequential read-ahead: streams are served from segments read ahead, and a segment
never serves bytes that a later write, truncate or cleaner move replaced."""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from engine_helpers import CTX, TEST_OPTIONS, MiB, mounted, pattern

from zonefs_py.fs.api import ROOT_INO, SetAttrRequest
from zonefs_py.fs.data.prefetch import Prefetcher
from zonefs_py.fs.filesystem import ZoneFS

SIZE = 12 * MiB


@pytest.fixture
async def fs(tmp_path: Path) -> AsyncIterator[ZoneFS]:
    async with mounted(tmp_path / "fs.img", create=True,
                       options=TEST_OPTIONS.replace(prefetch_mb=4)) as f:
        yield f


async def streamed_file(fs: ZoneFS) -> tuple[int, int, bytearray]:
    """A fsynced 12 MiB file, open read-write: (fh, ino, model of its bytes)."""
    fh, attr = await fs.create(ROOT_INO, b"stream.bin", 0o644, os.O_RDWR, CTX)
    fs.forget([(attr.ino, 1)])
    model = bytearray(pattern(1, SIZE))
    for off in range(0, SIZE, MiB):
        await fs.write(fh, off, bytes(model[off:off + MiB]))
    await fs.fsync(fh, False)
    return fh, attr.ino, model


async def read_and_check(fs: ZoneFS, fh: int, model: bytearray, start: int, end: int,
                         step: int = MiB) -> None:
    for off in range(start, end, step):
        got = bytes(await fs.read(fh, off, step))
        assert got == bytes(model[off:off + step]), f"bytes differ in [{off}, {off + step})"


def prefetcher(fs: ZoneFS) -> Prefetcher:
    assert fs.data.prefetch is not None
    return fs.data.prefetch


async def settle(fs: ZoneFS) -> None:
    """Wait until the read-ahead the reads so far started is read (no real sleep)."""
    await prefetcher(fs).wait_idle()


async def test_a_sequential_stream_is_served_from_read_ahead(fs: ZoneFS) -> None:
    fh, _ino, model = await streamed_file(fs)
    await read_and_check(fs, fh, model, 0, SIZE)
    assert prefetcher(fs).hits >= 8
    await fs.release(fh)


async def test_random_reads_do_not_read_ahead(fs: ZoneFS) -> None:
    """Random reads near each other (samples of a shard, 4 KiB reads of a dataset)
    are no stream: the first bench run read 9,000 segments ahead for a DataLoader
    epoch of random 32 KiB samples when "near the last read" counted as sequential."""
    fh, _ino, model = await streamed_file(fs)
    rng = random.Random(5)
    for _ in range(300):
        slot = rng.randrange(0, SIZE // 32768)
        await read_and_check(fs, fh, model, slot * 32768, slot * 32768 + 1, step=32768)
    for off in (7 * MiB, 0, 11 * MiB, 3 * MiB, 9 * MiB - 4096):
        await read_and_check(fs, fh, model, off, off + 1, step=65536)
    assert prefetcher(fs).segments_read == 0
    await fs.release(fh)


async def test_a_short_run_reads_ahead_a_little_not_the_window(fs: ZoneFS) -> None:
    """Three 128 KiB reads that happen to follow each other, then random ones (fio's
    random map picks the next free block when it draws a taken one): read-ahead
    starts at a few requests' worth and grows only as it is used (the window
    was read whole for every such run: 2x the device bytes of a random 128 KiB
    run)."""
    fh, _ino, model = await streamed_file(fs)
    pf = prefetcher(fs)
    step = 128 << 10
    for off in (0, step, 2 * step):
        await read_and_check(fs, fh, model, off, off + 1, step=step)
    await settle(fs)
    first = pf.segments_read
    assert 1 <= first <= 2  # 4 x 128 KiB ahead: at most two segments, not the window
    await read_and_check(fs, fh, model, 3 * step, 3 * step + 1, step=step)  # served: a hit
    assert pf.hits == 2  # the third read (it started the stream) and this one
    await read_and_check(fs, fh, model, 9 * MiB, 9 * MiB + 1, step=step)  # random: reset
    await settle(fs)
    assert pf.segments_read <= first + 2
    await fs.release(fh)


async def test_overwrite_ahead_of_a_stream(fs: ZoneFS) -> None:
    fh, _ino, model = await streamed_file(fs)
    await read_and_check(fs, fh, model, 0, 3 * MiB)
    await settle(fs)  # segments ahead are read now
    dropped = prefetcher(fs).segments_dropped
    new = pattern(2, MiB + MiB // 2 + 123)
    off = 4 * MiB + 777
    await fs.write(fh, off, new)
    await fs.fsync(fh, False)
    model[off:off + len(new)] = new
    await read_and_check(fs, fh, model, 3 * MiB, SIZE)
    assert prefetcher(fs).segments_dropped > dropped
    await fs.release(fh)


async def test_overwrite_while_the_segment_is_in_flight(fs: ZoneFS) -> None:
    """The write lands while a request waits for the segment that holds its range:
    that request must not get the old bytes after the write returned."""
    fh, _ino, model = await streamed_file(fs)
    await read_and_check(fs, fh, model, 0, 2 * MiB)
    # The next request starts segments and waits for the one at 2 MiB; before it
    # resumes, the same range is overwritten and fsynced.
    new = pattern(3, 2 * MiB)
    results: list[bytes] = []

    async def reader() -> None:
        results.append(bytes(await fs.read(fh, 2 * MiB, MiB)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await fs.write(fh, 2 * MiB, new)
        await fs.fsync(fh, False)
    # Concurrent with the write, the read may see either version, but never a mix.
    assert results[0] in (bytes(model[2 * MiB:3 * MiB]), new[:MiB])
    model[2 * MiB:4 * MiB] = new
    # The stream goes on at 3 MiB, inside the segment read before the write.
    await read_and_check(fs, fh, model, 3 * MiB, SIZE)
    await fs.release(fh)


async def test_truncate_while_a_stream_is_read(fs: ZoneFS) -> None:
    fh, ino, model = await streamed_file(fs)
    await read_and_check(fs, fh, model, 0, 3 * MiB)
    await settle(fs)
    # Shrink into the window (not on a block boundary), then grow again: the tail
    # must read as zeros, not as the bytes read ahead before the truncate.
    for new_size in (5 * MiB + 100, SIZE):
        await fs.setattr(ino, SetAttrRequest(size=new_size), CTX)
        del model[new_size:]
        model.extend(bytes(new_size - len(model)))
    await read_and_check(fs, fh, model, 3 * MiB, SIZE)
    await fs.release(fh)


async def test_cleaner_move_while_a_stream_is_read(fs: ZoneFS) -> None:
    fh, ino, model = await streamed_file(fs)
    await read_and_check(fs, fh, model, 0, 3 * MiB)
    await settle(fs)
    inode = fs.state.inodes[ino]
    assert inode.extents is not None
    piece = inode.extents.lookup((5 * MiB) // fs.bs, 1, fs.bs)[0]
    assert piece.dev is not None
    victim = piece.dev // fs.state.zone_size
    dropped = prefetcher(fs).segments_dropped
    copied = await fs.cleaner.clean_zone(victim, throttle=False)
    assert copied > 0
    await fs.reclaim.commit_and_reset()
    assert prefetcher(fs).segments_dropped > dropped
    # The old zone is reset and taken by new data of another file.
    other, attr = await fs.create(ROOT_INO, b"other.bin", 0o644, os.O_RDWR, CTX)
    fs.forget([(attr.ino, 1)])
    for off in range(0, 4 * MiB, MiB):
        await fs.write(other, off, pattern(9, MiB))
    await fs.fsync(other, False)
    await read_and_check(fs, fh, model, 3 * MiB, SIZE)
    await fs.release(other)
    await fs.release(fh)


async def test_prefetch_off(tmp_path: Path) -> None:
    async with mounted(tmp_path / "fs.img", create=True,
                       options=TEST_OPTIONS.replace(prefetch_mb=0)) as fs:
        assert fs.data.prefetch is None
        fh, _ino, model = await streamed_file(fs)
        await read_and_check(fs, fh, model, 0, SIZE)
        await fs.release(fh)
