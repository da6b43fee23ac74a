"""Drain that keeps up (issue 30): files in flight at once, multipart uploads resumed
after a crash (only the missing parts sent), and the object of a renamed drained
file moved (copy, verify, delete), also across a crash. Fake store, fake clock
(tests/unit/test_drain.py explains both); a "crash" closes the device without
unmounting, and the same fake store serves the next mount, as a real one would.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
import trio.testing
from engine_helpers import (
    CTX,
    assert_fsck_clean,
    mounted,
    new_image,
    open_image,
    read_file,
    resolve,
    write_file,
)
from fake_store import FakeStore
from test_drain import (
    BUCKET,
    OPTIONS,
    PART,
    clock,
    drainer_running,
    payload,
    setup_dir,
    state_of,
    use_fake,
    wait_for,
)

from zonefs_py.drain.policy import STATE_XATTR
from zonefs_py.fs.api import ROOT_INO, XattrFlags
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.fs.options import FsOptions
from zonefs_py.model.drain import DrainState

__all__ = ["clock"]  # the fixture, imported for the tests below

CTX_FLAGS = XattrFlags(0)


@asynccontextmanager
async def crashing(image: Path, store: FakeStore,
                   options: FsOptions = OPTIONS) -> AsyncIterator[ZoneFS]:
    """Mount `image` with `store`; at the end the device is closed without an unmount
    (power off after the last commit): only what was committed survives."""
    dev = open_image(image)
    try:
        async with ZoneFS.mount(dev, options, close=False) as fs:
            fs.drain.store = store
            fs.drain.part_bytes = PART
            yield fs
    finally:
        dev.close()


async def rename(fs: ZoneFS, old: str, new: str) -> None:
    op, on = old.rsplit("/", 1)
    np_, nn = new.rsplit("/", 1)
    await fs.rename(await resolve(fs, op or "/"), on.encode(),  # type: ignore[arg-type]
                    await resolve(fs, np_ or "/"), nn.encode(), 0)


async def test_files_upload_in_parallel(tmp_path: Path, clock: trio.testing.MockClock) -> None:
    """drain_parallel=2: two uploads run at once, never three; all three drain."""
    files = {f"/ck/f{i}.pt": payload(3 * PART + i, i) for i in range(3)}
    async with mounted(tmp_path / "img", create=True,
                       options=OPTIONS.replace(drain_parallel=2)) as fs:
        store = use_fake(fs)
        await setup_dir(fs)
        store.hold("upload_part")
        for path, data in files.items():
            await write_file(fs, path, data)
        async with drainer_running(fs):
            await wait_for(lambda: store.count("create_multipart") == 2)
            await trio.sleep(30)  # nothing more starts while both slots are taken
            assert store.count("create_multipart") == 2
            assert fs.drain.status()["uploading_files"] == 2
            store.release()
            inos = [await resolve(fs, p) for p in files]
            await wait_for(lambda: all(state_of(fs, i) == "drained" for i in inos))
        for path, data in files.items():
            assert store.objects[(BUCKET, "run1" + path[3:])][0] == data


@pytest.mark.expect_log("zonefs_py.drain.drainer", "WARNING", "the store went away")
async def test_crash_mid_multipart_resumes_only_missing_parts(
        tmp_path: Path, clock: trio.testing.MockClock) -> None:
    """The store takes 2 of 6 parts, then goes away; power off. The next mount lists
    the parts (ListParts), sends only the 4 missing ones plus one whose stored bytes
    are not ours (its ETag is not our MD5), and the object verifies."""
    image = tmp_path / "img"
    new_image(image)
    data = payload(5 * PART + 777, 9)
    store = FakeStore()
    async with crashing(image, store) as fs:
        await setup_dir(fs)
        await write_file(fs, "/ck/big.pt", data)
        ino = await resolve(fs, "/ck/big.pt")
        store.parts_budget = 2
        async with drainer_running(fs):
            await wait_for(lambda: fs.drain.errors >= 1)
        assert fs.state.drain[ino].state == DrainState.UPLOADING  # kept, to resume
    (upload_id, (_b, _k, _meta, parts)), = store.uploads.items()
    assert len(parts) == 2
    damaged = min(parts)
    parts[damaged] = b"\0" + parts[damaged][1:]  # a stored part with other bytes
    store.parts_budget = None
    before = store.count("upload_part")
    async with mounted(image, options=OPTIONS) as fs:
        fs.drain.store = store
        fs.drain.part_bytes = PART
        async with drainer_running(fs):
            await wait_for(lambda: state_of(fs, ino) == "drained")
        assert store.count("upload_part") - before == 6 - 2 + 1
        assert store.count("create_multipart") == 1  # the same upload, resumed
        assert store.count("list_parts") == 1
        assert fs.drain.status()["parts_reused"] == 1
        obj, etag, _meta = store.objects[(BUCKET, "run1/big.pt")]
        assert obj == data
        assert etag.endswith("-6")
        assert fs.state.drain[ino].token == etag.encode()
        assert not store.uploads
        assert upload_id not in store.uploads


@pytest.mark.expect_log("zonefs_py.drain.drainer", "WARNING", "the store went away")
async def test_resume_of_a_vanished_upload_starts_again(
        tmp_path: Path, clock: trio.testing.MockClock) -> None:
    """The pending upload was aborted in the store meanwhile (lifecycle rule): the
    next mount starts a new one and sends every part."""
    image = tmp_path / "img"
    new_image(image)
    data = payload(4 * PART, 10)
    store = FakeStore()
    async with crashing(image, store) as fs:
        await setup_dir(fs)
        await write_file(fs, "/ck/big.pt", data)
        ino = await resolve(fs, "/ck/big.pt")
        store.parts_budget = 1
        async with drainer_running(fs):
            await wait_for(lambda: fs.drain.errors >= 1)
    store.uploads.clear()
    store.parts_budget = None
    before = store.count("upload_part")
    async with mounted(image, options=OPTIONS) as fs:
        fs.drain.store = store
        fs.drain.part_bytes = PART
        async with drainer_running(fs):
            await wait_for(lambda: state_of(fs, ino) == "drained")
        assert store.count("upload_part") - before == 4
        assert store.objects[(BUCKET, "run1/big.pt")][0] == data


async def test_rename_after_drain_moves_the_object(tmp_path: Path,
                                                   clock: trio.testing.MockClock) -> None:
    """A drained file renamed, and a directory holding an evicted one renamed: each
    object ends under its new key only, and the evicted file restores from there."""
    a, b = payload(3 * PART + 5, 11), payload(PART + 100, 12)
    async with mounted(tmp_path / "img", create=True, options=OPTIONS) as fs:
        store = use_fake(fs)
        await setup_dir(fs)
        sub = (await fs.mkdir(await resolve(fs, "/ck"), b"sub", 0o755,
                              CTX)).ino
        fs.forget([(sub, 1)])
        await write_file(fs, "/ck/a.pt", a)
        await write_file(fs, "/ck/sub/b.pt", b)
        ia, ib = await resolve(fs, "/ck/a.pt"), await resolve(fs, "/ck/sub/b.pt")
        async with drainer_running(fs):
            await wait_for(lambda: state_of(fs, ia) == state_of(fs, ib) == "drained")
            await fs.setxattr(ib, STATE_XATTR, b"evicted", CTX_FLAGS,
                              CTX)
            await rename(fs, "/ck/a.pt", "/ck/a2.pt")
            await rename(fs, "/ck/sub", "/ck/sub2")
            await wait_for(lambda: fs.drain.files_moved == 2)
        assert sorted(k for _b, k in store.objects) == ["run1/a2.pt", "run1/sub2/b.pt"]
        assert store.objects[(BUCKET, "run1/a2.pt")][0] == a
        assert fs.state.drain[ia].url == b"s3://ckpts/run1/a2.pt"
        assert fs.state.drain[ib].state == DrainState.EVICTED
        assert await read_file(fs, "/ck/sub2/b.pt") == b
        assert state_of(fs, ib) == "drained"


async def test_new_file_at_the_old_name_waits_for_the_move(
        tmp_path: Path, clock: trio.testing.MockClock) -> None:
    """x.pt drained, renamed to y.pt, and a new x.pt written while the copy is slow:
    the new upload must not overwrite the key before the old object moved away."""
    old, new = payload(2 * PART, 13), payload(2 * PART, 14)
    async with mounted(tmp_path / "img", create=True, options=OPTIONS) as fs:
        store = use_fake(fs)
        await setup_dir(fs)
        await write_file(fs, "/ck/x.pt", old)
        ix = await resolve(fs, "/ck/x.pt")
        async with drainer_running(fs):
            await wait_for(lambda: state_of(fs, ix) == "drained")
            store.hold("copy")
            await rename(fs, "/ck/x.pt", "/ck/y.pt")
            await write_file(fs, "/ck/x.pt", new)
            inew = await resolve(fs, "/ck/x.pt")
            await wait_for(lambda: store.stalled_calls > 0)
            await trio.sleep(20)
            assert store.objects[(BUCKET, "run1/x.pt")][0] == old  # not overwritten
            assert state_of(fs, inew) == "queued"
            store.release()
            await wait_for(lambda: state_of(fs, inew) == "drained" and fs.drain.files_moved)
        assert store.objects[(BUCKET, "run1/y.pt")][0] == old
        assert store.objects[(BUCKET, "run1/x.pt")][0] == new


@pytest.mark.expect_log("zonefs_py.drain.drainer", "WARNING", "injected transient")
@pytest.mark.parametrize("cut", ["before_copy", "before_delete", "before_done"])
async def test_crash_mid_move_resumes(tmp_path: Path, clock: trio.testing.MockClock,
                                      cut: str) -> None:
    """Power off during the move of an evicted file's object, at each step: the file
    restores at every point (from the old key or the new), and the next mount's
    drainer finishes the move without copying twice what is already there."""
    image = tmp_path / "img"
    new_image(image)
    data = payload(3 * PART + 1, 15)
    store = FakeStore()
    async with crashing(image, store) as fs:
        await setup_dir(fs)
        await write_file(fs, "/ck/a.pt", data)
        ino = await resolve(fs, "/ck/a.pt")
        async with drainer_running(fs):
            await wait_for(lambda: state_of(fs, ino) == "drained")
            await fs.setxattr(ino, STATE_XATTR, b"evicted", CTX_FLAGS,
                              CTX)
            await fs.sync()
            if cut != "before_done":  # else the move ends; its last record is not committed
                store.fail_next("transient", 1000,
                                call="copy" if cut == "before_copy" else "delete")
            await rename(fs, "/ck/a.pt", "/ck/b.pt")
            await fs.sync()
            await wait_for(lambda: fs.drain.errors >= 1 if cut != "before_done"
                           else fs.drain.files_moved == 1)
        if cut != "before_done":
            assert fs.state.drain[ino].moving_to == b"s3://ckpts/run1/b.pt"
    store._fail.clear()
    copies = store.count("copy")
    async with mounted(image, options=OPTIONS) as fs:
        fs.drain.store = store
        fs.drain.part_bytes = PART
        if cut != "before_copy":
            # Restore while the move is pending: from whichever key holds the object.
            assert await read_file(fs, "/ck/b.pt") == data
            await fs.setxattr(ino, STATE_XATTR, b"evicted", CTX_FLAGS,
                              CTX)
        async with drainer_running(fs):
            await wait_for(lambda: fs.drain.files_moved == 1)
        assert store.count("copy") - copies == (1 if cut == "before_copy" else 0)
        assert fs.drain.files_moved == 1  # the recovered record named both keys
        assert [k for _b, k in store.objects] == ["run1/b.pt"]
        assert fs.state.drain[ino].url == b"s3://ckpts/run1/b.pt"
        assert not fs.state.drain[ino].moving_to
        assert await read_file(fs, "/ck/b.pt") == data
    assert_fsck_clean(image)


@pytest.mark.expect_log("zonefs_py.drain.drainer", "WARNING", "the store went away")
async def test_stop_mid_upload_keeps_it_for_the_next_mount(
        tmp_path: Path, clock: trio.testing.MockClock) -> None:
    """A clean unmount while parts are in flight does not abort the upload: the next
    mount resumes it."""
    image = tmp_path / "img"
    data = payload(4 * PART + 3, 16)
    store = FakeStore()
    async with mounted(image, create=True, options=OPTIONS) as fs:
        fs.drain.store = store
        fs.drain.part_bytes = PART
        await setup_dir(fs)
        await write_file(fs, "/ck/a.pt", data)
        ino = await resolve(fs, "/ck/a.pt")
        store.parts_budget = 3
        async with drainer_running(fs):
            await wait_for(lambda: fs.drain.errors >= 1)
    assert store.count("abort_multipart") == 0
    assert len(store.uploads) == 1
    store.parts_budget = None
    before = store.count("upload_part")
    async with mounted(image, options=OPTIONS) as fs:
        fs.drain.store = store
        fs.drain.part_bytes = PART
        async with drainer_running(fs):
            await wait_for(lambda: state_of(fs, ino) == "drained")
        assert store.count("upload_part") - before == 5 - 3
        assert store.objects[(BUCKET, "run1/a.pt")][0] == data


async def test_root_level_rename_out_of_policy_keeps_the_object(
        tmp_path: Path, clock: trio.testing.MockClock) -> None:
    """Renamed out of every drain directory: nothing to move to; the object stays
    and the file stays drained (its record names it)."""
    async with mounted(tmp_path / "img", create=True, options=OPTIONS) as fs:
        store = use_fake(fs)
        await setup_dir(fs)
        await write_file(fs, "/ck/a.pt", b"abc" * 100)
        ino = await resolve(fs, "/ck/a.pt")
        async with drainer_running(fs):
            await wait_for(lambda: state_of(fs, ino) == "drained")
            await fs.rename(await resolve(fs, "/ck"), b"a.pt", ROOT_INO,  # type: ignore[arg-type]
                            b"a.pt", 0)
            await trio.sleep(10)
        assert state_of(fs, ino) == "drained"
        assert list(store.objects) == [(BUCKET, "run1/a.pt")]
