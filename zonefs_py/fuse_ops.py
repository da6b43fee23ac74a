"""The pyfuse3 adapter: FUSE requests in, `FileSystemAPI` calls out.

This is the only module that knows errno. Every handler converts pyfuse3's
arguments to the engine's (`Ctx`, `SetAttrRequest`, `RenameFlags`), awaits the
engine, and converts the result back (`EntryAttributes`, `FileInfo`,
`StatvfsData`). Domain errors become `pyfuse3.FUSEError` through `ERRNO_OF`.

Failsafe: any exception that is not a `ZoneFSError` (a bug, or a corrupt
structure the engine did not expect) is logged once with its traceback,
answered with EIO, and switches the mount to read-only failsafe
(`fs.enter_failsafe`), as s3ql does. The daemon never dies from a request;
reads keep working so that data can be copied off, and a remount (which runs
recovery) clears the failsafe. `CorruptionError` is treated the same way.

Exactly one answer (issue 42): `_handler` lets out only a value pyfuse3 can
convert (`fuse_replies.REPLY_CHECKS`) or a `FUSEError`, so pyfuse3 always answers; any
BaseException but trio's cancellation at shutdown, and any value of the wrong
type, is EIO plus the failsafe. What fails before or after our handler, inside
pyfuse3, is answered by the census's guards (`fuseext`, docs/DESIGN.md 4.1).
TEST HOOK: `fuse_testhook` (off unless ZONEFS_PY_FUSE_TEST_FAIL is set).

Lookup counting: the kernel holds one reference per successful entry reply
(lookup, mknod, mkdir, symlink, link, create) and one per entry it *accepts*
from READDIRPLUS. The engine counts the first kind itself; for readdir the
adapter calls `fs.add_lookup(ino)` only for entries that
`pyfuse3.readdir_reply` accepted, never for "." and "..". The reply reaches
the kernel only when the handler returns, so no FORGET can overtake it.

Caching (measured; see docs/DESIGN.md section 4): the writeback cache is on
by default, attribute and entry timeouts are long (the daemon is the only
writer, and the kernel invalidates its own caches on every change it makes),
negative lookups are cached, and `keep_cache` is set on open when the file has
not changed since the kernel last cached its pages. `direct_io` is never set,
so mmap works. Near full, write(2) gets ENOSPC through the write gate
(`zonefs_py.writegate`): handles open for writing are tracked here, and the
attributes of their inodes are not cached while the gate is closed.

Concurrency: pyfuse3 runs every request in its own trio task (up to
`max_tasks`); nothing here takes a lock, so requests are never serialised by
the adapter. Device concurrency is bounded by the engine.

Caveats:
  * pyfuse3 implements XATTR_CREATE / XATTR_REPLACE itself by calling
    `getxattr` before `setxattr` in the same task (the flags never reach us).
    That check-then-set is atomic only because neither handler reaches a trio
    checkpoint (the engine applies xattr changes without awaiting; a unit test
    holds it to that); the kernel also serialises setxattr per inode.
  * The control xattrs (`trusted.zonefs.*`, root inode only) are answered
    here, not stored: see `zonefs_py.control`.
  * FALLOCATE and COPY_FILE_RANGE reach us through `zonefs_py.fuseext`
    (pyfuse3 has no handler for them); the constructor arms them
    (`install_extra_handlers`), which must happen before `pyfuse3.init`.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, ParamSpec, TypeVar, cast

import pyfuse3
import trio

from zonefs_py import control, errors, fuseext
from zonefs_py.caller import proc_credentials
from zonefs_py.census import STUCK_REQUEST_S, StuckRequestReport, census_status
from zonefs_py.dataplane import wiring as dataplane_wiring
from zonefs_py.fs.api import (
    CAPABILITY_XATTR,
    ROOT_INO,
    Attr,
    Ctx,
    FallocFlags,
    FileSystemAPI,
    RenameFlags,
    SetAttrRequest,
    XattrFlags,
)
from zonefs_py.fs.spacegate import SpaceGate
from zonefs_py.fuse_replies import REPLY_CHECKS
from zonefs_py.fuse_testhook import FailingEngine, FailureInjector, Unchecked
from zonefs_py.writegate import WriteGate

log = logging.getLogger(__name__)

#: Domain error class -> errno. Looked up along the exception's MRO, so a
#: subclass the engine adds later maps like its base.
ERRNO_OF: dict[type[errors.ZoneFSError], int] = {
    errors.NotFound: errno.ENOENT,
    errors.Exists: errno.EEXIST,
    errors.NotEmpty: errno.ENOTEMPTY,
    errors.IsDirectory: errno.EISDIR,
    errors.NotDirectory: errno.ENOTDIR,
    errors.NameTooLong: errno.ENAMETOOLONG,
    errors.InvalidArgument: errno.EINVAL,
    errors.LoopDetected: errno.EINVAL,
    errors.NoSpace: errno.ENOSPC,
    errors.QuotaExceeded: errno.EDQUOT,
    errors.PermissionDenied: errno.EACCES,
    errors.NotPermitted: errno.EPERM,
    errors.NoAttribute: errno.ENODATA,
    # getxattr/listxattr return whole values; pyfuse3 itself answers ERANGE
    # when the caller's buffer is too small, so the engine's error is E2BIG.
    errors.ValueTooLarge: errno.E2BIG,
    errors.TooManyLinks: errno.EMLINK,
    errors.ReadOnly: errno.EROFS,
    errors.FileTooBig: errno.EFBIG,
    errors.NotSupported: errno.EOPNOTSUPP,
    errors.IOFailure: errno.EIO,
    errors.CorruptionError: errno.EIO,
    errors.NotAFilesystem: errno.EINVAL,
    errors.DeviceRefused: errno.ENODEV,
    errors.Busy: errno.EBUSY,
    errors.CrossDevice: errno.EXDEV,
}

#: Largest copy_file_range answer: the reply's count is a u32 (fuse_write_out.size).
COPY_MAX_BYTES = (1 << 32) - (1 << 20)

#: Errors that mean the in-memory state can no longer be trusted for writing.
FAILSAFE_ERRORS: tuple[type[errors.ZoneFSError], ...] = (errors.CorruptionError,)


def errno_of(exc: errors.ZoneFSError) -> int:
    """Return the errno for a domain error (EIO for a class missing from ERRNO_OF)."""
    for cls in type(exc).__mro__:
        code = ERRNO_OF.get(cls)
        if code is not None:
            return code
    return errno.EIO


P = ParamSpec("P")
R = TypeVar("R")


def _safe_text(obj: object, how: Callable[[object], str]) -> str:
    """str() or repr() of `obj` for a log line; never raises (a broken __str__ of the
    very object being reported must not escape the wrapper)."""
    try:
        return how(obj)
    except Exception:  # noqa: BLE001 - whatever it raises, the answer must go out
        return f"<{type(obj).__name__}: unprintable>"


#: TEST HOOK (`FailureInjector`): None unless the daemon was started with
#: `ZONEFS_PY_FUSE_TEST_FAIL` set; then the hook `_handler` consults.
_injector: FailureInjector | None = None
#: Takes what C write streams staged into the engine (dataplane/cwrites.py), run at the
#: start of every handler so that the request sees every WRITE answered before it;
#: None without C writes.
_absorb_c_writes: Callable[[], None] | None = None


def set_c_write_absorber(fn: Callable[[], None] | None) -> None:
    global _absorb_c_writes
    _absorb_c_writes = fn


def _handler(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Wrap a request handler so that pyfuse3 can always answer it, exactly once.

    The wrapped handler either returns a value that passes its `REPLY_CHECKS`
    entry (pyfuse3 converts it without error and answers) or raises
    `pyfuse3.FUSEError` (pyfuse3 answers the errno): domain errors map through
    `ERRNO_OF`; anything else (any exception or BaseException, a value of the
    wrong type) is EIO, one log record and the failsafe. Only trio's
    cancellation passes through: the serve is being torn down and the kernel
    fails what is still in flight when the session closes.
    """
    check = REPLY_CHECKS[fn.__name__]
    hook_name = fn.__name__.lstrip("_")

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        self = args[0]
        assert isinstance(self, Operations)
        try:
            if _absorb_c_writes is not None:
                _absorb_c_writes()
            if _injector is None:
                value = await fn(*args, **kwargs)
            else:
                value = await _injector.call(hook_name, fn, args, kwargs)
        except pyfuse3.FUSEError:
            raise
        except FAILSAFE_ERRORS as exc:
            self.failsafe(f"{fn.__name__}: {exc}", exc)
            raise pyfuse3.FUSEError(errno_of(exc)) from None
        except errors.ZoneFSError as exc:
            raise pyfuse3.FUSEError(errno_of(exc)) from None
        except BaseException as exc:  # noqa: BLE001 - the failsafe boundary
            if fuseext.is_shutdown_cancel(exc):
                raise
            self.unexpected(f"unexpected {type(exc).__name__} in {fn.__name__}: "
                            f"{_safe_text(exc, str)}", exc)
            raise pyfuse3.FUSEError(errno.EIO) from None
        if not check(value, args):
            if _injector is not None and type(value) is Unchecked:
                return value  # TEST HOOK: let pyfuse3's own conversion fail on it
            self.unexpected(f"{fn.__name__} returned {type(value).__name__} "
                            f"({_safe_text(value, repr):.80}), which pyfuse3 cannot answer "
                            "with", None)
            raise pyfuse3.FUSEError(errno.EIO)
        return value

    return wrapper


