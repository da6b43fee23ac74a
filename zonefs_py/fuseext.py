"""FUSE requests pyfuse3 does not pass on (FALLOCATE, COPY_FILE_RANGE: issue 28), and
the request census (issue 29).

pyfuse3 (up to 3.5 at least) registers no `fallocate` or `copy_file_range`
handler with libfuse, so libfuse answers them with ENOSYS: the kernel then
refuses every fallocate(2) on the mount with EOPNOTSUPP, and copies every
copy_file_range(2) itself through READ and WRITE requests. `zonefs_py._fuseext`
(native/zonefs_fuseext.c) defines `fuse_session_new` itself.
`zonefs_py/__init__.py` promotes that module to the global symbol
scope *before* pyfuse3 is imported: Python loads extension modules with
RTLD_NOW, so pyfuse3's reference to `fuse_session_new` is bound when it is
imported, and the global scope is searched before pyfuse3's own libfuse3.
`install()` arms it: at `pyfuse3.init` it adds our handlers to the table
pyfuse3 hands to libfuse. Unarmed, our `fuse_session_new` only passes the
call on.

Requests arrive on the trio thread, inside pyfuse3's call to
`fuse_session_process_buf`; each is run as a task in the nursery the daemon
hands over with `serving(nursery)` around `pyfuse3.main` (the callback itself
must not block) and answered exactly once (`fuse_reply_err`, or
`fuse_reply_write` with the bytes a copy made): whatever the handler raises
or returns, the task's `finally` answers (EIO for anything unexpected, with
one log line); only trio's cancellation at shutdown leaves it to the end of
the session. One that arrives outside `serving` (none should: the session
runs inside it) is answered EIO at once and logged; a callback that fails
before starting the task returns 0 to C, which answers EIO.

The write gate (issue 42): `gate_add(fh)` makes the C side answer ENOSPC to
a GETATTR that carries handle `fh` (the one write(2) sends once the inode's
attributes were invalidated; stat(2) sends none), so that write(2) fails
before the page cache takes its bytes (`zonefs_py/writegate.py`).

The census (native/zonefs_census.h): `census_arm()` (before `pyfuse3.init`)
wraps every handler in libfuse's table with a C function that records the
request (received, by kernel opcode; in flight, with its inode and arrival
time), and libfuse's `fuse_reply_*` functions (also defined in the module,
so they win in the global scope) end it (answered). `census()` returns the
received counts by opcode name since the mount, GETXATTR also by attribute
name (`GETXATTR:<name>`); `census_answered()` the answered ones; `waiting()`
the requests in flight longer than a threshold (`zonefs_py.census` reports
them). The C dispatch guard answers EIO for a request whose pyfuse3 handler
failed before taking it (`_dispatch_failed` logs it). It costs an increment,
a clock read and a small hash insert and delete per request, so the daemon
always arms it; the no-op server in bench/ arms it too, so requests per file
compare in one run.

Caveats: `install()` must run before `pyfuse3.init`, in the process that
mounts, and pyfuse3 must be imported after `zonefs_py` (true for the CLI and
the daemon; a program that imports pyfuse3 first keeps libfuse's own
functions: no FALLOCATE, and the census counts received requests only, since
the answers bypass it: `census_arm` warns). `installed()` tells whether the
handler went in; when not, fallocate stays EOPNOTSUPP as before and the
adapter logs a warning. One mount per process (pyfuse3's limit too).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeGuard

import trio

log = logging.getLogger(__name__)

#: (ino, fh, mode, offset, length) -> errno (0 for success).
FallocateHandler = Callable[[int, int, int, int, int], Awaitable[int]]
#: (fh_in, off_in, fh_out, off_out, length, flags) -> (errno, bytes copied).
CopyHandler = Callable[[int, int, int, int, int, int], Awaitable[tuple[int, int]]]

_handler: FallocateHandler | None = None
_copy_handler: CopyHandler | None = None
_ext: Any = None
#: TEST HOOK (`fail_next_start`): task names whose next start raises.
_fail_start: set[str] = set()
#: Where requests run while the session serves (`serving`), else None.
_nursery: trio.Nursery | None = None


@contextmanager
def serving(nursery: trio.Nursery) -> Iterator[None]:
    """Run the requests that arrive meanwhile as tasks of `nursery` (around
    `pyfuse3.main`)."""
    global _nursery
    if _nursery is not None:
        raise RuntimeError("fuseext.serving() is already active (one mount per process)")
    _nursery = nursery
    try:
        yield
    finally:
        _nursery = None


def _start(fn: Callable[..., Awaitable[None]], req: Any, *args: Any, name: str) -> int:
    """Start a request's task in the serving nursery; with none, answer EIO now.

    Returns 1: the request is taken (answered here, or by its task). Raising
    makes the C callback return 0, and C answers EIO (`_callback_failed`)."""
    if _fail_start and name in _fail_start:
        _fail_start.discard(name)
        raise RuntimeError(f"TEST HOOK: starting {name} fails once")
    if _nursery is None:
        log.error("%s request arrived with no serving nursery; answered EIO", name)
        _ext.lib.zfx_reply_err(req, errno.EIO)
        return 1
    _nursery.start_soon(fn, req, *args, name=name)
    return 1


def fail_next_start(handler: str) -> None:
    """TEST HOOK (fuse_testhook.FailureInjector): the next `handler` request ("fallocate",
    "copy_file_range") fails in its callback, before its task starts."""
    _fail_start.add("fuse-" + handler.replace("_", "-"))


def _callback_failed(exc_type: type[BaseException] | None, exc: BaseException | None,
                     tb: Any) -> None:
    """cffi's onerror for the request callbacks: the request was not taken (C answers
    it EIO); one log line with the traceback."""
    log.error("a FUSE request could not be started; answered EIO",
              exc_info=(exc_type, exc, tb) if exc_type is not None and exc is not None
              else None)


def _dispatch_failed(opname: str, exc: BaseException | None, answered: int) -> None:
    """Called by the C dispatch guard (native/zonefs_fuseext.c, zfx_after_dispatch):
    pyfuse3's handler for an `opname` request failed before taking it; C answered
    it EIO (`answered`) unless it had an answer already. One log line."""
    log.error("pyfuse3 failed to take a %s request (%s: %s); %s", opname,
              type(exc).__name__, exc,
              "answered EIO" if answered else "it had been answered",
              exc_info=exc if isinstance(exc, BaseException) else None)


def extension() -> Any:
    """The extension module, loaded and in the global symbol scope (or None): the
    data plane's dispatcher (native/zonefs_dispatch.c) is compiled into it."""
    return _load()


