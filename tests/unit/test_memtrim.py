"""MemoryTrimmer: trims once a write burst is over, never during one (issue 19)."""

from __future__ import annotations

import trio
import trio.testing

from zonefs_py.daemon.memtrim import GlibcHeap, MemoryTrimmer


def _clock() -> trio.testing.MockClock:
    # Virtual time 50x real time, not autojump: autojump would leap past the
    # trim while its worker thread runs.
    return trio.testing.MockClock(rate=50)


class FakeHeap(GlibcHeap):
    def __init__(self, free: int | None) -> None:
        self.free = free
        self.calls: list[float] = []

    def available(self) -> bool:
        return True

    def free_bytes(self) -> int | None:
        return self.free

    def trim(self) -> bool:
        self.calls.append(trio.from_thread.run_sync(trio.current_time))
        return True


async def _drive(heap: FakeHeap, bursts: list[tuple[float, float]], until: float) -> None:
    """Count bytes during each (start, end) burst; run the trimmer until `until`."""
    written = [0]

    def activity() -> int:
        now = trio.current_time()
        if any(start <= now < end for start, end in bursts):
            written[0] += 1
        return written[0]

    trimmer = MemoryTrimmer(activity, heap, idle_s=2.0, interval_s=1.0, min_free_bytes=100)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trimmer.run)
        await trio.sleep(until)
        trimmer.stop()


def test_trims_once_after_each_burst_and_never_during_it() -> None:
    clock = _clock()
    heap = FakeHeap(free=1 << 30)

    async def main() -> None:
        await _drive(heap, [(5.0, 20.0), (40.0, 50.0)], until=80.0)

    trio.run(main, clock=clock)  # type: ignore[no-untyped-call]
    assert len(heap.calls) == 2
    assert 21.0 <= heap.calls[0] <= 24.0
    assert 51.0 <= heap.calls[1] <= 54.0


def test_no_trim_when_little_is_free_or_nothing_was_written() -> None:
    for heap, bursts in ((FakeHeap(free=10), [(5.0, 10.0)]), (FakeHeap(free=1 << 30), [])):
        trio.run(_drive, heap, bursts, 30.0,
                 clock=_clock())  # type: ignore[no-untyped-call]
        assert heap.calls == []


def test_real_glibc_heap_answers() -> None:
    heap = GlibcHeap()
    if not heap.available():
        return  # not glibc: nothing to check
    free = heap.free_bytes()
    assert free is None or free >= 0
    heap.trim()
