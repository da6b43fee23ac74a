"""File data: write coalescing, overwrite, holes, truncate, checksums, private zones."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.testing
from engine_helpers import (
    CTX,
    TEST_OPTIONS,
    CountingDevice,
    MiB,
    Model,
    assert_fsck_clean,
    mounted,
    new_image,
    pattern,
    read_file,
    resolve,
    write_file,
)

from zonefs_py import errors
from zonefs_py.device.base import ZoneCond
from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.fs.api import ROOT_INO, SetAttrRequest
from zonefs_py.fs.filesystem import ZoneFS


@pytest.fixture
async def counted(tmp_path: Path) -> AsyncIterator[tuple[ZoneFS, CountingDevice]]:
    image = tmp_path / "fs.img"
    new_image(image)
    dev = EmulatedZonedDevice.open(image)
    cdev = CountingDevice(dev)
    try:
        async with ZoneFS.mount(cdev, TEST_OPTIONS) as fs:  # type: ignore[arg-type]
            yield fs, cdev
    finally:
        dev.close()
    assert_fsck_clean(image)


@pytest.fixture
async def fs(tmp_path: Path) -> AsyncIterator[ZoneFS]:
    async with mounted(tmp_path / "fs.img", create=True) as f:
        yield f


async def open_new(fs: ZoneFS, name: bytes) -> tuple[int, int]:
    fh, attr = await fs.create(ROOT_INO, name, 0o644, os.O_RDWR, CTX)
    fs.forget([(attr.ino, 1)])
    return fh, attr.ino


def zones_of(fs: ZoneFS, ino: int) -> list[int]:
    inode = fs.state.inodes[ino]
    assert inode.extents is not None
    return [e.dev // fs.state.zone_size for e in inode.extents]


def data_appends(fs: ZoneFS, calls: list[int]) -> int:
    return sum(1 for z in calls if z >= fs.sb.data_first_zone)


async def test_sequential_small_writes_coalesce_into_1mib_appends(
        counted: tuple[ZoneFS, CountingDevice]) -> None:
    fs, cdev = counted
    zones: list[int] = []
    real_append = cdev.dev.append

    def spy(zone_idx: int, data: bytes | bytearray | memoryview) -> int:
        zones.append(zone_idx)
        return real_append(zone_idx, data)

    cdev.dev.append = spy  # type: ignore[method-assign]
    fh, ino = await open_new(fs, b"seq")
    data = pattern(1, 4 * MiB)
    for off in range(0, len(data), 32 * 1024):
        await fs.write(fh, off, data[off:off + 32 * 1024])
    # One append per MiB, and one more per zone boundary a chunk straddles (a zone's
    # data room is its size less its summary's room, not a MiB multiple).
    want = 4 + len(set(zones_of(fs, ino))) - 1
    assert data_appends(fs, zones) <= want, zones  # chunks may still be in flight
    await fs.fsync(fh, False)
    want = 4 + len(set(zones_of(fs, ino))) - 1
    assert 4 <= data_appends(fs, zones) <= want, zones  # nothing left over
    await fs.release(fh)
    assert await read_file(fs, "/seq") == data


async def test_overwrite_in_place(fs: ZoneFS) -> None:
    model = Model(files={"/f": pattern(2, 20000)})
    await write_file(fs, "/f", model.files["/f"])
    ino = await resolve(fs, "/f")
    for off, tag, n in ((5000, 3, 100), (0, 4, 4096), (19990, 5, 30), (4095, 6, 2)):
        fh = await fs.open(ino, os.O_WRONLY)
        await fs.write(fh, off, pattern(tag, n))
        await fs.fsync(fh, False)
        await fs.release(fh)
        model.write("/f", off, pattern(tag, n))
        assert await read_file(fs, "/f") == model.files["/f"]
    assert (await fs.getattr(ino)).size == 20020


async def test_sparse_file_holes_read_as_zeros(fs: ZoneFS) -> None:
    fh, ino = await open_new(fs, b"sparse")
    await fs.write(fh, 10 * MiB + 7, b"tail")
    await fs.write(fh, 3, b"head")
    await fs.fsync(fh, False)
    attr = await fs.getattr(ino)
    assert attr.size == 10 * MiB + 11
    assert attr.blocks * 512 == 2 * 4096  # only the two written blocks are stored
    assert await fs.read(fh, 0, 16) == b"\0\0\0head" + bytes(9)
    assert await fs.read(fh, 5 * MiB, 4096) == bytes(4096)
    assert await fs.read(fh, 10 * MiB, 16) == bytes(7) + b"tail"
    assert await fs.read(fh, 10 * MiB + 11, 100) == b""
    await fs.release(fh)


async def test_truncate_shrink_mid_block_then_extend_reads_zeros(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True) as fs:
        fh, ino = await open_new(fs, b"t")
        await fs.write(fh, 0, b"\xaa" * 10000)
        await fs.fsync(fh, False)
        await fs.setattr(ino, SetAttrRequest(size=5000), CTX)
        assert (await fs.getattr(ino)).size == 5000
        await fs.setattr(ino, SetAttrRequest(size=12000), CTX)
        assert await fs.read(fh, 0, 20000) == b"\xaa" * 5000 + bytes(7000)
        await fs.write(fh, 11999, b"Z")  # extend by writing too
        await fs.fsync(fh, False)
        await fs.release(fh)
    async with mounted(image) as fs:
        assert await read_file(fs, "/t") == b"\xaa" * 5000 + bytes(6999) + b"Z"


async def test_truncate_of_buffered_data_and_to_zero(fs: ZoneFS) -> None:
    fh, ino = await open_new(fs, b"t")
    await fs.write(fh, 0, pattern(7, 9000))  # still in the write buffer
    await fs.setattr(ino, SetAttrRequest(size=4097), CTX)
    assert await fs.read(fh, 0, 9000) == pattern(7, 4097)
    await fs.setattr(ino, SetAttrRequest(size=0), CTX)
    assert await fs.read(fh, 0, 10) == b""
    await fs.setattr(ino, SetAttrRequest(size=8192), CTX)
    assert await fs.read(fh, 0, 9000) == bytes(8192)
    await fs.release(fh)
    assert (await fs.getattr(ino)).blocks == 0


async def test_open_with_o_trunc(fs: ZoneFS) -> None:
    await write_file(fs, "/f", b"old content")
    ino = await resolve(fs, "/f")
    fh = await fs.open(ino, os.O_WRONLY | os.O_TRUNC)
    assert (await fs.getattr(ino)).size == 0
    await fs.write(fh, 0, b"new")
    await fs.release(fh)
    assert await read_file(fs, "/f") == b"new"


async def test_reads_merge_write_buffer_and_extents(fs: ZoneFS) -> None:
    model = Model(files={"/m": b""})
    fh, _ino = await open_new(fs, b"m")
    steps = [(0, pattern(8, 8192), True), (8192, pattern(9, 100), False),
             (8292, pattern(10, 5000), False), (4000, pattern(11, 50), False),
             (13000, pattern(12, 3), False)]
    for off, data, sync in steps:
        await fs.write(fh, off, data)
        model.write("/m", off, data)
        if sync:
            await fs.fsync(fh, False)
        assert await fs.read(fh, 0, 20000) == model.files["/m"]
        assert await fs.read(fh, 4090, 4200) == model.files["/m"][4090:8290]
    await fs.release(fh)
    assert await read_file(fs, "/m") == model.files["/m"]


@pytest.mark.expect_log("zonefs_py.fs.data.readpath", "ERROR", "checksum mismatch in /victim")
async def test_bit_flip_in_a_data_block_is_an_io_failure(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True) as fs:
        await write_file(fs, "/victim", pattern(13, 3 * 4096))
        await write_file(fs, "/bystander", pattern(14, 4096))
    dev = EmulatedZonedDevice.open(image)
    try:
        async with ZoneFS.mount(dev, TEST_OPTIONS) as fs:
            ino = await resolve(fs, "/victim")
            ext = next(iter(fs.state.inodes[ino].extents or []))
            dev.faults.flip_bit_on_read(ext.dev + 4096 + 17, bit=3)  # second block
            fh = await fs.open(ino, os.O_RDONLY)
            with caplog.at_level(logging.ERROR), pytest.raises(errors.IOFailure, match="4096"):
                await fs.read(fh, 0, 3 * 4096)
            assert await fs.read(fh, 0, 4096) == pattern(13, 4096)  # the good block still reads
            with pytest.raises(errors.IOFailure):
                await fs.read(fh, 5000, 10)
            await fs.release(fh)
            assert await read_file(fs, "/bystander") == pattern(14, 4096)
    finally:
        dev.close()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("/victim" in line and "offset 4096" in line for line in lines), lines


async def test_large_file_gets_private_zones_and_delete_resets_them(
        counted: tuple[ZoneFS, CountingDevice]) -> None:
    fs, cdev = counted
    await write_file(fs, "/small", b"s" * 5000)
    big = pattern(15, 7 * MiB)  # zones are 2 MiB: spans four zones
    await write_file(fs, "/big", big)
    big_ino = await resolve(fs, "/big")
    small_ino = await resolve(fs, "/small")
    zsize = fs.dev.info.zone_size_bytes
    big_zones = {e.dev // zsize for e in fs.state.inodes[big_ino].extents or []}
    small_zones = {e.dev // zsize for e in fs.state.inodes[small_ino].extents or []}
    assert len(big_zones) >= 3
    assert not (big_zones - {min(big_zones)}) & small_zones  # whole zones of its own
    whole = [z for z in big_zones
             if fs.alloc.live_bytes(z) == fs.alloc.zones[z].capacity]
    assert len(whole) >= 2  # zones it fills alone
    appends_before = cdev.appends
    await fs.unlink(ROOT_INO, b"big")
    await fs.sync()
    await fs.background_step()
    private = sorted(z for z in big_zones if z not in small_zones)
    conds = [z.cond for z in fs.dev.report_zones(private[0], private[-1] - private[0] + 1)]
    assert all(c == ZoneCond.EMPTY for c in conds), conds
    data_appends_after = cdev.appends - appends_before
    assert data_appends_after <= 2, "deleting must not copy data (only journal records)"
    assert fs.alloc.dead_bytes_reset >= 3 * MiB
    assert await read_file(fs, "/small") == b"s" * 5000


async def test_whole_chunk_writes_mixed_with_small_ones_read_back_exactly(fs: ZoneFS) -> None:
    """Aligned 1 MiB writes skip the buffer (zero-copy chunks); interleave them with
    small and unaligned writes over the same ranges, reading back all along."""
    fh, _ino = await open_new(fs, b"mix.bin")
    model = bytearray()

    async def put(offset: int, data: bytes) -> None:
        await fs.write(fh, offset, data)
        if len(model) < offset + len(data):
            model.extend(bytes(offset + len(data) - len(model)))
        model[offset:offset + len(data)] = data

    for i in range(6):
        await put(i * MiB, pattern(i, MiB))                # fast path, pipelined
    assert await fs.read(fh, 0, 6 * MiB) == bytes(model)  # in-flight chunks are visible
    await put(MiB + 100, pattern(10, 5000))                # unaligned, over a chunk
    await put(2 * MiB, pattern(11, 2 * MiB))               # fast path over older data
    await put(2 * MiB + 4096, pattern(12, 4096))           # small write inside it
    await put(7 * MiB, pattern(13, MiB + 4096))            # past a hole, > a chunk
    assert await fs.read(fh, 0, len(model)) == bytes(model)
    await fs.fsync(fh, False)
    assert await fs.read(fh, 0, len(model)) == bytes(model)
    attr = await fs.getattr(_ino)
    assert attr.size == len(model)
    await fs.release(fh)


@pytest.mark.parametrize("stamp", [True, False])
async def test_times_set_on_an_open_file_outlive_its_buffered_data(fs: ZoneFS,
                                                                   stamp: bool) -> None:
    """A SETATTR of mtime wins over data written before it that lands later
    (`DataPath.times_set`); with `stamp_times` off (the FUSE writeback cache owns
    the times) a write never changes them."""
    fs.data.stamp_times = stamp
    fh, ino = await open_new(fs, b"f")
    await fs.write(fh, 0, b"a" * 6000)           # buffered
    await fs.write(fh, 6000, b"b" * (2 << 20))   # chunks in flight
    await fs.setattr(ino, SetAttrRequest(mtime_ns=5_000_000_000), CTX)
    await fs.flush(fh)
    assert (await fs.getattr(ino)).mtime_ns == 5_000_000_000
    await fs.write(fh, 0, b"c")
    await fs.flush(fh)
    mtime = (await fs.getattr(ino)).mtime_ns
    assert (mtime > 5_000_000_000) if stamp else (mtime == 5_000_000_000)
    await fs.release(fh)


@pytest.mark.parametrize("state", ["stored", "inline", "buffered"])
async def test_a_read_arriving_after_a_write_sees_it(fs: ZoneFS, state: str) -> None:
    """A write parked before it buffers its data (here on the file's lock) is seen by
    a read that arrived after it (DataPath.write_arriving): the kernel sends the
    requests in that order, and without the writeback cache it keeps what the read
    returns in its page cache (checked while chasing fsx's stale reads with two
    processes on one file, DESIGN 4.3; fails on the code before it for stored
    and inline files)."""
    fh, ino = await open_new(fs, b"f")
    old = pattern(1, 300 if state == "inline" else 3 * MiB)
    await fs.write(fh, 0, old)
    if state != "buffered":
        await fs.flush(fh)
    assert (await fs.getattr(ino)).size == len(old)
    new = pattern(2, 5000)
    got: list[bytes] = []
    # The write parks on the file's lock; the read arrives after it.
    async with trio.open_nursery() as nursery, fs.data.lock(ino):
        nursery.start_soon(fs.write, fh, 100, new)
        await trio.testing.wait_all_tasks_blocked()

        async def reader() -> None:
            got.append(bytes(await fs.read(fh, 0, 8192)))

        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        assert not got  # waits for the write that arrived first
    want = bytearray(old[:8192])
    want[100:5100] = new
    assert got == [bytes(want)]
    await fs.release(fh)


async def test_pending_bytes_counts_what_is_buffered_or_in_flight(tmp_path: Path) -> None:
    """The space check's count (`FileWrites.pending_bytes`, O(1)) follows every way
    bytes enter and leave the write state: buffered, carved, streamed, flushed,
    inlined, truncated, deleted."""
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        w = fs.data.writes
        fh, attr = await fs.create(ROOT_INO, b"f", 0o100644, os.O_RDWR, CTX)
        await fs.write(fh, 10, b"x" * 5000)
        assert w.pending_bytes() == 10 + 5000  # the buffer starts on the block boundary
        await fs.write(fh, 5010, b"y" * (3 << 20))  # carves whole chunks out of it
        assert w.pending_bytes() == sum(len(b.data) for b in w.buffers.values()) + sum(
            len(c.data) for cs in w.inflight.values() for c in cs)
        await fs.write(fh, 8 << 20, bytes(2 << 20))  # aligned: streamed as it is
        await fs.fsync(fh, False)
        assert w.pending_bytes() == 0
        await fs.write(fh, 1, b"z")
        await fs.setattr(attr.ino, SetAttrRequest(size=0), CTX)
        assert w.pending_bytes() == 0
        await fs.write(fh, 0, b"small")  # small enough to be inlined at release
        await fs.release(fh)
        assert w.pending_bytes() == 0
        fh2, _ = await fs.create(ROOT_INO, b"g", 0o100644, os.O_RDWR, CTX)
        await fs.write(fh2, 0, b"q" * 9000)
        await fs.release(fh2)
        await fs.unlink(ROOT_INO, b"g")
        assert w.pending_bytes() == 0
