"""AsyncReader: io_uring reads polled by trio, and when they fall back to threads."""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
import trio.testing
from engine_helpers import CTX, TEST_OPTIONS, Geometry, assert_fsck_clean, mounted, new_image

from zonefs_py import errors
from zonefs_py.device import aread
from zonefs_py.device.aread import SQPOLL_MIN_INFLIGHT, AsyncReader
from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.fs.api import ROOT_INO
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.fs.options import FsOptions

MiB = 1 << 20
ZONE = 4 * MiB


def make_dev(tmp_path: Path) -> EmulatedZonedDevice:
    return EmulatedZonedDevice.create(tmp_path / "d.img", size_bytes=16 * ZONE,
                                      zone_size_bytes=ZONE)


@pytest.fixture
def dev(tmp_path: Path) -> EmulatedZonedDevice:
    d = make_dev(tmp_path)
    yield d
    d.close()


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def ring_or_skip(reader: AsyncReader) -> None:
    if not reader.uses_ring:
        pytest.skip("io_uring is not available on this kernel")


@asynccontextmanager
async def ring_reader(dev: EmulatedZonedDevice, sqpoll_ms: int = 0
                      ) -> AsyncIterator[tuple[AsyncReader, int, bytes]]:
    """A reader with a ring (or skip), and 1 MiB of random data written in zone 2:
    yields (reader, device offset of the data, the data); closes the reader (its
    reapers run in a nursery of this helper)."""
    blob = os.urandom(MiB)
    at = dev.append(2, blob)
    async with trio.open_nursery() as nursery:
        reader = AsyncReader(dev, nursery, sqpoll_ms=sqpoll_ms)
        ring_or_skip(reader)
        try:
            yield reader, at, blob
        finally:
            await reader.aclose()


@pytest.mark.parametrize("sqpoll_ms", [0, 2])
async def test_ring_reads_return_the_written_bytes(dev: EmulatedZonedDevice,
                                                   sqpoll_ms: int) -> None:
    async with ring_reader(dev, sqpoll_ms) as (reader, at, blob):
        results: dict[int, bytes | memoryview] = {}

        async def one(i: int) -> None:
            results[i] = await reader.read(at + i * 4096, 4096)

        async with trio.open_nursery() as nursery:
            for i in range(200):  # more than the ring holds at once
                nursery.start_soon(one, i)
        assert all(results[i] == blob[i * 4096:(i + 1) * 4096] for i in range(200))
        assert await reader.read(at, MiB) == blob
        assert reader.ring_reads == 201
        assert reader.thread_reads == 0


async def test_a_read_lends_its_buffer_until_the_view_is_dropped(
        dev: EmulatedZonedDevice) -> None:
    async with ring_reader(dev) as (reader, at, blob):
        view = await reader.read(at, MiB)
        assert isinstance(view, memoryview)
        assert view.readonly
        assert view == blob
        # While the view lives, its buffer is not reused by the next read.
        other = await reader.read(at, 4096)
        assert view == blob
        assert other == blob[:4096]
        assert not reader._free.get(MiB)
        del view
        assert len(reader._free[MiB]) == 1  # back on the free list, no copy made
        again = await reader.read(at + 4096, MiB - 4096)
        assert again == blob[4096:]
        assert not reader._free.get(MiB)  # the same buffer was reused


async def test_queued_small_reads_use_the_polled_ring_others_the_plain_ring(
        dev: EmulatedZonedDevice) -> None:
    async with ring_reader(dev, sqpoll_ms=2) as (reader, at, blob):
        assert reader._polled is not None
        assert reader._ring is not None
        # One read at a time (a paced reader): the plain ring, the polling
        # thread is never woken to spin.
        assert await reader.read(at, 4096) == blob[:4096]
        assert reader._ring.reaper_started
        assert not reader._polled.reaper_started
        # A queue of small reads: those behind SQPOLL_MIN_INFLIGHT go to the polled ring
        # (read_many submits them all before it waits for any).
        spans = [(at + i * 4096, 4096) for i in range(2 * SQPOLL_MIN_INFLIGHT)]
        got = await reader.read_many(spans)
        assert reader._polled.reaper_started
        assert [bytes(g) for g in got] == [blob[i * 4096:(i + 1) * 4096]
                                           for i in range(2 * SQPOLL_MIN_INFLIGHT)]
        # Large reads never go to the polled ring.
        assert await reader.read(at, MiB) == blob
    assert not reader.uses_ring


