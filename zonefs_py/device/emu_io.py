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
  * `punch_hole` (both backends, the data-discarding mode) is fallocate(2)
    with FALLOC_FL_PUNCH_HOLE through ctypes: os.posix_fallocate cannot free
    space. File systems without it (vfat, exfat, old ext3) raise EOPNOTSUPP.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from collections.abc import Callable
from typing import Literal, Protocol

IOMode = Literal["auto", "direct", "buffered"]
Buffer = bytes | bytearray | memoryview

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
#: `nonzero_runs` compares at most this much at once against `_ZEROS`.
_SCAN_BYTES = 1 << 20
_ZEROS = bytes(_SCAN_BYTES)


@functools.cache
def _fallocate() -> Callable[[int, int, int, int], int]:
    libc = ctypes.CDLL(None, use_errno=True)  # CDLL calls release the GIL
    fn = getattr(libc, "fallocate64", None) or libc.fallocate
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


def punch_hole(fd: int, offset_bytes: int, length_bytes: int) -> None:
    """Deallocate a file range, keeping the file size; it reads back as zeros.

    Raises OSError with fallocate(2)'s errno: EOPNOTSUPP where the file
    system cannot punch holes, EBADF, EIO, ...
    """
    if length_bytes <= 0:
        return
    fallocate = _fallocate()
    mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
    while fallocate(fd, mode, offset_bytes, length_bytes) != 0:
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise OSError(err, f"punch hole at {offset_bytes}+{length_bytes}: "
                               f"{os.strerror(err)}")


def nonzero_runs(data: Buffer, block_size: int) -> list[tuple[int, int]]:
    """Return the [start, end) byte ranges of `data` made of blocks that are not all zeros.

    Each range is a maximal run of consecutive such blocks (one pwrite each).
    `block_size` must be a power of two <= 1 MiB. Cost: one memcmp per MiB
    for zeros (bytes.startswith against a cached zero buffer; memoryview
    comparison goes item by item, ~50 times slower), one per block in a MiB
    that holds anything else.
    """
    view = memoryview(data).cast("B")
    size = view.nbytes
    zeros = _ZEROS
    runs: list[tuple[int, int]] = []
    run_start = -1
    for chunk in range(0, size, _SCAN_BYTES):
        chunk_end = min(size, chunk + _SCAN_BYTES)
        if zeros.startswith(view[chunk:chunk_end]):
            if run_start >= 0:
                runs.append((run_start, chunk))
                run_start = -1
            continue
        for pos in range(chunk, chunk_end, block_size):
            if zeros.startswith(view[pos : pos + block_size]):
                if run_start >= 0:
                    runs.append((run_start, pos))
                    run_start = -1
            elif run_start < 0:
                run_start = pos
    if run_start >= 0:
        runs.append((run_start, size))
    return runs


class ImageIO(Protocol):
    """The few file operations the emulator uses (offsets and lengths in bytes)."""

    fd: int
    direct: bool

    def pread(self, offset_bytes: int, length_bytes: int) -> bytes: ...

    def pwrite(self, offset_bytes: int, data: Buffer) -> None: ...

    def fdatasync(self) -> None: ...

    def punch_hole(self, offset_bytes: int, length_bytes: int) -> None: ...

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

    def punch_hole(self, offset_bytes: int, length_bytes: int) -> None:
        punch_hole(self.fd, offset_bytes, length_bytes)

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

    def punch_hole(self, offset_bytes: int, length_bytes: int) -> None:
        punch_hole(self.fd, offset_bytes, length_bytes)

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
