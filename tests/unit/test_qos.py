"""Read QoS: appends are slowed only while reads miss their latency target (simulated clock)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
import trio.testing
from engine_helpers import CTX, TEST_OPTIONS, MiB, mounted, pattern

from zonefs_py.fs.api import ROOT_INO
from zonefs_py.fs.data.qos import ReadLatencyController
from zonefs_py.fs.options import FsOptions

MB = 1_000_000
#: The simulated writer appends 1 MiB in 1 ms when nothing holds it: ~1 GB/s.
APPEND_S = 0.001


async def writer(gate: ReadLatencyController, until: float, log: list[tuple[float, int]],
                 ino: int = 7) -> None:
    """Append 1 MiB chunks through the gate until `until`, logging (time, bytes)."""
    while trio.current_time() < until:
        await gate.admit_write(MiB, ino)
        await trio.sleep(APPEND_S)
        log.append((trio.current_time(), MiB))


async def reader(gate: ReadLatencyController, until: float,
                 latency_s: Callable[[], float]) -> None:
    """Issue reads back to back until `until`, each taking `latency_s()`."""
    while trio.current_time() < until:
        token = gate.read_started()
        await trio.sleep(latency_s())
        gate.read_done(token)


def fixed(seconds: float) -> Callable[[], float]:
    return lambda: seconds


def slowed_by(written: list[tuple[float, int]], ms_per_100mb_s: float,
              any_write_ms: float = 0.0) -> Callable[[], float]:
    """Reads that take 0.5 ms, plus `ms_per_100mb_s` per 100 MB/s written in the
    last 50 ms, plus `any_write_ms` if anything was written then."""
    def latency() -> float:
        now = trio.current_time()
        recent = sum(n for t, n in written if t > now - 0.05)
        extra = any_write_ms if recent else 0.0
        return (0.5 + extra + ms_per_100mb_s * recent / 0.05 / (100 * MB)) / 1e3
    return latency


def rate(log: list[tuple[float, int]], start: float, end: float) -> float:
    return sum(n for t, n in log if start <= t < end) / (end - start)


async def test_no_reads_full_speed(autojump_clock: trio.testing.MockClock) -> None:
    gate = ReadLatencyController(0.002)
    t0 = trio.current_time()
    for _ in range(1000):
        await gate.admit_write(MiB)
    assert trio.current_time() == t0
    assert gate.throttled_s == 0
    assert gate.status()["write_allowance_mb_s"] is None


async def test_fast_reads_leave_writers_free(autojump_clock: trio.testing.MockClock) -> None:
    gate = ReadLatencyController(0.002)
    t0 = trio.current_time()
    written: list[tuple[float, int]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader, gate, t0 + 2, fixed(0.0005))
        nursery.start_soon(writer, gate, t0 + 2, written)
    assert gate.throttled_s == 0
    assert gate.allowance == math.inf
    assert rate(written, t0, t0 + 2) > 0.9 * MiB / APPEND_S
    assert gate.read_latency_s == pytest.approx(0.0005)


async def test_slow_reads_limit_writers(autojump_clock: trio.testing.MockClock) -> None:
    # Reads slowed by 10 ms by any write at all: the allowance falls near its floor.
    gate = ReadLatencyController(0.002, min_rate_bytes_s=4 * MB)
    t0 = trio.current_time()
    written: list[tuple[float, int]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader, gate, t0 + 5, slowed_by(written, 0.0, any_write_ms=10.0))
        nursery.start_soon(writer, gate, t0 + 5, written)
        await trio.sleep(4.5)
        status = gate.status()
    # From ~1 GB/s to a few chunks per second (a chunk in an interval slows its
    # reads; an interval without one lets the allowance grow again).
    assert status["write_allowance_mb_s"] <= 25
    assert gate.decreases >= 5
    assert 2 * MB < rate(written, t0 + 3, t0 + 5) < 30 * MB  # slowed, never stopped
    assert gate.throttled_s > 1


async def test_single_slow_intervals_do_not_cut_the_allowance(
        autojump_clock: trio.testing.MockClock) -> None:
    # A loaded machine: one 50 ms interval in three has slow reads (20 ms), whatever
    # the writer does. Never two in a row over the target: the writer is never cut.
    gate = ReadLatencyController(0.002)
    t0 = trio.current_time()
    written: list[tuple[float, int]] = []

    def noisy() -> float:
        return 0.020 if int((trio.current_time() - t0) / 0.05) % 3 == 0 else 0.0005

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader, gate, t0 + 3, noisy)
        nursery.start_soon(writer, gate, t0 + 3, written)
    assert gate.decreases == 0
    assert rate(written, t0, t0 + 3) > 0.9 * MiB / APPEND_S


async def test_writers_get_what_the_target_leaves(
        autojump_clock: trio.testing.MockClock) -> None:
    # Reads take 0.5 ms + 1 ms per 100 MB/s written: a 2 ms target leaves the writer
    # ~150 MB/s. The controller must find that region, not the floor nor full speed.
    gate = ReadLatencyController(0.002)
    t0 = trio.current_time()
    written: list[tuple[float, int]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader, gate, t0 + 6, slowed_by(written, 1.0))
        nursery.start_soon(writer, gate, t0 + 6, written)
    achieved = rate(written, t0 + 2, t0 + 6)
    assert 40 * MB < achieved < 250 * MB, achieved / MB
    assert gate.decreases > 0


async def test_reads_slow_on_their_own_do_not_starve_writers(
        autojump_clock: trio.testing.MockClock) -> None:
    # Reads take 10 ms with no writer at all (a loaded machine): over a 2 ms target,
    # but writers are not the cause, so after reads were seen alone they run free.
    gate = ReadLatencyController(0.002)
    t0 = trio.current_time()
    written: list[tuple[float, int]] = []

    async def late_writer() -> None:
        await trio.sleep(1)
        await writer(gate, t0 + 3, written)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader, gate, t0 + 3, fixed(0.010))
        nursery.start_soon(late_writer)
    assert gate.baseline_s == pytest.approx(0.010)
    assert gate.effective_target_s == pytest.approx(0.015)
    assert gate.throttled_s == 0
    assert rate(written, t0 + 1, t0 + 3) > 0.9 * MiB / APPEND_S


async def test_writers_run_free_once_reads_stop(autojump_clock: trio.testing.MockClock) -> None:
    gate = ReadLatencyController(0.002)
    t0 = trio.current_time()
    written: list[tuple[float, int]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader, gate, t0 + 3, slowed_by(written, 0.0, any_write_ms=10.0))
        nursery.start_soon(writer, gate, t0 + 5, written)
    assert rate(written, t0 + 2.5, t0 + 3) < 30 * MB
    assert rate(written, t0 + 3.5, t0 + 5) > 0.9 * MiB / APPEND_S
    assert gate.allowance == math.inf


async def test_expedited_file_never_waits(autojump_clock: trio.testing.MockClock) -> None:
    # An fsync expedites its file: waiting chunks are released at once, new ones pass.
    gate = ReadLatencyController(0.002, min_rate_bytes_s=1 * MB)
    gate.allowance = 1 * MB  # as after slow reads
    token = gate.read_started()  # a read in flight keeps the gate active
    released: list[float] = []

    async def chunk(ino: int) -> None:
        await gate.admit_write(MiB, ino)
        released.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(chunk, 1)
        nursery.start_soon(chunk, 2)
        await trio.testing.wait_all_tasks_blocked()
        t0 = trio.current_time()
        with gate.expedited(1):
            await trio.testing.wait_all_tasks_blocked()
            assert released == [t0]  # file 1's waiting chunk went at once
            await gate.admit_write(8 * MiB, 1)
            assert trio.current_time() == t0
    assert released[1] > t0 + 0.5  # file 2 still waited for the allowance
    gate.read_done(token)


async def test_disabled_gate_passes(autojump_clock: trio.testing.MockClock) -> None:
    gate = ReadLatencyController(0)
    gate.read_started()
    gate.allowance = 1.0
    t0 = trio.current_time()
    await gate.admit_write(1 << 30)
    assert trio.current_time() == t0
    assert gate.status() == {"read_latency_target_ms": 0.0, "enabled": False}


async def test_fsync_does_not_wait_on_a_throttled_gate(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """Through the engine: a file's streaming chunks held at a throttled gate are
    released by its fsync (simulated time does not move), and the bytes are right."""
    options = TEST_OPTIONS.replace(read_latency_ms=2.0)
    async with mounted(tmp_path / "fs.img", create=True, options=options) as fs:
        gate = fs.data.qos
        gate.min_rate = 1 * MB
        gate.allowance = 1 * MB
        token = gate.read_started()  # a dataset read in flight all along
        fh, attr = await fs.create(ROOT_INO, b"ckpt", 0o644, os.O_RDWR, CTX)
        data = pattern(5, 6 * MiB)
        for off in range(0, len(data), MiB):
            await fs.write(fh, off, data[off:off + MiB])
        assert fs.data.inflight.get(attr.ino)  # chunks are held at the gate
        t0 = trio.current_time()
        await fs.fsync(fh, False)
        assert trio.current_time() == t0
        assert not fs.data.inflight.get(attr.ino)
        gate.read_done(token)
        assert bytes(await fs.read(fh, 0, len(data))) == data
        await fs.release(fh)
        fs.forget([(attr.ino, 1)])


def test_mount_option() -> None:
    opts, rest = FsOptions.from_mount_options({"read_latency_ms": "3.5", "noatime": None})
    assert opts.read_latency_ms == 3.5
    assert rest == {"noatime": None}
    with pytest.raises(ValueError, match="replaced by read_latency_ms"):
        FsOptions.from_mount_options({"qos_write_mb": "32"})
    with pytest.raises(ValueError, match="read_latency_ms"):
        FsOptions.from_mount_options({"read_latency_ms": "-1"})
