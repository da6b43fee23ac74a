"""daemon/stopping.py: a stop cancels what still runs after the grace; the unmount
watch stops on a lazily unmounted mount only while requests are stuck (issue 42).

The mount table and fusectl are faked (monkeypatched readers); trio's
autojump clock runs the grace and the polls without waiting.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from zonefs_py.daemon import stopping
from zonefs_py.daemon.stopping import Stopper, watch_unmount

MOUNTINFO = ("36 25 0:33 / /run/user rw - tmpfs tmpfs rw\n"
             "45 27 0:40 / /mnt/my\\040zoned rw,nosuid - fuse.zonefs-py /dev/x rw\n")


def fake_mountinfo(monkeypatch: pytest.MonkeyPatch, text: list[str]) -> None:
    """Make the watch read `text[0]` as /proc/self/mountinfo (the test changes it)."""
    monkeypatch.setattr(stopping, "_mountinfo",
                        lambda: [line.split() for line in text[0].splitlines()])


def fake_fusectl(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, waiting: int | None) -> Path:
    """A fusectl directory with connection 40 (`waiting` unanswered; None: gone)."""
    monkeypatch.setattr(stopping, "FUSECTL", str(tmp_path))
    (tmp_path / "39").mkdir(parents=True)  # another connection: fusectl is there
    if waiting is not None:
        (tmp_path / "40").mkdir()
        (tmp_path / "40" / "waiting").write_text(f"{waiting}\n")
    return tmp_path


def test_the_mount_is_found_by_its_escaped_path() -> None:
    assert stopping._escape("/mnt/my zoned") == "/mnt/my\\040zoned"


def test_mount_device_and_is_mounted(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_mountinfo(monkeypatch, [MOUNTINFO])
    assert stopping.mount_device("/mnt/my zoned") == "0:40"
    assert stopping.mount_device("/run/user") is None  # not FUSE
    assert stopping.is_mounted("0:40")
    assert not stopping.is_mounted("0:41")


async def run_stopper(grace_s: float, body_s: float | None) -> tuple[Stopper, float]:
    """Run a loop that ends after `body_s` (None: never) under a Stopper stopped at
    once; return it and the time the loop ended."""
    terminated: list[bool] = []
    async with trio.open_nursery() as nursery:
        stopper = Stopper(nursery, grace_s, trio.Event(), lambda: terminated.append(True))
        stopper.stop("test")
        with stopper.loop_scope:
            if body_s is None:
                await trio.sleep_forever()
            await trio.sleep(body_s)
        stopper.loop_ended()
        ended = trio.current_time()
        stopper.finished()
    assert terminated == [True]
    return stopper, ended


@pytest.mark.expect_log("zonefs_py.daemon", "WARNING", "requests still unanswered")
async def test_a_stuck_loop_is_cancelled_after_the_grace(autojump_clock: trio.abc.Clock,
                                                         caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    t0 = trio.current_time()
    stopper, ended = await run_stopper(5.0, None)
    assert stopper.cancelled
    assert ended - t0 == pytest.approx(5.0)
    assert "requests still unanswered 5 s later" in caplog.text


async def test_a_loop_that_ends_in_the_grace_is_not_cancelled(autojump_clock: trio.abc.Clock
                                                              ) -> None:
    t0 = trio.current_time()
    stopper, ended = await run_stopper(5.0, 2.0)
    assert not stopper.cancelled
    assert ended - t0 == pytest.approx(2.0)


async def test_a_stop_begins_once(autojump_clock: trio.abc.Clock) -> None:
    calls: list[bool] = []
    closing = trio.Event()
    async with trio.open_nursery() as nursery:
        stopper = Stopper(nursery, 1.0, closing, lambda: calls.append(True))
        closing.set()
        stopper.stop("after the close began")  # pyfuse3.terminate then crashed
        assert stopper.reason is None
        closing = stopper.closing = trio.Event()
        stopper.stop("first")
        stopper.stop("second")
        stopper.loop_ended()
        stopper.finished()
    assert calls == [True]
    assert stopper.reason == "first"


async def watch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, waiting: int | None,
                moving: bool, limit_s: float, serving_after_s: float = 0.0) -> str | None:
    """Run the watch on a mount that leaves the table after 3 s (and serves after
    `serving_after_s`); return the stop's reason, or None if there was none within
    `limit_s`."""
    table = [MOUNTINFO]
    fake_mountinfo(monkeypatch, table)
    fake_fusectl(monkeypatch, tmp_path, waiting)
    counter = [0]

    def progress() -> int:
        counter[0] += 1 if moving else 0
        return counter[0]

    serving = trio.Event()

    async def serve() -> None:
        await trio.sleep(serving_after_s)
        serving.set()

    with trio.move_on_after(limit_s):
        async with trio.open_nursery() as nursery:
            stopper = Stopper(nursery, 5.0, trio.Event(), lambda: None)
            stopper.loop_ended()  # only the reason matters here
            nursery.start_soon(watch_unmount, "/mnt/my zoned", stopper, serving, progress)
            nursery.start_soon(serve)
            await trio.sleep(3)
            table[0] = MOUNTINFO.splitlines()[0] + "\n"  # umount -l
    stopper.finished()
    return stopper.reason


async def test_stuck_requests_on_a_lazily_unmounted_mount_stop_it(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
        ) -> None:
    reason = await watch(monkeypatch, tmp_path, waiting=1, moving=False, limit_s=60)
    assert reason is not None
    assert "1 request(s) unanswered" in reason


async def test_a_lazily_unmounted_mount_that_gets_anywhere_serves_on(
        autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
        ) -> None:
    assert await watch(monkeypatch, tmp_path / "a", waiting=1, moving=True, limit_s=60) is None
    assert await watch(monkeypatch, tmp_path / "b", waiting=0, moving=False, limit_s=60) is None


async def test_a_gone_connection_stops_it(autojump_clock: trio.abc.Clock,
                                          monkeypatch: pytest.MonkeyPatch, tmp_path: Path
                                          ) -> None:
    reason = await watch(monkeypatch, tmp_path, waiting=None, moving=True, limit_s=60)
    assert reason is not None
    assert "FUSE connection gone" in reason


async def test_an_unmount_before_serving_is_still_seen(autojump_clock: trio.abc.Clock,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    """`umount -l` right after the mount, before the tuning and the write gate's setup
    ended: the watch knew the device from the start, so it still sees it go."""
    reason = await watch(monkeypatch, tmp_path, waiting=None, moving=True, limit_s=60,
                         serving_after_s=10)
    assert reason is not None
    assert "FUSE connection gone" in reason