async def test_reads_the_device_must_emulate_take_the_thread_path(
        dev: EmulatedZonedDevice, nursery: trio.Nursery) -> None:
    at = dev.append(3, b"\x01" * 8192)
    reader = AsyncReader(dev, nursery)
    ring_or_skip(reader)
    try:
        # Past the write pointer: zeros come from the emulator, not the image.
        assert await reader.read(at, 16384) == b"\x01" * 8192 + bytes(8192)
        # Across a zone boundary.
        assert len(await reader.read(3 * ZONE - 4096, 8192)) == 8192
        # With a fault armed the emulator must see every read.
        dev.faults.fail_reads(3)
        with pytest.raises(OSError):
            await reader.read(at, 4096)
        assert reader.ring_reads == 0
        assert reader.thread_reads == 3
    finally:
        await reader.aclose()


async def test_a_cancelled_read_leaves_the_reader_usable(dev: EmulatedZonedDevice,
                                                         nursery: trio.Nursery) -> None:
    blob = os.urandom(64 * 4096)
    at = dev.append(1, blob)
    reader = AsyncReader(dev, nursery)
    ring_or_skip(reader)
    try:
        with trio.move_on_after(0):
            await reader.read(at, 4096)
        for _ in range(3):
            with trio.CancelScope() as scope:
                scope.cancel()
                await reader.read(at, 4096)
        assert await reader.read(at + 4096, 4096) == blob[4096:8192]
    finally:
        await reader.aclose()
    # Closed: reads still work, through threads.
    assert await reader.read(at, 4096) == blob[:4096]
    assert not reader.uses_ring


@pytest.mark.expect_log("zonefs_py.fs.data.readpath", "ERROR", "checksum mismatch in /f")
async def test_engine_detects_corruption_on_the_ring_path(tmp_path: Path) -> None:
    path = tmp_path / "fs.img"
    geo = Geometry(size_bytes=64 * MiB, zone_size_bytes=4 * MiB)
    async with mounted(path, geo=geo, create=True, fsck_after=False) as fs:
        fh, attr = await fs.create(ROOT_INO, b"f", 0o100644, os.O_RDWR, CTX)
        await fs.write(fh, 0, os.urandom(64 * 1024))
        await fs.fsync(fh, False)
        ext = next(iter(fs.state.inodes[attr.ino].extents))
        reader = fs.data.reader
        assert reader is not None
        ring_or_skip(reader)
        # Corrupt the stored block behind the device's back (a flash bit rot).
        dev_off = ext.dev + 4096
        image_off = fs.dev._data_offset + dev_off  # type: ignore[attr-defined]
        flip_byte(path, image_off)
        before = reader.ring_reads
        with pytest.raises(errors.IOFailure, match="checksum mismatch at file offset 4096"):
            await fs.read(fh, 0, 8192)
        assert reader.ring_reads > before
        await fs.release(fh)


async def test_engine_reads_through_threads_with_io_uring_off(tmp_path: Path) -> None:
    path = tmp_path / "fs.img"
    opts = FsOptions(commit_interval_s=3600.0, io_uring=False)
    async with mounted(path, create=True, options=opts) as fs:
        assert fs.data.reader is None
        fh, _attr = await fs.create(ROOT_INO, b"f", 0o100644, os.O_RDWR, CTX)
        blob = os.urandom(200_000)
        await fs.write(fh, 0, blob)
        await fs.fsync(fh, False)
        assert await fs.read(fh, 0, len(blob)) == blob
        await fs.release(fh)


async def test_read_many_keeps_every_read_in_flight_and_the_order(
        dev: EmulatedZonedDevice) -> None:
    # Scattered slices of one file range (as zone appends land), plus one span the
    # emulator must serve (past the write pointer of zone 3): results in span order.
    tail_at = dev.append(3, b"\x02" * 4096)
    async with ring_reader(dev) as (reader, at, blob):
        order = [5, 0, 7, 2, 6, 1, 4, 3]
        spans = [(at + k * 128 * 1024, 128 * 1024) for k in order] + [(tail_at, 8192)]
        got = await reader.read_many(spans)
        assert [bytes(g) for g in got[:-1]] == [
            blob[k * 128 * 1024:(k + 1) * 128 * 1024] for k in order]
        assert got[-1] == b"\x02" * 4096 + bytes(4096)
        assert reader.ring_reads == len(order)
        assert reader.thread_reads == 1


async def test_read_many_reports_the_failure_and_stays_usable(
        dev: EmulatedZonedDevice) -> None:
    async with ring_reader(dev) as (reader, at, blob):
        # The second span is not block aligned: the kernel refuses it (EINVAL).
        with pytest.raises(OSError):
            await reader.read_many([(at, 4096), (at + 1, 4096), (at + 8192, 4096)])
        assert bytes(await reader.read(at, 4096)) == blob[:4096]


