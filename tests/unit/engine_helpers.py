"""Shared helpers for the engine tests (format, journal, namespace, data, crash, fsck).

* `new_image` / `mounted` build an emulated device, mkfs it and load ZoneFS,
  always closing what they opened (the image stays under tmp_path).
* `CountingDevice` wraps a device, counts mutating calls and can cut power
  after the k-th one in "drop" or "tear" mode (the crash sweeps use it).
* `Model` is a tiny in-memory model of the namespace (path -> bytes, dirs).
* `read_tree` walks a mounted ZoneFS into the same shape as the model.
"""

from __future__ import annotations

import os
import random
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import crashlib

from zonefs_py import errors
from zonefs_py.device.base import DeviceInfo, Zone
from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.format.constants import INDEX_DISK_VERSION
from zonefs_py.fs.api import ROOT_INO, Attr, Ctx
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.fs.mkfs import make_filesystem
from zonefs_py.fs.options import FsOptions
from zonefs_py.fsck import Report

KiB = 1 << 10
MiB = 1 << 20
CTX = Ctx()

#: Options for tests: no background task runs, so nothing happens behind a test's back.
TEST_OPTIONS = FsOptions(commit_interval_s=3600.0)


@dataclass(frozen=True, slots=True)
class Geometry:
    """Image geometry for a test: small and sparse."""

    size_bytes: int = 64 * MiB
    zone_size_bytes: int = 2 * MiB
    block_size: int = 4096
    meta_zones: int | None = None
    max_active: int = 0
    #: None: crashlib's TEST_DISK_VERSION (ZONEFS_TEST_FORMAT); 4 pins a test
    #: about format 4's own mechanics (its whole-namespace checkpoints, conversions).
    disk_version: int | None = None


SMALL = Geometry()
#: Tiny zones so that a few dozen journal commits roll a meta zone.
TINY = Geometry(size_bytes=4 * MiB, zone_size_bytes=64 * KiB, meta_zones=4)


def new_image(path: Path, geo: Geometry = SMALL) -> None:
    """Create an emulated image at `path` holding a fresh filesystem (closed again)."""
    crashlib.new_image(path, size_bytes=geo.size_bytes, zone_size_bytes=geo.zone_size_bytes,
                       block_size=geo.block_size, max_active=geo.max_active,
                       meta_zones=geo.meta_zones, disk_version=geo.disk_version)


def new_image5(path: Path, geo: Geometry) -> None:
    """An emulated image holding a fresh format-5 filesystem with exactly `geo`'s
    meta zones (new_image adds format 5's for a geometry sized for format 4)."""
    dev = EmulatedZonedDevice.create(path, size_bytes=geo.size_bytes,
                                     zone_size_bytes=geo.zone_size_bytes,
                                     block_size=geo.block_size)
    try:
        make_filesystem(dev, meta_zones=geo.meta_zones, disk_version=INDEX_DISK_VERSION)
    finally:
        dev.close()


def open_image(path: Path, **kwargs: object) -> EmulatedZonedDevice:
    return EmulatedZonedDevice.open(path, **kwargs)  # type: ignore[arg-type]


def fsck(path: Path, *, check_data: bool = True) -> Report:
    """Run check_filesystem on a closed image (opened read-only; tests/crashlib.py)."""
    return crashlib.fsck_report(path, check_data=check_data)


def assert_fsck_clean(path: Path) -> None:
    report = fsck(path)
    assert report.clean, crashlib.findings_text(report)


@asynccontextmanager
async def mounted(path: Path, *, geo: Geometry = SMALL, create: bool = False,
                  options: FsOptions = TEST_OPTIONS, fsck_after: bool = True,
                  ) -> AsyncIterator[ZoneFS]:
    """Yield a loaded ZoneFS on the image at `path` (made first if `create`).

    On a normal exit the filesystem is closed cleanly and, with `fsck_after`,
    the image must pass check_filesystem. The device is always closed.
    """
    if create:
        new_image(path, geo)
    dev = EmulatedZonedDevice.open(path)
    clean_exit = False
    try:
        async with ZoneFS.mount(dev, options) as fs:
            yield fs
        clean_exit = True
    finally:
        dev.close()
    if clean_exit and fsck_after:
        assert_fsck_clean(path)


# -- a device wrapper that counts writes and cuts power -------------------------------

