"""A commit that fails takes the queued transactions with it: a commit queued
behind it for the log must fail too, never report them durable.

Found by tests/unit/crash_stress.py: after a power cut, an fsync queued behind
the failing commit found the queue empty and returned success.
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest
import trio
import trio.testing
from engine_helpers import CTX, mounted

from zonefs_py import errors
from zonefs_py.fs.api import ROOT_INO


@pytest.mark.expect_log("zonefs_py.journal.journal", "ERROR", "journal write failed")
@pytest.mark.expect_log("zonefs_py.fs.filesystem", "ERROR", "switching to read-only failsafe mode")
async def test_commit_queued_behind_a_failing_one_fails_too(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True, fsck_after=False) as fs:
        fh, _ = await fs.create(ROOT_INO, b"f", 0o644, 0, CTX)
        await fs.write(fh, 0, b"x" * 100)
        await fs.release(fh)  # queued, not durable
        dev = fs.dev
        entered, release = trio.Event(), threading.Event()
        real_flush = dev.flush

        def flush() -> None:  # in the commit's worker thread
            trio.from_thread.run_sync(entered.set)
            release.wait(10)
            raise OSError(errno.EIO, "test: flush fails")

        dev.flush = flush  # type: ignore[method-assign]
        outcome: dict[str, BaseException | None] = {}

        async def run(name: str, fn: object) -> None:
            try:
                await fn()  # type: ignore[operator]
                outcome[name] = None
            except errors.ZoneFSError as exc:
                outcome[name] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "first", fs.journal.commit)
            await entered.wait()
            # The first commit holds the log and has taken the batch; this one
            # queues for the log with the same transactions as its target.
            nursery.start_soon(run, "second", fs.journal.commit)
            await trio.testing.wait_all_tasks_blocked()  # it waits for the log now
            release.set()
        dev.flush = real_flush  # type: ignore[method-assign]
        assert isinstance(outcome["first"], errors.IOFailure), outcome
        assert isinstance(outcome["second"], errors.IOFailure), (
            "the commit queued behind a failed one reported success")
        assert fs.journal.durable_txn < fs.journal.added_txn
        fs.enter_failsafe("test")