def ctx_of(rctx: pyfuse3.RequestContext) -> Ctx:
    """Convert pyfuse3's request context (supplementary groups and capabilities are not
    sent by FUSE: the engine reads them from /proc when a rule needs them)."""
    return Ctx(uid=rctx.uid, gid=rctx.gid, pid=rctx.pid, umask=rctx.umask,
               creds=functools.partial(proc_credentials, rctx.pid, rctx.uid, rctx.gid))


class Operations(pyfuse3.Operations):
    """pyfuse3 request handlers over one mounted `FileSystemAPI`."""

    #: FUSE export support (issues 28, 42): node ids are inode numbers, with the
    #: inode's generation in every entry reply, so the kernel may resolve a file
    #: handle by looking up "." in its node id and ".." of a directory, and refuses
    #: (ESTALE) a handle whose generation differs (DESIGN 4.2a).
    supports_dot_lookup = True
    enable_acl = False

    def __init__(self, fs: FileSystemAPI, *, writeback_cache: bool = True,
                 attr_timeout_s: float = 3600.0, entry_timeout_s: float = 3600.0,
                 negative_timeout_s: float = 3600.0,
                 stuck_request_s: float = STUCK_REQUEST_S,
                 tenant_admins: control.TenantDelegates | None = None) -> None:
        super().__init__()
        #: Who besides root may run tenant commands (mount option tenant_admins=).
        self.tenant_admins = tenant_admins or control.TenantDelegates()
        global _injector
        injector = FailureInjector.from_env()  # TEST HOOK: None unless the variable is set
        if injector is not None:
            _injector = injector
            fs = cast(FileSystemAPI, FailingEngine(fs, injector))
        self.fs = fs
        self.enable_writeback_cache = writeback_cache
        self.attr_timeout_s = attr_timeout_s
        self.entry_timeout_s = entry_timeout_s
        self.negative_timeout_s = negative_timeout_s
        #: Logs requests waiting longer than stuck_request_s (the daemon runs it).
        self.stuck_requests = StuckRequestReport(stuck_request_s)
        #: Set once the first unexpected error switched the mount to failsafe.
        self.failsafe_reason: str | None = None
        self._failsafe_repeats = 0
        #: Inodes whose kernel-cached attributes were dropped (invalidate_changed).
        self.invalidations = 0
        #: Set by `init` (FUSE_INIT reached us): the mount serves (daemon/tuning.py).
        self.initialized = trio.Event()
        #: mtime_ns and size of each inode when the kernel last had it open, for keep_cache.
        self._cached_version: dict[int, tuple[int, int]] = {}
        #: Open file handle -> inode, to record the version on release.
        self._fh_ino: dict[int, int] = {}
        #: ENOSPC from write(2) near full (issue 42): only the writeback cache needs it
        #: (without it every write(2) is a WRITE the engine admits or refuses).
        space_gate = getattr(fs, "space_gate", None)
        has_reservation = getattr(fs, "has_reservation", None)
        tenant_of_ino = getattr(getattr(fs, "tenant_space", None), "tenant_of_ino", None)
        self.write_gate = WriteGate(
            space_gate if writeback_cache and isinstance(space_gate, SpaceGate) else None,
            self._invalidate,
            has_reservation if callable(has_reservation) else lambda ino: False,
            tenant_of_ino if callable(tenant_of_ino) else lambda ino: 0)
        # Built before pyfuse3.init (daemon/serve.py): the FALLOCATE handler goes in then.
        self.install_extra_handlers()

    # -- helpers -----------------------------------------------------------------------
    def failsafe(self, reason: str, exc: BaseException | None) -> None:
        """Log `exc` with its traceback and put the filesystem into read-only failsafe."""
        if _injector is not None and _injector.keep_writable:
            log.error("TEST HOOK: not entering failsafe: %s", reason, exc_info=exc)
            return
        if self.failsafe_reason is None:
            self.failsafe_reason = reason
            log.error("switching to read-only failsafe: %s", reason, exc_info=exc)
        else:
            # Already read-only: one line for the first few, then every 1000th (no flood).
            self._failsafe_repeats += 1
            if self._failsafe_repeats <= 10 or self._failsafe_repeats % 1000 == 0:
                log.warning("error while in failsafe (#%d): %s", self._failsafe_repeats, reason)
        enter = getattr(self.fs, "enter_failsafe", None)
        if enter is not None:
            try:
                enter(reason)
            except Exception:  # noqa: BLE001 - never let the failsafe itself fail a request
                log.exception("enter_failsafe failed")

    def unexpected(self, reason: str, exc: BaseException | None) -> None:
        """`failsafe` for the handler wrapper: whatever goes wrong in reporting (a
        logging handler that fails on the exception's text), the EIO answer goes out."""
        try:
            self.failsafe(reason, exc)
        except Exception:  # noqa: BLE001 - nothing more can be said; answer anyway
            pass

    def entry(self, attr: Attr) -> pyfuse3.EntryAttributes:
        """Convert an engine `Attr` to pyfuse3's EntryAttributes with our timeouts."""
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = attr.ino
        entry.generation = attr.generation
        entry.entry_timeout = self.entry_timeout_s
        # While the write gate is closed, an inode open for writing keeps no cached
        # attributes: its next write(2) asks (zonefs_py.writegate).
        entry.attr_timeout = 0.0 if self.write_gate.gated(attr.ino) else self.attr_timeout_s
        entry.st_mode = attr.mode
        entry.st_nlink = attr.nlink
        entry.st_uid = attr.uid
        entry.st_gid = attr.gid
        entry.st_rdev = attr.rdev
        entry.st_size = attr.size
        entry.st_blksize = attr.blksize
        entry.st_blocks = attr.blocks
        entry.st_atime_ns = attr.atime_ns
        entry.st_mtime_ns = attr.mtime_ns
        entry.st_ctime_ns = attr.ctime_ns
        return entry

    def _negative_entry(self) -> pyfuse3.EntryAttributes:
        """An entry with inode 0: the kernel caches the absence of the name."""
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = 0
        entry.entry_timeout = self.negative_timeout_s
        return entry

    def _add_lookup(self, ino: int) -> None:
        """Count one kernel reference to `ino` taken through READDIRPLUS."""
        self.fs.add_lookup(ino)

    # -- lookups and attributes ------------------------------------------------------
    @_handler
    async def lookup(self, parent_inode: int, name: bytes,
                     ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        try:
            attr = await self.fs.lookup(parent_inode, name)
        except errors.NotFound:
            if self.negative_timeout_s > 0:
                return self._negative_entry()
            raise
        return self.entry(attr)

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, _ in inode_list:
            # The kernel evicted the inode, and its page cache with it.
            self._cached_version.pop(ino, None)
        try:
            self.fs.forget(inode_list)
        except BaseException as exc:  # noqa: BLE001 - forget cannot report errors
            if fuseext.is_shutdown_cancel(exc):
                raise
            self.unexpected(f"unexpected {type(exc).__name__} in forget: "
                            f"{_safe_text(exc, str)}", exc)
        self.write_gate.space_may_be_back()  # the last reference to an unlinked file

    @_handler
    async def getattr(self, inode: int,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self.entry(await self.fs.getattr(inode))

    @_handler
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes,
                      fields: pyfuse3.SetattrFields, fh: int | None,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        req = SetAttrRequest()
        if fields.update_size:
            req.size = attr.st_size
        if fields.update_mode:
            req.mode = attr.st_mode
        if fields.update_uid:
            req.uid = attr.st_uid
        if fields.update_gid:
            req.gid = attr.st_gid
        # UTIME_NOW already carries the current time here (pyfuse3 fills it in);
        # UTIME_OMIT leaves the update_* flag false.
        if fields.update_atime:
            req.atime_ns = attr.st_atime_ns
        if fields.update_mtime:
            req.mtime_ns = attr.st_mtime_ns
        if fields.update_ctime:
            req.ctime_ns = attr.st_ctime_ns
        changed = await self.fs.setattr(inode, req, ctx_of(ctx))
        if fields.update_size:
            self.write_gate.space_may_be_back()
        return self.entry(changed)

    @_handler
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return await self.fs.readlink(inode)

    @_handler
    async def access(self, inode: int, mode: int,
                     ctx: pyfuse3.RequestContext) -> bool:
        try:
            await self.fs.access(inode, mode, ctx_of(ctx))
        except errors.PermissionDenied:
            return False
        return True

    # -- namespace changes ------------------------------------------------------------
    @_handler
    async def mknod(self, parent_inode: int, name: bytes, mode: int,
                    rdev: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self.entry(await self.fs.mknod(parent_inode, name, mode, rdev, ctx_of(ctx)))

    @_handler
    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self.entry(await self.fs.mkdir(parent_inode, name, mode, ctx_of(ctx)))

    @_handler
    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self.entry(await self.fs.symlink(parent_inode, name, target, ctx_of(ctx)))

    @_handler
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self.entry(await self.fs.link(inode, new_parent_inode, new_name))

    @_handler
    async def unlink(self, parent_inode: int, name: bytes,
                     ctx: pyfuse3.RequestContext) -> None:
        await self.fs.unlink(parent_inode, name)
        self.write_gate.space_may_be_back()

    @_handler
    async def rmdir(self, parent_inode: int, name: bytes,
                    ctx: pyfuse3.RequestContext) -> None:
        await self.fs.rmdir(parent_inode, name)

    @_handler
    async def rename(self, parent_inode_old: int, name_old: bytes,
                     parent_inode_new: int, name_new: bytes, flags: int,
                     ctx: pyfuse3.RequestContext) -> None:
        known = RenameFlags.NOREPLACE | RenameFlags.EXCHANGE
        if flags & ~int(known):
            raise pyfuse3.FUSEError(errno.EINVAL)
        await self.fs.rename(parent_inode_old, name_old, parent_inode_new, name_new,
                             RenameFlags(flags))
        self.write_gate.space_may_be_back()  # a file replaced

    # -- files ---------------------------------------------------------------------------
    def _file_info(self, fh: int, attr: Attr | None) -> pyfuse3.FileInfo:
        """Build the open reply: keep the page cache when the file is unchanged since last time."""
        keep = False
        if attr is not None:
            keep = self._cached_version.get(attr.ino) == (attr.mtime_ns, attr.size)
            self._fh_ino[fh] = attr.ino
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep, direct_io=False)

    @_handler
    async def open(self, inode: int, flags: int,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        writable = flags & os.O_ACCMODE != os.O_RDONLY
        if self.enable_writeback_cache and flags & os.O_ACCMODE == os.O_WRONLY:
            # With the writeback cache the kernel reads partial pages of
            # write-only files to fill them (libfuse's passthrough does the same).
            flags = (flags & ~os.O_ACCMODE) | os.O_RDWR
        if self.enable_writeback_cache:
            # The kernel computes append offsets itself and may write back any
            # page through any writable handle: the engine must use offsets as given.
            flags &= ~os.O_APPEND
        fh = await self.fs.open(inode, flags, ctx_of(ctx))
        attr = None if flags & os.O_TRUNC else await self.fs.getattr(inode)
        if flags & os.O_TRUNC:
            self.write_gate.space_may_be_back()  # the file's old data
        if writable:
            await self.write_gate.opened(fh, inode, created=False)
        return self._file_info(fh, attr)

    @_handler
    async def create(self, parent_inode: int, name: bytes, mode: int,
                     flags: int, ctx: pyfuse3.RequestContext
                     ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        writable = flags & os.O_ACCMODE != os.O_RDONLY
        if self.enable_writeback_cache and flags & os.O_ACCMODE == os.O_WRONLY:
            flags = (flags & ~os.O_ACCMODE) | os.O_RDWR
        if self.enable_writeback_cache:
            flags &= ~os.O_APPEND
        fh, attr = await self.fs.create(parent_inode, name, mode, flags, ctx_of(ctx))
        self._cached_version.pop(attr.ino, None)
        if writable:
            await self.write_gate.opened(fh, attr.ino, created=True)
        return self._file_info(fh, None), self.entry(attr)

    @_handler
    async def read(self, fh: int, off: int, size: int  # type: ignore[override]
                   ) -> bytes | memoryview:
        # pyfuse3 replies from any buffer (PyObject_GetBuffer), so a view of the
        # reader's pooled buffer goes to the kernel without a copy.
        return await self.fs.read(fh, off, size)

    @_handler
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return await self.fs.write(fh, off, buf)

    @_handler
    async def flush(self, fh: int) -> None:
        await self.fs.flush(fh)

    @_handler
    async def release(self, fh: int) -> None:
        self.write_gate.released(fh)
        ino = self._fh_ino.pop(fh, None)
        await self.fs.release(fh)
        self.write_gate.space_may_be_back()  # the last handle of an unlinked file
        if ino is not None:
            # Whatever the kernel has cached for ino now matches this version
            # (all writes went through the kernel's page cache).
            try:
                attr = await self.fs.getattr(ino)
            except errors.NotFound:
                self._cached_version.pop(ino, None)
            else:
                self._cached_version[ino] = (attr.mtime_ns, attr.size)

    @_handler
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.fs.fsync(fh, datasync)

    @_handler
    async def _fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        await self.fs.fallocate(fh, FallocFlags(mode), offset, length)
        self.write_gate.space_may_be_back()  # a punched hole
        ino = self._fh_ino.get(fh)
        if ino is not None:
            await self.write_gate.reservation_changed(ino)

    async def fallocate(self, ino: int, fh: int, mode: int, offset: int, length: int) -> int:
        """FUSE_FALLOCATE (via `fuseext`): 0 or the errno to answer."""
        try:
            await self._fallocate(fh, mode, offset, length)
        except pyfuse3.FUSEError as exc:
            return exc.errno
        return 0

    @_handler
    async def _copy_file_range(self, fh_in: int, off_in: int, fh_out: int, off_out: int,
                               length: int, flags: int) -> int:
        return await self.fs.copy_file_range(fh_in, off_in, fh_out, off_out,
                                             min(length, COPY_MAX_BYTES), flags)

    async def copy_file_range(self, fh_in: int, off_in: int, fh_out: int, off_out: int,
                              length: int, flags: int) -> tuple[int, int]:
        """FUSE_COPY_FILE_RANGE (via `fuseext`): (0, bytes copied) or (errno, 0)."""
        try:
            return 0, await self._copy_file_range(fh_in, off_in, fh_out, off_out, length,
                                                  flags)
        except pyfuse3.FUSEError as exc:
            return exc.errno, 0

    def install_extra_handlers(self) -> bool:
        """Arm the requests pyfuse3 does not handle (FALLOCATE, COPY_FILE_RANGE) and the
        request census for the next `pyfuse3.init`; False when the extension is not
        available."""
        fuseext.census_arm()
        installed = fuseext.install(self.fallocate, self.copy_file_range)
        fuseext.guard_pyfuse3(pyfuse3)  # after census_arm: needs the extension loaded
        return installed

    async def invalidate_changed(self) -> None:
        """Run for the mount's life: drop the kernel's cached attributes of every inode
        the engine changes on its own (`FileSystemAPI.changed_behind_kernel`).

        `pyfuse3.invalidate_inode` writes a notification to /dev/fuse, which the
        kernel may answer only after requests it waits for: it runs in a worker
        thread, never in the trio thread that serves those requests. ENOENT (the
        kernel has forgotten the inode) means there was nothing to drop."""
        while True:
            await self._invalidate(await self.fs.changed_behind_kernel())

    async def _invalidate(self, inodes: list[int]) -> None:
        for ino in inodes:
            self.invalidations += 1
            try:
                await trio.to_thread.run_sync(pyfuse3.invalidate_inode, ino, True)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    log.warning("dropping the kernel's attributes of inode %d: %s", ino, exc)

    def status_extra(self) -> dict[str, Any]:
        """The adapter's part of the status document: FUSE requests by opcode since
        the mount, received and answered, and those waiting too long (the census,
        issues 29 and 42), so that every round trip is visible."""
        extra = {**census_status(self.stuck_requests), "kernel_invalidations": self.invalidations,
                 "write_gate": self.write_gate.status()}
        # READs served in C (zonefs_py/dataplane) join the census, with where each went.
        return dataplane_wiring.with_c_reads(self.fs, extra)

    def _sync_capability_probe(self) -> None:
        """Let the C side answer the kernel's security.capability probe while no file
        has one (fuseext.set_no_capabilities); called at INIT and after xattr changes."""
        fuseext.set_no_capabilities(not self.fs.capability_xattrs_present())

    def init(self) -> None:
        """FUSE_INIT arrived: say whether fallocate is served; arm the answers the C side
        gives alone (the capability probe, system.* xattrs while none is stored)."""
        self._sync_capability_probe()
        fuseext.set_no_system_namespace(b"system." not in self.fs.xattr_namespaces())
        self.initialized.set()  # the daemon's proof that the mount serves (daemon/tuning.py)
        if fuseext.armed() and not fuseext.installed():
            log.warning("fallocate is not served (libfuse's fuse_session_new was not "
                        "intercepted): fallocate(2) gets EOPNOTSUPP")

    @_handler
    async def poll(self, inode: int, fh: int, poll_handle: Any,
                   ctx: pyfuse3.RequestContext) -> int:
        """FUSE_POLL (pyfuse3 3.5 passes it on): not supported; after ENOSYS the kernel
        stops asking and treats files as always ready, as for a regular file."""
        raise pyfuse3.FUSEError(errno.ENOSYS)

    # -- directories ----------------------------------------------------------------------
    @_handler
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        return await self.fs.opendir(inode)

    @_handler
    async def readdir(self, fh: int, start_id: int,
                      token: pyfuse3.ReaddirToken) -> None:
        offset = start_id
        counted: list[int] = []
        try:
            while True:
                batch = await self.fs.readdir(fh, offset)
                if not batch:
                    return
                for ent in batch:
                    if not pyfuse3.readdir_reply(token, ent.name, self.entry(ent.attr),
                                                 ent.next_offset):
                        return
                    if ent.name not in (b".", b".."):
                        self._add_lookup(ent.attr.ino)
                        counted.append(ent.attr.ino)
                    offset = ent.next_offset
        except BaseException:
            # pyfuse3 answers the error and drops the entries already added: the
            # kernel takes no reference to them, so neither may we.
            if counted:
                try:
                    self.fs.forget([(ino, 1) for ino in counted])
                except Exception:  # noqa: BLE001 - the first failure is the one reported
                    log.exception("undoing the lookups of a failed readdir")
            raise

    @_handler
    async def releasedir(self, fh: int) -> None:
        await self.fs.releasedir(fh)

    @_handler
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        await self.fs.fsyncdir(fh, datasync)

    # -- whole filesystem -----------------------------------------------------------------
    @_handler
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        st = await self.fs.statfs()
        self.write_gate.space_may_be_back()
        out = pyfuse3.StatvfsData()
        out.f_bsize = st.block_size
        out.f_frsize = st.block_size
        out.f_blocks = st.total_blocks
        out.f_bfree = st.free_blocks
        out.f_bavail = st.avail_blocks
        out.f_files = st.total_inodes
        out.f_ffree = st.free_inodes
        out.f_favail = st.free_inodes
        out.f_namemax = st.name_max
        return out

    # -- extended attributes ---------------------------------------------------------------
    @_handler
    async def getxattr(self, inode: int, name: bytes,
                       ctx: pyfuse3.RequestContext) -> bytes:
        if inode == ROOT_INO and control.is_control_name(name):
            return control.get(self.fs, name, ctx_of(ctx), self.failsafe_reason,
                               self.status_extra())
        if name == control.TENANT_XATTR:
            return control.tenant_xattr_get(self.fs, inode, ctx_of(ctx), self.tenant_admins)
        return await self.fs.getxattr(inode, name)

    @_handler
    async def setxattr(self, inode: int, name: bytes, value: bytes,
                       ctx: pyfuse3.RequestContext) -> None:
        if inode == ROOT_INO and _injector is not None and name == FailureInjector.XATTR:
            if ctx.uid != 0:
                raise errors.NotPermitted("the test hook is for root only")
            _injector.arm(value)  # TEST HOOK (FailureInjector)
            return
        if name == control.TENANT_XATTR:
            await control.tenant_xattr_set(self.fs, inode, value, ctx_of(ctx),
                                           self.tenant_admins)
            return
        if inode == ROOT_INO and control.is_control_name(name):
            await control.command(self.fs, name, value, ctx_of(ctx))
            # A command that changed files (an eviction) returns once the kernel has
            # dropped their attributes: a stat right after it sees the change.
            await self._invalidate(self.fs.take_changed_behind_kernel())
            return
        # pyfuse3 has already enforced XATTR_CREATE / XATTR_REPLACE (module caveats).
        if name == CAPABILITY_XATTR:
            fuseext.set_no_capabilities(False)  # before: the change may await a commit
        try:
            await self.fs.setxattr(inode, name, value, XattrFlags.NONE, ctx_of(ctx))
        finally:
            self._sync_capability_probe()
        # user.zonefs.state evicts or fetches the file: its new st_blocks, at once.
        await self._invalidate(self.fs.take_changed_behind_kernel())

    @_handler
    async def listxattr(self, inode: int,
                        ctx: pyfuse3.RequestContext) -> list[bytes]:
        return await self.fs.listxattr(inode)

    @_handler
    async def removexattr(self, inode: int, name: bytes,
                          ctx: pyfuse3.RequestContext) -> None:
        if (inode == ROOT_INO and control.is_control_name(name)) or \
                name == control.TENANT_XATTR:
            raise errors.NotPermitted(f"{name!r} cannot be removed")
        try:
            await self.fs.removexattr(inode, name, ctx_of(ctx))
        finally:
            self._sync_capability_probe()


__all__ = ["ERRNO_OF", "Operations", "ctx_of", "errno_of"]
