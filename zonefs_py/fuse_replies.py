"""What pyfuse3 (3.5, handlers.pxi) does with each request handler's return value.

pyfuse3 converts a handler's value after the handler returned, outside any
`try`: `<EntryAttributes?>` casts, `PyBytes_AsString`, `PyObject_GetBuffer`,
`b"\\0".join`, a `size_t`. A value of the wrong type raises there, no answer
is sent, and the exception ends pyfuse3's request loop (the whole mount).
`fuse_ops._handler` checks every value against `REPLY_CHECKS` first and
answers EIO instead (docs/DESIGN.md 4.1). Each check takes the value and the
handler's arguments (self first) and says whether pyfuse3 can answer with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyfuse3

#: A check: (value, the handler's arguments) -> whether pyfuse3 can answer with it.
ReplyCheck = Callable[[object, tuple[Any, ...]], bool]


def _is_none(value: object, args: tuple[Any, ...]) -> bool:
    """unlink, rmdir, rename, flush, release, fsync, readdir, ...: answered 0."""
    return value is None


def _is_entry(value: object, args: tuple[Any, ...]) -> bool:
    """`<EntryAttributes?>` cast, then fuse_reply_entry / fuse_reply_attr."""
    return isinstance(value, pyfuse3.EntryAttributes)


def _is_bytes(value: object, args: tuple[Any, ...]) -> bool:
    """readlink (PyBytes_AsString), getxattr (PyBytes_AsStringAndSize)."""
    return isinstance(value, bytes)


def _is_read_reply(value: object, args: tuple[Any, ...]) -> bool:
    """read: PyObject_GetBuffer(PyBUF_CONTIG_RO), at most the size asked (args[3])."""
    if type(value) is bytes:  # the common case first, no view made
        return len(value) <= args[3]
    if not isinstance(value, bytes | bytearray | memoryview):
        return False
    try:
        view = memoryview(value)
    except ValueError:  # a released view
        return False
    return view.contiguous and view.nbytes <= args[3]


def _is_write_reply(value: object, args: tuple[Any, ...]) -> bool:
    """write: a size_t, at most the bytes given (args[3]); the kernel refuses more."""
    return type(value) is int and 0 <= value <= len(args[3])


def _is_file_info(value: object, args: tuple[Any, ...]) -> bool:
    """open: `<FileInfo?>` cast."""
    return isinstance(value, pyfuse3.FileInfo)


def _is_create_reply(value: object, args: tuple[Any, ...]) -> bool:
    """create: tmp[0] as FileInfo, tmp[1] as EntryAttributes."""
    return (isinstance(value, tuple) and len(value) == 2
            and isinstance(value[0], pyfuse3.FileInfo)
            and isinstance(value[1], pyfuse3.EntryAttributes))


def _is_fh(value: object, args: tuple[Any, ...]) -> bool:
    """opendir: stored into fuse_file_info.fh, a uint64_t."""
    return type(value) is int and 0 <= value < 1 << 64


def _is_bool(value: object, args: tuple[Any, ...]) -> bool:
    """access: its truth picks 0 or EACCES (a __bool__ could raise there)."""
    return type(value) is bool


def _is_statvfs(value: object, args: tuple[Any, ...]) -> bool:
    """statfs: `<StatvfsData?>` cast."""
    return isinstance(value, pyfuse3.StatvfsData)


def _is_name_list(value: object, args: tuple[Any, ...]) -> bool:
    """listxattr: b"\\0".join(value), so bytes names without NUL."""
    return (isinstance(value, list | tuple)
            and all(isinstance(n, bytes) and n and b"\0" not in n for n in value))


def _is_int(value: object, args: tuple[Any, ...]) -> bool:
    """The fuseext handlers: copy_file_range's byte count (answered by fuseext)."""
    return type(value) is int and value >= 0


def _is_poll_mask(value: object, args: tuple[Any, ...]) -> bool:
    """poll: None or an unsigned event mask."""
    return value is None or (type(value) is int and 0 <= value < 1 << 32)


#: Handler name -> check of its return value. Every handler `fuse_ops._handler` wraps
#: is listed (decoration fails otherwise), so a new handler states what pyfuse3 will
#: do with its value.
REPLY_CHECKS: dict[str, ReplyCheck] = {
    "lookup": _is_entry, "getattr": _is_entry, "setattr": _is_entry,
    "mknod": _is_entry, "mkdir": _is_entry, "symlink": _is_entry, "link": _is_entry,
    "readlink": _is_bytes, "getxattr": _is_bytes, "listxattr": _is_name_list,
    "access": _is_bool, "open": _is_file_info, "create": _is_create_reply,
    "opendir": _is_fh, "read": _is_read_reply, "write": _is_write_reply,
    "statfs": _is_statvfs, "poll": _is_poll_mask, "_copy_file_range": _is_int,
    **{name: _is_none for name in (
        "unlink", "rmdir", "rename", "flush", "release", "fsync", "readdir",
        "releasedir", "fsyncdir", "setxattr", "removexattr", "_fallocate")},
}
