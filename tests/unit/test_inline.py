"""Inline data (fs/inline.py): small files' bytes in the metadata, checked against a model.

Every test compares with the per-block `Model` of the other data tests, after
each step, after a remount (journal replay) and after a checkpoint (the bytes
then come from the checkpoint's INLINE ops), and ends with an fsck.
"""

from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path

import pytest
from engine_helpers import (
    CTX,
    TEST_OPTIONS,
    CountingDevice,
    KiB,
    Model,
    fsck,
    mounted,
    new_image,
    pattern,
    read_file,
    resolve,
    write_file,
)

from zonefs_py import errors
from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.format.constants import INLINE_MAX_BYTES, OpType
from zonefs_py.format.ops import OpDecodeError, decode_ops, encode_op
from zonefs_py.format.superblock import Superblock, SuperblockError
from zonefs_py.fs.api import ROOT_INO, SetAttrRequest
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.fs.inline import inline_threshold
from zonefs_py.fs.options import FsOptions

THRESHOLD = inline_threshold(4096, TEST_OPTIONS.inline_max_bytes)


async def check_model(fs: ZoneFS, model: Model) -> None:
    for path, want in model.files.items():
        got = await read_file(fs, path)
        assert got == want, f"{path}: {len(got)} bytes, model {len(want)}"


def data_blocks(fs: ZoneFS, path_ino: int) -> int:
    ext = fs.state.inodes[path_ino].extents
    return ext.mapped_blocks if ext is not None else 0


