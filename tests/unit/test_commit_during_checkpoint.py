"""Commits do not wait for a checkpoint (issue 15, item 3), and the format change
that allows it (DISK_VERSION 3: journal records inside a checkpoint).

The crash sweeps (`test_crash.py`, scenarios `commits_inside_checkpoint` and
`fsync_during_checkpoint`) cut power at every write of such a checkpoint; these
tests pin down the order of records and the version conversion.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import trio
from crashlib import TEST_DISK_VERSION
from engine_helpers import (
    CTX,
    TEST_OPTIONS,
    Geometry,
    fsck,
    mounted,
    pattern,
    read_file,
    write_file,
)

from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.format.constants import DISK_VERSION, RecordType
from zonefs_py.fs.api import ROOT_INO
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.journal import journal as journal_mod
from zonefs_py.journal.log import ScanResult
from zonefs_py.journal.recovery import Recovered, read_superblock

#: Tests of format 4's checkpoint data records and of the conversion to format 4.
FORMAT4_ONLY = pytest.mark.skipif(
    TEST_DISK_VERSION != 4, reason="format 4's whole-namespace checkpoints "
    "(format 5: tests/unit/test_nsindex.py)")


def slow_checkpoint_data(mp: object, fs: ZoneFS, delay_s: float,
                         appended: list[RecordType] | None = None) -> trio.Event:
    """Make every CHECKPOINT_DATA append of `fs`'s log take `delay_s` (in the
    journal's worker thread), record the types appended in `appended`, and
    return an event set once the first data record is written."""
    mlog = fs.journal.log
    real_append = mlog.append
    data_written = trio.Event()

    def append(records: list[tuple[RecordType, bytes]], **kw: bool) -> object:
        data = records[0][0] == RecordType.CHECKPOINT_DATA
        if data:
            time.sleep(delay_s)
        if appended is not None:
            appended.extend(t for t, _ in records)
        result = real_append(records, **kw)
        if data and not data_written.is_set():
            trio.from_thread.run_sync(data_written.set)
        return result

    mp.setattr(mlog, "append", append)  # type: ignore[attr-defined]
    return data_written


@FORMAT4_ONLY
async def test_fsync_returns_while_a_checkpoint_is_being_written(
        tmp_path: Path, monkeypatch: object) -> None:
    image = tmp_path / "fs.img"
    appended: list[RecordType] = []
    async with mounted(image, create=True) as fs:
        for i in range(300):
            fh, _ = await fs.create(ROOT_INO, b"f%04d" % i, 0o644, 0, CTX)
            await fs.release(fh)
        await fs.sync()
        # Many small CHECKPOINT_DATA records, each its own hold of the log and
        # each slow, so that the checkpoint takes a while to write.
        mp = monkeypatch
        mp.setattr(journal_mod, "RECORD_PAYLOAD_TARGET", 1024)  # type: ignore[attr-defined]
        mp.setattr(journal_mod, "CHECKPOINT_WRITE_BYTES", 1)  # type: ignore[attr-defined]
        # A slow device: each data record takes 50 ms, so the fsyncs below land
        # between them.
        data_written = slow_checkpoint_data(mp, fs, 0.05, appended)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fs.journal.checkpoint)
            await data_written.wait()
            await write_file(fs, "/late", pattern(7, 5000), fsync=True)
            assert fs.journal.checkpoint_running, "the fsync waited for the whole checkpoint"
            await write_file(fs, "/small", b"inline bytes", fsync=True)
            assert fs.journal.checkpoint_running
        assert fs.journal.checkpoints_written == 1
    # The log order: the commits sit between the checkpoint's data records.
    begin = appended.index(RecordType.CHECKPOINT_BEGIN)
    end = appended.index(RecordType.CHECKPOINT_END)
    inside = appended[begin:end]
    first_data = inside.index(RecordType.CHECKPOINT_DATA)
    assert RecordType.JOURNAL in inside[first_data:], appended
    assert inside.count(RecordType.CHECKPOINT_DATA) > 10
    async with mounted(image) as fs:
        assert await read_file(fs, "/late") == pattern(7, 5000)
        assert await read_file(fs, "/small") == b"inline bytes"
        assert fs.state.inode_count == 303


@FORMAT4_ONLY
async def test_commits_inside_a_checkpoint_survive_a_lost_superblock_write(
        tmp_path: Path, monkeypatch: object) -> None:
    """A crash after END but before the superblock write: recovery starts at the
    older checkpoint, loads the newer one it meets, then applies the commits
    found inside it (and the mount completes the superblock step)."""
    image = tmp_path / "fs.img"
    # Meta zones are never reset here (the "crash" takes the resets) and each
    # record of this checkpoint is written alone: with the commits landing
    # between them, the default geometry's 4 meta zones could fill (LogFull,
    # seen on a loaded machine); 8 leave room.
    async with mounted(image, geo=Geometry(meta_zones=8), create=True) as fs:
        for i in range(50):
            await write_file(fs, f"/a{i}", pattern(i, 100), fsync=False)
        await fs.sync()
    mp = monkeypatch
    mp.setattr(journal_mod, "RECORD_PAYLOAD_TARGET", 512)  # type: ignore[attr-defined]
    mp.setattr(journal_mod, "CHECKPOINT_WRITE_BYTES", 1)  # type: ignore[attr-defined]
    dev = EmulatedZonedDevice.open(image)
    try:
        async with ZoneFS.mount(dev, TEST_OPTIONS, close=False) as fs:
            before = read_superblock(dev)[0].checkpoint_offset
            # The crash takes the superblock write and everything after it.
            mp.setattr(fs.journal.sbstore, "write", lambda sb: None)  # type: ignore[attr-defined]
            mp.setattr(fs.journal.log, "reset_zones", lambda zones: None)  # type: ignore[attr-defined]
            # 10 ms a data record, so that the commits below land inside the
            # checkpoint however fast or loaded the machine is.
            data_written = slow_checkpoint_data(mp, fs, 0.01)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fs.journal.checkpoint)
                await data_written.wait()
                for i in range(5):
                    await write_file(fs, f"/b{i}", pattern(100 + i, 3000), fsync=True)
                    await fs.unlink(ROOT_INO, b"a%d" % i)
                    await fs.sync()
            # No clean unmount: the "crash" is here, with everything flushed.
            await trio.to_thread.run_sync(dev.flush)
    finally:
        dev.close()
    mp.undo()  # type: ignore[attr-defined]
    dev = EmulatedZonedDevice.open(image)
    try:
        assert read_superblock(dev)[0].checkpoint_offset == before
        async with ZoneFS.mount(dev, TEST_OPTIONS) as fs:
            rec = fs.recovered
            assert rec.newest_checkpoint is not None
            assert rec.newest_checkpoint.offset != before
            assert _journal_inside_newest_checkpoint(rec), "no commit landed inside it"
            for i in range(5):
                assert await read_file(fs, f"/b{i}") == pattern(100 + i, 3000)
            names = {n for n in fs.state.inodes[ROOT_INO].entries or {}}
            assert not {b"a%d" % i for i in range(5)} & names
            assert {b"a%d" % i for i in range(5, 50)} <= names
    finally:
        dev.close()
    assert fsck(image).clean


def _journal_inside_newest_checkpoint(rec: Recovered) -> bool:
    """True when a JOURNAL record lies between CHECKPOINT_DATA records of the
    newest complete checkpoint of the recovered log."""
    cp = rec.newest_checkpoint
    assert cp is not None
    types: list[RecordType] = []
    for r, _off in rec.log.scan(cp, ScanResult()):
        types.append(r.type)
        if r.type == RecordType.CHECKPOINT_END:
            break
    data = [i for i, t in enumerate(types) if t == RecordType.CHECKPOINT_DATA]
    return RecordType.JOURNAL in types[data[0]:data[-1]]


@FORMAT4_ONLY
async def test_version_2_image_is_converted_by_its_first_read_write_mount(
        tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True) as fs:
        await write_file(fs, "/old", pattern(1, 300))
    dev = EmulatedZonedDevice.open(image)
    try:
        sb, store = read_superblock(dev)
        store.write(dataclasses.replace(sb, disk_version=2))
        dev.flush()
        assert read_superblock(dev)[0].disk_version == 2
    finally:
        dev.close()
    assert fsck(image).clean  # a version 2 image is read as it is
    read_only = dataclasses.replace(TEST_OPTIONS, read_only=True)
    async with mounted(image, options=read_only, fsck_after=False) as fs:
        assert await read_file(fs, "/old") == pattern(1, 300)
    dev = EmulatedZonedDevice.open(image)
    try:
        assert read_superblock(dev)[0].disk_version == 2  # a read-only mount writes nothing
    finally:
        dev.close()
    async with mounted(image) as fs:
        assert fs.journal.sb.disk_version == DISK_VERSION
        assert await read_file(fs, "/old") == pattern(1, 300)
    dev = EmulatedZonedDevice.open(image)
    try:
        assert read_superblock(dev)[0].disk_version == DISK_VERSION == 4
    finally:
        dev.close()