async def test_a_file_scattered_by_zone_appends_reads_back_exactly(tmp_path: Path) -> None:
    """Through the engine on a zone-append device (slices land shuffled): reads of
    every size and alignment over many scattered pieces give the written bytes,
    and a read of several pieces has them all in flight (DataPath._read_pieces)."""
    path = tmp_path / "za.img"
    new_image(path, Geometry(size_bytes=96 * MiB, zone_size_bytes=8 * MiB))
    dev = EmulatedZonedDevice.open(path, zone_append=True)
    try:
        async with ZoneFS.mount(dev, TEST_OPTIONS) as fs:
            if fs.data.reader is None or not fs.data.reader.uses_ring:
                pytest.skip("io_uring is not available on this kernel")
            data = os.urandom(6 * MiB + 12345)
            fh, attr = await fs.create(ROOT_INO, b"ckpt", 0o644, os.O_RDWR, CTX)
            for off in range(0, len(data), MiB):
                await fs.write(fh, off, data[off:off + MiB])
            await fs.fsync(fh, False)
            inode = fs.state.inodes[attr.ino]
            assert inode.extents is not None
            assert len(inode.extents) > 6  # scattered: more pieces than chunks
            rng = random.Random(12)
            for _ in range(200):
                off = rng.randrange(len(data))
                n = rng.choice([1, 4096, 100_000, MiB, 3 * MiB])
                assert bytes(await fs.read(fh, off, n)) == data[off:off + n]
            assert bytes(await fs.read(fh, 0, len(data))) == data
            await fs.release(fh)
            fs.forget([(attr.ino, 1)])
    finally:
        dev.close()
    assert_fsck_clean(path)


@pytest.mark.parametrize("sqpoll_ms", [0, 2])
async def test_read_many_of_more_spans_than_the_ring_holds(dev: EmulatedZonedDevice,
                                                           sqpoll_ms: int) -> None:
    """A read-ahead segment of a file fragmented into hundreds of 4 KiB pieces is one
    read_many of more spans than the ring has slots. Slots come back only when
    their reader takes the result, so read_many must take its own results before
    it waits for room (it once filled the ring with 128 of its own reads and
    waited forever; every later read queued behind it: a hung mount under fsx)."""
    async with ring_reader(dev, sqpoll_ms) as (reader, at, blob):
        spans = [(at + (i % 256) * 4096, 4096) for i in range(3 * 128 + 7)]
        want = [blob[(i % 256) * 4096:(i % 256 + 1) * 4096] for i in range(len(spans))]
        results: dict[int, list[bytes]] = {}

        async def many(k: int) -> None:
            results[k] = [bytes(b) for b in await reader.read_many(spans)]

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for k in range(4):  # four of them at once, with single reads between
                    nursery.start_soon(many, k)
                    nursery.start_soon(reader.read, at, 4096)
        assert all(results[k] == want for k in range(4))
        for ring in (reader._ring, reader._polled):
            if ring is not None:
                assert len(ring.free) == len(ring.slots)  # every slot came back


async def test_a_read_waiting_for_a_slot_wakes_when_the_slot_is_freed(
        dev: EmulatedZonedDevice, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 42, the READ never answered: a slot is freed when its reader takes the
    result, after the reap that woke the reads waiting for room. A waiter that ran
    first found no free slot and waited again; the readers then freed every slot
    without waking it, and with nothing left in flight it slept forever (fio
    randread 128 KiB QD1: 640 read-ahead segments parked on an empty ring, the
    request waiting on one of them). Driven step by step on a one-slot ring."""
    monkeypatch.setattr(aread, "RING_ENTRIES", 1)
    async with ring_reader(dev) as (reader, at, blob):
        ring = reader._ring
        assert ring is not None
        assert len(ring.slots) == 1
        target = reader._target(at, 4096)
        assert target is not None
        n = await reader._submit(ring, *target, at, 4096, None)  # the only slot, held
        reaped = ring.room  # set by the reap of that read's completion
        got: list[bytes] = []

        async def waiter() -> None:
            got.append(bytes(await reader.read(at + 4096, 4096)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await reaped.wait()  # the completion is reaped: the slot is not free yet
            await trio.testing.wait_all_tasks_blocked()
            assert not got  # the waiter ran and waits again
            assert not ring.free
            first = await reader._complete(ring, n, at, 4096, None)  # frees the slot
            assert bytes(first) == blob[:4096]
            await trio.testing.wait_all_tasks_blocked()
            # Woken by the freed slot: its read is in flight or done (never parked
            # on a free slot; before the fix it stayed parked here for good).
            assert got or ring.inflight == 1
        assert got == [blob[4096:8192]]