def _load() -> Any:
    """Import the extension and put it into the global symbol scope (or None)."""
    global _ext
    if _ext is not None:
        return _ext
    try:
        import zonefs_py._fuseext as fuseext_mod
    except ImportError as exc:
        log.warning("fallocate unavailable: zonefs_py._fuseext is not built (%s)", exc)
        return None
    try:
        ctypes.CDLL(fuseext_mod.__file__, mode=os.RTLD_GLOBAL | getattr(os, "RTLD_NOLOAD", 0))
    except OSError as exc:
        log.warning("fallocate unavailable: %s", exc)
        return None
    _register(fuseext_mod)
    _ext = fuseext_mod
    return _ext


def _register(ext: Any) -> None:
    @ext.ffi.def_extern(error=0, onerror=_callback_failed)
    def zfx_py_fallocate(req: Any, ino: int, mode: int, offset: int, length: int,
                         fh: int) -> int:
        return _start(_run_fallocate, req, ino, fh, mode, offset, length,
                      name="fuse-fallocate")

    @ext.ffi.def_extern(error=0, onerror=_callback_failed)
    def zfx_py_copy_file_range(req: Any, fh_in: int, off_in: int, fh_out: int, off_out: int,
                               length: int, flags: int) -> int:
        return _start(_run_copy, req, fh_in, off_in, fh_out, off_out, length, flags,
                      name="fuse-copy-file-range")


def _valid_errno(value: object) -> TypeGuard[int]:
    """An errno a handler may answer: an int in 0..4095 (0: success)."""
    return type(value) is int and 0 <= value < 4096