async def test_small_file_is_inline_and_costs_no_block(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    new_image(image)
    dev = EmulatedZonedDevice.open(image)
    cdev = CountingDevice(dev)
    try:
        async with ZoneFS.mount(cdev, TEST_OPTIONS) as fs:  # type: ignore[arg-type]
            live_before = fs.state.live_blocks_total
            for i in range(20):
                await write_file(fs, f"/s{i}", pattern(i, 256), fsync=i % 2 == 0)
            assert fs.state.live_blocks_total == live_before  # no data block at all
            ino = await resolve(fs, "/s3")
            assert fs.state.inodes[ino].inline == pattern(3, 256)
            attr = await fs.getattr(ino)
            assert attr.size == 256
            assert attr.blocks == 1
            assert fs.inline.files_inlined == 20
    finally:
        dev.close()
    # Replayed from the checkpoint written at unmount.
    async with mounted(image) as fs:
        for i in range(20):
            assert await read_file(fs, f"/s{i}") == pattern(i, 256)


async def test_threshold_boundary(tmp_path: Path) -> None:
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        await write_file(fs, "/at", pattern(1, THRESHOLD))
        await write_file(fs, "/over", pattern(2, THRESHOLD + 1))
        assert fs.state.inodes[await resolve(fs, "/at")].inline == pattern(1, THRESHOLD)
        over = await resolve(fs, "/over")
        assert not fs.state.inodes[over].inline
        assert data_blocks(fs, over) == 1
        await write_file(fs, "/empty", b"")
        assert await read_file(fs, "/empty") == b""
    assert THRESHOLD <= INLINE_MAX_BYTES


async def test_grow_across_threshold_and_shrink_into_it(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    model = Model(files={"/g": pattern(5, 400)})
    async with mounted(image, create=True) as fs:
        await write_file(fs, "/g", model.files["/g"])
        ino = await resolve(fs, "/g")
        assert fs.state.inodes[ino].inline
        fh = await fs.open(ino, os.O_RDWR)
        # Grow past the threshold with an unaligned write: converts, keeps the head.
        extra = pattern(6, 3000)
        await fs.write(fh, 300, extra)
        model.write("/g", 300, extra)
        assert await fs.read(fh, 0, 10000) == model.files["/g"]  # before the flush too
        await fs.fsync(fh, False)
        assert not fs.state.inodes[ino].inline
        assert data_blocks(fs, ino) >= 1
        assert fs.inline.files_converted == 1
        await check_model(fs, model)
        # Shrink into the threshold: the blocks stay, the bytes are right.
        await fs.setattr(ino, SetAttrRequest(size=300), CTX)
        model.truncate("/g", 300)
        await fs.fsync(fh, False)
        await fs.release(fh)
        await check_model(fs, model)
        # Rewritten whole (O_TRUNC) it becomes inline again.
        await write_file(fs, "/g", pattern(7, 100))
        model.files["/g"] = pattern(7, 100)
        assert fs.state.inodes[ino].inline == pattern(7, 100)
        assert data_blocks(fs, ino) == 0
    async with mounted(image) as fs:
        await check_model(fs, model)


async def test_sparse_inline_file_and_truncate(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    model = Model(files={"/s": pattern(8, 200)})
    async with mounted(image, create=True) as fs:
        await write_file(fs, "/s", model.files["/s"])
        ino = await resolve(fs, "/s")
        # Extend far past the threshold: a hole after the inline bytes, no block.
        await fs.setattr(ino, SetAttrRequest(size=1 << 20), CTX)
        model.truncate("/s", 1 << 20)
        assert fs.state.inodes[ino].inline
        assert data_blocks(fs, ino) == 0
        await check_model(fs, model)
        # Shrink into the inline bytes: they are cut in the same transaction.
        await fs.setattr(ino, SetAttrRequest(size=50), CTX)
        model.truncate("/s", 50)
        assert fs.state.inodes[ino].inline == pattern(8, 50)
        fh = await fs.open(ino, os.O_RDWR)
        assert await fs.read(fh, 40, 100) == pattern(8, 50)[40:]
        # A write inside a grown inline file converts it and keeps the zeros.
        await fs.setattr(ino, SetAttrRequest(size=1000), CTX)
        model.truncate("/s", 1000)
        await fs.write(fh, 900, b"xyz")
        model.write("/s", 900, b"xyz")
        await fs.release(fh)
        await check_model(fs, model)
    async with mounted(image) as fs:
        await check_model(fs, model)


async def test_trailing_zeros_are_not_stored(tmp_path: Path) -> None:
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        await write_file(fs, "/z", b"ab" + bytes(300))
        ino = await resolve(fs, "/z")
        assert fs.state.inodes[ino].inline == b"ab"
        assert await read_file(fs, "/z") == b"ab" + bytes(300)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_small_file_ops_match_the_model(tmp_path: Path, seed: int) -> None:
    """Writes, truncates, rewrites and remounts of files around the threshold."""
    rng = random.Random(seed)
    image = tmp_path / "fs.img"
    model = Model()
    names = [f"/r{i}" for i in range(6)]
    new_image(image)
    for round_no in range(4):
        async with mounted(image) as fs:
            await check_model(fs, model)
            for step in range(40):
                path = rng.choice(names)
                kind = rng.random()
                where = f"seed={seed} round={round_no} step={step} {path}"
                if path not in model.files or kind < 0.2:
                    data = pattern(rng.randrange(1000), rng.randrange(0, 3 * THRESHOLD))
                    await write_file(fs, path, data, fsync=rng.random() < 0.5)
                    model.files[path] = data
                    continue
                ino = await resolve(fs, path)
                fh = await fs.open(ino, os.O_RDWR)
                try:
                    if kind < 0.6:
                        off = rng.randrange(0, 2 * THRESHOLD)
                        data = pattern(rng.randrange(1000), rng.randrange(1, THRESHOLD))
                        await fs.write(fh, off, data)
                        model.write(path, off, data)
                    else:
                        size = rng.randrange(0, 3 * THRESHOLD)
                        await fs.setattr(ino, SetAttrRequest(size=size), CTX)
                        model.truncate(path, size)
                    got = await fs.read(fh, 0, 1 << 20)
                    assert got == model.files[path], where
                    if rng.random() < 0.3:
                        await fs.fsync(fh, False)
                finally:
                    await fs.release(fh)
                inode = fs.state.inodes[ino]
                assert not (inode.inline and len(inode.extents or ())), where
            if round_no == 2:
                await fs.checkpoint()


async def test_mmap_style_page_writes_over_inline_file(tmp_path: Path) -> None:
    """The kernel writes back mmap'ed pages as whole-page WRITEs at offset 0."""
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        await write_file(fs, "/m", pattern(9, 300))
        ino = await resolve(fs, "/m")
        fh = await fs.open(ino, os.O_RDWR)
        page = bytearray(pattern(9, 300) + bytes(4096 - 300))
        page[10:20] = b"0123456789"
        await fs.write(fh, 0, bytes(page[:300]))  # writeback clips the page at EOF
        await fs.flush(fh)
        await fs.release(fh)
        want = bytes(page[:300])
        assert await read_file(fs, "/m") == want
        # Written whole from offset 0 and small: inline again after the conversion.
        assert fs.state.inodes[ino].inline == want or data_blocks(fs, ino) == 1


async def test_inline_op_round_trip_and_refusals() -> None:
    op = (OpType.INLINE, 42, 5, 7, 8, b"hello")
    assert decode_ops(encode_op(op)) == [op]
    with pytest.raises(ValueError, match="INLINE op"):
        encode_op((OpType.INLINE, 1, 0, 0, 0, bytes(INLINE_MAX_BYTES + 1)))
    # A body whose length field disagrees with the frame is refused, never misread.
    raw = bytearray(encode_op(op))
    raw[5 + 32] += 1
    with pytest.raises(OpDecodeError, match="INLINE"):
        decode_ops(bytes(raw))


def test_version_1_superblock_is_refused_with_a_clear_message() -> None:
    sb = Superblock(b"u" * 16, 4096, 1 << 20, 64, 0, 1, 2, 4, 6, 58, 0, b"x", 2, 2 << 20, 1, 0,
                    disk_version=1)
    with pytest.raises(SuperblockError, match="version 1 predates inline"):
        Superblock.decode(sb.encode())


async def test_fsck_refuses_inline_data_longer_than_the_file(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True, fsck_after=False) as fs:
        await write_file(fs, "/f", pattern(1, 100))
        ino = await resolve(fs, "/f")
        # A well-checksummed record with an impossible INLINE op (a bug, or
        # damage that kept its checksum valid): longer than the file.
        bad = (OpType.INLINE, ino, 100, 0, 0, pattern(2, 500))
        fs.state.apply(bad)
        fs.journal.add([bad])
        await fs.sync()
    report = fsck(image)
    assert [f.invariant for f in report.findings] == ["INV-22"], report.findings
    assert "longer than the file" in report.findings[0].message


async def test_damaged_inline_record_is_refused(tmp_path: Path) -> None:
    """A flipped byte inside an inline file's bytes fails its record's checksum:
    mount and fsck refuse the log (INV-3), never return other bytes."""
    image = tmp_path / "fs.img"
    marker = b"INLINE-MARKER-" * 10
    new_image(image)
    dev = EmulatedZonedDevice.open(image)
    try:
        async with ZoneFS.mount(dev, TEST_OPTIONS, close=False) as fs:
            await write_file(fs, "/f", marker)
            await write_file(fs, "/g", pattern(3, 5000))  # a later record in the same zone
            # Crash (no clean unmount): the bytes are only in a JOURNAL record.
    finally:
        dev.close()
    raw = image.read_bytes()
    pos = raw.find(marker)
    assert pos > 0
    image.write_bytes(raw[:pos + 3] + bytes([raw[pos + 3] ^ 0x40]) + raw[pos + 4:])
    report = fsck(image)
    assert not report.clean
    assert {f.invariant for f in report.findings} <= {"INV-3"}, report.findings
    dev = EmulatedZonedDevice.open(image)
    try:
        with pytest.raises(errors.CorruptionError):
            await ZoneFS.load(dev, TEST_OPTIONS)
    finally:
        dev.close()


async def test_drained_inline_file_is_not_evicted(tmp_path: Path) -> None:
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        await write_file(fs, "/d", pattern(4, 100))
        inode = fs.state.inodes[await resolve(fs, "/d")]
        assert fs.drain.evictable(inode) is not None
        assert ROOT_INO in fs.state.inodes
        assert 4 * KiB > THRESHOLD


async def test_times_only_inode_ops_superseded_in_the_same_commit(tmp_path: Path) -> None:
    """A directory's INODE op at every create in it, and the kernel's SETATTR of
    mtime before close, are superseded in the queue by later ops of the same
    inode: fewer journal bytes, and the journal replays to the same attributes."""
    image = tmp_path / "fs.img"
    new_image(image)
    dev = EmulatedZonedDevice.open(image)
    try:
        async with ZoneFS.mount(dev, TEST_OPTIONS, close=False) as fs:
            d = (await fs.mkdir(ROOT_INO, b"d", 0o755, CTX)).ino
            for i in range(5):
                fh, attr = await fs.create(d, f"f{i}".encode(), 0o644, os.O_RDWR, CTX)
                fs.forget([(attr.ino, 1)])
                await fs.write(fh, 0, pattern(i, 256))
                await fs.setattr(attr.ino, SetAttrRequest(mtime_ns=123 + i), CTX)  # mtime only
                await fs.flush(fh)
                await fs.release(fh)
            await fs.setattr(d, SetAttrRequest(mode=0o700), CTX)  # not times only: kept
            assert fs.journal.superseded_bytes >= 4 * 73 + 5 * 73
            await fs.sync()
            want = {ino: (i.mode, i.nlink, i.size, i.atime, i.mtime, i.ctime, i.inline)
                    for ino, i in fs.state.inodes.items()}
            # No close: the next mount replays the journal (no unmount checkpoint).
    finally:
        dev.close()
    async with mounted(image) as fs:
        got = {ino: (i.mode, i.nlink, i.size, i.atime, i.mtime, i.ctime, i.inline)
               for ino, i in fs.state.inodes.items()}
        assert got == want


async def test_inline_max_mount_option(tmp_path: Path) -> None:
    opts, rest = FsOptions.from_mount_options({"inline_max": "0", "ro": None})
    assert opts.inline_max_bytes == 0
    assert "inline_max" not in rest
    with pytest.raises(ValueError, match="inline_max"):
        FsOptions.from_mount_options({"inline_max": "4096"})
    off = dataclasses.replace(TEST_OPTIONS, inline_max_bytes=0)
    async with mounted(tmp_path / "fs.img", create=True, options=off) as fs:
        await write_file(fs, "/b", pattern(1, 100))
        ino = await resolve(fs, "/b")
        assert not fs.state.inodes[ino].inline
        assert data_blocks(fs, ino) == 1