class CountingDevice:
    """Delegate to an EmulatedZonedDevice; count mutating calls; cut power after one.

    Mutating calls are append, write, reset/open/close/finish_zone (flush is
    not counted: a cut right after a flush equals a cut before the next write).
    With `cut_after=k`, power is cut (`mode` "drop" or "tear") right after
    the k-th such call returns; later calls then fail with OSError(EIO).
    """

    def __init__(self, dev: EmulatedZonedDevice, *, cut_after: int | None = None,
                 mode: str = "drop", rng: random.Random | None = None,
                 scatter_bytes: int = 0) -> None:
        self.dev = dev
        self.scatter_bytes = scatter_bytes
        self.writes = 0
        self.appends = 0
        self.cut_after = cut_after
        self.mode = mode
        self.rng = rng or random.Random(0)
        self.cut = False

    @property
    def info(self) -> DeviceInfo:
        return self.dev.info

    def report_zones(self, first_zone: int = 0, count: int | None = None) -> list[Zone]:
        return self.dev.report_zones(first_zone, count)

    def read(self, offset_bytes: int, length_bytes: int) -> bytes:
        return self.dev.read(offset_bytes, length_bytes)

    def flush(self) -> None:
        self.dev.flush()

    def close(self) -> None:
        self.dev.close()

    def _counted(self) -> None:
        self.writes += 1
        if self.cut_after is not None and self.writes == self.cut_after and not self.cut:
            self.cut = True
            self.dev.simulate_power_cut(self.mode, rng=self.rng)  # type: ignore[arg-type]

    def append(self, zone_idx: int, data: bytes | bytearray | memoryview) -> int:
        off = self.dev.append(zone_idx, data)
        self.appends += 1
        self._counted()
        return off

    def append_scattered(self, zone_idx: int,
                         data: bytes | bytearray | memoryview) -> list[tuple[int, int]]:
        """With `scatter_bytes`: slices of that size land in a random order, one
        counted append each (a cut can fall between slices of one chunk, and
        "tear" keeps a random prefix of them), as concurrent zone appends
        completing out of order would; else one append."""
        view = memoryview(data).cast("B")
        step = self.scatter_bytes
        if not step or view.nbytes <= step:
            return [(self.append(zone_idx, view), view.nbytes)]
        starts = list(range(0, view.nbytes, step))
        order = list(starts)
        self.rng.shuffle(order)
        where = {pos: self.append(zone_idx, view[pos:pos + step]) for pos in order}
        return [(where[pos], min(step, view.nbytes - pos)) for pos in starts]

    def write(self, offset_bytes: int, data: bytes | bytearray | memoryview) -> None:
        self.dev.write(offset_bytes, data)
        self._counted()

    def reset_zone(self, zone_idx: int) -> None:
        self.dev.reset_zone(zone_idx)
        self._counted()

    def open_zone(self, zone_idx: int) -> None:
        self.dev.open_zone(zone_idx)
        self._counted()

    def close_zone(self, zone_idx: int) -> None:
        self.dev.close_zone(zone_idx)
        self._counted()

    def finish_zone(self, zone_idx: int) -> None:
        self.dev.finish_zone(zone_idx)
        self._counted()


# -- path helpers over the inode API -----------------------------------------------------

async def lookup(fs: ZoneFS, parent_ino: int, name: bytes) -> Attr:
    """Look a name up and drop the lookup count again, as the kernel does eventually."""
    attr = await fs.lookup(parent_ino, name)
    fs.forget([(attr.ino, 1)])
    return attr


async def resolve(fs: ZoneFS, path: str) -> int:
    """Return the inode of `path` ("/a/b"); raises errors.NotFound."""
    ino = ROOT_INO
    for part in path.strip("/").split("/"):
        if part:
            ino = (await lookup(fs, ino, part.encode())).ino
    return ino


async def parent_and_name(fs: ZoneFS, path: str) -> tuple[int, bytes]:
    head, _, name = path.rstrip("/").rpartition("/")
    return await resolve(fs, head or "/"), name.encode()


async def write_file(fs: ZoneFS, path: str, data: bytes, *, fsync: bool = True,
                     chunk: int = 0) -> Attr:
    """Create or truncate `path`, write `data` (in writes of `chunk` bytes, or
    one), optionally fsync, release."""
    parent, name = await parent_and_name(fs, path)
    try:
        ino = (await lookup(fs, parent, name)).ino
        fh = await fs.open(ino, os.O_WRONLY | os.O_TRUNC)
    except errors.NotFound:
        fh, attr = await fs.create(parent, name, 0o644, os.O_WRONLY, CTX)
        fs.forget([(attr.ino, 1)])
    try:
        step = chunk or len(data)
        for off in range(0, len(data), step or 1):
            await fs.write(fh, off, data[off:off + step])
        if fsync:
            await fs.fsync(fh, False)
        return await fs.getattr(fs.files[fh])
    finally:
        await fs.release(fh)