def is_shutdown_cancel(exc: BaseException) -> bool:
    """trio's cancellation (alone or a group of only it): the serve is being torn
    down; the session ends with it and the kernel fails what is still in flight."""
    if isinstance(exc, BaseExceptionGroup):
        return all(is_shutdown_cancel(e) for e in exc.exceptions)
    return isinstance(exc, trio.Cancelled | GeneratorExit)


async def _answer_once(req: Any, what: str,
                       call: Callable[[], Awaitable[object]] | None,
                       accept: Callable[[object], tuple[int, int] | None],
                       reply_ok: Callable[[int], None]) -> None:
    """Run a request's handler and answer the request exactly once, whatever happens:
    `accept(result)` gives (errno, count) or None for a result no handler may return
    (answered EIO, one log line); a failure of the handler is EIO with its log line, as
    pyfuse3's are; the serve's teardown (trio's cancellation) answers EINTR and goes
    on. Success is `reply_ok(count)`, an error `zfx_reply_err`."""
    err, count = errno.EIO, 0
    try:
        if call is not None:
            result = await call()
            answer = accept(result)
            if answer is not None:
                err, count = answer
            else:
                log.error("%s handler returned %.200r; answered EIO", what, result)
    except BaseException as exc:
        if is_shutdown_cancel(exc):
            err = errno.EINTR
            raise
        log.error("%s handler failed; answered EIO", what, exc_info=exc)
    finally:
        if err:
            _ext.lib.zfx_reply_err(req, err)
        else:
            reply_ok(count)


async def _run_copy(req: Any, fh_in: int, off_in: int, fh_out: int, off_out: int,
                    length: int, flags: int) -> None:
    """The copy handler, answered once: the count copied, or an errno."""
    def accept(result: object) -> tuple[int, int] | None:
        if (isinstance(result, tuple) and len(result) == 2 and _valid_errno(result[0])
                and type(result[1]) is int and 0 <= result[1] <= min(length, 0xFFFFFFFF)):
            return result[0], result[1]
        return None

    handler = _copy_handler
    await _answer_once(
        req, "copy_file_range",
        None if handler is None else lambda: handler(fh_in, off_in, fh_out, off_out, length,
                                                     flags),
        accept, lambda count: _ext.lib.zfx_reply_write(req, count))


async def _run_fallocate(req: Any, ino: int, fh: int, mode: int, offset: int,
                         length: int) -> None:
    """The fallocate handler, answered once: its errno (0: done)."""
    handler = _handler
    await _answer_once(
        req, "fallocate",
        None if handler is None else lambda: handler(ino, fh, mode, offset, length),
        lambda result: (result, 0) if _valid_errno(result) else None,
        lambda _count: _ext.lib.zfx_reply_err(req, 0))


def install(fallocate: FallocateHandler, copy_file_range: CopyHandler) -> bool:
    """Arm the handlers for the next `pyfuse3.init`; False if unavailable."""
    global _handler, _copy_handler
    ext = _load()
    if ext is None:
        return False
    _handler = fallocate
    _copy_handler = copy_file_range
    ext.lib.zfx_arm(1)
    return True


#: pyfuse3's request coroutine functions (3.5, handlers.pxi) and their opcodes: its C
#: handlers look them up in the module at each request (`guard_pyfuse3`).
PYFUSE3_REQUEST_COROUTINES = {
    "fuse_lookup_async": "LOOKUP", "fuse_getattr_async": "GETATTR",
    "fuse_setattr_async": "SETATTR", "fuse_readlink_async": "READLINK",
    "fuse_mknod_async": "MKNOD", "fuse_mkdir_async": "MKDIR", "fuse_unlink_async": "UNLINK",
    "fuse_rmdir_async": "RMDIR", "fuse_symlink_async": "SYMLINK",
    "fuse_rename_async": "RENAME", "fuse_link_async": "LINK", "fuse_open_async": "OPEN",
    "fuse_read_async": "READ", "fuse_write_async": "WRITE", "fuse_write_buf_async": "WRITE",
    "fuse_flush_async": "FLUSH", "fuse_release_async": "RELEASE", "fuse_fsync_async": "FSYNC",
    "fuse_opendir_async": "OPENDIR", "fuse_readdirplus_async": "READDIRPLUS",
    "fuse_releasedir_async": "RELEASEDIR", "fuse_fsyncdir_async": "FSYNCDIR",
    "fuse_statfs_async": "STATFS", "fuse_setxattr_async": "SETXATTR",
    "fuse_getxattr_async": "GETXATTR", "fuse_listxattr_async": "LISTXATTR",
    "fuse_removexattr_async": "REMOVEXATTR", "fuse_access_async": "ACCESS",
    "fuse_poll_async": "POLL", "fuse_create_async": "CREATE",
}


