"""Every request answered exactly once, without a mount (issue 42).

The adapter's wrapper (`fuse_ops._handler`) against an engine that fails in
every way, the return checks (`REPLY_CHECKS`) against what pyfuse3 3.5 can
convert, fuseext's answers for FALLOCATE and COPY_FILE_RANGE, the stuck-request
report, and the census's part of `stat` and the metrics. The same through a
real mount: tests/integration/test_answered.py.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pyfuse3
import pytest
import trio
import trio.testing

from zonefs_py import fuse_ops, fuseext, statusview
from zonefs_py.census import StuckRequestReport
from zonefs_py.daemon.options import MountConfig, MountError
from zonefs_py.fs.api import Attr, DirEntry
from zonefs_py.metrics import render

pytestmark = pytest.mark.expect_log("zonefs_py", "ERROR",
                                    "switching to read-only failsafe|handler (failed|returned)")


class Boom(BaseException):
    """A BaseException that is not an Exception (as KeyboardInterrupt is)."""


class FailingEngine:
    """Every engine method raises `exc` (sync and async alike: raised at the call)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc
        self.failsafe: str | None = None

    def enter_failsafe(self, reason: str) -> None:
        self.failsafe = reason

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def fail(*args: Any, **kwargs: Any) -> Any:
            raise self.exc
        return fail


CTX = pyfuse3.RequestContext()
ENTRY = pyfuse3.EntryAttributes()
FIELDS = pyfuse3.SetattrFields()
#: Arguments of each handler (after self), as pyfuse3 passes them.
ARGS: dict[str, tuple[Any, ...]] = {
    "lookup": (1, b"a", CTX), "getattr": (1, CTX), "setattr": (1, ENTRY, FIELDS, None, CTX),
    "readlink": (1, CTX), "access": (1, 4, CTX), "mknod": (1, b"a", 0o10644, 0, CTX),
    "mkdir": (1, b"a", 0o755, CTX), "symlink": (1, b"a", b"t", CTX), "link": (2, 1, b"a", CTX),
    "unlink": (1, b"a", CTX), "rmdir": (1, b"a", CTX), "rename": (1, b"a", 1, b"b", 0, CTX),
    "open": (2, 0, CTX), "create": (1, b"a", 0o644, 0, CTX), "read": (3, 0, 4096),
    "write": (3, 0, b"x"), "flush": (3,), "release": (3,), "fsync": (3, False),
    "_fallocate": (3, 0, 0, 4096), "_copy_file_range": (3, 0, 4, 0, 4096, 0),
    "opendir": (1, CTX), "readdir": (5, 0, None), "releasedir": (5,), "fsyncdir": (5, False),
    "statfs": (CTX,), "getxattr": (2, b"user.a", CTX), "setxattr": (2, b"user.a", b"v", CTX),
    "listxattr": (2, CTX), "removexattr": (2, b"user.a", CTX),
}
#: Handlers that answer without the engine (poll: ENOSYS by design).
NO_ENGINE = {"poll"}


def ops_over(engine: Any) -> fuse_ops.Operations:
    return fuse_ops.Operations(engine)


def test_every_handler_is_listed_with_arguments() -> None:
    assert set(ARGS) | NO_ENGINE == set(fuse_ops.REPLY_CHECKS)


@pytest.mark.parametrize("name", sorted(ARGS))
@pytest.mark.parametrize("exc", [RuntimeError("bug"), Boom("base"), KeyError("k")],
                         ids=["Exception", "BaseException", "KeyError"])
async def test_an_unexpected_failure_is_eio_and_failsafe(name: str, exc: BaseException) -> None:
    engine = FailingEngine(exc)
    ops = ops_over(engine)
    with pytest.raises(pyfuse3.FUSEError) as info:
        await getattr(ops, name)(*ARGS[name])
    assert info.value.errno == errno.EIO
    assert ops.failsafe_reason is not None
    assert engine.failsafe is not None


