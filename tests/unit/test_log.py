"""journal/log.py and journal/sbstore.py on an emulated device (no filesystem on top)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import KiB

from zonefs_py.device.base import ZoneCond
from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.format.constants import RecordType
from zonefs_py.format.superblock import Superblock
from zonefs_py.journal.log import LogCorrupt, LogFull, LogPosition, MetaLog, ScanResult
from zonefs_py.journal.sbstore import SuperblockStore

BS = 4096
ZONE = 64 * KiB  # 16 blocks per zone
UUID = uuid.UUID(int=0x1234).bytes
FS_ID = int.from_bytes(UUID[:4], "little")


@pytest.fixture
def dev(tmp_path: Path) -> Iterator[EmulatedZonedDevice]:
    d = EmulatedZonedDevice.create(tmp_path / "log.img", size_bytes=16 * ZONE,
                                   zone_size_bytes=ZONE)
    yield d
    d.close()


def new_log(dev: EmulatedZonedDevice, zones: int = 4) -> MetaLog:
    return MetaLog(dev, 2, zones, UUID, FS_ID)


def payloads(n: int, size: int = 100) -> list[tuple[RecordType, bytes]]:
    return [(RecordType.JOURNAL, bytes([i % 251 + 1]) * size) for i in range(n)]


def scan_all(mlog: MetaLog, start: LogPosition) -> tuple[list[bytes], ScanResult]:
    fresh = MetaLog(mlog.dev, mlog.zones[0], len(mlog.zones), UUID, FS_ID)
    res = ScanResult()
    got = [rec.payload for rec, _off in fresh.scan(start, res)]
    return got, res


def start_of(mlog: MetaLog) -> LogPosition:
    """Position of the first record after the first zone header."""
    z = mlog.zones[0]
    return LogPosition(z, z * ZONE, 1)


def test_append_then_scan_returns_every_record(dev: EmulatedZonedDevice) -> None:
    mlog = new_log(dev)
    recs = payloads(5)
    pos = mlog.append(recs)
    dev.flush()
    assert [p.seq for p in pos] == [2, 3, 4, 5, 6]  # seq 1 is the zone header
    assert [p.offset for p in pos] == [2 * ZONE + BS * (i + 1) for i in range(5)]
    got, res = scan_all(mlog, start_of(mlog))
    assert got == [p for _, p in recs]
    assert res.last_seq == 6
    assert not res.torn_tail
    assert res.append_zone == 2


def test_log_rolls_across_zones_with_gapless_sequence(dev: EmulatedZonedDevice) -> None:
    mlog = new_log(dev)
    recs = payloads(40)
    for i in range(0, 40, 7):  # batches that straddle zone ends
        mlog.append(recs[i:i + 7])
    dev.flush()
    got, res = scan_all(mlog, start_of(mlog))
    assert got == [p for _, p in recs]
    assert res.chain_zones == [2, 3, 4]
    assert res.last_seq == 40 + 3  # three zone headers
    zones = dev.report_zones(2, 3)
    assert [z.cond for z in zones[:2]] == [ZoneCond.FULL, ZoneCond.FULL]


def test_multi_block_records_straddling_a_zone_end(dev: EmulatedZonedDevice) -> None:
    mlog = new_log(dev)
    import random

    # Incompressible (a compressible JOURNAL payload is stored in fewer blocks).
    recs = [(RecordType.JOURNAL, random.Random(i).randbytes(3 * BS)) for i in range(9)]
    mlog.append(recs)
    dev.flush()
    got, _res = scan_all(mlog, start_of(mlog))
    assert got == [p for _, p in recs]


def test_log_full_when_no_meta_zone_is_left(dev: EmulatedZonedDevice) -> None:
    mlog = new_log(dev, zones=2)
    mlog.append(payloads(30))  # header + 15 records per zone: both zones full
    with pytest.raises(LogFull):
        mlog.append(payloads(1))


def test_torn_tail_is_not_corruption(dev: EmulatedZonedDevice) -> None:
    mlog = new_log(dev)
    pos = mlog.append(payloads(6))
    dev.flush()
    dev.faults.flip_bit_on_read(pos[-1].offset + 40)  # damage the last record only
    got, res = scan_all(mlog, start_of(mlog))
    assert len(got) == 5
    assert res.torn_tail
    assert res.append_zone is None


def test_damage_in_the_middle_is_log_corrupt(dev: EmulatedZonedDevice) -> None:
    mlog = new_log(dev)
    pos = mlog.append(payloads(6))
    dev.flush()
    dev.faults.flip_bit_on_read(pos[2].offset + 40)
    with pytest.raises(LogCorrupt, match="valid records after it"):
        scan_all(mlog, start_of(mlog))


def test_damaged_zone_header_in_the_middle_is_log_corrupt(dev: EmulatedZonedDevice) -> None:
    mlog = new_log(dev)
    for _ in range(3):
        mlog.append(payloads(12))
    dev.flush()
    dev.faults.flip_bit_on_read(3 * ZONE + 40)  # header of the second zone of the chain
    with pytest.raises(LogCorrupt, match="past the end of the log"):
        scan_all(mlog, start_of(mlog))


def test_unflushed_appends_vanish_in_a_power_cut(tmp_path: Path,
                                                 dev: EmulatedZonedDevice) -> None:
    mlog = new_log(dev)
    mlog.append(payloads(3))
    dev.flush()
    mlog.append(payloads(3, size=5000))
    dev.simulate_power_cut("drop")
    dev.close()
    again = EmulatedZonedDevice.open(tmp_path / "log.img")
    try:
        got, res = scan_all(MetaLog(again, 2, 4, UUID, FS_ID), start_of(mlog))
        assert len(got) == 3
        assert res.last_seq == 4
        assert not res.torn_tail
    finally:
        again.close()


def test_reset_zones_and_obsolete_zones(dev: EmulatedZonedDevice) -> None:
    mlog = new_log(dev)
    for _ in range(3):
        mlog.append(payloads(12))
    dev.flush()
    assert mlog.zones_before(mlog.zone_first_seq[4]) == [2, 3]
    # Scanning from the third zone: the earlier zones are obsolete.
    got, res = scan_all(mlog, LogPosition(4, 4 * ZONE, mlog.zone_first_seq[4]))
    assert sorted(res.obsolete_zones) == [2, 3]
    assert res.chain_zones == [4]
    mlog.reset_zones([2, 3])
    assert [z.cond for z in dev.report_zones(2, 2)] == [ZoneCond.EMPTY] * 2
    assert set(mlog.free_zones()) == {2, 3, 5}


# -- superblock store -----------------------------------------------------------------

def _sb(seq: int) -> Superblock:
    return Superblock(fs_uuid=UUID, block_size=BS, zone_size=ZONE, nr_zones=16, sb_zone_a=0,
                      sb_zone_b=1, meta_first_zone=2, meta_zone_count=4, data_first_zone=6,
                      data_zone_count=10, reserve_bytes=0, label=b"", checkpoint_zone=2,
                      checkpoint_offset=2 * ZONE + BS, checkpoint_seq=seq, created_ns=1)


def test_superblock_store_rolls_between_its_two_zones(tmp_path: Path,
                                                      dev: EmulatedZonedDevice) -> None:
    store = SuperblockStore(dev, 0, 1)
    seen_zones = set()
    for i in range(1, 41):  # 16 records per zone: rolls twice
        store.write(_sb(i))
        seen_zones.add(store.current_zone)
        assert SuperblockStore(dev, 0, 1).read_latest() == _sb(i)
    assert seen_zones == {0, 1}
    dev.close()
    again = EmulatedZonedDevice.open(tmp_path / "log.img")
    try:
        assert SuperblockStore(again, 0, 1).read_latest() == _sb(40)
    finally:
        again.close()


def test_torn_superblock_record_is_skipped(dev: EmulatedZonedDevice) -> None:
    store = SuperblockStore(dev, 0, 1)
    for i in range(1, 4):
        store.write(_sb(i))
    dev.faults.flip_bit_on_read(2 * BS + 50)  # the newest record
    assert SuperblockStore(dev, 0, 1).read_latest() == _sb(2)


def test_superblock_in_the_other_zone_survives_a_damaged_zone(dev: EmulatedZonedDevice) -> None:
    store = SuperblockStore(dev, 0, 1)
    for i in range(1, 18):  # 16 in zone 0, the 17th in zone 1
        store.write(_sb(i))
    assert store.current_zone == 1
    dev.faults.flip_bit_on_read(ZONE + 50)
    assert SuperblockStore(dev, 0, 1).read_latest() == _sb(16)


def test_no_superblock_on_an_empty_device(dev: EmulatedZonedDevice) -> None:
    assert SuperblockStore(dev, 0, 1).read_latest() is None


@pytest.mark.parametrize("seed", range(12))
def test_a_tear_across_a_zone_roll_leaves_no_gap(tmp_path: Path, seed: int) -> None:
    """Records spilling from one meta zone into the next, not flushed, then a
    power cut that keeps a random prefix of each zone's appends: the log must
    read as a (maybe shorter) gapless chain, never as damage in the middle
    (the roll flushes the zone it leaves)."""
    import random

    d = EmulatedZonedDevice.create(tmp_path / "roll.img", size_bytes=16 * ZONE,
                                   zone_size_bytes=ZONE, volatile_cache=True)
    mlog = new_log(d)
    mlog.append(payloads(2))
    d.flush()
    start = start_of(mlog)
    mlog.append(payloads(14, size=3000))  # a block each: past the first zone's end
    assert len(mlog.zone_first_seq) == 2
    d.simulate_power_cut("tear", rng=random.Random(seed))
    d.close()
    again = EmulatedZonedDevice.open(tmp_path / "roll.img")
    try:
        got, res = scan_all(MetaLog(again, 2, 4, UUID, FS_ID), start)  # no LogCorrupt
        assert len(got) >= 2
        assert res.last_seq == len(got) + len(res.chain_zones)
    finally:
        again.close()
