"""How the journal accounts for the meta area: which meta zones are empty and
the room of the current one (kept by `MetaLog`, no zone report on the trio
thread), when a checkpoint is due (in proportion to the newest one), how large
a checkpoint the namespace will need (device bytes: records are compressed),
and records that fit a meta zone whatever its size.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from pathlib import Path

import pytest
import trio
from crashlib import TEST_DISK_VERSION
from engine_helpers import (
    CTX,
    TEST_OPTIONS,
    CountingDevice,
    Geometry,
    KiB,
    MiB,
    create_files,
    mounted,
    new_image,
    pattern,
    read_file,
    write_file,
)

from zonefs_py import errors
from zonefs_py.device.base import Zone, ZoneCond
from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.format.constants import RecordType
from zonefs_py.fs.api import ROOT_INO
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.fs.options import FsOptions
from zonefs_py.journal.journal import Journal
from zonefs_py.journal.log import MetaLog

#: Format 4's meta-area rules (rotating whole-namespace checkpoints, compressed); format 5's:
#: test_nsindex.py, test_meta_room.py.
FORMAT4_ONLY = pytest.mark.skipif(TEST_DISK_VERSION != 4, reason="format 4's meta-area rules")

#: 64 KiB zones, 8 meta zones: a few dozen commits roll a meta zone.
ROLLING = Geometry(size_bytes=8 * MiB, zone_size_bytes=64 * KiB, meta_zones=8)
#: 4 meta zones of 128 KiB: a checkpoint of at most ~105 KiB on the device.
SMALL_META = Geometry(size_bytes=16 * MiB, zone_size_bytes=128 * KiB, meta_zones=4)


class ReportCountingDevice(CountingDevice):
    """Count zone reports, per calling thread."""

    def __init__(self, dev: EmulatedZonedDevice) -> None:
        super().__init__(dev)
        self.reports: Counter[int] = Counter()

    def report_zones(self, first_zone: int = 0, count: int | None = None) -> list[Zone]:
        self.reports[threading.get_ident()] += 1
        return super().report_zones(first_zone, count)


def device_free_zones(mlog: MetaLog) -> list[int]:
    """`MetaLog.free_zones` as it was computed before: from a zone report."""
    report = mlog.dev.report_zones(mlog.zones[0], len(mlog.zones))
    return [z.index for z in report
            if z.cond == ZoneCond.EMPTY and z.index not in mlog.zone_first_seq]


def assert_log_matches_device(mlog: MetaLog) -> None:
    assert mlog.free_zones() == device_free_zones(mlog)
    assert mlog.free_zone_count() == len(device_free_zones(mlog))
    if mlog.cur_zone is not None:
        zone = mlog.dev.report_zones(mlog.cur_zone, 1)[0]
        assert mlog.room_in_current_zone() == zone.remaining_bytes


async def commit_files(fs: ZoneFS, prefix: str, count: int, size: int = 300) -> None:
    for i in range(count):
        await write_file(fs, f"/{prefix}{i}", pattern(i, size), fsync=True)


# -- 1. meta-zone accounting without the device --------------------------------------

async def test_meta_zone_accounting_asks_the_device_nothing(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    new_image(image, ROLLING)
    dev = ReportCountingDevice(EmulatedZonedDevice.open(image))
    trio_thread = threading.get_ident()
    try:
        async with ZoneFS.mount(dev, TEST_OPTIONS) as fs:
            j = fs.journal
            zones_started = len(j.log.zone_first_seq)
            dev.reports.clear()
            for round_ in range(3):
                await commit_files(fs, f"r{round_}-", 40)
                await fs.checkpoint()
            assert dev.reports[trio_thread] == 0, "a zone report ran on the trio thread"
            assert dev.reports, "the workload never reported zones at all"
            # (format 5 may checkpoint more often in these tiny zones: `_meta_short`)
            assert j.checkpoints_written >= 3
            assert len(j.log.zone_first_seq) + len(j.log.free_zones()) > zones_started
            # The figures the commit path and the status ask for: memory only.
            dev.reports.clear()
            for pending in (False, True):
                if pending:
                    await write_file(fs, "/pending", pattern(9, 4000), fsync=False)
                j.checkpoint_needed(j.journal_limit)
                j._meta_short()
                j._last_meta_zones_at_stake()
                j.log.free_zone_count()
                j.log.room_in_current_zone()
                j.estimated_checkpoint_bytes(fs.state.inode_count)
                await fs.statfs()
            assert sum(dev.reports.values()) == 0
    finally:
        dev.close()


@pytest.mark.expect_log(
    "zonefs_py.journal.journal", "ERROR",
    "checkpoint write failed: .*power cut")
async def test_cached_meta_zones_equal_the_zone_report(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """After commits, zone rolls, checkpoints, and the mount-time repairs (a
    lost superblock write, a torn checkpoint), the log's own view of its zones
    is what a zone report says."""
    image = tmp_path / "fs.img"
    async with mounted(image, geo=ROLLING, create=True) as fs:
        mlog = fs.journal.log
        assert_log_matches_device(mlog)
        for round_ in range(4):
            for i in range(15):
                await write_file(fs, f"/a{round_}-{i}", pattern(i, 500), fsync=True)
                assert_log_matches_device(mlog)
            await fs.checkpoint()
            assert_log_matches_device(mlog)
        assert fs.journal.checkpoints_written >= 4  # format 5: maybe more (`_meta_short`)
    # A checkpoint whose superblock write and zone resets are lost: the next
    # mount completes them (fs/after_recovery.py).
    dev = EmulatedZonedDevice.open(image)
    try:
        async with ZoneFS.mount(dev, TEST_OPTIONS, close=False) as fs:
            with monkeypatch.context() as mp:
                mp.setattr(fs.journal.sbstore, "write", lambda sb: None)
                mp.setattr(fs.journal.log, "reset_zones", lambda zones: None)
                await commit_files(fs, "b", 10)
                await fs.journal.checkpoint()
            await trio.to_thread.run_sync(dev.flush)
    finally:
        dev.close()
    dev = EmulatedZonedDevice.open(image)
    try:
        async with ZoneFS.mount(dev, TEST_OPTIONS, close=False) as fs:
            rec = fs.recovered
            assert rec.newest_checkpoint is not None
            assert rec.newest_checkpoint.offset != rec.sb.checkpoint_offset
            assert len(rec.scan.chain_zones) > len(fs.journal.log.zone_first_seq)  # reset
            assert_log_matches_device(fs.journal.log)
            # A checkpoint torn at its END (the journal breaks; the "crash" follows).
            await commit_files(fs, "c", 5)
            real_append = fs.journal.log.append

            def append(records: list[tuple[RecordType, bytes]], **kw: bool) -> object:
                if any(rtype == RecordType.CHECKPOINT_END for rtype, _ in records):
                    raise OSError(5, "power cut")
                return real_append(records, **kw)

            with monkeypatch.context() as mp:
                mp.setattr(fs.journal.log, "append", append)
                with pytest.raises(errors.IOFailure):
                    await fs.journal.checkpoint()
            await trio.to_thread.run_sync(dev.flush)
    finally:
        dev.close()
    async with mounted(image) as fs:
        assert fs.recovered.torn_checkpoint is not None
        assert_log_matches_device(fs.journal.log)
        assert await read_file(fs, "/c4") == pattern(4, 300)
        await commit_files(fs, "d", 5)
        assert_log_matches_device(fs.journal.log)


class FailingDevice(CountingDevice):
    """Fail resets of, or appends to, chosen zones."""

    def __init__(self, dev: EmulatedZonedDevice) -> None:
        super().__init__(dev)
        self.fail_reset: set[int] = set()
        self.fail_append = False

    def reset_zone(self, zone_idx: int) -> None:
        if zone_idx in self.fail_reset:
            raise OSError(5, "reset failed")
        super().reset_zone(zone_idx)

    def append(self, zone_idx: int, data: bytes | bytearray | memoryview) -> int:
        if self.fail_append:
            raise OSError(5, "append failed")
        return super().append(zone_idx, data)


def test_failed_reset_and_append_leave_the_figures_on_the_safe_side(tmp_path: Path) -> None:
    emu = EmulatedZonedDevice.create(tmp_path / "log.img", size_bytes=16 * 64 * KiB,
                                     zone_size_bytes=64 * KiB)
    dev = FailingDevice(emu)
    try:
        mlog = MetaLog(dev, 2, 4, b"u" * 16, 7)  # type: ignore[arg-type]
        payload = [(RecordType.JOURNAL, bytes([i + 1]) * 100) for i in range(12)]
        for _ in range(3):
            mlog.append(payload)
        assert mlog.free_zones() == [5]
        dev.fail_reset = {3}
        with pytest.raises(OSError):
            mlog.reset_zones([2, 3])
        # Zone 2 was reset, zone 3 is still written: it is not free.
        assert mlog.free_zones() == [2, 5] == device_free_zones(mlog)
        assert mlog.room_in_current_zone() > 0
        dev.fail_append = True
        with pytest.raises(OSError):
            mlog.append(payload[:1])
        assert mlog.room_in_current_zone() == 0
    finally:
        dev.close()


# -- 3. the checkpoint trigger ---------------------------------------------------------

@FORMAT4_ONLY
async def test_checkpoint_is_due_after_as_much_journal_as_the_last_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    image = tmp_path / "fs.img"
    limit = 8 * KiB
    options = FsOptions(commit_interval_s=3600.0, checkpoint_journal_bytes=limit)
    geo = Geometry(size_bytes=64 * MiB, zone_size_bytes=1 * MiB, meta_zones=12)
    async with mounted(image, geo=geo, create=True, options=options) as fs:
        j = fs.journal
        assert j.journal_limit == limit
        d = await fs.mkdir(ROOT_INO, b"d", 0o755, CTX)
        assert await create_files(fs, d.ino, b"f", 3000, b"x" * 100) == 3000
        await fs.checkpoint()
        cp = j.last_checkpoint_disk_bytes
        assert cp > 4 * limit, "the test needs a checkpoint much larger than the limit"
        assert j.journal_bytes_since_checkpoint == 0
        # Commits go on; the background task would be asked for the checkpoint.
        requested: list[int] = []
        j.request_checkpoint = lambda: requested.append(j.journal_bytes_since_checkpoint)
        seen_between = False
        n = 0
        while j.journal_bytes_since_checkpoint < cp:
            assert not j.checkpoint_needed(limit), j.journal_bytes_since_checkpoint
            seen_between |= j.journal_bytes_since_checkpoint >= limit
            await write_file(fs, f"/w{n}", pattern(n, 200), fsync=True)
            n += 1
        assert seen_between, "no commit landed between the limit and the checkpoint size"
        assert j.checkpoint_needed(limit)
        assert j.checkpoints_written == 1
        assert not requested, "a checkpoint was asked for before the journal reached its size"
        await write_file(fs, "/last", b"z" * 200, fsync=True)
        assert requested, "the commit past the checkpoint size did not ask for one"
        await fs.checkpoint()
        # The limit stays the floor: a small checkpoint waits for `limit` of journal.
        j.last_checkpoint_disk_bytes = limit // 4
        j.journal_bytes_since_checkpoint = limit - 1
        assert not j.checkpoint_needed(limit)
        j.journal_bytes_since_checkpoint = limit
        assert j.checkpoint_needed(limit)
        # Meta zones running short ask for one earlier, whatever the journal.
        j.last_checkpoint_disk_bytes = cp
        j.journal_bytes_since_checkpoint = 1
        assert not j.checkpoint_needed(limit)
        monkeypatch.setattr(j.log, "free_zone_count", lambda: 2)
        assert j.checkpoint_needed(limit)
        j.journal_bytes_since_checkpoint = 0
        assert not j.checkpoint_needed(limit)  # nothing to checkpoint


async def test_meta_short_counts_zones_in_device_bytes(tmp_path: Path) -> None:
    """The reserve `_meta_short` keeps is two checkpoints as stored, plus three
    zones: at 1 MiB zones, a 2.5 MiB checkpoint needs 5 + 3 free zones."""
    geo = Geometry(size_bytes=64 * MiB, zone_size_bytes=1 * MiB, meta_zones=12)
    async with mounted(tmp_path / "fs.img", geo=geo, create=True) as fs:
        j: Journal = fs.journal
        lender = j.zone_lender
        j.zone_lender = None  # the meta zones alone (format 6 adds lendable data zones)
        j.last_checkpoint_disk_bytes = 5 * MiB // 2
        j.last_checkpoint_bytes = 50 * MiB  # inflated: no longer what counts
        free = j.log.free_zone_count()
        assert free >= 8
        assert not j._meta_short()
        j.last_checkpoint_disk_bytes = (free - 2) * MiB
        assert j._meta_short()
        if lender is not None and lender.lendable_zones() >= 4:
            j.zone_lender = lender  # data zones the index may borrow count as room
            assert not j._meta_short()


@FORMAT4_ONLY
async def test_a_fill_rewrites_the_metadata_a_bounded_number_of_times(tmp_path: Path) -> None:
    """With a fixed 16 KiB trigger a growing namespace is checkpointed over and
    over (metadata writes grow with the square of the files); with the trigger
    in proportion, checkpoints take at most about as many bytes as the journal."""
    options = FsOptions(commit_interval_s=3600.0, checkpoint_journal_bytes=16 * KiB)
    geo = Geometry(size_bytes=64 * MiB, zone_size_bytes=1 * MiB, meta_zones=12)
    async with mounted(tmp_path / "fs.img", geo=geo, create=True, options=options) as fs:
        j = fs.journal
        sizes: list[int] = []
        real_write = j._write_checkpoint

        async def write_checkpoint() -> None:
            await real_write()
            sizes.append(j.last_checkpoint_disk_bytes)

        j._write_checkpoint = write_checkpoint  # type: ignore[method-assign]
        log_bytes = j.log.bytes_written
        for batch in range(60):
            for i in range(50):
                await write_file(fs, f"/b{batch}-{i}", pattern(i, 120), fsync=False)
            await fs.sync()
        journal_bytes = j.log.bytes_written - log_bytes - sum(sizes)
        print(f"{len(sizes)} checkpoints: {sum(sizes)} bytes, the last {sizes[-1]}; "
              f"journal {journal_bytes} bytes")
        # (A checkpoint every 16 KiB of journal: 20 of them, 2.6x the journal's
        # bytes, and the ratio grows with the namespace.)
        assert 2 <= len(sizes) <= 15
        assert sum(sizes) <= 2 * journal_bytes


# -- 4. the bound on files -------------------------------------------------------------

@FORMAT4_ONLY
@pytest.mark.expect_log("zonefs_py.fs.namespace", "WARNING", "the metadata area is full")
async def test_file_bound_uses_device_bytes_and_holds(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, geo=SMALL_META, create=True) as fs:
        j = fs.journal
        d = await fs.mkdir(ROOT_INO, b"d", 0o755, CTX)
        assert await create_files(fs, d.ino, b"early-", 1000) == 1000
        await fs.checkpoint()
        inodes = fs.state.inode_count
        budget = j.checkpoint_budget_bytes()
        # The bound as it was: the checkpoint's bytes before compression.
        per_inode_inflated = j.last_checkpoint_bytes // inodes
        old_room = (budget - j.last_checkpoint_bytes) // per_inode_inflated
        st = await fs.statfs()
        assert st.total_inodes == inodes + j.inodes_room(inodes)
        print(f"df -i: {st.total_inodes} files (was {inodes + old_room}); checkpoint "
              f"{j.last_checkpoint_disk_bytes} bytes on the device, "
              f"{j.last_checkpoint_bytes} inflated")
        assert j.last_checkpoint_disk_bytes * 3 < j.last_checkpoint_bytes
        assert st.total_inodes > 2 * (inodes + old_room)
        promised = st.total_inodes
        # It holds: the namespace really grows that far, and ENOSPC comes only
        # once a checkpoint fills most of the budget.
        more = await create_files(fs, d.ino, b"late-", 100_000)
        assert inodes + more >= promised
        assert (await fs.statfs()).free_inodes == 0
        await fs.checkpoint()
        zone = SMALL_META.zone_size_bytes
        rotatable = (len(j.log.zones) - 2) // 2 * zone
        assert 0.75 * budget <= j.last_checkpoint_disk_bytes <= rotatable
        assert fs.failsafe is None
        assert j.broken is None
        # Still writable: deletes make room again, once a checkpoint measured it
        # (in device blocks: a few files' worth of compressed ops may free none).
        for i in range(500):
            await fs.unlink(d.ino, b"late-%06d" % i)
        await fs.checkpoint()
        await write_file(fs, "/after", pattern(1, 3000))
    async with mounted(image) as fs:
        assert fs.state.inode_count == inodes + more - 500 + 1
        assert await read_file(fs, "/after") == pattern(1, 3000)


@FORMAT4_ONLY
@pytest.mark.expect_log("zonefs_py.fs.namespace", "WARNING", "the metadata area is full")
@pytest.mark.parametrize("late", ["inline-500", "inline-2000", "name-255"])
async def test_files_that_do_not_compress_after_files_that_do(tmp_path: Path,
                                                             late: str) -> None:
    """The bytes per inode of a namespace of empty files are a few dozen on the
    device; files of random inline bytes, or with random 255-byte names, that
    follow cost ten times that and more. Counting them by the average ran the
    log out of meta zones (LogFull, read-only) or made checkpoints larger than
    the area rotates; their payloads count as they are."""
    image = tmp_path / "fs.img"
    kind, size = late.split("-")
    rng = random.Random(late)
    alphabet = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    options = FsOptions(commit_interval_s=3600.0, inline_max_bytes=2048)
    async with mounted(image, geo=SMALL_META, create=True, options=options) as fs:
        j = fs.journal
        d = await fs.mkdir(ROOT_INO, b"d", 0o755, CTX)
        assert await create_files(fs, d.ino, b"empty-", 5000) == 5000
        rotatable = (len(j.log.zones) - 2) // 2 * SMALL_META.zone_size_bytes
        made = 0
        while True:
            if kind == "inline":
                name, content = b"rand-%04d-" % made, rng.randbytes(int(size))
            else:
                name, content = bytes(rng.choices(alphabet, k=int(size) - 6)), b""
            if not await create_files(fs, d.ino, name, 1, content):
                break
            made += 1
            assert j.last_checkpoint_disk_bytes <= rotatable
        assert made > 0
        await fs.checkpoint()
        assert j.last_checkpoint_disk_bytes <= rotatable
        assert fs.failsafe is None
        assert j.broken is None
    async with mounted(image) as fs:
        assert fs.state.inode_count == 5000 + made + 2


async def test_recovered_checkpoint_size_is_the_size_written(tmp_path: Path) -> None:
    """A mount starts from the figures of the checkpoint it loads: the same
    device bytes (zone tails and headers included: this one spans zones whose
    capacity is below their size) as when it was written. (Format 4: its
    whole-namespace checkpoint spans zones.)"""
    image = tmp_path / "fs.img"
    emu = EmulatedZonedDevice.create(image, size_bytes=8 * MiB, zone_size_bytes=64 * KiB,
                                     zone_capacity_bytes=48 * KiB)
    try:
        from zonefs_py.fs.mkfs import make_filesystem

        make_filesystem(emu, meta_zones=16, disk_version=4)
    finally:
        emu.close()
    rng = random.Random(5)
    async with mounted(image) as fs:
        d = await fs.mkdir(ROOT_INO, b"d", 0o755, CTX)
        for i in range(400):
            await create_files(fs, d.ino, b"f%03d-" % i, 1, rng.randbytes(300))
        await fs.close()  # its checkpoint is the one the next mount loads
        written = (fs.journal.last_checkpoint_bytes, fs.journal.last_checkpoint_disk_bytes)
        first = fs.journal.sb.checkpoint_zone
        assert fs.journal.log.cur_zone != first, "the checkpoint does not span zones"
    async with mounted(image) as fs:
        rec = fs.recovered
        assert (rec.checkpoint_bytes, rec.checkpoint_disk_bytes) == written
        assert fs.journal.last_checkpoint_disk_bytes == written[1]
        assert fs.journal.checkpoint_sample == (written[1], fs.state.inode_count)


# -- records fit the meta zones --------------------------------------------------------

async def test_a_commit_larger_than_a_meta_zone_is_split_into_records_that_fit(
        tmp_path: Path) -> None:
    """150 files of 500 random inline bytes committed at once: ~96 KiB of ops
    that do not compress, in 64 KiB meta zones. Packed into 1 MiB payloads they
    made one 80 KiB record: "does not fit in a meta zone", journal broken."""
    image = tmp_path / "fs.img"
    rng = random.Random(3)
    geo = Geometry(size_bytes=16 * MiB, zone_size_bytes=64 * KiB, meta_zones=32)
    async with mounted(image, geo=geo, create=True) as fs:
        for i in range(150):
            await create_files(fs, ROOT_INO, b"f%03d-" % i, 1, rng.randbytes(500))
        assert fs.journal.checkpoints_written == 0
        assert fs.journal.pending_bytes > geo.zone_size_bytes
        await fs.sync()
        assert fs.journal.broken is None
        await fs.checkpoint()
    async with mounted(image) as fs:
        assert fs.state.inode_count == 151
