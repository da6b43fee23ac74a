"""Errors of the on-device index.

`IndexCorrupt` subclasses `zonefs_py.errors.CorruptionError`, the package's
corruption class (there is no class named `Corruption`), so once the index is
wired in a damaged page reaches FUSE as EIO like any other damaged metadata.
"""

from __future__ import annotations

from zonefs_py.errors import CorruptionError


class IndexCorrupt(CorruptionError):
    """A page read from the store failed validation; no value from it is returned.

    `address` is the page's byte offset in its store, `reason` one line saying
    which check failed (bad magic, checksum mismatch, keys out of order, ...).
    """

    def __init__(self, address: int, reason: str) -> None:
        super().__init__(f"index page at {address:#x}: {reason} (run `zonefs-py fsck`)")
        self.address = address
        self.reason = reason
