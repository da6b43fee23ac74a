"""The prefetcher's rules driven directly (no filesystem): which reads make a run, how
far a run reads ahead, and how many segment reads may be in flight (issue 42)."""

from __future__ import annotations

import bisect
import random
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from zonefs_py.fs.data.prefetch import START_REQUESTS, Prefetcher
from zonefs_py.fs.tasks import MountTasks

MiB = 1 << 20
GiB = 1 << 30
FILE_SIZE = 2 * GiB
INO = 7
_ZEROS = memoryview(bytes(MiB))


class Device:
    """Reads of the file's stored bytes, as the prefetcher's `read_stored`: zeros at
    once, or held at `gate` until the test sets it; counts what was asked."""

    def __init__(self) -> None:
        self.reads = 0
        self.bytes = 0
        self.gate: trio.Event | None = None

    async def read(self, ino: int, offset: int, length: int) -> memoryview:
        assert ino == INO
        self.reads += 1
        self.bytes += length
        if self.gate is not None:
            await self.gate.wait()
        return _ZEROS[:length]


@pytest.fixture
async def tasks() -> AsyncIterator[MountTasks]:
    mt = MountTasks()
    async with mt.run():
        yield mt


async def read_all(pf: Prefetcher, offsets: list[int], length: int) -> None:
    for off in offsets:
        await pf.read(INO, off, length, FILE_SIZE)
    await pf.wait_idle()


async def test_reads_at_the_ends_of_earlier_runs_do_not_make_a_run(
        tasks: MountTasks) -> None:
    """Issue 42's runaway: the ends of earlier runs were kept across a reset and the
    run's reach was its furthest end, so a read at an old far end then one at an
    old near end read ahead everything between (1,549 segments, 1.6 GB, for one
    fio randread 128 KiB run; its reads parked the io_uring reader)."""
    dev = Device()
    pf = Prefetcher(dev.read, tasks)
    k = 128 << 10
    near, far, other = 100 * MiB, 1900 * MiB, 500 * MiB
    await read_all(pf, [near, far, other, far + k, near + k], k)
    assert dev.bytes == 0
    assert pf.runs_started == 0


def fio_random_map(blocks: int, passes: int, seed: int) -> list[int]:
    """Block numbers in fio's randread order: a random draw, or the next free block
    after it when it is taken (fio's random map), every block once per pass."""
    rng = random.Random(seed)
    out: list[int] = []
    for _ in range(passes):
        free = list(range(blocks))
        while free:
            i = bisect.bisect_left(free, rng.randrange(blocks))
            out.append(free.pop(i if i < len(free) else 0))
    return out


@pytest.mark.parametrize(("block", "span"), [(128 << 10, 2 * GiB), (4096, 64 * MiB)])
async def test_random_reads_never_read_megabytes_ahead(tasks: MountTasks, block: int,
                                                       span: int) -> None:
    """fio randread over a file, two passes of its random map (near the end of a pass
    most draws are taken and fio reads the next free block: short sequential
    runs): read-ahead reads a few requests' worth per chance run, never the
    window, and a small share of what the requests read."""
    dev = Device()
    pf = Prefetcher(dev.read, tasks)
    offsets = [b * block for b in fio_random_map(span // block, 2, seed=42)]
    furthest = 0  # bytes read ahead past a request's end, at most
    for off in offsets:
        await pf.read(INO, off, block, FILE_SIZE)
        st = pf._streams[INO]
        if st.segments:
            furthest = max(furthest, st.segments[-1].end - (off + block))
    await pf.wait_idle()
    print(f"seed 42: {dev.bytes} bytes read ahead for {len(offsets) * block} read, "
          f"{pf.runs_started} runs, {pf.hits} hits, furthest {furthest}")
    assert furthest <= 2 * START_REQUESTS * block
    assert dev.bytes <= len(offsets) * block // 100


async def test_a_sequential_stream_reads_ahead_up_to_the_window(tasks: MountTasks) -> None:
    dev = Device()
    pf = Prefetcher(dev.read, tasks, window_bytes=8 * MiB)
    k = 128 << 10
    await read_all(pf, list(range(0, 64 * MiB, k)), k)
    assert pf.runs_started == 1
    assert pf.run_breaks == 0
    assert pf.hits >= 64 * MiB // k - 4
    assert dev.bytes <= 64 * MiB + 8 * MiB  # the file's bytes once, plus the window
    assert pf.status()["runs_started"] == 1


async def test_out_of_order_requests_of_a_stream_continue_it(tasks: MountTasks) -> None:
    """The kernel's readahead requests may arrive out of order: one that starts at an
    end of the run, or inside its segments, continues it."""
    dev = Device()
    pf = Prefetcher(dev.read, tasks)
    k = 128 << 10
    await read_all(pf, [0, k, 2 * k, 4 * k, 3 * k, 5 * k, 7 * k, 6 * k], k)
    assert pf.run_breaks == 0
    assert pf.hits >= 5


async def test_segment_reads_in_flight_are_bounded(tasks: MountTasks) -> None:
    """However the rules go, at most `max_filling` segment reads are in flight; a
    request past that reads the device itself (the prefetcher answers None)."""
    dev = Device()
    dev.gate = trio.Event()
    pf = Prefetcher(dev.read, tasks, window_bytes=8 * MiB)
    pf.max_filling = 3
    k = MiB
    for off in (0, k):
        assert await pf.read(INO, off, k, FILE_SIZE) is None  # run 1 and 2: no read-ahead
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pf.read, INO, 2 * k, k, FILE_SIZE)  # run 3: waits for its segment
        await trio.testing.wait_all_tasks_blocked()
        assert dev.reads == 3
        assert pf.segments_refused == 1
        assert pf.status()["segments_in_flight"] == 3
        dev.gate.set()
    await pf.wait_idle()
    assert pf.status()["segments_in_flight"] == 0
