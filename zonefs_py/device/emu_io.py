"""Byte I/O on the emulator's backing file: O_DIRECT through the native layer, or buffered.

`open_image_io(path, read_only=..., mode=...)` picks the backend:

  * ``"direct"`` -- `zonefs_py.device.native` with O_DIRECT, the normal path.
    The emulator then runs at the speed of the backing disk.
  * ``"buffered"`` -- os.pread / os.pwrite / os.fdatasync through the page
    cache. Needed where O_DIRECT is impossible (tmpfs answers EINVAL) and
    selectable by tests.
  * ``"auto"`` (default) -- direct, falling back to buffered only when the
    O_DIRECT open itself fails with EINVAL. The choice is visible as
    `ImageIO.direct`.

Caveats:
  * With O_DIRECT every offset and length must be a multiple of the backing
    file system's logical block size; the image layout keeps metadata on
    4 KiB boundaries, but an emulated block size of 512 on a 4Kn disk fails
    with EINVAL on the first data I/O.
  * Durability on the buffered backend relies on os.fdatasync like the direct
    one; only the cost differs.
"""

from __future__ import annotations

import errno
import os
from typing import Literal, Protocol

IOMode = Literal["auto", "direct", "buffered"]
Buffer = bytes | bytearray | memoryview


class ImageIO(Protocol):
    """The few file operations the emulator uses (offsets and lengths in bytes)."""

    fd: int
    direct: bool

    def pread(self, offset_bytes: int, length_bytes: int) -> bytes: ...

    def pwrite(self, offset_bytes: int, data: Buffer) -> None: ...

    def fdatasync(self) -> None: ...

    def file_size(self) -> int: ...

    def close(self) -> None: ...


class NativeImageIO:
    """O_DIRECT I/O through `zonefs_py.device.native` (GIL released while blocked)."""

    direct = True

    def __init__(self, path: str, *, read_only: bool) -> None:
        from zonefs_py.device import native

        self._native = native
        self.fd = native.open_path(path, direct=True, read_only=read_only)

    def pread(self, offset_bytes: int, length_bytes: int) -> bytes:
        # The emulator checks alignment to its own block size (>= 512) first;
        # 512 is all the native layer needs to check for O_DIRECT on a file.
        return self._native.pread(self.fd, offset_bytes, length_bytes, block_size=512)

    def pwrite(self, offset_bytes: int, data: Buffer) -> None:
        self._native.pwrite(self.fd, offset_bytes, data, block_size=512)

    def fdatasync(self) -> None:
        self._native.fdatasync(self.fd)

    def file_size(self) -> int:
        return int(self._native.file_size(self.fd))

    def close(self) -> None:
        self._native.close_fd(self.fd)


class BufferedImageIO:
    """Page-cache I/O with os.pread / os.pwrite; for file systems without O_DIRECT."""

    direct = False

    def __init__(self, path: str, *, read_only: bool) -> None:
        flags = (os.O_RDONLY if read_only else os.O_RDWR) | os.O_CLOEXEC
        self.fd = os.open(path, flags)

    def pread(self, offset_bytes: int, length_bytes: int) -> bytes:
        data = os.pread(self.fd, length_bytes, offset_bytes)
        if len(data) != length_bytes:
            raise OSError(errno.EIO, f"short read at {offset_bytes} of the image")
        return data

    def pwrite(self, offset_bytes: int, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset_bytes + done)

    def fdatasync(self) -> None:
        os.fdatasync(self.fd)

    def file_size(self) -> int:
        return os.fstat(self.fd).st_size

    def close(self) -> None:
        os.close(self.fd)


def open_image_io(path: str, *, read_only: bool, mode: IOMode = "auto") -> ImageIO:
    """Open `path` with the backend `mode` selects (see the module docstring).

    Raises OSError from the open (ENOENT, EACCES, EINVAL for "direct" on a file
    system without O_DIRECT, ...).
    """
    if mode == "buffered":
        return BufferedImageIO(path, read_only=read_only)
    try:
        return NativeImageIO(path, read_only=read_only)
    except OSError as exc:
        if mode == "auto" and exc.errno == errno.EINVAL:
            return BufferedImageIO(path, read_only=read_only)
        raise
