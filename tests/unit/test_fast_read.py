"""The read fast path (fs/data/readpath.py) against the general path and a model.

The same seeded random operations (unaligned and overlapping writes, truncates
both ways, fsyncs, the cleaner moving data, reads while chunks land) run on
two engines, one with `fast_read` on and one with it off; every read of
either must equal the model. Damaged data blocks fail with EIO for exactly
the blocks they are, through either path.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import trio
from engine_helpers import (
    CTX,
    TEST_OPTIONS,
    MiB,
    corrupt_image,
    mounted,
    pattern,
    resolve,
    write_file,
)

from zonefs_py import errors
from zonefs_py.device.aread import AsyncReader, BadChecksum
from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.format.checksum import block_checksums
from zonefs_py.fs.api import ROOT_INO, SetAttrRequest
from zonefs_py.fs.filesystem import ZoneFS

BS = 4096
KiB = 1024


async def _run_ops(fs: ZoneFS, seed: int, nops: int) -> tuple[int, int]:
    """Random ops on two files against a model; returns (fast reads, general reads)."""
    rng = random.Random(seed)
    files: dict[int, tuple[int, bytearray]] = {}
    for i in range(2):
        fh, attr = await fs.create(ROOT_INO, f"f{i}".encode(), 0o100644, os.O_RDWR, CTX)
        files[i] = (fh, bytearray())
    log: list[str] = []
    tag = 0
    for step in range(nops):
        i = rng.randrange(2)
        fh, model = files[i]
        r = rng.random()
        if r < 0.35:
            off = rng.randrange(0, max(1, len(model) + 64 * KiB))
            n = rng.choice([1, 17, 4095, 4096, 5000, 65536, 300_000, 1 << 20, (1 << 20) + 3])
            tag += 1
            data = pattern(tag, n)
            log.append(f"{step} write f{i} {off} {n}")
            await fs.write(fh, off, data)
            if off > len(model):
                model.extend(bytes(off - len(model)))
            model[off:off + n] = data
        elif r < 0.42:
            size = rng.randrange(0, len(model) + 8 * KiB + 1)
            log.append(f"{step} truncate f{i} {size}")
            await fs.setattr(fs.files[fh], SetAttrRequest(size=size), CTX)
            if size < len(model):
                del model[size:]
            else:
                model.extend(bytes(size - len(model)))
        elif r < 0.52:
            log.append(f"{step} fsync f{i}")
            await fs.fsync(fh, False)
        elif r < 0.56:
            log.append(f"{step} clean")
            await fs.sync()
            victim = fs.cleaner.pick_victim()
            if victim is not None:
                await fs.cleaner.clean_zone(victim.zone_idx, throttle=False)
                await fs.reclaim.commit_and_reset()
        elif r < 0.62:
            # Reads of both files while a streaming write of one lands chunks.
            off = rng.randrange(0, len(model) + 1)
            tag += 1
            data = pattern(tag, 3 * MiB)
            log.append(f"{step} concurrent write f{i} {off} + reads")
            got: list[tuple[int, int, int, bytes]] = []

            async def reader(j: int, lo: int, n: int,
                             out: list[tuple[int, int, int, bytes]] = got) -> None:
                out.append((j, lo, n, bytes(await fs.read(files[j][0], lo, n))))

            other = 1 - i
            omodel = files[other][1]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fs.write, fh, off, data)
                for _ in range(4):
                    lo = rng.randrange(0, len(omodel) + 1)
                    nursery.start_soon(reader, other, lo, rng.choice([1, 4096, 65536]))
            if off > len(model):
                model.extend(bytes(off - len(model)))
            model[off:off + len(data)] = data
            for j, lo, n, blob in got:
                assert blob == bytes(files[j][1][lo:lo + n]), (seed, log[-30:])
        else:
            off = rng.randrange(0, len(model) + 2)
            n = rng.choice([1, 100, 4096, 4096 * 3, 32 * KiB, 128 * KiB, 1 << 20])
            blob = bytes(await fs.read(fh, off, n))
            assert blob == bytes(model[off:off + n]), (seed, step, off, n, log[-30:])
    for fh, model in files.values():
        await fs.fsync(fh, False)
        assert bytes(await fs.read(fh, 0, len(model) + 1)) == bytes(model), seed
        await fs.release(fh)
    return fs.data.reads.fast_reads, fs.data.reads.general_reads


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_fast_and_general_paths_give_the_model_s_bytes(tmp_path: Path, seed: int) -> None:
    print(f"seed {seed}")
    counts = {}
    for fast in (True, False):
        opts = TEST_OPTIONS.replace(fast_read=fast, prefetch_mb=0)
        async with mounted(tmp_path / f"fs-{fast}.img", create=True, options=opts) as fs:
            if fs.data.reader is None or not fs.data.reader.uses_ring:
                pytest.skip("io_uring is not available on this kernel")
            counts[fast] = await _run_ops(fs, seed, 400)
    fast_reads, _general = counts[True]
    print(f"fast path on: {counts[True]} (fast, general reads); off: {counts[False]}")
    assert fast_reads > 0
    assert counts[False][0] == 0  # off means off


@pytest.mark.expect_log("zonefs_py.fs.data.readpath", "ERROR", "checksum mismatch")
@pytest.mark.parametrize("fast", [True, False])
async def test_a_damaged_data_block_is_eio_for_exactly_that_block(tmp_path: Path,
                                                                 fast: bool) -> None:
    image = tmp_path / "fs.img"
    blob = pattern(7, 256 * KiB)
    opts = TEST_OPTIONS.replace(fast_read=fast, prefetch_mb=0)
    async with mounted(image, create=True, options=opts) as fs:
        await write_file(fs, "/f", blob)
        ino = await resolve(fs, "/f")
        inode = fs.state.inodes[ino]
        assert inode.extents is not None
        ext = next(iter(inode.extents))
        bad_dev = ext.dev + 5 * BS
        bad_file = (ext.fblock + 5) * BS
    corrupt_image(image, bad_dev + 100)
    async with mounted(image, options=opts, fsck_after=False) as fs:
        fh = await fs.open(await resolve(fs, "/f"), os.O_RDONLY)
        before = fs.data.reads.fast_reads
        with pytest.raises(errors.IOFailure, match=f"checksum mismatch at file offset {bad_file}"):
            await fs.read(fh, bad_file + 10, 10)
        with pytest.raises(errors.IOFailure, match=f"at file offset {bad_file}"):
            await fs.read(fh, 0, 128 * KiB)
        assert bytes(await fs.read(fh, bad_file - BS, BS)) == blob[bad_file - BS:bad_file]
        assert bytes(await fs.read(fh, bad_file + BS, 64 * KiB)) == \
            blob[bad_file + BS:bad_file + BS + 64 * KiB]
        if fast and fs.data.reader is not None and fs.data.reader.uses_ring:
            assert fs.data.reads.fast_reads > before
        await fs.release(fh)
        assert fs.failsafe is None  # one file's data: EIO, the mount stays writable
        await write_file(fs, "/after", b"still writable")


# -- the reader's checksum verification alone ------------------------------------------

@pytest.mark.parametrize("ring", [True, False])
async def test_reader_verifies_the_checksums_it_is_given(tmp_path: Path, ring: bool,
                                                         nursery: trio.Nursery) -> None:
    dev = EmulatedZonedDevice.create(tmp_path / "d.img", size_bytes=16 * 4 * MiB,
                                     zone_size_bytes=4 * MiB)
    try:
        blob = os.urandom(64 * KiB)
        at = dev.append(2, blob)
        sums = block_checksums(blob, BS)
        reader = AsyncReader(dev, nursery)
        if ring and not reader.uses_ring:
            pytest.skip("io_uring is not available on this kernel")
        if not ring:
            reader.close()  # every read through a worker thread
        try:
            assert bytes(await reader.read(at, len(blob), sums)) == blob
            wrong = bytearray(sums)
            wrong[3 * 4] ^= 1
            with pytest.raises(BadChecksum) as info:
                await reader.read(at, len(blob), bytes(wrong))
            assert info.value.block == 3
            # Without checksums nothing is verified.
            assert bytes(await reader.read(at, 8192)) == blob[:8192]
            assert (reader.ring_reads > 0) == ring
        finally:
            await reader.aclose()
    finally:
        dev.close()
