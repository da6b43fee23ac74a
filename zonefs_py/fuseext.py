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
`fuse_reply_write` with the bytes a copy made). One that arrives outside
`serving` (none should: the session runs inside it) is answered EIO at once
and logged.

The write gate (issue 42): `gate_add(fh)` makes the C side answer ENOSPC to
a GETATTR that carries handle `fh` (the one write(2) sends once the inode's
attributes were invalidated; stat(2) sends none), so that write(2) fails
before the page cache takes its bytes (`zonefs_py/writegate.py`).

The census: `census_arm()` (before `pyfuse3.init`) wraps every handler in
libfuse's table with a C counter; `census()` returns the counts by opcode
name since the mount, GETXATTR also by attribute name (`GETXATTR:<name>`).
It costs one increment per request, so the daemon always arms it; the no-op
server in bench/ arms it too, so requests per file compare in one run.

Caveats: `install()` must run before `pyfuse3.init`, in the process that
mounts, and pyfuse3 must be imported after `zonefs_py` (true for the CLI and
the daemon; a program that imports pyfuse3 first keeps libfuse's own
function). `installed()` tells whether the handler went in; when not,
fallocate stays EOPNOTSUPP as before and the adapter logs a warning. One
mount per process (pyfuse3's limit too).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import trio

log = logging.getLogger(__name__)

#: (ino, fh, mode, offset, length) -> errno (0 for success).
FallocateHandler = Callable[[int, int, int, int, int], Awaitable[int]]
#: (fh_in, off_in, fh_out, off_out, length, flags) -> (errno, bytes copied).
CopyHandler = Callable[[int, int, int, int, int, int], Awaitable[tuple[int, int]]]

_handler: FallocateHandler | None = None
_copy_handler: CopyHandler | None = None
_ext: Any = None
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


def _start(fn: Callable[..., Awaitable[None]], req: Any, *args: Any, name: str) -> None:
    """Start a request's task in the serving nursery; with none, answer EIO now."""
    if _nursery is None:
        log.error("%s request arrived with no serving nursery; answered EIO", name)
        _ext.lib.zfx_reply_err(req, errno.EIO)
        return
    _nursery.start_soon(fn, req, *args, name=name)


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
    @ext.ffi.def_extern()
    def zfx_py_fallocate(req: Any, ino: int, mode: int, offset: int, length: int,
                         fh: int) -> None:
        _start(_run_fallocate, req, ino, fh, mode, offset, length, name="fuse-fallocate")

    @ext.ffi.def_extern()
    def zfx_py_copy_file_range(req: Any, fh_in: int, off_in: int, fh_out: int, off_out: int,
                               length: int, flags: int) -> None:
        _start(_run_copy, req, fh_in, off_in, fh_out, off_out, length, flags,
               name="fuse-copy-file-range")


async def _run_copy(req: Any, fh_in: int, off_in: int, fh_out: int, off_out: int,
                    length: int, flags: int) -> None:
    """Run the copy handler and answer exactly once: the count, or an errno."""
    err, count = errno.EIO, 0
    try:
        if _copy_handler is not None:
            err, count = await _copy_handler(fh_in, off_in, fh_out, off_out, length, flags)
    except trio.Cancelled:
        err = errno.EINTR
        raise
    except Exception:  # noqa: BLE001 - a request's failure is its EIO, as pyfuse3's are
        log.exception("copy_file_range handler failed")
    finally:
        if err:
            _ext.lib.zfx_reply_err(req, err)
        else:
            _ext.lib.zfx_reply_write(req, count)


async def _run_fallocate(req: Any, ino: int, fh: int, mode: int, offset: int,
                         length: int) -> None:
    """Run the handler and answer the request exactly once, whatever happens."""
    err = errno.EIO
    try:
        if _handler is not None:
            err = await _handler(ino, fh, mode, offset, length)
    except trio.Cancelled:
        err = errno.EINTR
        raise
    except Exception:  # noqa: BLE001 - a request's failure is its EIO, as pyfuse3's are
        log.exception("fallocate handler failed")
    finally:
        _ext.lib.zfx_reply_err(req, err)


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


def census_arm() -> bool:
    """Count every request of the next `pyfuse3.init` by opcode; False if unavailable."""
    ext = _load()
    if ext is None:
        return False
    ext.lib.zfx_census_arm(1)
    return True


def census() -> dict[str, int]:
    """Requests by FUSE opcode since the mount (only those seen), plus GETXATTR by name
    as `GETXATTR:<name>` and `forgotten_inodes`; {} when the census is not armed."""
    ext = _ext
    if ext is None:
        return {}
    lib, ffi = ext.lib, ext.ffi
    out: dict[str, int] = {}
    for slot in range(lib.zfx_census_slots()):
        count = int(lib.zfx_census_count(slot))
        if count:
            out[ffi.string(lib.zfx_census_name(slot)).decode()] = count
    count_p = ffi.new("uint64_t *")
    for i in range(64):
        name = lib.zfx_census_xattr(i, count_p)
        if name == ffi.NULL:
            break
        out["GETXATTR:" + ffi.string(name).decode(errors="replace")] = int(count_p[0])
    return out


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
