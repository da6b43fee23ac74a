"""The mount owns its tasks (fs/tasks.py, issue 31 item 3).

Tasks started by the engine run in `ZoneFS.mount`'s nursery: they do not
outlive the block, a bug raised by one leaves through the block (not
swallowed, not wrapped in an exception group), and nothing starts once the
nursery is closed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
import trio.testing
from engine_helpers import CTX, TEST_OPTIONS, MiB, assert_fsck_clean, mounted, new_image

from zonefs_py import errors
from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.fs.api import ROOT_INO
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.fs.tasks import MountTasks, NoTaskGroup


async def test_a_task_of_the_mount_ends_with_the_mount(tmp_path: Path) -> None:
    ended = trio.Event()

    async def forever() -> None:
        try:
            await trio.sleep_forever()
        finally:
            ended.set()

    async with mounted(tmp_path / "fs.img", create=True) as fs:
        fs.tasks.start_soon(forever, name="test-forever")
        await trio.testing.wait_all_tasks_blocked()
        assert not ended.is_set()
    assert ended.is_set()
    assert not fs.tasks.is_open


async def test_nothing_starts_once_the_mount_is_over(tmp_path: Path) -> None:
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        pass
    with pytest.raises(NoTaskGroup, match="ZoneFS.mount"):
        fs.tasks.start_soon(trio.sleep, 0, name="late")


@pytest.mark.expect_log("zonefs_py.fs.data.writepipe", "ERROR",
                        "unexpected error writing file data")
async def test_a_bug_in_a_chunk_task_leaves_through_the_mount(tmp_path: Path) -> None:
    """A streaming write's chunk (a task) that hits a bug: the error is not
    swallowed, it ends the mount's block (as itself, or a group of the chunks'
    errors when several hit it)."""
    image = tmp_path / "fs.img"
    new_image(image)

    async def buggy(*args: object) -> None:
        raise RuntimeError("injected bug")

    async def stream_until_the_bug(dev: EmulatedZonedDevice) -> None:
        async with ZoneFS.mount(dev, TEST_OPTIONS) as fs:
            fs.data.pipe.place_file_data = buggy  # type: ignore[method-assign,assignment]
            fh, _attr = await fs.create(ROOT_INO, b"f", 0o644, os.O_RDWR, CTX)
            data = os.urandom(MiB)
            for off in range(0, 8 * MiB, MiB):  # full chunks go to tasks
                await fs.write(fh, off, data)
            await trio.sleep_forever()  # the task's bug cancels the block

    dev = EmulatedZonedDevice.open(image)
    try:
        with pytest.raises((RuntimeError, ExceptionGroup)) as info:
            await stream_until_the_bug(dev)
    finally:
        dev.close()
    exc = info.value
    leaves = exc.exceptions if isinstance(exc, ExceptionGroup) else (exc,)
    assert leaves
    assert all(isinstance(e, RuntimeError) and "injected bug" in str(e) for e in leaves), exc


async def test_a_zone_error_in_a_chunk_task_fails_the_fsync_not_the_mount(
        tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True) as fs:
        real = fs.data.pipe.place_file_data

        async def failing(*args: object) -> object:
            raise errors.IOFailure("injected device failure")

        fh, _attr = await fs.create(ROOT_INO, b"f", 0o644, os.O_RDWR, CTX)
        fs.data.pipe.place_file_data = failing  # type: ignore[method-assign,assignment]
        data = os.urandom(MiB)
        for off in range(0, 4 * MiB, MiB):
            await fs.write(fh, off, data)
        with pytest.raises(errors.IOFailure):
            await fs.fsync(fh, False)
        fs.data.pipe.place_file_data = real  # type: ignore[method-assign]
        await fs.release(fh)
    assert_fsck_clean(image)


async def test_mount_tasks_run_cancels_what_is_left() -> None:
    tasks = MountTasks()
    cancelled = []

    async def forever() -> None:
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled.append(True)
            raise

    async with tasks.run():
        assert tasks.is_open
        tasks.start_soon(forever, name="forever")
        await trio.testing.wait_all_tasks_blocked()
    assert cancelled == [True]
