"""Host tests of the native layer (zonefs_py._native via zonefs_py.device.native).

Regular files on the host's file system stand in for devices: O_DIRECT I/O,
alignment errors, batches, the buffer pool, and the ioctl paths, which must
fail cleanly (ENOTTY / ENOTBLK) on something that is not a zoned device.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from zonefs_py.device import native, open_device
from zonefs_py.errors import DeviceRefused

MiB = 1 << 20
BLK = 4096


@pytest.fixture
def image(tmp_path: Path) -> Path:
    path = tmp_path / "dev.bin"
    path.write_bytes(bytes(range(256)) * (4 * MiB // 256))
    return path


@pytest.fixture
def fd(image: Path) -> Iterator[int]:
    try:
        handle = native.open_path(str(image))
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            pytest.skip(f"{image.parent} does not support O_DIRECT")
        raise
    yield handle
    native.close_fd(handle)


def test_pread_matches_file(fd: int, image: Path) -> None:
    want = image.read_bytes()[BLK:5 * BLK]
    assert native.pread(fd, BLK, 4 * BLK, block_size=BLK) == want


def test_pwrite_roundtrip_longer_than_a_pool_buffer(fd: int) -> None:
    pool = native.BufferPool(nr_bufs=2, buf_size=BLK)
    data = os.urandom(16 * BLK)
    native.pwrite(fd, 2 * BLK, data, block_size=BLK, pool=pool)
    assert native.pread(fd, 2 * BLK, 16 * BLK, block_size=BLK, pool=pool) == data
    stats = pool.stats()
    assert stats.nr_free == stats.nr_bufs == 2
    assert stats.acquires == 2  # one buffer per call, reused for every chunk


def test_pwrite_accepts_memoryview_and_bytearray(fd: int) -> None:
    data = bytearray(b"\x5a" * (2 * BLK))
    native.pwrite(fd, 0, memoryview(data)[BLK:], block_size=BLK)
    native.pwrite(fd, BLK, data[:BLK])
    assert native.pread(fd, 0, 2 * BLK) == bytes(data)


@pytest.mark.parametrize(("offset", "length"), [(100, BLK), (BLK, 100), (-BLK, BLK), (0, -1)])
def test_misaligned_io_is_einval_and_names_offset(fd: int, offset: int, length: int) -> None:
    with pytest.raises(OSError) as exc:
        native.pread(fd, offset, length, block_size=BLK)
    assert exc.value.errno == errno.EINVAL
    assert f"offset {offset}" in str(exc.value)
    if length < 0:
        return  # pwrite takes its length from the data
    with pytest.raises(OSError) as exc:
        native.pwrite(fd, offset, b"\0" * length, block_size=BLK)
    assert exc.value.errno == errno.EINVAL


def test_bad_block_size_is_einval(fd: int) -> None:
    with pytest.raises(OSError, match="block size 3000") as exc:
        native.pread(fd, 0, BLK, block_size=3000)
    assert exc.value.errno == errno.EINVAL


def test_default_block_size_is_512(image: Path) -> None:
    handle = native.open_path(str(image), direct=False)  # buffered: the kernel takes any size
    try:
        assert native.pread(handle, 512, 512) == image.read_bytes()[512:1024]
        with pytest.raises(OSError) as exc:
            native.pread(handle, 256, 512)
        assert exc.value.errno == errno.EINVAL
    finally:
        native.close_fd(handle)


def test_read_past_end_is_eio(fd: int) -> None:
    with pytest.raises(OSError) as exc:
        native.pread(fd, 4 * MiB - BLK, 2 * BLK, block_size=BLK)
    assert exc.value.errno == errno.EIO


def test_zero_length_io(fd: int) -> None:
    assert native.pread(fd, 0, 0) == b""
    native.pwrite(fd, 0, b"")


def test_read_only_write_is_ebadf(image: Path) -> None:
    handle = native.open_path(str(image), read_only=True, exclusive=True)
    try:
        with pytest.raises(OSError) as exc:
            native.pwrite(handle, 0, b"\0" * BLK)
        assert exc.value.errno == errno.EBADF
    finally:
        native.close_fd(handle)


def test_open_missing_names_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        native.open_path(str(missing))


def test_close_twice_is_ebadf(image: Path) -> None:
    handle = native.open_path(str(image), direct=False)
    native.close_fd(handle)
    with pytest.raises(OSError) as exc:
        native.close_fd(handle)
    assert exc.value.errno == errno.EBADF


def test_fdatasync_and_file_size(fd: int) -> None:
    native.fdatasync(fd)
    assert native.file_size(fd) == 4 * MiB


@pytest.mark.parametrize("ring", [True, None], ids=["io_uring", "sequential"])
def test_batch_roundtrip(fd: int, ring: bool | None) -> None:
    writes = [(z * MiB + i * 2 * BLK, os.urandom(2 * BLK)) for z in range(4) for i in range(3)]
    native.pwrite_batch(fd, writes, block_size=BLK, ring=ring, zone_size_bytes=MiB)
    got = native.pread_batch(fd, [(off, len(d)) for off, d in writes], block_size=BLK, ring=ring)
    assert got == [d for _off, d in writes]


def test_batch_empty_and_zero_length(fd: int) -> None:
    assert native.pread_batch(fd, []) == []
    native.pwrite_batch(fd, [])
    assert native.pread_batch(fd, [(0, 0), (0, BLK)])[0] == b""


def test_batch_larger_than_pool_and_ring(fd: int) -> None:
    pool = native.BufferPool(nr_bufs=2, buf_size=BLK)
    ring = native.IoRing.create(2)
    spans = [(i * 3 * BLK, 3 * BLK) for i in range(20)]
    data = native.pread_batch(fd, spans, block_size=BLK, pool=pool, ring=ring or None)
    assert b"".join(data) == native.pread(fd, 0, 60 * BLK, block_size=BLK)
    assert pool.stats().nr_free == 2


def test_batch_misalignment_is_einval_before_any_io(fd: int) -> None:
    before = native.pread(fd, 0, BLK, block_size=BLK)
    with pytest.raises(OSError) as exc:
        native.pwrite_batch(fd, [(0, b"\1" * BLK), (100, b"\1" * BLK)], block_size=BLK)
    assert exc.value.errno == errno.EINVAL
    assert native.pread(fd, 0, BLK, block_size=BLK) == before


def test_batch_error_names_request(fd: int) -> None:
    with pytest.raises(OSError) as exc:
        native.pread_batch(fd, [(0, BLK), (4 * MiB, BLK)], block_size=BLK)
    assert exc.value.errno == errno.EIO
    assert "offset 4194304" in str(exc.value)
    assert "request 1 of 2" in str(exc.value)


def test_pool_waits_when_exhausted(fd: int) -> None:
    pool = native.BufferPool(nr_bufs=1, buf_size=BLK)
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            for _ in range(50):
                native.pread(fd, 0, 8 * BLK, block_size=BLK, pool=pool)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    stats = pool.stats()
    assert stats.acquires == 200
    assert stats.nr_free == 1


@pytest.mark.parametrize(("nr_bufs", "buf_size"), [(0, BLK), (1, 1000), (1, 0)])
def test_bad_pool_shape_is_einval(nr_bufs: int, buf_size: int) -> None:
    with pytest.raises(OSError) as exc:
        native.BufferPool(nr_bufs=nr_bufs, buf_size=buf_size)
    assert exc.value.errno == errno.EINVAL


def test_bad_ring_size_is_einval() -> None:
    with pytest.raises(OSError) as exc:
        native.IoRing.create(0)
    assert exc.value.errno == errno.EINVAL


def test_zone_ioctls_on_regular_file_fail_cleanly(fd: int, image: Path) -> None:
    with pytest.raises(OSError) as exc:
        native.report_zones(fd, 0, 4)
    assert exc.value.errno == errno.ENOTTY
    with pytest.raises(OSError) as exc:
        native.zone_mgmt(fd, "reset", 0, MiB)
    assert exc.value.errno == errno.ENOTTY
    with pytest.raises(OSError) as exc:
        native.block_geometry(fd, str(image))
    assert exc.value.errno == errno.ENOTBLK
    assert str(image) in str(exc.value)
    with pytest.raises(OSError) as exc:
        native.zoned_model(str(image))
    assert exc.value.errno == errno.ENOTBLK


@pytest.mark.parametrize(("op", "offset", "length"),
                         [("erase", 0, MiB), ("reset", 100, MiB), ("open", 0, 0)])
def test_zone_mgmt_bad_arguments_are_einval(fd: int, op: str, offset: int, length: int) -> None:
    with pytest.raises(OSError) as exc:
        native.zone_mgmt(fd, op, offset, length)
    assert exc.value.errno == errno.EINVAL


def test_report_zones_bad_arguments(fd: int) -> None:
    assert native.report_zones(fd, 0, 0) == []
    for offset, count in ((100, 1), (-512, 1), (0, -1)):
        with pytest.raises(OSError) as exc:
            native.report_zones(fd, offset, count)
        assert exc.value.errno == errno.EINVAL


def test_is_zoned_block_device_false_for_non_devices(image: Path, tmp_path: Path) -> None:
    assert not native.is_zoned_block_device(str(image))
    assert not native.is_zoned_block_device(str(tmp_path))
    assert not native.is_zoned_block_device(str(tmp_path / "missing"))
    assert not native.is_zoned_block_device("/dev/null")


@pytest.mark.parametrize("what", ["missing", "directory", "char device", "random file"])
def test_open_device_refuses(tmp_path: Path, what: str) -> None:
    path = {
        "missing": tmp_path / "missing",
        "directory": tmp_path,
        "char device": Path("/dev/null"),
        "random file": tmp_path / "junk.bin",
    }[what]
    if what == "random file":
        path.write_bytes(b"not an image" * 100)
    with pytest.raises(DeviceRefused) as exc:
        open_device(str(path))
    message = str(exc.value)
    assert str(path) in message
    assert "expected" in message
    assert "\n" not in message


def test_open_device_refuses_conventional_block_device() -> None:
    candidates = [f"/dev/{name}" for name in ("vda", "sda", "nvme0n1", "xvda")]
    disk = next((p for p in candidates if Path(p).is_block_device()), None)
    if disk is None or native.is_zoned_block_device(disk):
        pytest.skip("no conventional block device to try on this machine")
    with pytest.raises(DeviceRefused, match="conventional"):
        open_device(disk)


@pytest.mark.parametrize("block_size", [512, 4096])
def test_native_checksums_equal_the_xxhash_module(block_size: int) -> None:
    from zonefs_py.format import checksum

    for nblocks in (0, 1, 7, 256):
        data = os.urandom(block_size * nblocks)
        csums = checksum.block_checksums(data, block_size)
        assert csums == checksum.py_block_checksums(data, block_size)
        assert checksum.first_bad_block(data, block_size, csums) is None
        if nblocks:
            bad = bytearray(data)
            bad[-1] ^= 0x80
            assert checksum.first_bad_block(bad, block_size, csums) == nblocks - 1
            assert checksum.py_first_bad_block(bad, block_size, csums) == nblocks - 1
