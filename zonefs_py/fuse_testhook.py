"""TEST HOOK: make a request handler of the FUSE adapter fail on purpose (issue 42).

Off unless the daemon runs with `ZONEFS_PY_FUSE_TEST_FAIL` set: then
`fuse_ops.Operations` wraps its engine in `FailingEngine` and arms a
`FailureInjector` through the root's `trusted.zonefs.test_fail` xattr
(tests/integration/test_answered.py). Users never set it; with it unset
nothing here is used.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Coroutine
from typing import Any

import pyfuse3
import trio

from zonefs_py import errors, fuseext
from zonefs_py.fs.api import FileSystemAPI
from zonefs_py.fuse_replies import REPLY_CHECKS

log = logging.getLogger(__name__)


class InjectedFailure(RuntimeError):
    """TEST HOOK: the exception `FailureInjector` raises (an Exception)."""


class InjectedBaseFailure(BaseException):
    """TEST HOOK: the BaseException (not an Exception) `FailureInjector` raises."""


class Garbage:
    """TEST HOOK: what a handler returns under `garbage` (no handler accepts it)."""

    def __repr__(self) -> str:
        return "<injected garbage>"


class Unchecked(Garbage):
    """TEST HOOK: garbage the wrapper lets through (`unchecked`), for pyfuse3 to fail on."""


#: pyfuse3's module-level coroutine functions its C handlers call, by handler name
#: (TEST HOOK `dispatch`); the default is fuse_<name>_async.
_PYFUSE3_ASYNC = {"readdir": ("fuse_readdirplus_async",),
                  "write": ("fuse_write_async", "fuse_write_buf_async")}


class FailureInjector:
    """TEST HOOK: make the next call of a named handler fail, once (tests/integration/
    test_answered.py). Off unless the daemon runs with `ZONEFS_PY_FUSE_TEST_FAIL`
    set (`1`; `keep-writable`: injected failures do not enter the failsafe, so that
    one mount can try every handler). Armed by setxattr of `trusted.zonefs.test_fail`
    on the root, value `HANDLER=KIND`:

      * ``raise``: the handler's first engine call raises `InjectedFailure`;
      * ``base``: the same with `InjectedBaseFailure` (a BaseException);
      * ``garbage``: the handler runs, then returns an object pyfuse3 cannot use;
      * ``none``: the handler runs, then returns None;
      * ``unchecked``: as ``garbage``, but the wrapper lets the value through, so
        pyfuse3's own conversion fails after the handler returned (its coroutine
        raises: `fuseext.guard_pyfuse3` must answer);
      * ``dispatch``: the request fails before any handler runs: pyfuse3's C-level
        handler raises (its coroutine function is replaced for one call), or for
        fallocate / copy_file_range the fuseext callback does (`fuseext`);
      * ``stall``: the handler waits until the value ``release`` is written (at
        most 60 s), then runs: a stuck request for the stuck-request report.

    With the hook off, `_handler` checks one module global and the engine is not
    wrapped.
    """

    XATTR = b"trusted.zonefs.test_fail"
    ENV = "ZONEFS_PY_FUSE_TEST_FAIL"
    KINDS = ("raise", "base", "garbage", "none", "unchecked", "dispatch", "stall")
    STALL_MAX_S = 60.0

    def __init__(self, keep_writable: bool) -> None:
        self.keep_writable = keep_writable
        #: handler name -> kind, for its next call.
        self.armed: dict[str, str] = {}
        #: Set while a `raise`/`base` injection waits for the handler's engine call.
        self.engine_fails: type[BaseException] | None = None
        self._release = trio.Event()

    @classmethod
    def from_env(cls) -> FailureInjector | None:
        value = os.environ.get(cls.ENV, "")
        if not value:
            return None
        log.warning("TEST HOOK %s=%s: request handlers can be made to fail", cls.ENV, value)
        return cls(keep_writable=value == "keep-writable")

    def arm(self, value: bytes) -> None:
        """Parse `HANDLER=KIND` (or `release`) and arm it; raises InvalidArgument."""
        text = value.decode("ascii", errors="replace").strip()
        if text == "release":
            self._release.set()
            return
        name, _, kind = text.partition("=")
        if name not in {n.lstrip("_") for n in REPLY_CHECKS} or kind not in self.KINDS:
            raise errors.InvalidArgument(f"test_fail: bad value {value!r}")
        if kind != "dispatch":
            self.armed[name] = kind
        elif name in ("fallocate", "copy_file_range"):
            fuseext.fail_next_start(name)
        else:
            self._break_pyfuse3(name)

    @staticmethod
    def _break_pyfuse3(name: str) -> None:
        """Make pyfuse3's C handler for `name` raise on its next call (then restore)."""
        attrs = _PYFUSE3_ASYNC.get(name, (f"fuse_{name}_async",))
        saved = {attr: getattr(pyfuse3, attr) for attr in attrs}

        def failing(*args: Any) -> Any:
            for attr, fn in saved.items():
                setattr(pyfuse3, attr, fn)
            raise InjectedFailure(f"injected into pyfuse3's dispatch of {name}")

        log.warning("TEST HOOK: pyfuse3's dispatch of %s fails once", name)
        for attr in attrs:
            setattr(pyfuse3, attr, failing)

    async def call(self, name: str, fn: Callable[..., Coroutine[Any, Any, Any]],
                   args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        kind = self.armed.pop(name, None)
        if kind is None:
            return await fn(*args, **kwargs)
        log.warning("TEST HOOK: %s fails once (%s)", name, kind)
        if kind == "stall":
            with trio.move_on_after(self.STALL_MAX_S):
                await self._release.wait()
            self._release = trio.Event()
            return await fn(*args, **kwargs)
        if kind in ("raise", "base"):
            self.engine_fails = InjectedFailure if kind == "raise" else InjectedBaseFailure
            try:
                return await fn(*args, **kwargs)
            finally:
                pending, self.engine_fails = self.engine_fails, None
                if pending is not None:  # the handler made no engine call: fail here
                    raise pending(f"injected into {name} (no engine call)")
        await fn(*args, **kwargs)
        if kind == "none":
            return None
        return Unchecked() if kind == "unchecked" else Garbage()

    def engine_call(self, attr: str) -> None:
        """Raise the armed exception at the handler's first engine call."""
        exc, self.engine_fails = self.engine_fails, None
        if exc is not None:
            raise exc(f"injected into the engine call {attr}")


class FailingEngine:
    """TEST HOOK: the engine as the adapter sees it while `FailureInjector` is on: every
    method call first lets the injector raise."""

    def __init__(self, fs: FileSystemAPI, injector: FailureInjector) -> None:
        self._fs = fs
        self._injector = injector

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._fs, attr)
        if not callable(value):
            return value
        injector = self._injector

        def call(*args: Any, **kwargs: Any) -> Any:
            injector.engine_call(attr)
            return value(*args, **kwargs)

        return call
