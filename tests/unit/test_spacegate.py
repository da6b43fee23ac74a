"""The write gate's policy (fs/spacegate.py), its adapter half (writegate.py) with the C
side faked, and the kernel dirty limit as the daemon reads and sets it (daemon/tuning.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
import trio.lowlevel

from zonefs_py import fuseext, writegate
from zonefs_py.daemon import tuning
from zonefs_py.daemon.tuning import BdiLimit, dirty_max_bytes
from zonefs_py.fs.spacegate import SpaceGate
from zonefs_py.writegate import WriteGate

MiB = 1 << 20


class Space:
    """A free-space figure the test moves."""

    def __init__(self, avail: int) -> None:
        self.avail = avail

    def __call__(self) -> int:
        return self.avail


def gate_at(avail: int, default: int = 48 * MiB, tunable: bool = True) -> tuple[SpaceGate, Space]:
    space = Space(avail)
    gate = SpaceGate(space)
    gate.configure(default, tunable)
    return gate, space


def test_unconfigured_gate_never_refuses() -> None:
    space = Space(0)
    gate = SpaceGate(space)
    gate.check()
    assert not gate.enabled
    assert not gate.refusing
    assert not gate.near


def test_far_from_full_keeps_the_kernels_limit_and_passes() -> None:
    gate, _ = gate_at(10_000 * MiB)
    assert not gate.refusing
    assert gate.wanted_limit_bytes == 48 * MiB
    assert not gate.limit_change_due()


def test_refuses_below_what_the_kernel_may_hold_plus_margin() -> None:
    gate, space = gate_at(1000 * MiB, tunable=False)
    below = gate.refuse_below_bytes
    assert below == 48 * MiB + 12 * MiB + MiB + SpaceGate.MARGIN_BYTES
    space.avail = below
    gate.check()
    assert not gate.refusing
    space.avail = below - 1
    gate.check()
    assert gate.refusing
    assert gate.closed_count == 1


def test_passes_again_only_with_resume_bytes_above_the_threshold() -> None:
    gate, space = gate_at(0, tunable=False)
    assert gate.refusing
    below = gate.refuse_below_bytes
    space.avail = below + SpaceGate.RESUME_BYTES - 1
    gate.check()
    assert gate.refusing
    space.avail = below + SpaceGate.RESUME_BYTES
    gate.check()
    assert not gate.refusing


def test_wanted_limit_is_an_eighth_of_free_space_between_floor_and_default() -> None:
    gate, _ = gate_at(1000 * MiB)
    assert gate.wanted_limit(800 * MiB) == 48 * MiB
    assert gate.wanted_limit(80 * MiB) == 10 * MiB
    assert gate.wanted_limit(MiB) == SpaceGate.FLOOR_BYTES
    assert gate.wanted_limit(0) == SpaceGate.FLOOR_BYTES


def test_untunable_limit_stays_the_default() -> None:
    gate, _ = gate_at(10 * MiB, tunable=False)
    assert gate.wanted_limit_bytes == 48 * MiB
    assert not gate.limit_change_due()


def test_limit_changes_in_steps_not_every_byte() -> None:
    gate, space = gate_at(1000 * MiB)
    space.avail = 300 * MiB  # wants 37.5 MiB: not 1.5x under 48
    assert not gate.limit_change_due()
    space.avail = 200 * MiB  # wants 25 MiB
    assert gate.limit_change_due()
    gate.limit_applied(gate.wanted_limit_bytes)
    assert gate.limit_bytes == 25 * MiB
    space.avail = 1000 * MiB  # back to the default at once
    assert gate.limit_change_due()


def test_a_lowered_limit_lowers_the_threshold_to_a_few_mib() -> None:
    gate, space = gate_at(1000 * MiB)
    gate.limit_applied(SpaceGate.FLOOR_BYTES)
    assert gate.refuse_below_bytes == gate.full_refuse_below_bytes
    assert gate.full_refuse_below_bytes < 8 * MiB
    space.avail = 8 * MiB
    gate.check()
    assert not gate.refusing


def test_the_threshold_always_leaves_room_for_what_the_kernel_holds() -> None:
    """Whatever the free space, the limit wanted for it lets the kernel hold less than
    is free, with the margin to spare, down to the final threshold."""
    gate, _ = gate_at(0)
    for avail in range(gate.full_refuse_below_bytes, 4000 * MiB, 3 * MiB + 4096):
        held = SpaceGate.held_bound(gate.wanted_limit(avail))
        assert held + SpaceGate.MARGIN_BYTES <= max(avail, gate.full_refuse_below_bytes)


async def test_check_wakes_the_adapter_on_a_change() -> None:
    gate, space = gate_at(1000 * MiB, tunable=False)
    await gate.wait_changed()  # configure() evaluated: nothing pending after this
    space.avail = 0
    gate.check()
    with trio.fail_after(1):
        await gate.wait_changed()
    assert gate.refusing


def test_near_while_refusing_or_lowered() -> None:
    gate, space = gate_at(10_000 * MiB)
    assert not gate.near
    gate.limit_applied(10 * MiB)
    assert gate.near
    gate.limit_applied(48 * MiB)
    space.avail = 0
    gate.check()
    assert gate.near


async def test_relieve_asks_for_what_keeps_the_gate_open() -> None:
    space = Space(0)
    asked: list[int] = []

    async def evict(need: int) -> bool:
        asked.append(need)
        space.avail += need
        return True

    gate = SpaceGate(space, relieve=evict)
    gate.configure(48 * MiB, tunable=False)
    assert gate.refusing
    assert await gate.relieve()
    assert asked == [gate.refuse_below_bytes + SpaceGate.RESUME_BYTES]
    assert not gate.refusing


async def test_relieve_without_a_drain_frees_nothing() -> None:
    gate, _ = gate_at(0, tunable=False)
    assert not await gate.relieve()
    assert gate.refusing


# -- the adapter half, with the C list faked -----------------------------------------

class FakeC:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.listed: set[int] = set()
        monkeypatch.setattr(fuseext, "gate_add", self.add)
        monkeypatch.setattr(fuseext, "gate_remove", self.listed.discard)
        monkeypatch.setattr(fuseext, "gate_clear", self.listed.clear)
        monkeypatch.setattr(fuseext, "gate_refused", lambda: 0)

    def add(self, fh: int) -> bool:
        self.listed.add(fh)
        return True


class Invalidations:
    def __init__(self) -> None:
        self.inodes: list[int] = []

    async def __call__(self, inodes: list[int]) -> None:
        self.inodes += inodes


async def test_closing_lists_writable_handles_then_invalidates(
        monkeypatch: pytest.MonkeyPatch) -> None:
    c = FakeC(monkeypatch)
    gate, space = gate_at(1000 * MiB, tunable=False)
    inval = Invalidations()
    wg = WriteGate(gate, inval)
    await wg.opened(7, 100, created=False)
    await wg.opened(8, 100, created=True)
    await wg.opened(9, 101, created=False)
    assert c.listed == set()
    assert inval.inodes == []
    assert not wg.gated(100)
    space.avail = 0
    gate.check()
    await wg.apply()
    assert wg.closed
    assert c.listed == {7, 8, 9}
    assert inval.inodes == [100, 101]
    assert wg.gated(100)
    assert not wg.gated(5)


async def test_open_while_closed_is_listed_before_the_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    c = FakeC(monkeypatch)
    gate, _ = gate_at(0, tunable=False)
    inval = Invalidations()
    wg = WriteGate(gate, inval)
    await wg.apply()
    await wg.opened(3, 30, created=False)
    assert 3 in c.listed
    assert inval.inodes == [30]
    await wg.opened(4, 40, created=True)  # a CREATE's entry carries timeout 0 instead
    assert 4 in c.listed
    assert inval.inodes == [30]
    assert wg.gated(40)


async def test_release_unlists_and_opening_clears(monkeypatch: pytest.MonkeyPatch) -> None:
    c = FakeC(monkeypatch)
    gate, space = gate_at(0, tunable=False)
    wg = WriteGate(gate, Invalidations())
    await wg.opened(1, 10, created=True)
    await wg.opened(2, 10, created=True)
    await wg.apply()
    wg.released(1)
    assert c.listed == {2}
    assert wg.gated(10)
    wg.released(2)
    assert not wg.gated(10)
    await wg.opened(5, 50, created=True)
    space.avail = 10_000 * MiB
    gate.check()
    await wg.apply()
    assert not wg.closed
    assert c.listed == set()
    assert not wg.gated(50)


async def test_closing_evicts_drained_files_first(monkeypatch: pytest.MonkeyPatch) -> None:
    c = FakeC(monkeypatch)
    space = Space(1000 * MiB)

    async def evict(need: int) -> bool:
        space.avail += need
        return True

    gate = SpaceGate(space, relieve=evict)
    gate.configure(48 * MiB, tunable=False)
    wg = WriteGate(gate, Invalidations())
    await wg.opened(1, 10, created=True)
    space.avail = 0
    gate.check()
    await wg.apply()
    assert not wg.closed
    assert c.listed == set()


async def test_handles_of_reserved_files_are_never_listed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    c = FakeC(monkeypatch)
    gate, space = gate_at(1000 * MiB, tunable=False)
    reserved = {20}
    inval = Invalidations()
    wg = WriteGate(gate, inval, reserved.__contains__)
    await wg.opened(1, 10, created=True)
    await wg.opened(2, 20, created=True)
    space.avail = 0
    gate.check()
    await wg.apply()
    assert c.listed == {1}
    assert inval.inodes == [10]
    assert not wg.gated(20)
    await wg.opened(3, 20, created=False)
    assert c.listed == {1}
    reserved.add(10)  # a fallocate while closed
    await wg.reservation_changed(10)
    assert c.listed == set()
    reserved.clear()
    await wg.reservation_changed(20)
    assert c.listed == {2, 3}


async def test_space_back_reopens_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    c = FakeC(monkeypatch)
    gate, space = gate_at(0, tunable=False)
    wg = WriteGate(gate, Invalidations())
    await wg.opened(1, 10, created=True)
    await wg.apply()
    wg.space_may_be_back()  # nothing freed: stays closed
    assert wg.closed
    space.avail = 10_000 * MiB
    wg.space_may_be_back()
    assert not wg.closed
    assert c.listed == set()


async def test_apply_sets_the_wanted_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeC(monkeypatch)
    gate, space = gate_at(10_000 * MiB)
    wg = WriteGate(gate, Invalidations())
    asked: list[int] = []

    def set_limit(limit: int) -> int:
        asked.append(limit)
        return limit

    wg.set_limit = set_limit
    space.avail = 80 * MiB
    await wg.apply()
    assert asked == [10 * MiB]
    assert gate.limit_bytes == 10 * MiB


async def test_a_limit_that_cannot_be_set_leaves_the_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    FakeC(monkeypatch)
    gate, space = gate_at(10_000 * MiB)
    wg = WriteGate(gate, Invalidations())
    wg.set_limit = lambda limit: None
    space.avail = 80 * MiB
    await wg.apply()
    assert not gate.tunable
    assert gate.limit_bytes == 48 * MiB


async def test_run_polls_while_near(monkeypatch: pytest.MonkeyPatch) -> None:
    """Space that comes back without a check() (an unlink) reopens the gate."""
    c = FakeC(monkeypatch)
    monkeypatch.setattr(writegate, "POLL_S", 0.001)
    gate, space = gate_at(0, tunable=False)
    wg = WriteGate(gate, Invalidations())
    await wg.opened(1, 10, created=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wg.run)
        with trio.fail_after(5):
            while not wg.closed:
                await trio.lowlevel.checkpoint()
        assert c.listed == {1}
        space.avail = 10_000 * MiB
        with trio.fail_after(5):
            while wg.closed:
                await trio.lowlevel.checkpoint()
        nursery.cancel_scope.cancel()
    assert c.listed == set()


# -- the kernel's dirty limit --------------------------------------------------------

def fake_bdi(tmp_path: Path, ratio_fine: int = 10_000, strict: str = "1") -> BdiLimit:
    bdi = tmp_path / "bdi"
    bdi.mkdir()
    (bdi / "max_ratio_fine").write_text(f"{ratio_fine}\n")
    (bdi / "strict_limit").write_text(strict + "\n")
    return BdiLimit(str(bdi), dirty_max=4000 * MiB)


def test_dirty_max_from_ratio_or_bytes(tmp_path: Path) -> None:
    vm = tmp_path / "vm"
    vm.mkdir()
    (vm / "dirty_bytes").write_text("0\n")
    (vm / "dirty_ratio").write_text("20\n")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1048576 kB\nMemFree: 1 kB\n")
    assert dirty_max_bytes(str(vm), str(meminfo)) == (1 << 30) // 5
    (vm / "dirty_bytes").write_text("123456789\n")
    assert dirty_max_bytes(str(vm), str(meminfo)) == 123456789


def test_bdi_bound_is_its_share_of_the_dirty_maximum(tmp_path: Path) -> None:
    bdi = fake_bdi(tmp_path)
    assert bdi.bound_bytes() == 40 * MiB  # 1% of 4000 MiB
    assert bdi.tunable()
    assert bdi.set(10 * MiB) == 10 * MiB
    assert (tmp_path / "bdi" / "max_ratio_fine").read_text() == "2500"


def test_bdi_without_strictlimit_is_bounded_by_the_global_limit(tmp_path: Path) -> None:
    assert fake_bdi(tmp_path, strict="0").bound_bytes() == 4000 * MiB


@pytest.mark.expect_log("zonefs_py.daemon", "WARNING", "could not set the dirty limit")
def test_bdi_not_writable_is_not_tunable(tmp_path: Path) -> None:
    bdi = fake_bdi(tmp_path)
    knob = tmp_path / "bdi" / "max_ratio_fine"
    knob.unlink()
    knob.mkdir()  # EISDIR on write, as root meets no EACCES
    with pytest.raises(OSError):
        bdi.bound_bytes()
    assert not bdi.tunable()
    assert bdi.set(10 * MiB) is None


def test_a_bdi_gone_with_its_mount_is_no_warning(tmp_path: Path) -> None:
    """A mount stopped at once takes its bdi away: quietly no limit (CI met the race)."""
    bdi = fake_bdi(tmp_path)
    bdi.dir = str(tmp_path / "missing")
    assert not bdi.tunable()
    assert bdi.set(10 * MiB) is None


async def test_setup_write_gate_of_a_mount_gone_meanwhile_is_no_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bdi = fake_bdi(tmp_path)
    bdi.dir = str(tmp_path / "0:40")  # opened, then the mount and its bdi went away
    monkeypatch.setattr(tuning, "open_bdi_limit", lambda mountpoint: bdi)
    monkeypatch.setattr(tuning, "_in_mountinfo", lambda mountpoint: False)
    gate, _ = gate_at(10_000 * MiB, tunable=False)
    ops = SimpleNamespace(write_gate=SimpleNamespace(gate=gate, set_limit=None))
    cfg = SimpleNamespace(writeback_cache=True, mountpoint=str(tmp_path / "mnt"))
    await tuning.setup_write_gate(cfg, ops)  # type: ignore[arg-type]
    assert ops.write_gate.set_limit is None
