"""Read QoS gate: appends are rate-limited only while reads are being served."""

from __future__ import annotations

import trio
import trio.testing

from zonefs_py.fs.qos import ReadPriority

MB = 1_000_000


async def test_appends_pass_at_once_without_reads(autojump_clock: trio.testing.MockClock) -> None:
    gate = ReadPriority(1 * MB)
    t0 = trio.current_time()
    for _ in range(100):
        await gate.admit_write(1 << 20)
    assert trio.current_time() == t0
    assert gate.throttled_s == 0


async def test_appends_are_rate_limited_while_reads_are_served(
        autojump_clock: trio.testing.MockClock) -> None:
    gate = ReadPriority(10 * MB)
    gate.read_started()
    t0 = trio.current_time()
    for _ in range(20):
        await gate.admit_write(MB)
    elapsed = trio.current_time() - t0
    assert 1.8 <= elapsed <= 2.1  # 20 MB at 10 MB/s, 50 ms of burst
    gate.read_done()
    # The window after the last read is still protected, then writes run free.
    await trio.sleep(0.1)
    t1 = trio.current_time()
    await gate.admit_write(50 * MB)
    assert trio.current_time() == t1


async def test_rate_zero_disables_the_gate(autojump_clock: trio.testing.MockClock) -> None:
    gate = ReadPriority(0)
    gate.read_started()
    t0 = trio.current_time()
    await gate.admit_write(1 << 30)
    assert trio.current_time() == t0