async def read_file(fs: ZoneFS, path: str) -> bytes:
    ino = await resolve(fs, path)
    return await read_ino(fs, ino)


async def read_ino(fs: ZoneFS, ino: int) -> bytes:
    fh = await fs.open(ino, os.O_RDONLY)
    try:
        size = (await fs.getattr(ino)).size
        return await fs.read(fh, 0, size + 1)
    finally:
        await fs.release(fh)


async def listdir(fs: ZoneFS, ino: int) -> list[bytes]:
    dh = await fs.opendir(ino)
    try:
        names: list[bytes] = []
        offset = 0
        while True:
            entries = await fs.readdir(dh, offset)
            if not entries:
                break
            names += [e.name for e in entries]
            offset = entries[-1].next_offset
        return [n for n in names if n not in (b".", b"..")]
    finally:
        await fs.releasedir(dh)


async def read_tree(fs: ZoneFS) -> tuple[dict[str, bytes], set[str]]:
    """Return (files: path -> content, dirs: paths) of the whole tree ("/" excluded)."""
    files: dict[str, bytes] = {}
    dirs: set[str] = set()
    stack = [("", ROOT_INO)]
    while stack:
        prefix, ino = stack.pop()
        for name in await listdir(fs, ino):
            path = f"{prefix}/{name.decode(errors='surrogateescape')}"
            attr = await lookup(fs, ino, name)
            if stat.S_ISDIR(attr.mode):
                dirs.add(path)
                stack.append((path, attr.ino))
            elif stat.S_ISREG(attr.mode):
                files[path] = await read_ino(fs, attr.ino)
    return files, dirs


# -- a tiny model ------------------------------------------------------------------------

@dataclass
class Model:
    """What the namespace should hold: regular files (path -> bytes) and directories."""

    files: dict[str, bytes] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=set)

    def copy(self) -> Model:
        return Model(dict(self.files), set(self.dirs))

    def children(self, d: str) -> list[str]:
        pre = d.rstrip("/") + "/"
        return [p for p in list(self.files) + list(self.dirs)
                if p.startswith(pre) and "/" not in p[len(pre):]]

    def write(self, path: str, offset: int, data: bytes) -> None:
        old = self.files[path]
        if offset > len(old):
            old = old + bytes(offset - len(old))
        self.files[path] = old[:offset] + data + old[offset + len(data):]

    def truncate(self, path: str, size: int) -> None:
        old = self.files[path]
        self.files[path] = old[:size] + bytes(max(0, size - len(old)))

    def rename(self, src: str, dst: str) -> None:
        if src in self.files:
            self.files[dst] = self.files.pop(src)
            return
        self.dirs.discard(dst)
        moved = {p for p in self.dirs if p == src or p.startswith(src + "/")}
        self.dirs -= moved
        self.dirs |= {dst + p[len(src):] for p in moved}
        for p in [p for p in self.files if p.startswith(src + "/")]:
            self.files[dst + p[len(src):]] = self.files.pop(p)


def pattern(tag: int, length: int) -> bytes:
    """Return `length` bytes that are never zero and differ between tags (seeded)."""
    rng = random.Random(tag)
    block = bytes(rng.randrange(1, 256) for _ in range(1021))
    return (block * (length // len(block) + 1))[:length]


def corrupt_image(path: Path, dev_offset: int, *, xor: int = 0x01) -> None:
    """Flip bits of the byte at device offset `dev_offset` inside a closed image file."""
    dev = EmulatedZonedDevice.open(path, read_only=True)
    try:
        file_offset = dev.geometry.data_offset + dev_offset
    finally:
        dev.close()
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, 1, file_offset)
        os.pwrite(fd, bytes([old[0] ^ xor]), file_offset)
        os.fsync(fd)
    finally:
        os.close(fd)


async def create_files(fs: ZoneFS, parent: int, prefix: bytes, count: int,
                       content: bytes = b"") -> int:
    """Create up to `count` files holding `content`; stop at NoSpace; return how many."""
    for n in range(count):
        try:
            fh, attr = await fs.create(parent, prefix + b"%06d" % n, 0o644, os.O_RDWR, CTX)
        except errors.NoSpace:
            return n
        if content:
            await fs.write(fh, 0, content)
        await fs.release(fh)
        fs.forget([(attr.ino, 1)])
    return count