async def test_cancellation_at_shutdown_passes_through() -> None:
    class Waits:
        async def statfs(self) -> None:
            await trio.sleep_forever()

    ops = ops_over(Waits())
    with trio.CancelScope() as scope:
        scope.cancel()
        await ops.statfs(CTX)
    assert scope.cancelled_caught
    assert ops.failsafe_reason is None


async def test_a_value_pyfuse3_cannot_answer_with_is_eio() -> None:
    class Wrong:
        async def readlink(self, ino: int) -> str:
            return "not bytes"  # PyBytes_AsString would raise inside pyfuse3

    ops = ops_over(Wrong())
    with pytest.raises(pyfuse3.FUSEError) as info:
        await ops.readlink(1, CTX)
    assert info.value.errno == errno.EIO
    assert ops.failsafe_reason is not None
    assert "readlink returned str" in ops.failsafe_reason


@pytest.mark.expect_log("zonefs_py.fuse_ops", "WARNING", "error while in failsafe")
async def test_an_unprintable_failure_is_still_answered() -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise ValueError("no text")

    class Garbage:
        def __repr__(self) -> str:
            raise ValueError("no text")

    class Engine:
        async def statfs(self) -> None:
            raise Unprintable()

        async def readlink(self, ino: int) -> Garbage:
            return Garbage()

    ops = ops_over(Engine())
    for call in (ops.statfs(CTX), ops.readlink(1, CTX)):
        with pytest.raises(pyfuse3.FUSEError) as info:
            await call
        assert info.value.errno == errno.EIO


async def test_a_failed_readdir_takes_back_its_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    # pyfuse3 drops the entries already added when readdir fails: no kernel reference.
    class Dir:
        def __init__(self) -> None:
            self.lookups: list[int] = []
            self.forgotten: list[tuple[int, int]] = []

        async def readdir(self, fh: int, offset: int) -> list[DirEntry]:
            return [DirEntry(name, replace(_attr(), ino=ino), i + 1) for i, (name, ino) in
                    enumerate([(b".", 1), (b"a", 5), (b"b", 6), (b"c", 7)]) if i >= offset]

        def add_lookup(self, ino: int) -> None:
            self.lookups.append(ino)

        def forget(self, inodes: list[tuple[int, int]]) -> None:
            self.forgotten += inodes

    replies = iter([True, True, True])

    def reply(token: object, name: bytes, attr: object, next_id: int) -> bool:
        if next(replies, None) is None:
            raise MemoryError("calloc")
        return True

    monkeypatch.setattr(pyfuse3, "readdir_reply", reply)
    engine = Dir()
    with pytest.raises(pyfuse3.FUSEError):
        await ops_over(engine).readdir(5, 0, cast(pyfuse3.ReaddirToken, None))
    assert engine.lookups == [5, 6]
    assert engine.forgotten == [(5, 1), (6, 1)]


async def test_access_answers_through_the_wrapper() -> None:
    # ACCESS never reaches a default_permissions mount: its handler is tested here.
    class Allows:
        async def access(self, ino: int, mode: int, ctx: Any) -> None:
            return None

    assert await ops_over(Allows()).access(1, 4, CTX) is True


def _attr() -> Attr:
    return Attr(ino=5, mode=0o100644, nlink=1, uid=0, gid=0, rdev=0, size=0, blocks=0,
                atime_ns=0, mtime_ns=0, ctime_ns=0)


def _released_view() -> memoryview:
    view = memoryview(b"abc")
    view.release()
    return view


