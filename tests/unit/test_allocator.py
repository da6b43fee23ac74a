"""The allocator alone (no device I/O): heads, sharing, finishing and deferred resets.

Built on a synthetic zone report, so each test states exactly which zones are
empty, which are heads and which appends are in flight.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from zonefs_py.alloc.allocator import Allocator
from zonefs_py.device.base import DeviceInfo, Zone, ZoneCond, ZoneType
from zonefs_py.format.constants import Stream
from zonefs_py.format.ops import Op
from zonefs_py.format.zonesum import room_blocks
from zonefs_py.model.state import State

ZONE = 1 << 20
BS = 4096


class FakeJournal:
    """The allocator's view of the journal: a transaction counter and the INV-7 flag."""

    def __init__(self) -> None:
        self.added_txn = 0
        self.data_dirty = False

    def data_appended(self) -> None:
        self.data_dirty = True


def make_alloc(nr_data: int = 8, max_active: int = 0) -> Allocator:
    info = DeviceInfo("test", "emulated", BS, ZONE, nr_data + 1, max_active, max_active, 0)
    zones = [Zone(i, i * ZONE, ZONE, ZONE, i * ZONE, ZoneType.SEQ_WRITE_REQUIRED, ZoneCond.EMPTY)
             for i in range(nr_data + 1)]
    sb = SimpleNamespace(data_first_zone=1, data_count=nr_data, data_zone_count=nr_data,
                         reserve_bytes=0)
    state = State(BS, ZONE)
    alloc = Allocator(info, sb, state, zones, FakeJournal())  # type: ignore[arg-type]
    state.subscribe(zone_emptied=alloc.zone_emptied)
    return alloc


def take_empty(alloc: Allocator, keep: int) -> None:
    """Fill every empty zone but `keep` with dead-but-unreset data (reserved, FULL)."""
    for dz in alloc.empty_zones()[keep:]:
        dz.reserved = dz.capacity


def fill_private_head_then_run_short(alloc: Allocator, ops: list[Op],
                                     finish: list[int]) -> int:
    """File 10 gets a private head and fills most of it, then empty zones run short
    (so file 11 of the same stream will share that head). Returns the zone."""
    zone, _ = alloc.reserve(Stream.CHECKPOINT, 10, 200 * BS, ops, finish)
    alloc.append_done(zone, ok=True)
    take_empty(alloc, keep=alloc.reserve_zones + 1)
    return zone


def test_release_never_finishes_a_zone_another_file_is_appending_to() -> None:
    alloc = make_alloc()
    ops: list[Op] = []
    finish: list[int] = []
    zone_a = fill_private_head_then_run_short(alloc, ops, finish)
    # File 11 of the same stream shares file 10's head, and its append is in flight.
    zone_b, granted = alloc.reserve(Stream.CHECKPOINT, 11, 32 * BS, ops, finish)
    assert zone_b == zone_a
    assert granted == 32 * BS
    # File 10 closes while that append is in flight: the zone must stay writable.
    alloc.release_owner(10, finish)
    assert zone_a not in finish
    alloc.append_done(zone_b, ok=True)
    assert not alloc.zones[zone_a].unusable


def test_idle_headless_zone_is_finished_when_its_token_is_needed() -> None:
    alloc = make_alloc(nr_data=16, max_active=4 + 2)  # a head budget of 2
    ops: list[Op] = []
    finish: list[int] = []
    za, _ = alloc.reserve(Stream.CHECKPOINT, 10, 64 * BS, ops, finish)
    zb, _ = alloc.reserve(Stream.DATASET, 11, 64 * BS, ops, finish)
    alloc.append_done(za, ok=True)
    alloc.append_done(zb, ok=True)
    # A third head exceeds the budget: a private head without appends is finished.
    zc, _ = alloc.reserve(Stream.LOG, 12, 64 * BS, ops, finish)
    assert zc not in (za, zb)
    assert len(finish) == 1
    assert finish[0] in (za, zb)


def test_a_zone_that_dies_twice_waits_for_the_later_death() -> None:
    alloc = make_alloc()
    journal = alloc.journal
    assert isinstance(journal, FakeJournal)
    journal.added_txn = 5
    dz = alloc.zones[3]
    dz.reserved = dz.capacity
    alloc._maybe_dead(3)
    assert alloc.pending_resets == [(3, 5)]
    # Reused (e.g. as a shared head), written, and freed again in transaction 9.
    journal.added_txn = 8
    alloc._maybe_dead(3, after_next_txn=True)
    assert alloc.pending_resets == [(3, 9)]
    assert alloc.take_resettable(durable_txn=5) == []
    assert alloc.take_resettable(durable_txn=9) == [3]


@pytest.mark.expect_log(
    "zonefs_py.alloc.allocator", "ERROR",
    "stopped taking writes after a write error")
