"""Drain to an object store: the state machine, its journal replay, and the drainer,
eviction and restore against a fake store (tests/unit/fake_store.py) on a fake clock.

The fake clock (trio's MockClock) jumps ahead whenever the event loop has
been idle for 2 ms of real time, so backoffs of minutes take no time while
the worker threads that call the store still run for real.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
import trio.testing
import xxhash
from engine_helpers import (
    CTX,
    KiB,
    MiB,
    assert_fsck_clean,
    mounted,
    new_image,
    open_image,
    read_file,
    resolve,
    write_file,
)
from fake_store import FakeStore

from zonefs_py import errors
from zonefs_py.drain.drainer import Drainer
from zonefs_py.drain.policy import DRAIN_XATTR, KEEP_XATTR, STATE_XATTR
from zonefs_py.drain.store import META_XXH3, parse_url
from zonefs_py.format.constants import OpType
from zonefs_py.format.ops import decode_ops, encode_ops
from zonefs_py.fs.api import ROOT_INO, XattrFlags
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.fs.options import FsOptions
from zonefs_py.model import drain as model
from zonefs_py.model.drain import DrainRecord, DrainState, DrainTransitionError

BUCKET = "ckpts"
PART = 64 * KiB
OPTIONS = FsOptions(commit_interval_s=3600.0, drain_delay_s=1.0, drain_parts=3)


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0.002)


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


async def setup_dir(fs: ZoneFS, name: str = "ck", keep: int | None = None,
                    url: str = f"s3://{BUCKET}/run1") -> int:
    attr = await fs.mkdir(ROOT_INO, name.encode(), 0o755, CTX)
    fs.forget([(attr.ino, 1)])
    await fs.setxattr(attr.ino, DRAIN_XATTR, url.encode(), XattrFlags(0), CTX)
    if keep is not None:
        await fs.setxattr(attr.ino, KEEP_XATTR, str(keep).encode(), XattrFlags(0), CTX)
    return attr.ino


def use_fake(fs: ZoneFS) -> FakeStore:
    store = FakeStore()
    fs.drain.store = store
    fs.drain.part_bytes = PART
    return store


@asynccontextmanager
async def drainer_running(fs: ZoneFS) -> AsyncIterator[None]:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(Drainer(fs.drain).run)
        try:
            yield
        finally:
            fs.drain.stop()


async def wait_for(cond: Callable[[], bool], virtual_s: float = 3600.0) -> None:
    """Poll `cond` every 50 virtual ms (fake clock); fail after `virtual_s`."""
    with trio.move_on_after(virtual_s):
        while not cond():
            await trio.sleep(0.05)
        return
    pytest.fail("condition not reached")


def state_of(fs: ZoneFS, ino: int) -> str:
    return model.state_name(fs.state.drain.get(ino))


# -- the state machine ------------------------------------------------------------------

def test_legal_path_and_refusals() -> None:
    rec = model.queue(None)
    assert rec.state == DrainState.QUEUED
    rec = model.start_upload(rec, b"s3://b/k", 10, 7, b"up-1")
    assert (rec.state, rec.token) == (DrainState.UPLOADING, b"up-1")
    rec = model.upload_done(rec, b"etag")
    assert (rec.state, rec.token, rec.size, rec.xxh3) == (DrainState.DRAINED, b"etag", 10, 7)
    ev = model.evict(rec)
    assert ev.state == DrainState.EVICTED
    assert model.restored(ev) == rec
    assert model.modify(rec) is None
    with pytest.raises(DrainTransitionError):
        model.modify(ev)  # an evicted file must be restored before it changes
    with pytest.raises(DrainTransitionError):
        model.evict(model.queue(None))  # never evict what is not drained
    with pytest.raises(DrainTransitionError):
        model.upload_done(model.queue(None), b"e")
    with pytest.raises(DrainTransitionError):
        model.start_upload(rec, b"", 0, 0, b"")
    # A multipart upload in flight resumes (its id kept); a single PUT restarts.
    up = model.start_upload(model.queue(None), b"u", 1, 1, b"x")
    assert model.after_recovery(up) == up
    assert model.after_recovery(model.start_upload(model.queue(None), b"u", 1, 1,
                                                   b"")).state == DrainState.QUEUED
    # A move keeps the state (drained/evicted) and names both keys until it is done.
    mv = model.start_move(rec, b"s3://b/k2")
    assert (mv.state, mv.url, mv.moving_to) == (DrainState.DRAINED, b"s3://b/k", b"s3://b/k2")
    assert model.evict(mv).moving_to == b"s3://b/k2"
    done = model.move_done(model.evict(mv), b"e2")
    assert (done.state, done.url, done.token, done.moving_to) == (
        DrainState.EVICTED, b"s3://b/k2", b"e2", b"")
    with pytest.raises(DrainTransitionError):
        model.move_done(rec, b"e")  # no move in flight
    with pytest.raises(DrainTransitionError):
        model.start_move(model.queue(None), b"s3://b/k2")
    assert model.state_name(None) == "local"
    assert model.state_name(ev) == "evicted"


@pytest.mark.parametrize("state", list(DrainState))
def test_drain_op_round_trip(state: DrainState) -> None:
    rec = DrainRecord(state, b"s3://bucket/a/b.pt", 123456789, 0xDEADBEEF12345678,
                      b"upload-or-etag")
    op = rec.op(42)
    assert op[0] == OpType.DRAIN
    (back,) = decode_ops(encode_ops([op]))
    assert back == op
    assert DrainRecord.from_op(back) == (None if state == DrainState.LOCAL else rec)


@pytest.mark.parametrize("state", [DrainState.DRAINED, DrainState.EVICTED])
def test_moving_record_round_trip(state: DrainState) -> None:
    """A move in flight: bit 7 of the state byte, the destination as the token."""
    rec = DrainRecord(state, b"s3://bucket/old.pt", 5, 6, b"", b"s3://bucket/new.pt")
    op = rec.op(7)
    assert op[2] == int(state) | model.MOVING_BIT
    assert op[6] == b"s3://bucket/new.pt"
    (back,) = decode_ops(encode_ops([op]))
    assert DrainRecord.from_op(back) == rec
    for bad in (int(DrainState.QUEUED) | model.MOVING_BIT, model.MOVING_BIT):
        with pytest.raises(ValueError):
            DrainRecord.from_op((OpType.DRAIN, 7, bad, 5, 6, b"s3://b/x", b"s3://b/y"))


def test_parse_url() -> None:
    assert parse_url("s3://my-bucket/a/b/") == ("my-bucket", "a/b")
    assert parse_url("s3://my-bucket") == ("my-bucket", "")
    for bad in ("http://x/y", "s3:///x", "s3://a/x", "s3://b_c_d/x?y=1"):
        with pytest.raises(ValueError):
            parse_url(bad)


# -- journal replay of every state -------------------------------------------------------

@pytest.mark.parametrize("via", ["journal", "checkpoint"])
async def test_every_state_survives_a_crash(tmp_path: Path, via: str) -> None:
    """Each drain state, journaled (or checkpointed) then a crash (no clean close),
    comes back as it was; an UPLOADING one restarts as QUEUED with its upload id
    handed over for an abort."""
    image = tmp_path / "img"
    new_image(image)
    records = {
        DrainState.QUEUED: model.queue(None),
        DrainState.UPLOADING: DrainRecord(DrainState.UPLOADING, b"s3://ckpts/run1/f2", 3, 9,
                                          b"up-7"),
        DrainState.DRAINED: DrainRecord(DrainState.DRAINED, b"s3://ckpts/run1/f3", 3, 9,
                                        b"e3"),
        DrainState.EVICTED: DrainRecord(DrainState.EVICTED, b"s3://ckpts/run1/f4", 3, 9,
                                        b"e4"),
    }
    dev = open_image(image)
    try:
        async with ZoneFS.mount(dev, OPTIONS, close=False) as fs:
            await setup_dir(fs)
            inos = {}
            for i, (st, rec) in enumerate(records.items()):
                await write_file(fs, f"/ck/f{i + 1}", b"abc")
                ino = await resolve(fs, f"/ck/f{i + 1}")
                fs.drain.queue.clear()
                ops = [rec.op(ino)]
                if st == DrainState.EVICTED:
                    ops.insert(0, (OpType.TRUNCATE, ino, 0))
                fs._txn(ops)
                inos[st] = ino
            # A LOCAL op drops a record: queue then local, net nothing.
            await write_file(fs, "/ck/f5", b"abc")
            local_ino = await resolve(fs, "/ck/f5")
            fs._txn([model.queue(fs.state.drain.get(local_ino)).op(local_ino)])
            fs._txn([model.local_op(local_ino)])
            if via == "checkpoint":
                await fs.checkpoint()
            else:
                await fs.journal.commit()
    finally:
        dev.close()  # crash: no clean unmount
    dev = open_image(image)
    try:
        async with ZoneFS.mount(dev, OPTIONS) as fs:
            for st, ino in inos.items():
                assert fs.state.drain[ino] == records[st], st
            assert local_ino not in fs.state.drain
            assert await fs.getxattr(inos[DrainState.EVICTED], STATE_XATTR) == b"evicted"
            assert await fs.getxattr(local_ino, STATE_XATTR) == b"local"
            fs.drain.resume_after_mount()
            # The multipart upload is kept, to resume (ListParts) under its id.
            assert fs.state.drain[inos[DrainState.UPLOADING]] == records[DrainState.UPLOADING]
            assert fs.drain.stale_uploads == []
            assert set(fs.drain.queue) == {inos[DrainState.QUEUED], inos[DrainState.UPLOADING]}
    finally:
        dev.close()
    assert_fsck_clean(image)


# -- the drainer against the fake store ---------------------------------------------------

async def test_fsync_close_queues_and_drains_multipart(tmp_path: Path,
                                                       clock: trio.testing.MockClock) -> None:
    data = payload(5 * PART + 123)
    async with mounted(tmp_path / "img", create=True, options=OPTIONS) as fs:
        store = use_fake(fs)
        await setup_dir(fs)
        await write_file(fs, "/ck/a.pt", data)
        ino = await resolve(fs, "/ck/a.pt")
        assert state_of(fs, ino) == "queued"
        async with drainer_running(fs):
            await wait_for(lambda: state_of(fs, ino) == "drained")
        obj, etag, meta = store.objects[(BUCKET, "run1/a.pt")]
        assert obj == data
        assert meta[META_XXH3] == f"{xxhash.xxh3_64_intdigest(data):016x}"
        assert etag.endswith("-6")
        assert fs.state.drain[ino].token == etag.encode()
        assert store.count("upload_part") == 6
        assert fs.drain.status()["bytes_drained"] == len(data)


async def test_unsynced_close_is_not_queued_until_renamed(
        tmp_path: Path, clock: trio.testing.MockClock) -> None:
    """The torch.save pattern: write x.tmp, close, rename to x: one upload, final name."""
    async with mounted(tmp_path / "img", create=True, options=OPTIONS) as fs:
        store = use_fake(fs)
        d = await setup_dir(fs)
        await write_file(fs, "/ck/step-1.pt.tmp", b"weights", fsync=False)
        ino = await resolve(fs, "/ck/step-1.pt.tmp")
        assert state_of(fs, ino) == "local"
        await fs.rename(d, b"step-1.pt.tmp", d, b"step-1.pt", 0)  # type: ignore[arg-type]
        assert state_of(fs, ino) == "queued"
        async with drainer_running(fs):
            await wait_for(lambda: state_of(fs, ino) == "drained")
        assert list(store.objects) == [(BUCKET, "run1/step-1.pt")]
        assert store.count("put") == 1


async def test_changed_while_uploading_is_requeued(tmp_path: Path,
                                                   clock: trio.testing.MockClock) -> None:
    """The store stalls mid-upload; the file is rewritten meanwhile: the stale upload
    never counts, the new version drains, and the object is the new version."""
    old, new = payload(4 * PART, 1), payload(3 * PART, 2)
    async with mounted(tmp_path / "img", create=True, options=OPTIONS) as fs:
        store = use_fake(fs)
        await setup_dir(fs)
        await write_file(fs, "/ck/a.pt", old)
        ino = await resolve(fs, "/ck/a.pt")
        store.hold("upload_part")
        async with drainer_running(fs):
            await wait_for(lambda: store.stalled_calls > 0)
            assert fs.state.drain[ino].state == DrainState.UPLOADING
            await write_file(fs, "/ck/a.pt", new)  # modified, fsynced, closed: re-queued
            assert state_of(fs, ino) == "queued"
            store.release()
            await wait_for(lambda: state_of(fs, ino) == "drained")
        assert store.objects[(BUCKET, "run1/a.pt")][0] == new
        assert fs.state.drain[ino].xxh3 == xxhash.xxh3_64_intdigest(new)
        assert not store.uploads  # the abandoned multipart upload was aborted


@pytest.mark.expect_log("zonefs_py.drain.drainer", "WARNING", "injected transient")
@pytest.mark.expect_log("zonefs_py.drain.drainer", "ERROR", "refused our credentials")
async def test_store_errors_back_off_and_auth_logs_once(
        tmp_path: Path, clock: trio.testing.MockClock,
        caplog: pytest.LogCaptureFixture) -> None:
    async with mounted(tmp_path / "img", create=True, options=OPTIONS) as fs:
        store = use_fake(fs)
        await setup_dir(fs)
        await write_file(fs, "/ck/a.pt", b"x" * 1000)
        ino = await resolve(fs, "/ck/a.pt")
        store.fail_always = "transient"
        with caplog.at_level(logging.INFO, logger="zonefs_py.drain"):
            async with drainer_running(fs):
                t0 = trio.current_time()
                await wait_for(lambda: fs.drain.errors >= 6)
                # One attempt per backoff step (1, 2, 4, 8, 16 s before the 6th), and
                # virtual time only ever runs ahead of the drainer, never behind.
                assert trio.current_time() - t0 >= 31
                assert len(store.calls) == fs.drain.errors
                assert fs.drain._drainer.backoff_s in (32.0, 60.0)
                assert state_of(fs, ino) == "queued"
                store.fail_always = "auth"
                await wait_for(lambda: fs.drain.auth_error is not None)
                n_auth = len(store.calls)
                await trio.sleep(1200)  # twenty minutes of wrong credentials
                assert len(store.calls) - n_auth <= 5, "auth errors retry every 5 minutes"
                store.fail_always = None
                fs.drain.pause(False)  # `zonefs-py drain resume`: retry at once
                await wait_for(lambda: state_of(fs, ino) == "drained")
        auth_lines = [r for r in caplog.records if "refused our credentials" in r.message]
        assert len(auth_lines) == 1
        assert fs.drain.status()["auth_error"] is None


async def test_keep_evicts_and_open_restores(tmp_path: Path,
                                             clock: trio.testing.MockClock) -> None:
    """keep=2 and 5 checkpoints: 3 evicted (no extents, size/mtime/xattrs kept, zones
    freed without cleaning); opening one restores the same bytes."""
    files = {f"/ck/step-{i}.pt": payload(3 * PART + i * 1000, i) for i in range(5)}
    async with mounted(tmp_path / "img", create=True, options=OPTIONS) as fs:
        use_fake(fs)
        await setup_dir(fs, keep=2)
        async with drainer_running(fs):
            for path, data in files.items():
                await write_file(fs, path, data)
                await fs.setxattr(await resolve(fs, path), b"user.tag", b"v", XattrFlags(0),
                                  CTX)
                await trio.sleep(2)  # distinct mtimes even on a coarse clock
            inos = [await resolve(fs, p) for p in files]
            await wait_for(lambda: [state_of(fs, i) for i in inos]
                           == ["evicted"] * 3 + ["drained"] * 2)
        await fs.reclaim.commit_and_reset()
        first = fs.state.inodes[inos[0]]
        attr = await fs.getattr(inos[0])
        assert attr.size == len(files["/ck/step-0.pt"])
        assert first.extents is not None
        assert first.extents.mapped_blocks == 0
        assert await fs.getxattr(inos[0], b"user.tag") == b"v"
        assert fs.cleaner.stats.bytes_copied == 0
        mtime = attr.mtime_ns
        assert await read_file(fs, "/ck/step-0.pt") == files["/ck/step-0.pt"]
        assert state_of(fs, inos[0]) == "drained"
        assert (await fs.getattr(inos[0])).mtime_ns == mtime


@pytest.mark.expect_log("zonefs_py.drain.manager", "ERROR", "checksum mismatch")
async def test_corrupt_object_is_eio_never_wrong_bytes(tmp_path: Path,
                                                       clock: trio.testing.MockClock) -> None:
    data = payload(4 * PART + 5, 3)
    async with mounted(tmp_path / "img", create=True, options=OPTIONS) as fs:
        store = use_fake(fs)
        await setup_dir(fs)
        await write_file(fs, "/ck/a.pt", data)
        ino = await resolve(fs, "/ck/a.pt")
        async with drainer_running(fs):
            await wait_for(lambda: state_of(fs, ino) == "drained")
        await fs.setxattr(ino, STATE_XATTR, b"evicted", XattrFlags(0), CTX)
        assert state_of(fs, ino) == "evicted"
        live = fs.alloc.live_total_bytes()
        store.corrupt(BUCKET, "run1/a.pt", at=3 * PART + 17)
        with pytest.raises(errors.IOFailure):
            await fs.open(ino, os.O_RDONLY)
        assert state_of(fs, ino) == "evicted"
        assert fs.alloc.live_total_bytes() == live  # nothing of the bad copy is referenced
        store.corrupt(BUCKET, "run1/a.pt", at=3 * PART + 17)  # flip it back
        assert await read_file(fs, "/ck/a.pt") == data


async def test_enospc_evicts_drained_files_first(tmp_path: Path,
                                                 clock: trio.testing.MockClock) -> None:
    async with mounted(tmp_path / "img", create=True, options=OPTIONS) as fs:
        use_fake(fs)
        fs.drain.part_bytes = 4 * MiB
        await setup_dir(fs)
        cap = fs.alloc.user_capacity_bytes()
        big = payload(int(cap * 0.6), 4)
        await write_file(fs, "/ck/old.pt", big)
        ino = await resolve(fs, "/ck/old.pt")
        async with drainer_running(fs):
            await wait_for(lambda: state_of(fs, ino) == "drained")
        # Without eviction this second file would not fit.
        await write_file(fs, "/ck/new.pt", payload(int(cap * 0.6), 5))
        assert state_of(fs, ino) == "evicted"
        assert await read_file(fs, "/ck/new.pt") == payload(int(cap * 0.6), 5)


async def test_undrained_file_is_never_evicted(tmp_path: Path) -> None:
    async with mounted(tmp_path / "img", create=True, options=OPTIONS) as fs:
        use_fake(fs)
        await setup_dir(fs)
        await write_file(fs, "/ck/a.pt", b"data")
        ino = await resolve(fs, "/ck/a.pt")
        with pytest.raises(errors.Busy):
            await fs.setxattr(ino, STATE_XATTR, b"evicted", XattrFlags(0), CTX)
        assert not await fs.drain.relieve_space(1 << 30)
        assert state_of(fs, ino) == "queued"


async def test_policy_xattrs_are_checked(tmp_path: Path) -> None:
    async with mounted(tmp_path / "img", create=True, options=OPTIONS) as fs:
        d = await setup_dir(fs)
        for name, value in ((DRAIN_XATTR, b"http://x"), (KEEP_XATTR, b"-1"),
                            (KEEP_XATTR, b"2:size")):
            with pytest.raises(errors.InvalidArgument):
                await fs.setxattr(d, name, value, XattrFlags(0), CTX)
        await write_file(fs, "/ck/f", b"x")
        with pytest.raises(errors.InvalidArgument):
            await fs.setxattr(await resolve(fs, "/ck/f"), KEEP_XATTR, b"2", XattrFlags(0), CTX)


@pytest.mark.expect_log("zonefs_py.drain.manager", "ERROR", "injected transient")
async def test_write_or_truncate_of_evicted_file(tmp_path: Path,
                                                 clock: trio.testing.MockClock) -> None:
    """Opening an evicted file for writing restores it first, or is refused (EIO) when
    the store is unreachable; truncation to 0 needs no bytes and no store."""
    data = payload(2 * PART + 7, 6)
    async with mounted(tmp_path / "img", create=True, options=OPTIONS) as fs:
        store = use_fake(fs)
        await setup_dir(fs)
        for name in ("a.pt", "b.pt"):
            await write_file(fs, f"/ck/{name}", data)
        a, b = await resolve(fs, "/ck/a.pt"), await resolve(fs, "/ck/b.pt")
        async with drainer_running(fs):
            await wait_for(lambda: state_of(fs, a) == state_of(fs, b) == "drained")
        for ino in (a, b):
            await fs.setxattr(ino, STATE_XATTR, b"evicted", XattrFlags(0), CTX)
        store.fail_always = "transient"
        with pytest.raises(errors.IOFailure):
            await fs.open(a, os.O_RDWR)
        assert state_of(fs, a) == "evicted"
        fh = await fs.open(b, os.O_WRONLY | os.O_TRUNC)  # no bytes needed
        await fs.release(fh)
        assert state_of(fs, b) == "local"
        assert (await fs.getattr(b)).size == 0
        store.fail_always = None
        fh = await fs.open(a, os.O_RDWR)
        try:
            assert state_of(fs, a) == "drained"
            await fs.write(fh, 0, b"X")
            assert state_of(fs, a) == "local"
            assert await fs.read(fh, 0, 3) == b"X" + data[1:3]
        finally:
            await fs.release(fh)


async def test_fsck_flags_an_evicted_file_with_data(tmp_path: Path) -> None:
    """INV-21: corrupt one thing (an EVICTED record on a file that keeps its extents);
    fsck flags exactly that; the same image with a proper eviction is clean."""
    from zonefs_py.fsck import check_filesystem

    image = tmp_path / "img"
    async with mounted(image, create=True, options=OPTIONS, fsck_after=False) as fs:
        await setup_dir(fs)
        await write_file(fs, "/ck/a.pt", b"abc" * 5000)
        ino = await resolve(fs, "/ck/a.pt")
        fs._txn([DrainRecord(DrainState.EVICTED, b"s3://ckpts/run1/a.pt", 15000, 1,
                             b"etag").op(ino)])
    dev = open_image(image, read_only=True)
    try:
        report = check_filesystem(dev)
    finally:
        dev.close()
    assert [f.invariant for f in report.findings] == ["INV-21"]
    async with mounted(image, options=OPTIONS) as fs:  # fsck clean after: evicted for real
        fs._txn([(OpType.TRUNCATE, ino, 0)])