@pytest.mark.parametrize(("name", "value", "args", "ok"), [
    ("read", b"x" * 4096, (None, 3, 0, 4096), True),
    ("read", b"x" * 4097, (None, 3, 0, 4096), False),  # more than asked
    ("read", memoryview(bytearray(10))[::2], (None, 3, 0, 4096), False),  # not contiguous
    ("read", _released_view(), (None, 3, 0, 4096), False),
    ("read", "text", (None, 3, 0, 4096), False),
    ("write", 1, (None, 3, 0, b"x"), True),
    ("write", 2, (None, 3, 0, b"x"), False),  # the kernel refuses more than it sent
    ("write", True, (None, 3, 0, b"x"), False),
    ("write", -1, (None, 3, 0, b"x"), False),
    ("opendir", 1 << 64, (), False),
    ("listxattr", [b"user.a", b"user.b"], (), True),
    ("listxattr", [b"user.a", "user.b"], (), False),
    ("listxattr", [b"user\0a"], (), False),
    ("create", (pyfuse3.FileInfo(fh=1), ENTRY), (), True),
    ("create", [pyfuse3.FileInfo(fh=1), ENTRY], (), False),
    ("access", 1, (), False),
    ("unlink", 0, (), False),
    ("lookup", None, (), False),
])
def test_reply_checks(name: str, value: object, args: tuple[Any, ...], ok: bool) -> None:
    assert fuse_ops.REPLY_CHECKS[name](value, args) is ok


async def test_a_good_answer_passes() -> None:
    class Good:
        async def getattr(self, ino: int) -> Attr:
            return _attr()

    entry = await ops_over(Good()).getattr(5, CTX)
    assert entry.st_ino == 5


class FakeLib:
    """The two reply functions of zonefs_py._fuseext, recorded."""

    def __init__(self) -> None:
        self.replies: list[tuple[str, int]] = []

    def zfx_reply_err(self, req: object, err: int) -> int:
        self.replies.append(("err", err))
        return 0

    def zfx_reply_write(self, req: object, count: int) -> int:
        self.replies.append(("write", count))
        return 0


@pytest.fixture
def fake_ext(monkeypatch: pytest.MonkeyPatch) -> FakeLib:
    lib = FakeLib()
    monkeypatch.setattr(fuseext, "_ext", type("Ext", (), {"lib": lib})())
    return lib


@pytest.mark.expect_log("zonefs_py.fuseext", "ERROR", "answered EIO")
@pytest.mark.parametrize(("result", "answer"), [
    ((0, 4096), ("write", 4096)), ((errno.ENOSPC, 0), ("err", errno.ENOSPC)),
    (None, ("err", errno.EIO)), ((0, -1), ("err", errno.EIO)), ((0, 1 << 40), ("err", errno.EIO)),
    (Boom(), ("err", errno.EIO)), (RuntimeError(), ("err", errno.EIO)),
])
async def test_copy_file_range_is_answered_once(fake_ext: FakeLib, monkeypatch: pytest.MonkeyPatch,
                                                result: object,
                                                answer: tuple[str, int]) -> None:
    async def handler(*args: int) -> Any:
        if isinstance(result, BaseException):
            raise result
        return result

    monkeypatch.setattr(fuseext, "_copy_handler", handler)
    await fuseext._run_copy(object(), 3, 0, 4, 0, 4096, 0)
    assert fake_ext.replies == [answer]


@pytest.mark.expect_log("zonefs_py.fuseext", "ERROR", "answered EIO")
@pytest.mark.parametrize(("result", "err"), [
    (0, 0), (errno.ENOSPC, errno.ENOSPC), ("0", errno.EIO), (-5, errno.EIO), (Boom(), errno.EIO),
])
async def test_fallocate_is_answered_once(fake_ext: FakeLib, monkeypatch: pytest.MonkeyPatch,
                                          result: object, err: int) -> None:
    async def handler(*args: int) -> Any:
        if isinstance(result, BaseException):
            raise result
        return result

    monkeypatch.setattr(fuseext, "_handler", handler)
    await fuseext._run_fallocate(object(), 3, 3, 0, 0, 4096)
    assert fake_ext.replies == [("err", err)]


