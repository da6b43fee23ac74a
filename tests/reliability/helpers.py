"""Small in-process helpers for the reliability tests (no FUSE): images, files, fsck."""

from __future__ import annotations

import os
from pathlib import Path

from crashlib import fsck_findings as fsck_findings
from crashlib import new_image as _new_image

from zonefs_py import errors
from zonefs_py.fs.api import ROOT_INO, Ctx
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.fs.options import FsOptions

KiB, MiB = 1 << 10, 1 << 20
CTX = Ctx()
#: No background task, no cleaner: nothing happens behind a test's back.
OPTIONS = FsOptions(commit_interval_s=3600.0, cleaner_rate_mb_s=0.0)


def new_image(path: Path, *, size_bytes: int = 64 * MiB, zone_size_bytes: int = 2 * MiB,
              max_active: int = 0) -> None:
    """Create an emulated image holding a fresh filesystem (closed again; tests/crashlib.py)."""
    _new_image(path, size_bytes=size_bytes, zone_size_bytes=zone_size_bytes,
               max_active=max_active)


async def write_file(fs: ZoneFS, name: bytes, data: bytes, *, parent: int = ROOT_INO,
                     fsync: bool = True) -> int:
    """Create `name` with `data` (fsync'ed unless told not to); return the inode number."""
    fh, attr = await fs.create(parent, name, 0o644, os.O_RDWR, CTX)
    try:
        await fs.write(fh, 0, data)
        if fsync:
            await fs.fsync(fh, False)
    finally:
        await fs.release(fh)
    return attr.ino


async def read_file(fs: ZoneFS, name: bytes, *, parent: int = ROOT_INO) -> bytes:
    """Read the whole file (raises errors.IOFailure on EIO)."""
    attr = await fs.lookup(parent, name)
    fh = await fs.open(attr.ino, os.O_RDONLY)
    try:
        return await fs.read(fh, 0, attr.size)
    finally:
        await fs.release(fh)


def is_eio(exc: BaseException) -> bool:
    return isinstance(exc, errors.IOFailure) or (isinstance(exc, OSError) and exc.errno == 5)
