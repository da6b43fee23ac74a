#!/usr/bin/env python3
"""Bad-image fuzzer: mutate superblock, journal and checkpoint bytes; recover; read everything.

    python3 tests/reliability/fuzz_images.py --iterations 10000 --seed 1 [--dir D]

A small image (8 MiB, 64 KiB zones, 8 meta zones) is built in-process with
files written, overwritten, renamed and fsync'ed (small ones inline, INLINE
ops), a checkpoint written in small records while fsyncs commit journal
records inside it, and journal records after it; it is left as after a
crash (no clean unmount). Each
iteration applies 1-8 random mutations (bit flip, random byte, random word,
zeroed or 0xFF sector, a sector copied from elsewhere in the metadata, zeroed
tail) to bytes below the write pointer of the superblock and meta zones,
or (half of the iterations) changes bytes inside one record and recomputes
its checksum, so the garbage reaches the op decoders and the replay; then,
on the image opened read-only:

  * `fsck.check_filesystem` must return a report (findings or not), never raise;
  * `ZoneFS.load(read_only)` must either refuse with NotAFilesystem,
    CorruptionError or DeviceRefused, or load; then every directory is listed
    and every file read: a read may fail with IOFailure (EIO), and what it
    returns must be exactly a content the generator wrote at some point;
  * every 4th iteration does the same read-write on a copy (recovery may
    reset zones and write a checkpoint), closes it, and fscks the result;
  * nothing may hang (faulthandler aborts an iteration after 60 s).

The original bytes are restored after each iteration. Exit 0 when no bug was
seen; else 1, with each distinct failure (exception type and place) printed once.
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import os
import random
import shutil
import stat as statmod
import struct
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path

import trio
import xxhash

from zonefs_py import errors
from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.format.constants import RECORD_HEADER_SIZE
from zonefs_py.format.records import FLAG_ZLIB, padded_size, peek_header
from zonefs_py.fs.api import ROOT_INO, Ctx
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.fs.mkfs import make_filesystem
from zonefs_py.fs.options import FsOptions
from zonefs_py.fsck import check_filesystem
from zonefs_py.journal import journal as journal_mod
from zonefs_py.journal.recovery import read_superblock

KiB, MiB = 1 << 10, 1 << 20
REFUSALS = (errors.NotAFilesystem, errors.CorruptionError, errors.DeviceRefused)
OPTIONS = FsOptions(commit_interval_s=3600.0, read_only=True, cleaner_rate_mb_s=0.0)
CTX = Ctx()


async def _write(fs: ZoneFS, parent: int, name: bytes, data: bytes) -> None:
    try:
        ino = (await fs.lookup(parent, name)).ino
        fh = await fs.open(ino, os.O_WRONLY | os.O_TRUNC)
        from zonefs_py.fs.api import SetAttrRequest

        await fs.setattr(ino, SetAttrRequest(size=0), CTX)
    except errors.NotFound:
        fh, _attr = await fs.create(parent, name, 0o644, os.O_WRONLY, CTX)
    await fs.write(fh, 0, data)
    await fs.fsync(fh, False)
    await fs.release(fh)


async def build(path: Path, rng: random.Random) -> set[bytes]:
    """Make the base image; return every content a file ever had."""
    written: set[bytes] = {b""}
    dev = EmulatedZonedDevice.create(path, size_bytes=8 * MiB, zone_size_bytes=64 * KiB)
    try:
        # 8 meta zones: the checkpoint written in 256-byte records below takes
        # ~90 KB of the device, more than 4 zones of 64 KiB can rotate.
        make_filesystem(dev, meta_zones=8)
        fs = await ZoneFS.load(dev, FsOptions(commit_interval_s=3600.0, cleaner_rate_mb_s=0.0))
        # Checkpoints only where written below (the daemon's background task would
        # write the ones commits ask for; there is none here), so that the image
        # ends with the checkpoint that has commits inside it.
        fs.journal.request_checkpoint = lambda: None
        sub = (await fs.mkdir(ROOT_INO, b"dir", 0o755, CTX)).ino
        for i in range(12):
            data = rng.randbytes(rng.randrange(1, 24 * KiB))
            written.add(data)
            await _write(fs, sub if i % 2 else ROOT_INO, f"f{i}".encode(), data)
        for i in range(6):  # small files: their bytes are INLINE ops (fs/inline.py)
            data = rng.randbytes(rng.randrange(1, 512))
            written.add(data)
            await _write(fs, sub if i % 2 else ROOT_INO, f"s{i}".encode(), data)
        # A checkpoint of small records, with fsyncs committed while it is written:
        # their JOURNAL records land inside it (format 3, issue 15).
        saved = (journal_mod.RECORD_PAYLOAD_TARGET, journal_mod.CHECKPOINT_WRITE_BYTES,
                 journal_mod.CHECKPOINT_SLICE_INODES)
        (journal_mod.RECORD_PAYLOAD_TARGET, journal_mod.CHECKPOINT_WRITE_BYTES,
         journal_mod.CHECKPOINT_SLICE_INODES) = 256, 1, 1
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fs.journal.checkpoint)
                await trio.lowlevel.checkpoint()
                for i in range(0, 12, 3):  # overwrite, rename, unlink during and after it
                    data = rng.randbytes(rng.randrange(1, 24 * KiB))
                    written.add(data)
                    await _write(fs, ROOT_INO if i % 2 == 0 else sub, f"f{i}".encode(), data)
        finally:
            (journal_mod.RECORD_PAYLOAD_TARGET, journal_mod.CHECKPOINT_WRITE_BYTES,
             journal_mod.CHECKPOINT_SLICE_INODES) = saved
        for i in range(0, 6, 2):  # new inline bytes in the journal after the checkpoint
            data = rng.randbytes(rng.randrange(1, 512))
            written.add(data)
            await _write(fs, ROOT_INO, f"s{i}".encode(), data)
        # Many small files in one commit: a JOURNAL payload past a block, stored
        # compressed (FLAG_ZLIB, format 3).
        for i in range(16):
            data = bytes([i + 1]) * rng.randrange(150, 300)
            written.add(data)
            fh, _attr = await fs.create(sub, f"b{i}".encode(), 0o644, os.O_WRONLY, CTX)
            await fs.write(fh, 0, data)
            await fs.release(fh)
        await fs.journal.commit()
        await fs.rename(ROOT_INO, b"f0", sub, b"moved", 0)
        await fs.unlink(ROOT_INO, b"f2")
        await fs.symlink(sub, b"link", b"../f4", CTX)
        await fs.sync()
        # No fs.close(): the image stays as after a crash (journal after the checkpoint).
    finally:
        dev.close()
    return written


def metadata_ranges(path: Path) -> tuple[list[tuple[int, int]], int]:
    """(file offset, length) of the written part of the superblock and meta zones."""
    dev = EmulatedZonedDevice.open(path, read_only=True, io_mode="buffered")
    try:
        sb, _ = read_superblock(dev)
        zones = {z.index: z for z in dev.report_zones()}
        idxs = [sb.sb_zone_a, sb.sb_zone_b,
                *range(sb.meta_first_zone, sb.meta_first_zone + sb.meta_zone_count)]
        base = dev.geometry.data_offset
        ranges = [(base + zones[i].start_bytes, zones[i].written_bytes)
                  for i in idxs if zones[i].written_bytes]
        return ranges, dev.info.block_size
    finally:
        dev.close()


def find_records(fd: int, ranges: list[tuple[int, int]], block_size: int) -> list[tuple[int, int]]:
    """(file offset, header + payload length) of every record in the metadata ranges."""
    found = []
    for start, length in ranges:
        buf = os.pread(fd, length, start)
        pos = 0
        while pos + RECORD_HEADER_SIZE <= length:
            head = peek_header(buf, pos)
            if head is None:
                pos += block_size
                continue
            found.append((start + pos, RECORD_HEADER_SIZE + head[3]))
            pos += padded_size(head[3], block_size)
    return found


def mutate_resigned(fd: int, records: list[tuple[int, int]],
                    rng: random.Random) -> list[tuple[int, bytes]]:
    """Change 1-4 bytes of one record's header or payload and fix its checksum.

    The record stays valid, so this reaches the decoders and the replay of
    ops (State.apply) with garbage that no checksum catches.
    """
    off, length = rng.choice(records)
    old = os.pread(fd, length, off)
    buf = bytearray(old)
    for _ in range(rng.randrange(1, 5)):
        if rng.random() < 0.15:
            i = rng.randrange(4, 24)  # type, flags, seq, length, fs_id (not the magic)
        elif length > RECORD_HEADER_SIZE:
            i = rng.randrange(RECORD_HEADER_SIZE, length)
        else:
            continue
        buf[i] = rng.choice([rng.randrange(256), buf[i] ^ (1 << rng.randrange(8)), 0, 0xFF])
    digest = xxhash.xxh3_64_intdigest(bytes(buf[:24]) + bytes(buf[RECORD_HEADER_SIZE:]))
    buf[24:32] = struct.pack("<Q", digest)
    os.pwrite(fd, bytes(buf), off)
    return [(off, old)]


def mutate(fd: int, ranges: list[tuple[int, int]], rng: random.Random) -> list[tuple[int, bytes]]:
    """Apply 1-8 mutations; return (offset, original bytes) to restore, in order."""
    undo: list[tuple[int, bytes]] = []
    weights = [length for _off, length in ranges]
    for _ in range(rng.choice([1, 1, 1, 2, 3, 8])):
        start, length = rng.choices(ranges, weights)[0]
        kind = rng.randrange(7)
        pos = start + rng.randrange(length)
        if kind == 0:
            new = None
            old = os.pread(fd, 1, pos)
            new = bytes([old[0] ^ (1 << rng.randrange(8))])
        elif kind == 1:
            old, new = os.pread(fd, 1, pos), bytes([rng.randrange(256)])
        elif kind == 2:
            pos -= pos % 4
            old = os.pread(fd, 4, pos)
            new = rng.choice([b"\xff\xff\xff\xff", b"\0\0\0\0", b"\xff\xff\xff\x7f",
                              rng.randbytes(4), (int.from_bytes(old, "little") + 1
                                                 ).to_bytes(5, "little")[:4]])
        elif kind in (3, 4):
            pos -= pos % 512
            old = os.pread(fd, 512, pos)
            new = bytes(512) if kind == 3 else b"\xff" * 512
        elif kind == 5:
            pos -= pos % 512
            src_start, src_len = rng.choice(ranges)
            src = src_start + rng.randrange(src_len) // 512 * 512
            old, new = os.pread(fd, 512, pos), os.pread(fd, 512, src)
        else:
            end = start + length
            pos -= pos % 4096
            old = os.pread(fd, end - pos, pos)
            new = bytes(len(old))
        undo.append((pos, old))
        os.pwrite(fd, new, pos)
    return undo


ZERO_BLOCK = bytes(4096)


def written_blocks(written: set[bytes]) -> set[bytes]:
    """Every 4 KiB block (zero-padded at the end) of every written content."""
    return {data[pos:pos + 4096].ljust(4096, b"\0")
            for data in written for pos in range(0, len(data), 4096)}


async def read_everything(fs: ZoneFS, written: set[bytes], blocks: set[bytes],
                          resigned: bool) -> list[str]:
    """Walk the tree; return violations (bytes never written, unexpected exceptions)."""
    bad: list[str] = []
    todo = [(ROOT_INO, b"/")]
    seen = set()
    while todo:
        ino, path = todo.pop()
        if ino in seen:
            bad.append(f"{path!r}: directory reached twice (a loop)")
            continue
        seen.add(ino)
        dh = await fs.opendir(ino)
        entries = await fs.readdir(dh, 0)
        await fs.releasedir(dh)
        for entry in entries:
            if entry.name in (b".", b".."):
                continue
            child, cpath = entry.attr.ino, path + entry.name
            attr = await fs.getattr(child)
            if statmod.S_ISDIR(attr.mode):
                todo.append((child, cpath + b"/"))
            elif statmod.S_ISLNK(attr.mode):
                try:
                    await fs.readlink(child)
                except errors.InvalidArgument:
                    if not resigned:  # a forged mode: a "symlink" without a target (EINVAL)
                        raise
            elif statmod.S_ISREG(attr.mode):
                fh = await fs.open(child, os.O_RDONLY)
                try:
                    # As FUSE does: 128 KiB requests (the first MiB of a huge file).
                    chunks = [await fs.read(fh, pos, 128 * KiB)
                              for pos in range(0, min(attr.size, MiB) + 1, 128 * KiB)]
                    data = b"".join(chunks)
                except errors.IOFailure:
                    continue
                finally:
                    await fs.release(fh)
                if resigned and fs.state.inodes[child].inline:
                    # A re-signed INLINE op can carry any bytes, as a re-signed
                    # SYMLINK op any target: the record checksum is all they have.
                    continue
                if resigned:
                    # Metadata with a valid checksum but forged sizes/offsets: zeros (holes)
                    # and written blocks at other offsets are possible, nothing else.
                    for pos in range(0, len(data), 4096):
                        piece = data[pos:pos + 4096]
                        block = piece.ljust(4096, b"\0")
                        if block == ZERO_BLOCK or block in blocks:
                            continue
                        if len(piece) < 4096 and any(b.startswith(piece) for b in blocks):
                            continue  # a forged smaller size cuts the last block
                        bad.append(f"{cpath!r}: block at {pos} was never written anywhere")
                        break
                elif data not in written:
                    bad.append(f"{cpath!r}: {len(data)} bytes that were never written as a file")
    return bad


async def check_once(path: Path, written: set[bytes], blocks: set[bytes], *, rw: bool = False,
                     resigned: bool = False) -> str:
    """One recovery + read of the mutated image; return the outcome's name.

    `rw`: load read-write (recovery may reset zones and write a checkpoint),
    close cleanly, and fsck the result (which must not raise).
    """
    dev = EmulatedZonedDevice.open(path, read_only=not rw, io_mode="buffered")
    try:
        report = check_filesystem(dev, check_data=True)
        with trio.fail_after(60):
            try:
                fs = await ZoneFS.load(dev, OPTIONS.replace(read_only=not rw))
            except REFUSALS as exc:
                msg = str(exc)
                if "\n" in msg or not msg:
                    raise AssertionError(f"refusal message is not one line: {msg!r}") from exc
                return "refused"
            bad = await read_everything(fs, written, blocks, resigned)
            await fs.close()
        if bad:
            raise AssertionError("; ".join(bad))
        if rw:
            dev.close()
            dev = EmulatedZonedDevice.open(path, read_only=True, io_mode="buffered")
            after = check_filesystem(dev, check_data=True)
            return "rw-mounted-fsck-clean" if after.clean else "rw-mounted-fsck-findings"
        return "mounted-fsck-clean" if report.clean else "mounted-fsck-findings"
    finally:
        dev.close()


def run(workdir: Path, iterations: int, seed: int, *, quiet: bool = False) -> dict[str, int]:
    """Fuzz `iterations` times; return outcome counts (key 'bug' counts failures)."""
    rng = random.Random(seed)
    image = workdir / "fuzz.img"
    written = trio.run(build, image, rng)
    ranges, block_size = metadata_ranges(image)
    outcomes: collections.Counter[str] = collections.Counter()
    distinct: dict[str, str] = {}
    scratch = workdir / "fuzz-rw.img"
    fd = os.open(image, os.O_RDWR)
    records = find_records(fd, ranges, block_size)
    flags = [peek_header(os.pread(fd, RECORD_HEADER_SIZE, off))[1]  # type: ignore[index]
             for off, _len in records]
    if FLAG_ZLIB not in flags:
        raise AssertionError("the base image holds no compressed record to fuzz")
    blocks = written_blocks(written)
    t0 = time.monotonic()
    try:
        for it in range(iterations):
            resigned = rng.random() < 0.5
            if resigned:
                undo = mutate_resigned(fd, records, rng)
            else:
                undo = mutate(fd, ranges, rng)
            rw = it % 4 == 3  # every 4th: a read-write mount of a copy
            if rw:
                shutil.copyfile(image, scratch)
            faulthandler.dump_traceback_later(60, exit=True)
            try:
                outcomes[trio.run(partial(check_once, scratch if rw else image, written,
                                          blocks, rw=rw, resigned=resigned))] += 1
            except Exception as exc:  # noqa: BLE001 - every other exception is a bug
                outcomes["bug"] += 1
                frames = traceback.extract_tb(exc.__traceback__)
                tb = frames[-1]
                key = f"{type(exc).__name__} at {os.path.basename(tb.filename)}:{tb.lineno}"
                if key not in distinct:
                    where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}"
                                        for f in reversed(frames[-6:]))
                    distinct[key] = f"iteration {it} (seed {seed}): {exc!r}\n    at {where}"
                    shutil.copy(image, workdir / f"bug-{len(distinct)}.img")
                    if not quiet:
                        print(f"BUG {key}: {distinct[key]}", flush=True)
            finally:
                faulthandler.cancel_dump_traceback_later()
                for pos, old in reversed(undo):
                    os.pwrite(fd, old, pos)
            if not quiet and (it + 1) % 1000 == 0:
                print(f"{it + 1} iterations, {dict(outcomes)} "
                      f"({time.monotonic() - t0:.0f}s)", flush=True)
    finally:
        os.close(fd)
    for key, first in distinct.items():
        print(f"distinct failure: {key}\n  first: {first}")
    return dict(outcomes)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=10000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="zonefs-fuzz-", dir="/var/tmp"))
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    outcomes = run(workdir, args.iterations, args.seed)
    print(f"seed={args.seed} iterations={args.iterations} outcomes={outcomes} "
          f"in {time.monotonic() - t0:.0f}s")
    if not outcomes.get("bug") and args.dir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if outcomes.get("bug") else 0


if __name__ == "__main__":
    sys.exit(main())