async def test_a_cancelled_fallocate_is_answered_eintr(fake_ext: FakeLib,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    async def handler(*args: int) -> int:
        await trio.sleep_forever()
        return 0

    monkeypatch.setattr(fuseext, "_handler", handler)
    with trio.move_on_after(0.01):
        await fuseext._run_fallocate(object(), 3, 3, 0, 0, 4096)
    assert fake_ext.replies == [("err", errno.EINTR)]


class Waiting:
    """A fake census: the requests in flight, with ages."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def __call__(self, older_than_s: float) -> tuple[list[dict[str, Any]], int]:
        rows = [r for r in self.rows if r["age_s"] >= older_than_s]
        return rows, len(rows)


@pytest.mark.expect_log("zonefs_py.census", "WARNING", "FUSE request waiting")
def test_stuck_requests_are_logged_once_each(caplog: pytest.LogCaptureFixture) -> None:
    census = Waiting()
    report = StuckRequestReport(30.0, census)
    census.rows = [{"id": 7, "opcode": "READ", "inode": 12, "age_s": 10.0}]
    with caplog.at_level(logging.WARNING, "zonefs_py.census"):
        assert report.check() == []
        census.rows[0]["age_s"] = 31.0
        assert report.check() == census.rows
        census.rows[0]["age_s"] = 40.0
        census.rows.append({"id": 9, "opcode": "COPY_FILE_RANGE", "inode": 4, "age_s": 30.5})
        report.check()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "READ of inode 12 (request #7)" in lines[0]
    assert "COPY_FILE_RANGE of inode 4" in lines[1]
    assert report.status() == {"threshold_s": 30.0, "waiting": census.rows,
                               "waiting_total": 2, "reported_total": 2}


@pytest.mark.expect_log("zonefs_py.census", "WARNING", "FUSE request waiting")
async def test_the_report_runs_until_stopped(autojump_clock: trio.testing.MockClock) -> None:
    census = Waiting()
    census.rows = [{"id": 1, "opcode": "STATFS", "inode": 1, "age_s": 99.0}]
    report = StuckRequestReport(1.0, census)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(report.run)
        await trio.sleep(10)
        report.stop()
    assert report.reported_total == 1


def test_the_threshold_is_a_mount_option(tmp_path: Path) -> None:
    dev = tmp_path / "d.img"
    dev.write_bytes(b"")
    assert MountConfig.build(str(dev), str(tmp_path), []).stuck_request_s == 30.0
    assert MountConfig.build(str(dev), str(tmp_path),
                             ["stuck_request_s=2.5"]).stuck_request_s == 2.5
    with pytest.raises(MountError, match="bad value"):
        MountConfig.build(str(dev), str(tmp_path), ["stuck_request_s=0"])


STUCK_DOC: dict[str, Any] = {
    "requests": {"READ": 10, "GETXATTR": 2}, "requests_answered": {"READ": 9, "GETXATTR": 1},
    "requests_in_flight": 2,
    "stuck_requests": {"threshold_s": 30.0, "waiting_total": 1, "reported_total": 1,
                       "waiting": [{"id": 4, "opcode": "READ", "inode": 12, "age_s": 45.0}]},
}


def test_stat_shows_the_stuck_request() -> None:
    line = statusview.stuck_line(STUCK_DOC)
    assert "1 waiting over 30 s: READ of inode 12 for 45 s" in line
    assert "2 in flight" in line


def test_metrics_export_received_answered_and_stuck() -> None:
    text = render(STUCK_DOC)
    assert 'zonefs_fuse_requests_total{op="READ"} 10.0' in text
    assert 'zonefs_fuse_requests_answered_total{op="READ"} 9.0' in text
    assert "zonefs_fuse_requests_in_flight 2.0" in text
    assert "zonefs_fuse_requests_stuck 1.0" in text
    assert "zonefs_fuse_oldest_stuck_request_seconds 45.0" in text


@pytest.mark.expect_log("zonefs_py.fuseext", "WARNING", "imported before zonefs_py")
def test_the_census_counts_only_when_pyfuse3_came_first(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    import zonefs_py

    monkeypatch.setattr(zonefs_py, "PYFUSE3_IMPORTED_FIRST", True)
    with caplog.at_level(logging.WARNING, "zonefs_py.fuseext"):
        assert fuseext.census_arm()
    assert "counts requests received only" in caplog.text
    monkeypatch.setattr(zonefs_py, "PYFUSE3_IMPORTED_FIRST", False)
    assert fuseext.census_arm()  # as the daemon arms it
