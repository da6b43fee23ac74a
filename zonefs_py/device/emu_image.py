"""The emulator's image file: create it (geometry, lock, header, first zone
table) and read back what an open needs (header and newest table copy).

Byte layout in docs/SPEC.md, "Emulator image"; encoding in `emu_format`.
`EmulatedZonedDevice.create` and `.open` (emulated.py) call these.
"""

from __future__ import annotations

import fcntl
import os

from zonefs_py.device.emu_discard import _probe_punch_hole
from zonefs_py.device.emu_format import (
    HEADER_BYTES,
    HEADER_MAGIC,
    DataDiscard,
    Geometry,
    ImageFormatError,
    TableEntry,
    decode_header_full,
    encode_header,
    encode_table,
    pick_newest_table,
)
from zonefs_py.device.emu_io import ImageIO
from zonefs_py.device.emu_zones import ZoneStates
from zonefs_py.errors import Busy, DeviceRefused


def probe_image(path: str | os.PathLike[str]) -> bool:
    """Return True if `path` starts with the emulator image magic (no validation)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(len(HEADER_MAGIC)) == HEADER_MAGIC
    except OSError:
        return False


def write_fresh_image(path: str, geo: Geometry, *, overwrite: bool, discard_data: bool) -> None:
    """Create (or, with `overwrite`, replace) a sparse image of a validated
    geometry with every zone empty, durable on return (file and directory).

    Raises FileExistsError if `path` exists and not `overwrite`, Busy if
    another process has it open for writing, OSError from the file system
    (EOPNOTSUPP with `discard_data` where holes cannot be punched).
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (0 if overwrite else os.O_EXCL)
    fd = os.open(path, flags, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Busy(f"{path}: image is open for writing by another process") from None
        os.ftruncate(fd, 0)
        os.ftruncate(fd, geo.image_bytes)
        if discard_data:
            _probe_punch_hole(path, fd, geo)
        os.pwrite(fd, encode_header(geo, DataDiscard(enabled=discard_data)), 0)
        os.pwrite(fd, encode_table(geo, 1, ZoneStates.fresh_entries(geo)), geo.table_offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_image(path: str, io: ImageIO) -> tuple[Geometry, DataDiscard, int, list[TableEntry]]:
    """Read and check an opened image's header and newest zone table copy: its
    geometry, discard mode, table sequence number and zone entries.

    Raises DeviceRefused (one-line message) for a too-small, truncated or
    damaged image.
    """
    size = io.file_size()
    if size < HEADER_BYTES:
        raise DeviceRefused(f"{path}: too small to be an emulator image ({size} bytes)")
    try:
        geo, discard = decode_header_full(io.pread(0, HEADER_BYTES))
        if size < geo.image_bytes:
            raise DeviceRefused(
                f"{path}: truncated image ({size} bytes, geometry needs {geo.image_bytes})"
            )
        tbytes = geo.table_copy_bytes
        copies = [io.pread(geo.table_offset + i * tbytes, tbytes) for i in range(2)]
        _slot, seq, entries = pick_newest_table(geo, copies)
    except ImageFormatError as exc:
        raise DeviceRefused(f"{path}: not a valid emulator image: {exc}") from None
    return geo, discard, seq, entries