def guard_pyfuse3(module: Any) -> int:
    """Wrap pyfuse3's request coroutine functions (in `module`, pyfuse3 itself) so that
    an exception escaping one, in pyfuse3's own code after our handler returned,
    answers its request EIO (if unanswered) with one log line, instead of ending
    pyfuse3's request loop with the request unanswered. Idempotent; returns how many
    are guarded (0 without the census, which identifies the request)."""
    if _ext is None:
        return 0
    guarded = 0
    for name, opname in PYFUSE3_REQUEST_COROUTINES.items():
        fn = getattr(module, name, None)
        if fn is None:
            log.debug("pyfuse3 has no %s: its requests are not guarded", name)
            continue
        if not getattr(fn, "_zonefs_guard", False):
            setattr(module, name, _guard(fn, opname))
        guarded += 1
    return guarded


def _guard(fn: Callable[..., Awaitable[None]], opname: str) -> Callable[..., Any]:
    lib = _ext.lib

    def start(*args: Any) -> Any:
        # Called by pyfuse3's C handler while the census dispatches the request:
        # zfx_current_seq is its arrival number (a C global read, no call).
        return _guarded(fn(*args), int(lib.zfx_current_seq), opname)

    start._zonefs_guard = True  # type: ignore[attr-defined]
    start.__wrapped__ = fn  # type: ignore[attr-defined]
    return start


async def _guarded(coro: Awaitable[None], seq: int, opname: str) -> None:
    """Await pyfuse3's request coroutine; answer EIO if it fails unanswered."""
    try:
        await coro
    except BaseException as exc:
        if is_shutdown_cancel(exc) or not seq:
            raise  # without its arrival number the request cannot be answered here
        answered = _ext.lib.zfx_census_fail(seq, errno.EIO)
        log.error("pyfuse3 failed in a %s request after its handler (%s: %s); %s", opname,
                  type(exc).__name__, exc,
                  "answered EIO" if answered else "it had been answered", exc_info=exc)


def census_arm() -> bool:
    """Count every request of the next `pyfuse3.init` by opcode; False if unavailable.

    When pyfuse3 was imported before zonefs_py its answers bypass the census: then
    only requests received are counted (nothing is tracked in flight, so nothing is
    reported stuck), with a warning."""
    import zonefs_py

    ext = _load()
    if ext is None:
        return False
    if zonefs_py.PYFUSE3_IMPORTED_FIRST:
        log.warning("pyfuse3 was imported before zonefs_py: the request census counts "
                    "requests received only (no answers, no stuck-request report)")
    ext.lib.zfx_census_arm(2 if zonefs_py.PYFUSE3_IMPORTED_FIRST else 1)
    return True


def census() -> dict[str, int]:
    """Requests received by FUSE opcode since the mount (only those seen), plus GETXATTR
    by name as `GETXATTR:<name>` and `forgotten_inodes`; {} when the census is not
    armed."""
    ext = _ext
    if ext is None:
        return {}
    lib, ffi = ext.lib, ext.ffi
    out: dict[str, int] = {}
    for slot in range(lib.zfx_census_slots()):
        count = int(lib.zfx_census_count(slot))
        if count:
            out[_opname(slot)] = count
    forgotten = int(lib.zfx_census_forgotten())
    if forgotten:
        out["forgotten_inodes"] = forgotten
    count_p = ffi.new("uint64_t *")
    for i in range(64):
        name = lib.zfx_census_xattr(i, count_p)
        if name == ffi.NULL:
            break
        out["GETXATTR:" + ffi.string(name).decode(errors="replace")] = int(count_p[0])
    return out


