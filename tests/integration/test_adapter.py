"""The FUSE adapter in-process, without a mount: the errno table and the failsafe boundary.

These run the real `fuse_ops.Operations` handlers that need no pyfuse3 request
context (read, write, fsync, forget) against a minimal engine double.
"""

from __future__ import annotations

import errno
import inspect
from typing import Any

import pyfuse3
import pytest

from zonefs_py import errors
from zonefs_py.fuse_ops import ERRNO_OF, Operations, errno_of

pytestmark = pytest.mark.integration


class _Engine:
    """Just enough of the engine for the handlers under test; `fail_with` is raised by read."""

    def __init__(self, fail_with: BaseException | None = None) -> None:
        self.fail_with = fail_with
        self.failsafe_reasons: list[str] = []
        self.forgotten: list[tuple[int, int]] = []

    async def read(self, fh: int, offset: int, length: int) -> bytes:
        if self.fail_with is not None:
            raise self.fail_with
        return b"r" * length

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        if self.failsafe_reasons:
            raise errors.ReadOnly("failsafe")
        return len(data)

    def forget(self, forgets: list[tuple[int, int]]) -> None:
        self.forgotten.extend(forgets)
        raise RuntimeError("bug in forget")

    def enter_failsafe(self, reason: str) -> None:
        self.failsafe_reasons.append(reason)


def _ops(engine: _Engine) -> Operations:
    fs: Any = engine  # duck-typed: only the methods the tests call
    return Operations(fs)


def test_every_domain_error_has_an_errno() -> None:
    domain = [cls for _, cls in inspect.getmembers(errors, inspect.isclass)
              if issubclass(cls, errors.ZoneFSError) and cls is not errors.ZoneFSError]
    assert domain
    missing = [cls.__name__ for cls in domain if cls not in ERRNO_OF]
    assert missing == []


def test_subclass_maps_like_its_base() -> None:
    class Vanished(errors.NotFound):
        pass

    assert errno_of(Vanished("x")) == errno.ENOENT


@pytest.mark.parametrize(("exc", "code"), [
    (errors.NotFound("x"), errno.ENOENT),
    (errors.NoSpace("x"), errno.ENOSPC),
    (errors.IOFailure("x"), errno.EIO),
    (errors.ReadOnly("x"), errno.EROFS),
])
async def test_domain_error_becomes_errno_without_failsafe(exc: Exception, code: int) -> None:
    engine = _Engine(fail_with=exc)
    with pytest.raises(pyfuse3.FUSEError) as info:
        await _ops(engine).read(1, 0, 10)
    assert info.value.errno == code
    assert engine.failsafe_reasons == []


@pytest.mark.expect_log(
    "zonefs_py.fuse_ops", "ERROR",
    "switching to read-only failsafe: unexpected KeyError")
async def test_unexpected_exception_is_eio_and_failsafe() -> None:
    engine = _Engine(fail_with=KeyError("bug"))
    ops = _ops(engine)
    with pytest.raises(pyfuse3.FUSEError) as info:
        await ops.read(1, 0, 10)
    assert info.value.errno == errno.EIO
    assert len(engine.failsafe_reasons) == 1
    assert "KeyError" in engine.failsafe_reasons[0]
    assert ops.failsafe_reason is not None
    # Later mutations are refused by the engine (EROFS), reads of good data still work.
    with pytest.raises(pyfuse3.FUSEError) as info:
        await ops.write(1, 0, b"x")
    assert info.value.errno == errno.EROFS


@pytest.mark.expect_log(
    "zonefs_py.fuse_ops", "ERROR",
    "switching to read-only failsafe: read: bad extent")
async def test_corruption_error_enters_failsafe() -> None:
    engine = _Engine(fail_with=errors.CorruptionError("bad extent; run zonefs-py fsck"))
    with pytest.raises(pyfuse3.FUSEError) as info:
        await _ops(engine).read(1, 0, 10)
    assert info.value.errno == errno.EIO
    assert engine.failsafe_reasons


@pytest.mark.expect_log("zonefs_py.fuse_ops", "ERROR", "unexpected RuntimeError in forget")
async def test_forget_never_raises() -> None:
    engine = _Engine()
    await _ops(engine).forget([(5, 2)])
    assert engine.forgotten == [(5, 2)]
    assert engine.failsafe_reasons