def test_a_zone_whose_write_failed_is_reset_once_dead_and_used_again() -> None:
    alloc = make_alloc()
    ops: list[Op] = []
    finish: list[int] = []
    zone, _ = alloc.reserve(Stream.DATASET, 0, 8 * BS, ops, finish)
    alloc.append_done(zone, ok=False)
    dz = alloc.zones[zone]
    assert dz.unusable
    assert dz.remaining == 0
    assert zone not in [z.idx for z in alloc.empty_zones()]
    # Nothing live in it: it is queued for a reset like any dead zone.
    assert alloc.take_resettable(durable_txn=1 << 30) == [zone]
    alloc.zone_was_reset(zone, ops)
    assert not dz.unusable
    assert dz.reserved == 0
    assert dz in alloc.empty_zones()


@pytest.mark.expect_log(
    "zonefs_py.alloc.allocator", "ERROR",
    "stopped taking writes after a write error")
def test_a_zone_that_cannot_be_reset_stays_out_of_use() -> None:
    alloc = make_alloc()
    ops: list[Op] = []
    finish: list[int] = []
    zone, _ = alloc.reserve(Stream.DATASET, 0, 8 * BS, ops, finish)
    alloc.append_done(zone, ok=False)
    assert alloc.take_resettable(durable_txn=1 << 30) == [zone]
    alloc.zone_reset_failed(zone)
    alloc._maybe_dead(zone)
    assert alloc.pending_resets == []
    assert alloc.zones[zone].unusable


def test_a_file_filling_another_files_head_leaves_no_full_head() -> None:
    alloc = make_alloc()
    ops: list[Op] = []
    finish: list[int] = []
    zone_a = fill_private_head_then_run_short(alloc, ops, finish)
    zone_b, _ = alloc.reserve(Stream.CHECKPOINT, 11, 56 * BS, ops, finish)
    assert zone_b == zone_a
    alloc.append_done(zone_b, ok=True)
    assert alloc.zones[zone_a].remaining == 0
    assert alloc.zones[zone_a].head_of is None
    assert zone_a not in alloc.heads.values()


def test_a_zone_being_read_is_not_reset_until_the_read_is_done() -> None:
    alloc = make_alloc()
    dz = alloc.zones[4]
    dz.reserved = dz.capacity
    alloc._maybe_dead(4)
    alloc.pin_read(4)
    alloc.pin_read(4)
    assert alloc.take_resettable(durable_txn=1 << 30) == []
    alloc.unpin_read(4)
    assert alloc.take_resettable(durable_txn=1 << 30) == []
    alloc.unpin_read(4)
    assert alloc.take_resettable(durable_txn=1 << 30) == [4]


@pytest.mark.expect_log(
    "zonefs_py.alloc.allocator", "ERROR",
    "stopped taking writes after a write error")
def test_total_capacity_follows_zones_going_out_of_use_and_back() -> None:
    alloc = make_alloc()
    # What data may fill of a zone: its capacity less the room for its summary.
    DATA_ROOM = ZONE - room_blocks(ZONE // BS, BS) * BS  # noqa: N806

    def brute() -> int:
        return sum(z.capacity for z in alloc.zones.values() if not z.unusable)

    ops: list[Op] = []
    finish: list[int] = []
    assert alloc.total_capacity() == brute() == 8 * DATA_ROOM
    zone, _ = alloc.reserve(Stream.DATASET, 0, 8 * BS, ops, finish)
    alloc.append_done(zone, ok=False)  # write error: out of use
    assert alloc.total_capacity() == brute() == 7 * DATA_ROOM
    assert alloc.take_resettable(durable_txn=1 << 30) == [zone]
    alloc.zone_was_reset(zone, ops)  # the reset worked: back in use
    assert alloc.total_capacity() == brute() == 8 * DATA_ROOM
    zone, _ = alloc.reserve(Stream.DATASET, 0, 8 * BS, ops, finish)
    alloc.append_done(zone, ok=False)
    assert alloc.take_resettable(durable_txn=1 << 30) == [zone]
    alloc.zone_reset_failed(zone)  # the reset failed: out of use for good
    assert alloc.total_capacity() == brute() == 7 * DATA_ROOM


@pytest.mark.expect_log("zonefs_py.alloc", "ERROR", "stopped taking writes after a write error")
def test_every_accounted_append_tells_the_journal_to_flush_first() -> None:
    """INV-7 by construction: the allocator, which accounts every append, tells
    the journal that the next commit must flush the device before its records."""
    alloc = make_alloc()
    journal = alloc.journal
    assert isinstance(journal, FakeJournal)
    ops: list[Op] = []
    zone, granted = alloc.reserve(0, 0, BS, ops, [])
    assert granted == BS
    assert not journal.data_dirty
    alloc.append_done(zone, ok=False)
    assert not journal.data_dirty, "a failed append left nothing to flush"
    zone, _ = alloc.reserve(0, 0, BS, ops, [])
    alloc.append_done(zone, ok=True)
    assert journal.data_dirty
    journal.data_dirty = False
    alloc.summary_written(zone)
    assert journal.data_dirty