def _opname(slot: int) -> str:
    """The name of kernel opcode `slot` (`OP<n>` for one without a name)."""
    ext = _ext
    name = ext.lib.zfx_census_name(slot) if ext is not None else None
    if name is None or name == ext.ffi.NULL:
        return f"OP{slot}"
    return str(ext.ffi.string(name).decode())


def census_answered() -> dict[str, int]:
    """Requests answered by FUSE opcode since the mount (only those seen). FORGET and
    BATCH_FORGET, which get no answer by protocol, count when they are done; INIT
    once libfuse answers it. {} when the census is not armed."""
    ext = _ext
    if ext is None:
        return {}
    out: dict[str, int] = {}
    for slot in range(ext.lib.zfx_census_slots()):
        count = int(ext.lib.zfx_census_answered_count(slot))
        if count:
            out[_opname(slot)] = count
    return out


def in_flight() -> int:
    """Requests received and not answered yet (0 without the census)."""
    return int(_ext.lib.zfx_census_in_flight()) if _ext is not None else 0


def dispatch_failures() -> int:
    """Requests pyfuse3 failed to take, answered EIO by the C dispatch guard."""
    return int(_ext.lib.zfx_census_dispatch_failures()) if _ext is not None else 0


#: Most waiting requests `waiting()` lists.
WAITING_MAX = 64


def waiting(older_than_s: float, limit: int = WAITING_MAX) -> tuple[list[dict[str, Any]], int]:
    """The requests in flight for at least `older_than_s`, oldest first (at most
    `limit`), and how many there are in all: each {"id", "opcode", "inode", "age_s"}
    (`id`: the arrival number since the mount, unique)."""
    ext = _ext
    if ext is None:
        return [], 0
    out_p = ext.ffi.new("struct zfx_waiting[]", limit)
    total = int(ext.lib.zfx_census_waiting(out_p, limit, int(max(0.0, older_than_s) * 1e9)))
    rows = [{"id": int(w.seq), "opcode": _opname(int(w.opcode)), "inode": int(w.ino),
             "age_s": round(w.age_ns / 1e9, 3)} for w in out_p[0:min(total, limit)]]
    rows.sort(key=lambda row: -row["age_s"])
    return rows, total


def set_no_capabilities(on: bool) -> None:
    """Say whether no file has a security.capability xattr: while True, the C side
    answers the kernel's probe for it (before every write(2)) with ENODATA itself."""
    if _ext is not None:
        _ext.lib.zfx_set_no_caps(1 if on else 0)


def set_no_system_namespace(on: bool) -> None:
    """Say whether the engine stores no `system.*` xattr: while True the C side answers
    getxattr/setxattr/removexattr of those names (cp -a's ACL probes) with EOPNOTSUPP."""
    if _ext is not None:
        _ext.lib.zfx_set_no_system_ns(1 if on else 0)


def gate_add(fh: int) -> bool:
    """Answer ENOSPC to every GETATTR the kernel sends with handle `fh` (the write
    gate: write(2) asks one once the inode's attributes were invalidated); False
    when the extension is missing or out of memory (then the gate cannot close)."""
    if _ext is None or not installed():
        return False
    return _ext.lib.zfx_gate_add(fh) == 0


def gate_remove(fh: int) -> None:
    """Stop refusing GETATTR with handle `fh` (released, or the gate opened)."""
    if _ext is not None:
        _ext.lib.zfx_gate_remove(fh)


def gate_clear() -> None:
    """Stop refusing GETATTR for every handle."""
    if _ext is not None:
        _ext.lib.zfx_gate_clear()


def gate_refused() -> int:
    """GETATTR requests (hence write(2) calls) answered ENOSPC by the gate."""
    return int(_ext.lib.zfx_gate_refused_count()) if _ext is not None else 0


def armed() -> bool:
    """Whether `install` armed the handler."""
    return _handler is not None


def installed() -> bool:
    """Whether the last `pyfuse3.init` took the handler (call after it)."""
    return _ext is not None and bool(_ext.lib.zfx_installed_flag())
