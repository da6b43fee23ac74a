"""Domain errors raised by the layers below the FUSE adapter.

Only `zonefs_py.fuse_ops` turns these into errno values (see its `ERRNO_OF`
table); everything else raises and catches these classes by meaning. Device
backends raise plain `OSError` with the kernel's errno, which the engine wraps
in `DeviceError` when it reaches a file operation.
"""

from __future__ import annotations


class ZoneFSError(Exception):
    """Base class of every zonefs-py domain error."""


class NotFound(ZoneFSError):
    """A name, inode, handle or attribute does not exist."""


class Exists(ZoneFSError):
    """The target name already exists."""


class NotEmpty(ZoneFSError):
    """A directory that must be empty is not."""


class IsDirectory(ZoneFSError):
    """A directory was given where a non-directory is required."""


class NotDirectory(ZoneFSError):
    """A non-directory was given where a directory is required."""


class NameTooLong(ZoneFSError):
    """A name exceeds 255 bytes (or an xattr name its limit)."""


class InvalidArgument(ZoneFSError):
    """Arguments that no state of the filesystem could accept."""


class NoSpace(ZoneFSError):
    """The live data (or metadata) does not fit on the device."""


class QuotaExceeded(ZoneFSError):
    """A directory quota (`user.zonefs.quota`) would be exceeded."""


class PermissionDenied(ZoneFSError):
    """The caller lacks the permission (EACCES)."""


class NotPermitted(ZoneFSError):
    """The operation is not allowed for this caller or object (EPERM)."""


class NoAttribute(ZoneFSError):
    """The extended attribute does not exist (ENODATA)."""


class ValueTooLarge(ZoneFSError):
    """A value (xattr, buffer) is larger than allowed or than the buffer (E2BIG/ERANGE)."""


class TooManyLinks(ZoneFSError):
    """The link count would exceed its maximum (EMLINK)."""


class ReadOnly(ZoneFSError):
    """The filesystem is mounted read-only or fell into read-only failsafe (EROFS)."""


class FileTooBig(ZoneFSError):
    """An offset or size beyond the largest supported file (EFBIG)."""


class NotSupported(ZoneFSError):
    """The operation is not supported by zonefs-py (EOPNOTSUPP)."""


class LoopDetected(ZoneFSError):
    """A rename would make a directory its own ancestor (EINVAL in rename(2))."""


class IOFailure(ZoneFSError):
    """Data could not be read or written correctly (EIO).

    Raised for checksum mismatches and device errors on a file operation;
    the message names the file and offset.
    """


class CorruptionError(ZoneFSError):
    """On-disk metadata is inconsistent; the filesystem cannot be mounted safely.

    The message is one line and names `zonefs-py fsck`.
    """


class NotAFilesystem(ZoneFSError):
    """The device holds no zonefs-py filesystem (no valid superblock)."""


class DeviceRefused(ZoneFSError):
    """`open_device` refused the path (not a zoned device or a valid image)."""


class Busy(ZoneFSError):
    """The device is in use (already mounted by another daemon)."""


class CrossDevice(ZoneFSError):
    """A rename or link would cross a declared tenant's boundary (EXDEV, as between
    two filesystems; fs/tenants.py)."""
