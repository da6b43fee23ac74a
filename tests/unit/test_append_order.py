"""Appends at the write pointer land in reservation order (fs/data/append_order.py)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from engine_helpers import CTX, Geometry, MiB, mounted, pattern, read_file

from zonefs_py.fs.api import ROOT_INO
from zonefs_py.fs.data.append_order import AppendOrder


def test_workers_enter_in_ticket_order_whatever_order_they_start() -> None:
    order = AppendOrder(wait_s=5.0)
    tickets = [order.ticket(7) for _ in range(6)]
    entered: list[int] = []

    def worker(t: int) -> None:
        order.wait(7, t)
        entered.append(t)
        order.done(7, t)

    threads = [threading.Thread(target=worker, args=(t,)) for t in reversed(tickets)]
    for th in threads:
        th.start()
        time.sleep(0.01)
    for th in threads:
        th.join()
    assert entered == tickets
    assert order.timeouts == 0
    assert order.pending_zones() == 0


def test_a_ticket_never_used_costs_its_successor_one_bounded_wait() -> None:
    """The successor gives up after wait_s (one timeout); later tickets do not wait.

    Asserted through `timeouts`, not the clock: a wait that wrongly blocked
    would time out too and count, whatever the machine's load.
    """
    order = AppendOrder(wait_s=0.05)
    order.ticket(1)  # its task was cancelled before its thread ran
    second = order.ticket(1)
    start = time.monotonic()
    order.wait(1, second)
    assert time.monotonic() - start >= 0.05  # it did wait (a lower bound cannot flake)
    assert order.timeouts == 1
    order.done(1, second)
    # The skipped ticket's late `done` changes nothing, and new tickets go at once.
    order.done(1, 0)
    third = order.ticket(1)
    order.wait(1, third)
    assert order.timeouts == 1, "the third ticket waited for the skipped one"
    order.done(1, third)
    assert order.pending_zones() == 0


def test_zones_are_independent() -> None:
    order = AppendOrder(wait_s=5.0)
    order.ticket(1)
    t2 = order.ticket(2)
    order.wait(2, t2)  # zone 1's pending ticket does not hold zone 2
    assert order.timeouts == 0, "zone 2's ticket waited for zone 1's"


async def test_a_sequential_file_is_one_extent_per_zone(tmp_path: Path) -> None:
    """1 MiB writes, 4 chunks in flight: without the order the chunks landed shuffled
    (7,603-8,414 extents for 10 GiB in 1 MiB chunks, 40 zones, over the runs measured)."""
    geo = Geometry(size_bytes=256 * MiB, zone_size_bytes=8 * MiB)
    async with mounted(tmp_path / "fs.img", geo=geo, create=True) as fs:
        assert fs.data.append_order is not None
        fs.data.append_order.wait_s = 10.0  # a loaded test machine must not flake
        fh, attr = await fs.create(ROOT_INO, b"ckpt.pt", 0o644, os.O_WRONLY, CTX)
        data = pattern(3, 48 * MiB)
        for off in range(0, len(data), MiB):
            await fs.write(fh, off, data[off:off + MiB])
        await fs.fsync(fh, False)
        await fs.release(fh)
        inode = fs.state.inodes[attr.ino]
        assert inode.extents is not None
        zones = {e.dev // geo.zone_size_bytes for e in inode.extents}
        # One extent per zone. Zones keep room for their summary, so 1 MiB chunks
        # straddle each zone's end; both pieces of such a chunk are reserved before
        # either is appended, so its second piece opens the next zone ahead of the
        # later chunks (reserved one after the other, it gave up to 3 per zone).
        assert len(inode.extents) == len(zones), [
            (e.fblock, e.dev // 4096, e.nblocks) for e in inode.extents]
        assert await read_file(fs, "/ckpt.pt") == data
        fs.forget([(attr.ino, 1)])
