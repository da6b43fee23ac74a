"""Device faults under the engine (in-process ZoneFS on the emulator's fault hooks).

A mount cannot reach the hooks of its daemon's emulator, so these run the
engine directly, as the FUSE adapter would call it (IOFailure is EIO there).
Each test: the affected operation fails with IOFailure (EIO) or succeeds
elsewhere; data in other zones stays readable; nothing returns wrong bytes;
after a clean close (or a crash) fsck is clean apart from the reported loss.
"""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from cstream_model import ModelStreams, create_armed
from helpers import CTX, OPTIONS, KiB, MiB, fsck_findings, new_image, read_file, write_file

from zonefs_py import errors
from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.fs.api import ROOT_INO
from zonefs_py.fs.filesystem import ZoneFS

ZONE = 2 * MiB


def data(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


@asynccontextmanager
async def engine(path: Path) -> AsyncIterator[tuple[ZoneFS, EmulatedZonedDevice]]:
    dev = EmulatedZonedDevice.open(path)
    try:
        async with ZoneFS.mount(dev, OPTIONS) as fs:
            yield fs, dev
    finally:
        dev.close()


def zones_of(fs: ZoneFS, ino: int) -> set[int]:
    inode = fs.state.inodes[ino]
    assert inode.extents is not None
    return {e.dev // ZONE for e in inode.extents}


def first_block_offset(fs: ZoneFS, ino: int) -> int:
    inode = fs.state.inodes[ino]
    assert inode.extents is not None
    return min(e.dev for e in inode.extents)


@pytest.fixture
def image(tmp_path: Path) -> Path:
    path = tmp_path / "dev.img"
    new_image(path)
    return path


@pytest.mark.expect_log(
    "zonefs_py.alloc.allocator", "ERROR",
    "stopped taking writes after a write error")
@pytest.mark.expect_log("zonefs_py.fs.data.writepipe", "ERROR", "injected write error")
async def test_write_error_moves_the_writer_to_another_zone(image: Path) -> None:
    a1, a2, b = data(1, 300 * KiB), data(2, 300 * KiB), data(3, 200 * KiB)
    async with engine(image) as (fs, dev):
        ino_b = await write_file(fs, b"b.log", b)
        ino = await write_file(fs, b"a.log", a1)
        (zone,) = zones_of(fs, ino)
        dev.faults.fail_writes(zone)  # the zone fails every write from now on
        fh = await fs.open(ino, os.O_WRONLY)
        try:
            await fs.write(fh, len(a1), a2)
            await fs.fsync(fh, False)  # retried in another zone: acknowledged
        finally:
            await fs.release(fh)
        assert zones_of(fs, ino) - {zone}, "the writer stayed on the failing zone"
        assert await read_file(fs, b"a.log") == a1 + a2
        assert await read_file(fs, b"b.log") == b
        assert ino_b in fs.state.inodes
        dev.faults.clear()
    assert fsck_findings(image) == []
    async with engine(image) as (fs, _dev):
        assert await read_file(fs, b"a.log") == a1 + a2


@pytest.mark.expect_log(
    "zonefs_py.alloc.allocator", "ERROR",
    "stopped taking writes after a write error")
@pytest.mark.expect_log("zonefs_py.fs.data.writepipe", "ERROR", "injected write error")
@pytest.mark.parametrize("failing", ["first", "second"])
async def test_write_error_in_either_piece_of_a_straddling_chunk(image: Path,
                                                                 failing: str) -> None:
    """A chunk crossing the end of a zone's data room is two pieces, both reserved
    before either is appended: whichever fails, its bytes go to another zone and
    the other piece stays where it landed."""
    async with engine(image) as (fs, dev):
        room = fs.alloc.zones[fs.sb.data_first_zone].capacity
        head, tail = data(20, room - 64 * KiB), data(21, MiB)
        fh, attr = await fs.create(ROOT_INO, b"ckpt.pt", 0o644, os.O_WRONLY, CTX)
        try:
            await fs.write(fh, 0, head)
            await fs.fsync(fh, False)
            (zone,) = zones_of(fs, attr.ino)
            assert fs.alloc.zones[zone].remaining == 64 * KiB
            if failing == "first":
                dev.faults.fail_writes(zone, times=1)
            else:  # the zone the allocator opens next
                nxt = min(fs.alloc.empty_zones(), key=lambda z: (z.resets, z.idx)).idx
                dev.faults.fail_writes(nxt, times=1)
            await fs.write(fh, len(head), tail)
            await fs.fsync(fh, False)  # retried elsewhere: acknowledged
        finally:
            await fs.release(fh)
        assert not dev.faults.io_armed  # the armed write failed (and only once)
        assert await read_file(fs, b"ckpt.pt") == head + tail
        dev.faults.clear()
    assert fsck_findings(image) == []
    async with engine(image) as (fs, _dev):
        assert await read_file(fs, b"ckpt.pt") == head + tail


@pytest.mark.expect_log(
    "zonefs_py.alloc.allocator", "ERROR",
    "stopped taking writes after a write error")
@pytest.mark.expect_log("zonefs_py.fs.data.writepipe", "ERROR", "injected write error")
async def test_every_zone_failing_writes_is_eio_and_consistent(image: Path) -> None:
    keep = data(4, 100 * KiB)
    async with engine(image) as (fs, dev):
        await write_file(fs, b"keep", keep)
        sb = fs.sb
        for z in range(sb.data_first_zone, sb.data_first_zone + sb.data_zone_count):
            dev.faults.fail_writes(z)
        with pytest.raises(errors.IOFailure):
            await write_file(fs, b"doomed", data(5, 256 * KiB))
        assert await read_file(fs, b"keep") == keep
        dev.faults.clear()
    assert fsck_findings(image) == []


async def _armed_file(fs: ZoneFS, name: bytes, first: bytes) -> tuple[int, int, ModelStreams]:
    """A file whose C write stream is armed (ModelStreams: the C side modelled) after
    `first` was written and fsynced through Python; (fh, ino, streams)."""
    streams, fh, ino = await create_armed(fs, name, first, CTX, credit=3 * MiB)
    await fs.fsync(fh, False)
    return fh, ino, streams


@pytest.mark.expect_log(
    "zonefs_py.alloc.allocator", "ERROR",
    "stopped taking writes after a write error")
@pytest.mark.expect_log("zonefs_py.fs.data.writepipe", "ERROR", "injected write error")
async def test_write_error_on_bytes_staged_in_c_moves_them_to_another_zone(
        image: Path) -> None:
    """Issue 44: a record staged by a C write stream whose append fails is written
    again elsewhere like any chunk; the fsync after it is acknowledged."""
    first, staged = data(30, MiB), data(31, 512 * KiB)
    async with engine(image) as (fs, dev):
        fh, ino, streams = await _armed_file(fs, b"ckpt", first)
        try:
            (zone,) = zones_of(fs, ino)
            dev.faults.fail_writes(zone, times=1)
            assert streams.stage(ino, staged)
            await fs.fsync(fh, False)
        finally:
            streams.close()
            await fs.release(fh)
        assert not dev.faults.io_armed  # the armed write failed (and only once)
        assert await read_file(fs, b"ckpt") == first + staged
    assert fsck_findings(image) == []
    async with engine(image) as (fs, _dev):
        assert await read_file(fs, b"ckpt") == first + staged


@pytest.mark.expect_log(
    "zonefs_py.alloc.allocator", "ERROR",
    "stopped taking writes after a write error")
@pytest.mark.expect_log("zonefs_py.fs.data.writepipe", "ERROR", "injected write error")
@pytest.mark.parametrize("reported_by", ["fsync", "close"])
async def test_bytes_staged_in_c_that_cannot_be_written_fail_the_next_fsync_or_close(
        image: Path, reported_by: str) -> None:
    """Issue 44: when no zone takes a record staged by a C write stream (the WRITE
    was answered already), the file's next fsync, or its close (FLUSH), says EIO;
    the fsynced bytes before it and other files stay; fsck is clean."""
    keep, first = data(32, 100 * KiB), data(33, MiB)
    async with engine(image) as (fs, dev):
        await write_file(fs, b"keep", keep)
        fh, ino, streams = await _armed_file(fs, b"ckpt", first)
        try:
            sb = fs.sb
            for z in range(sb.data_first_zone, sb.data_first_zone + sb.data_zone_count):
                dev.faults.fail_writes(z)
            assert streams.stage(ino, data(34, 512 * KiB))
            report = fs.fsync(fh, False) if reported_by == "fsync" else fs.flush(fh)
            with pytest.raises(errors.IOFailure):
                await report
        finally:
            streams.close()
            await fs.release(fh)
        assert await read_file(fs, b"keep") == keep
        dev.faults.clear()
    assert fsck_findings(image) == []
    async with engine(image) as (fs, _dev):
        assert (await read_file(fs, b"ckpt"))[:MiB] == first
        assert await read_file(fs, b"keep") == keep


@pytest.mark.expect_log("zonefs_py.fs.data.zonesums", "ERROR", "injected read error")
@pytest.mark.expect_log("zonefs_py.fs.data.readpath", "ERROR", "injected read error")
async def test_read_error_is_eio_and_other_zones_stay_readable(image: Path) -> None:
    a, b = data(6, 3 * MiB), data(7, 100 * KiB)
    async with engine(image) as (fs, dev):
        ino_a = await write_file(fs, b"big", a)
        await write_file(fs, b"small", b)
        bad_zone = min(zones_of(fs, ino_a))
        dev.faults.fail_reads(bad_zone, times=1)
        with pytest.raises(errors.IOFailure):
            await read_file(fs, b"big")
        assert await read_file(fs, b"small") == b
        assert await read_file(fs, b"big") == a  # the error was transient
    assert fsck_findings(image) == []


@pytest.mark.expect_log("zonefs_py.fs.data.readpath", "ERROR", "checksum mismatch")
async def test_bit_flip_is_eio_never_wrong_bytes(image: Path) -> None:
    a, b = data(8, 64 * KiB), data(9, 64 * KiB)
    async with engine(image) as (fs, dev):
        ino_a = await write_file(fs, b"a", a)
        await write_file(fs, b"b", b)
        dev.faults.flip_bit_on_read(first_block_offset(fs, ino_a) + 1234, bit=3)
        with pytest.raises(errors.IOFailure):
            await read_file(fs, b"a")
        assert await read_file(fs, b"b") == b
        dev.faults.clear()
        assert await read_file(fs, b"a") == a
    assert fsck_findings(image) == []


@pytest.mark.expect_log(
    "zonefs_py.alloc.allocator", "ERROR",
    "stopped taking writes after a write error")
@pytest.mark.expect_log("zonefs_py.fs.data.writepipe", "ERROR", "is READONLY")
async def test_zone_turning_readonly_keeps_data_and_moves_writes(image: Path) -> None:
    a1, a2, b = data(10, 200 * KiB), data(11, 200 * KiB), data(12, 50 * KiB)
    async with engine(image) as (fs, dev):
        ino = await write_file(fs, b"a", a1)
        (zone,) = zones_of(fs, ino)
        dev.faults.set_zone_readonly(zone)
        fh = await fs.open(ino, os.O_WRONLY)
        try:
            await fs.write(fh, len(a1), a2)
            await fs.fsync(fh, False)
        finally:
            await fs.release(fh)
        await write_file(fs, b"b", b)
        assert await read_file(fs, b"a") == a1 + a2  # READONLY zones stay readable
        assert await read_file(fs, b"b") == b
    assert fsck_findings(image) == []
    async with engine(image) as (fs, _dev):
        assert await read_file(fs, b"a") == a1 + a2


@pytest.mark.expect_log("zonefs_py.fs", "ERROR", "OFFLINE zone")
async def test_zone_going_offline_loses_only_its_files(image: Path) -> None:
    lost, kept = data(13, 3 * MiB), data(14, 100 * KiB)
    async with engine(image) as (fs, dev):
        ino_lost = await write_file(fs, b"lost", lost)
        ino_kept = await write_file(fs, b"kept", kept)
        (zone_kept,) = zones_of(fs, ino_kept)
        zone = min(zones_of(fs, ino_lost) - {zone_kept})
        dev.faults.set_zone_offline(zone)
        with pytest.raises(errors.IOFailure):
            await read_file(fs, b"lost")
        assert await read_file(fs, b"kept") == kept
        await write_file(fs, b"new", data(15, 300 * KiB))  # writes go elsewhere
        assert zone not in zones_of(fs, (await fs.lookup(ROOT_INO, b"new")).ino)
    findings = fsck_findings(image)
    # The loss is reported, and only the loss: the lost file's extents in that zone.
    assert findings, "fsck did not report the offline zone's data"
    assert all(f"inode {ino_lost}" in f or f"zone {zone}" in f for f in findings), findings
    async with engine(image) as (fs, _dev):
        assert await read_file(fs, b"kept") == kept
        with pytest.raises(errors.IOFailure):
            await read_file(fs, b"lost")


@pytest.mark.expect_log(
    "zonefs_py.journal.journal", "ERROR",
    "journal write failed: .*injected write error")
@pytest.mark.expect_log("zonefs_py.fs.filesystem", "ERROR", "read-only failsafe")
async def test_journal_write_error_is_eio_then_read_only_and_nothing_acked_is_lost(
        image: Path) -> None:
    """A failed journal write: that fsync is EIO, the mount turns read-only (EROFS), and
    after a crash everything acknowledged before is there."""
    before, after = data(16, 20 * KiB), data(17, 20 * KiB)
    dev = EmulatedZonedDevice.open(image)
    try:
        async with ZoneFS.mount(dev, OPTIONS, close=False) as fs:
            await write_file(fs, b"before", before)
            for z in range(fs.sb.meta_first_zone, fs.sb.meta_first_zone + fs.sb.meta_zone_count):
                dev.faults.fail_writes(z, times=1)
            with pytest.raises(errors.IOFailure):
                await write_file(fs, b"after", after)
            dev.faults.clear()
            with pytest.raises(errors.ReadOnly):
                await write_file(fs, b"later", after)
            assert await read_file(fs, b"before") == before  # reads still served
            dev.simulate_power_cut("drop")
    finally:
        dev.close()
    assert fsck_findings(image) == []
    async with engine(image) as (fs, _dev):
        assert await read_file(fs, b"before") == before
        try:
            got: bytes | None = await read_file(fs, b"after")
        except errors.NotFound:
            got = None
        assert got in (None, b"", after)  # never acknowledged: absent, empty or complete


@pytest.mark.expect_log("zonefs_py", "ERROR", "")
async def test_fault_mix_keeps_fsck_clean(image: Path) -> None:
    """Random transient read/write faults over a workload; every acknowledged file reads back."""
    rng = random.Random(99)
    acked: dict[bytes, bytes] = {}
    eio = 0
    async with engine(image) as (fs, dev):
        sb = fs.sb
        for i in range(60):
            z = rng.randrange(sb.data_first_zone, sb.data_first_zone + sb.data_zone_count)
            if rng.random() < 0.5:
                dev.faults.fail_writes(z, times=rng.randrange(1, 3))
            else:
                dev.faults.fail_reads(z, times=1)
            name = f"f{i % 20}".encode()
            content = data(100 + i, rng.randrange(1, 400) * KiB)
            try:
                if name in acked:
                    await fs.unlink(ROOT_INO, name)
                    del acked[name]
                await write_file(fs, name, content)
                acked[name] = content
            except errors.IOFailure:
                eio += 1
                try:
                    await fs.unlink(ROOT_INO, name)
                except errors.NotFound:
                    pass
        dev.faults.clear()
        for name, content in acked.items():
            assert await read_file(fs, name) == content
    assert fsck_findings(image) == []
    print(f"fault mix: {len(acked)} files acknowledged, {eio} EIO")
