#!/usr/bin/env python3
"""Bad-image fuzzer: mutate superblock, journal, checkpoint and zone-summary bytes; recover; read.

    python3 tests/reliability/fuzz_images.py --iterations 10000 --seed 1 [--dir D]

A small image (8 MiB, 64 KiB zones, 12 meta zones) is built in-process with
files written, overwritten, renamed and fsync'ed (small ones inline, INLINE
ops), files big enough to fill data zones (a zone's data room is 15 blocks
of 4 KiB, its 16th holds its summary), so that zones are sealed (format 4:
summary blocks after their data, ZONE_SEAL ops), a checkpoint written in
small records, holding ZONE_SEAL and EXTENT_SEALED ops, while fsyncs commit
journal records inside it, and journal records after it (more seals among
them, and an overwrite inside sealed data); it is left as after a crash (no
clean unmount). Each iteration is one of:

  * (3/8) 1-8 random mutations (bit flip, random byte, random word, zeroed or
    0xFF sector, a sector copied from elsewhere, zeroed tail) of bytes below
    the write pointer of the superblock and meta zones, or of the summary
    blocks of sealed zones;
  * (3/8) bytes changed inside one record whose checksum is then recomputed,
    so the garbage reaches the op decoders and the replay;
    On format 5 (the default; ZONEFS_TEST_FORMAT=4 makes it 4): half of these re-sign
    one index page instead (bytes of its header or body changed, its xxh3
    fixed), so the garbage reaches the page's structure checks and the
    inode records; and the random mutations above hit index pages too;
  * (1/4) 1-3 mutations of sealed zones only: their summary blocks (bit
    flips, zeroed, 0xFF or torn sector, the summary of another sealed zone, a
    re-signed block of another generation, zone, position or size, a
    re-signed block with another checksum) or their data blocks (bit flips, a
    block copied from another sealed zone). The metadata is intact, so the
    outcome is known exactly: the mount must succeed, the tree must be the
    one the generator left, a file must read as it was unless it maps a block
    whose summary block or data no longer verifies, and then it must fail
    with IOFailure; fsck must report findings exactly when such a block exists.

Then, on the image opened read-only:

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
import logging
import os
import random
import shutil
import stat as statmod
import struct
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import trio
import xxhash

from zonefs_py import errors
from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.format import zonesum
from zonefs_py.format.constants import MKFS_DISK_VERSION, RECORD_HEADER_SIZE, OpType, RecordType
from zonefs_py.format.ops import decode_ops, record_body
from zonefs_py.format.records import FLAG_ZLIB, decode_record, padded_size, peek_header
from zonefs_py.fs.api import ROOT_INO, Ctx, SetAttrRequest
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.fs.mkfs import make_filesystem
from zonefs_py.fs.options import FsOptions
from zonefs_py.fsck import check_filesystem
from zonefs_py.index.page import MAGIC as PAGE_MAGIC
from zonefs_py.index.page import page_checksum
from zonefs_py.journal import journal as journal_mod
from zonefs_py.journal.recovery import read_superblock

KiB, MiB = 1 << 10, 1 << 20
#: On-disk format of the base image: ZONEFS_TEST_FORMAT, else mkfs's default
#: (5: the namespace index, whose pages are then fuzzed too).
DISK_FORMAT = int(os.environ.get("ZONEFS_TEST_FORMAT", MKFS_DISK_VERSION))
REFUSALS = (errors.NotAFilesystem, errors.CorruptionError, errors.DeviceRefused)
OPTIONS = FsOptions(commit_interval_s=3600.0, read_only=True, cleaner_rate_mb_s=0.0)
CTX = Ctx()


async def _write(fs: ZoneFS, parent: int, name: bytes, data: bytes) -> None:
    try:
        ino = (await fs.lookup(parent, name)).ino
        fh = await fs.open(ino, os.O_WRONLY | os.O_TRUNC)
        await fs.setattr(ino, SetAttrRequest(size=0), CTX)
    except errors.NotFound:
        fh, _attr = await fs.create(parent, name, 0o644, os.O_WRONLY, CTX)
    await fs.write(fh, 0, data)
    await fs.fsync(fh, False)
    await fs.release(fh)


async def build(path: Path, rng: random.Random
                ) -> tuple[set[bytes], dict[int, tuple[int, int]]]:
    """Make the base image; return every content a file ever had, and the
    sealed zones it leaves (zone -> (reset count, data blocks))."""
    written: set[bytes] = {b""}
    dev = EmulatedZonedDevice.create(path, size_bytes=8 * MiB, zone_size_bytes=64 * KiB)
    try:
        # 12 meta zones: the checkpoint written in 256-byte records below takes
        # ~100 KB of the device, more than 4 zones of 64 KiB can rotate; and with
        # fewer than 2 x its size + 3 zones free after it (journal.py _meta_short),
        # the commits after it would write a compact checkpoint that replaces it
        # (as they did with 8 meta zones): `log_coverage` checks it is the last.
        make_filesystem(dev, meta_zones=12, disk_version=DISK_FORMAT)
        options = FsOptions(commit_interval_s=3600.0, cleaner_rate_mb_s=0.0)
        async with ZoneFS.mount(dev, options, close=False) as fs:
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
            # Files that fill data zones (15 data blocks of 4 KiB each, the 16th block
            # holds the zone's summary): the full zones are sealed by a system task;
            # waiting for it puts their ZONE_SEAL and EXTENT_SEALED ops in the checkpoint.
            big0 = b""
            for i in range(2):
                data = rng.randbytes(rng.randrange(130 * KiB, 250 * KiB))
                written.add(data)
                await _write(fs, sub if i else ROOT_INO, f"big{i}".encode(), data)
                big0 = big0 or data
            await fs.data.sealer.wait_idle()
            if len(fs.state.zone_seals) < 2:
                raise AssertionError(
                    f"no zones sealed before the checkpoint: {fs.state.zone_seals}")
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
            # Seals only in the journal after the checkpoint: another zone-filling file;
            # and an overwrite inside sealed data (its old blocks die, the summary
            # keeps their checksums).
            before = set(fs.state.zone_seals)
            data = rng.randbytes(rng.randrange(130 * KiB, 250 * KiB))
            written.add(data)
            await _write(fs, ROOT_INO, b"big2", data)
            ino = (await fs.lookup(ROOT_INO, b"big0")).ino
            fh = await fs.open(ino, os.O_WRONLY)
            pos, piece = rng.randrange(len(big0) // 2), rng.randbytes(rng.randrange(1, 12 * KiB))
            await fs.write(fh, pos, piece)
            await fs.fsync(fh, False)
            await fs.release(fh)
            written.add(big0[:pos] + piece + big0[pos + len(piece):])
            await fs.data.sealer.wait_idle()
            await fs.journal.commit()
            if not set(fs.state.zone_seals) - before:
                raise AssertionError("no zone sealed after the checkpoint")
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
            await fs.data.sealer.wait_idle()  # every summary written has its ZONE_SEAL durable
            await fs.sync()
            seals = dict(fs.state.zone_seals)
            # No fs.close(): the image stays as after a crash (journal after the checkpoint).
    finally:
        dev.close()
    if len(seals) < 2:
        raise AssertionError(f"the base image has fewer than two sealed zones: {seals}")
    return written, seals


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


def find_pages(fd: int, ranges: list[tuple[int, int]], page_size: int) -> list[int]:
    """File offsets of the index pages (format 5) in the metadata ranges."""
    found = []
    for start, length in ranges:
        buf = os.pread(fd, length, start)
        found += [start + pos for pos in range(0, length - page_size + 1, page_size)
                  if buf[pos:pos + 4] == PAGE_MAGIC]
    return found


def mutate_resigned_page(fd: int, pages: list[int], page_size: int,
                         rng: random.Random) -> list[tuple[int, bytes]]:
    """Change 1-4 bytes of one index page's header or body and fix its checksum:
    the page passes its xxh3, so the garbage reaches the structure checks (kind,
    level, counts, lengths, key order, separators) and the inode records."""
    off = rng.choice(pages)
    old = os.pread(fd, page_size, off)
    buf = bytearray(old)
    for _ in range(rng.randrange(1, 5)):
        i = rng.randrange(4, 8) if rng.random() < 0.15 else rng.randrange(16, page_size)
        buf[i] = rng.choice([rng.randrange(256), buf[i] ^ (1 << rng.randrange(8)), 0, 0xFF])
    struct.pack_into("<Q", buf, 8, page_checksum(buf))
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


@dataclass(frozen=True)
class Sealed:
    """A sealed zone of the base image, with its bytes' offsets in the image file."""

    zone: int
    resets: int
    data_blocks: int
    nsum: int  # summary blocks
    zone_dev: int  # device offset of the zone (as extents give it)
    data_off: int  # file offset of the zone's first block
    sum_off: int  # file offset of its first summary block


def sealed_zones(path: Path, seals: dict[int, tuple[int, int]]) -> list[Sealed]:
    dev = EmulatedZonedDevice.open(path, read_only=True, io_mode="buffered")
    try:
        bs = dev.info.block_size
        zones = {z.index: z for z in dev.report_zones()}
        out = []
        for zone, (resets, data_blocks) in sorted(seals.items()):
            start = dev.geometry.data_offset + zones[zone].start_bytes
            out.append(Sealed(zone, resets, data_blocks, zonesum.sum_blocks(data_blocks, bs),
                              zones[zone].start_bytes, start, start + data_blocks * bs))
        return out
    finally:
        dev.close()


def log_coverage(fd: int, records: list[tuple[int, int]], block_size: int) -> dict[str, int]:
    """Count what the base image's log must hold for the fuzzer to reach it: JOURNAL
    records inside the last checkpoint, ZONE_SEAL and EXTENT_SEALED ops in it,
    ZONE_SEAL ops in the journal after it."""
    decoded = []
    for off, length in records:
        buf = os.pread(fd, length, off)
        rec = decode_record(buf, 0, None, block_size)
        ops = ([] if rec.type not in (RecordType.JOURNAL, RecordType.CHECKPOINT_DATA)
               else decode_ops(record_body(rec.type, rec.flags, rec.payload)))
        decoded.append((rec.seq, rec.type, ops))
    decoded.sort(key=lambda r: r[0])
    end = max(seq for seq, rtype, _ in decoded if rtype == RecordType.CHECKPOINT_END)
    begin = max(seq for seq, rtype, _ in decoded
                if rtype == RecordType.CHECKPOINT_BEGIN and seq < end)
    count = collections.Counter[str]()
    for seq, rtype, ops in decoded:
        if rtype == RecordType.JOURNAL and begin < seq < end:
            count["journal records inside the checkpoint"] += 1
        for op in ops:
            if rtype == RecordType.CHECKPOINT_DATA and begin < seq < end:
                if op[0] == OpType.ZONE_SEAL:
                    count["checkpoint ZONE_SEAL"] += 1
                elif op[0] == OpType.EXTENT and op[5] is None:
                    count["checkpoint EXTENT_SEALED"] += 1
            elif rtype == RecordType.JOURNAL and seq > end and op[0] == OpType.ZONE_SEAL:
                count["journal ZONE_SEAL after the checkpoint"] += 1
    return dict(count)


def _resign(block: bytearray) -> bytes:
    """A summary block with its xxh3 recomputed (format/zonesum.py layout)."""
    block[24:32] = bytes(8)
    block[24:32] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(block)))
    return bytes(block)


def mutate_sealed(fd: int, sealed: list[Sealed], block_size: int,
                  rng: random.Random) -> list[tuple[int, bytes]]:
    """1-3 mutations of the summary blocks (mostly) or data blocks of sealed zones;
    return (offset, original bytes) to restore, in order."""
    bs = block_size
    undo: list[tuple[int, bytes]] = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        s = rng.choice(sealed)
        others = [o for o in sealed if o.zone != s.zone]
        kind = rng.randrange(10)
        k = rng.randrange(s.nsum)
        off = s.sum_off + k * bs
        old = os.pread(fd, bs, off)
        block = bytearray(old)
        # (An earlier mutation of this iteration may have left any count there.)
        count = min(struct.unpack_from("<I", old, 20)[0], zonesum.per_block(bs))
        if kind == 0:  # a bit flip, mostly in the header and checksums
            i = rng.randrange(32 + 4 * count) if rng.random() < 0.7 else rng.randrange(bs)
            block[i] ^= 1 << rng.randrange(8)
        elif kind == 1:  # a zeroed or 0xFF block
            block[:] = rng.choice([b"\0", b"\xff"]) * bs
        elif kind == 2:  # a torn or garbled sector
            sector = rng.randrange(bs // 512) if rng.random() < 0.5 else 0
            block[sector * 512:(sector + 1) * 512] = rng.choice(
                [bytes(512), rng.randbytes(512)])
        elif kind == 3:  # the summary of another sealed zone: its header names that zone
            o = rng.choice(others)
            block[:] = os.pread(fd, bs, o.sum_off + min(k, o.nsum - 1) * bs)
        elif kind == 4:
            # A summary of another generation of this zone (another reset count), with
            # a valid xxh3: what a stale summary left by an earlier reset looks like.
            resets = rng.choice([s.resets + 1, (s.resets - 1) & 0xFFFFFFFF,
                                 rng.randrange(1 << 32)])
            if resets == s.resets:
                resets ^= 1
            struct.pack_into("<I", block, 8, resets)
            _resign(block)
        elif kind == 5:  # another header field (magic, zone, index, D, count), re-signed
            field = rng.choice([0, 4, 12, 16, 20])
            value = struct.unpack_from("<I", block, field)[0]
            new_value = rng.choice([value + 1, value - 1, 0, rng.randrange(1 << 32),
                                    rng.choice(others).zone if field == 4 else value ^ 2])
            struct.pack_into("<I", block, field, new_value & 0xFFFFFFFF)
            _resign(block)
        elif kind == 6:  # another checksum in a valid block: the data must not verify
            j = rng.randrange(max(count, 1))
            struct.pack_into("<I", block, 32 + 4 * j, rng.randrange(1 << 32))
            _resign(block)
        else:  # data blocks of a sealed zone
            j = rng.randrange(s.data_blocks)
            off = s.data_off + j * bs
            old = os.pread(fd, bs, off)
            block = bytearray(old)
            if kind in (7, 8):
                for _flip in range(rng.randrange(1, 4)):
                    block[rng.randrange(bs)] ^= 1 << rng.randrange(8)
            else:  # a block of another sealed zone (a misdirected write)
                o = rng.choice(others)
                block[:] = os.pread(fd, bs, o.data_off + rng.randrange(o.data_blocks) * bs)
        undo.append((off, old))
        os.pwrite(fd, bytes(block), off)
    return undo


def unverifiable_blocks(fd: int, sealed: list[Sealed], live: set[int],
                        block_size: int) -> set[int]:
    """The live blocks (device offsets) of sealed zones that no longer verify: their
    summary block is not valid for the seal, or their checksum differs from their data."""
    bs = block_size
    per = zonesum.per_block(bs)
    bad: set[int] = set()
    for s in sealed:
        raw = os.pread(fd, s.nsum * bs, s.sum_off)
        summary = [zonesum.decode_block(raw[k * bs:(k + 1) * bs], s.zone, s.resets, k,
                                        s.data_blocks) for k in range(s.nsum)]
        for j in range(s.data_blocks):
            dev_off = s.zone_dev + j * bs
            if dev_off not in live:
                continue
            csums = summary[j // per]
            if csums is None:
                bad.add(dev_off)
                continue
            data = os.pread(fd, bs, s.data_off + j * bs)
            want = struct.unpack_from("<I", csums, (j % per) * 4)[0]
            if xxhash.xxh3_64_intdigest(data) & 0xFFFFFFFF != want:
                bad.add(dev_off)
    return bad


ZERO_BLOCK = bytes(4096)


def written_blocks(written: set[bytes]) -> set[bytes]:
    """Every 4 KiB block (zero-padded at the end) of every written content."""
    return {data[pos:pos + 4096].ljust(4096, b"\0")
            for data in written for pos in range(0, len(data), 4096)}


async def read_everything(fs: ZoneFS, written: set[bytes], blocks: set[bytes],
                          resigned: bool, found: dict[bytes, tuple[str, bytes | None]] | None = None
                          ) -> list[str]:
    """Walk the tree; return violations (bytes never written, unexpected exceptions).

    `found`, if given, gets every path: ("dir", None), ("link", target),
    ("file", bytes read), or ("file", None) for a read that failed with EIO.
    A lazy mount (format 5) reads inodes and names from the index as the walk
    needs them: a damaged index page shows there as CorruptionError (EIO to
    the kernel, and the failsafe), recorded as ("damaged", None) for the path
    (or the directory) whose entries it held."""
    bad: list[str] = []
    if found is None:
        found = {}
    todo = [(ROOT_INO, b"/")]
    seen = set()
    while todo:
        ino, path = todo.pop()
        if ino in seen:
            bad.append(f"{path!r}: directory reached twice (a loop)")
            continue
        seen.add(ino)
        try:
            dh = await fs.opendir(ino)
            try:
                entries = await fs.readdir(dh, 0)
            finally:
                await fs.releasedir(dh)
        except errors.CorruptionError:
            found[path] = ("damaged", None)
            continue
        for entry in entries:
            if entry.name in (b".", b".."):
                continue
            child, cpath = entry.attr.ino, path + entry.name
            try:
                attr = await fs.getattr(child)
            except errors.CorruptionError:
                found[cpath] = ("damaged", None)
                continue
            if statmod.S_ISDIR(attr.mode):
                found[cpath] = ("dir", None)
                todo.append((child, cpath + b"/"))
            elif statmod.S_ISLNK(attr.mode):
                try:
                    found[cpath] = ("link", await fs.readlink(child))
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
                    found[cpath] = ("file", None)
                    continue
                finally:
                    await fs.release(fh)
                found[cpath] = ("file", data)
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


@dataclass
class Baseline:
    """What the unmutated base image holds, for iterations that mutate sealed zones only."""

    tree: dict[bytes, tuple[str, bytes | None]]
    #: path -> device offsets of the blocks the file maps below its size
    file_blocks: dict[bytes, set[int]]
    #: device offsets of every block some extent maps in a sealed zone (fsck checks them)
    live: set[int]
    #: those of them files with a name map (a read-write mount frees the unlinked ones)
    named: set[int]
    sealed: list[Sealed]


async def baseline(path: Path, written: set[bytes], blocks: set[bytes],
                   seals: dict[int, tuple[int, int]]) -> Baseline:
    """Mount the unmutated image read-only and record what it holds (and that it is sound)."""
    sealed = sealed_zones(path, seals)
    dev = EmulatedZonedDevice.open(path, read_only=True, io_mode="buffered")
    try:
        report = check_filesystem(dev, check_data=True)
        if not report.clean:
            raise AssertionError(f"fsck of the base image: {report}")
        async with ZoneFS.mount(dev, OPTIONS) as fs:
            if fs.state.zone_seals != seals:
                raise AssertionError(f"recovered seals {fs.state.zone_seals} != written {seals}")
            tree: dict[bytes, tuple[str, bytes | None]] = {}
            bad = await read_everything(fs, written, blocks, False, tree)
            if bad or any(kind == "file" and data is None for kind, data in tree.values()):
                raise AssertionError(f"base image does not read back: {bad} {tree.keys()}")
            state, bs, zsize = fs.state, fs.state.block_size, fs.state.zone_size
            in_sealed = {s.zone for s in sealed}
            live: set[int] = set()
            named: set[int] = set()
            for inode in state.inodes.values():
                for e in inode.extents or ():
                    if e.dev // zsize in in_sealed:
                        mapped = {e.dev + i * bs for i in range(e.nblocks)}
                        live |= mapped
                        if inode.nlink:
                            named |= mapped
            file_blocks: dict[bytes, set[int]] = {}
            for fpath, (kind, data) in tree.items():
                if kind != "file":
                    continue
                if data is None or len(data) > MiB:  # read_everything reads the first MiB
                    raise AssertionError(f"{fpath!r}: {len(data or b'')} bytes in the base image")
                ino = ROOT_INO
                for name in fpath.strip(b"/").split(b"/"):
                    ino = (await fs.lookup(ino, name)).ino
                extents = state.inodes[ino].extents or ()
                file_blocks[fpath] = {e.dev + i * bs for e in extents for i in range(e.nblocks)
                                      if (e.fblock + i) * bs < len(data)}
    finally:
        dev.close()
    if not live or not any(b & live for b in file_blocks.values()):
        raise AssertionError("no file of the base image maps a block of a sealed zone")
    return Baseline(tree, file_blocks, live, named, sealed)


def sealed_violations(found: dict[bytes, tuple[str, bytes | None]], base: Baseline,
                      unverifiable: set[int]) -> list[str]:
    """Only sealed zones were mutated: the tree and every content must be as in the
    base image, except that a file mapping an unverifiable block must fail (EIO)."""
    bad = []
    for path in sorted(base.tree.keys() | found.keys()):
        want, got = base.tree.get(path), found.get(path)
        if want is None or got is None:
            bad.append(f"{path!r}: {'appeared' if want is None else 'vanished'}")
        elif want[0] != "file" or got[0] != "file":
            if want != got:
                bad.append(f"{path!r}: {got!r} instead of {want!r}")
        else:
            must_fail = sorted(base.file_blocks[path] & unverifiable)
            if got[1] is None and not must_fail:
                bad.append(f"{path!r}: EIO, but every block it maps verifies")
            elif got[1] is not None and must_fail:
                bad.append(f"{path!r}: read, but its blocks at device offsets {must_fail[:4]} "
                           f"do not verify")
            elif got[1] is not None and got[1] != want[1]:
                bad.append(f"{path!r}: read {len(got[1])} bytes, not its content")
    return bad


async def check_once(path: Path, written: set[bytes], blocks: set[bytes], *, rw: bool = False,
                     resigned: bool = False,
                     sealed: tuple[Baseline, set[int]] | None = None) -> str:
    """One recovery + read of the mutated image; return the outcome's name.

    `rw`: load read-write (recovery may reset zones and write a checkpoint),
    close cleanly, and fsck the result (which must not raise).
    `sealed`: only sealed zones were mutated: (the base image, the device offsets
    of its live blocks that no longer verify); see `sealed_violations`, and fsck
    must report findings exactly when such blocks exist.
    """
    dev = EmulatedZonedDevice.open(path, read_only=not rw, io_mode="buffered")
    try:
        # On format 5 this fsck streams the index (fsck/bounded.py), data checks
        # per batch; the whole-namespace walk must not raise either.
        report = check_filesystem(dev, check_data=True)
        check_filesystem(dev, check_data=False, bounded=False)
        if sealed is not None and report.clean != (not sealed[1]):
            raise AssertionError(f"fsck {'found nothing' if report.clean else report} with "
                                 f"{len(sealed[1])} unverifiable blocks in sealed zones")
        with trio.fail_after(60):
            try:
                fs = await ZoneFS.load(dev, OPTIONS.replace(read_only=not rw))
            except REFUSALS as exc:
                msg = str(exc)
                if "\n" in msg or not msg:
                    raise AssertionError(f"refusal message is not one line: {msg!r}") from exc
                if sealed is not None:
                    raise AssertionError(f"refused with intact metadata: {exc!r}") from exc
                return "refused"
            found: dict[bytes, tuple[str, bytes | None]] = {}
            bad = await read_everything(fs, written, blocks, resigned, found)
            try:
                await fs.close()
            except errors.IOFailure as exc:
                # A lazy read-write mount meets a damaged index page only when its
                # closing checkpoint needs it: an error naming fsck then, on an image
                # fsck had already found damaged, is an answer, not a bug (found by
                # the 10,000-image run after issue 42's lending, seed 12 iteration
                # 7875; the next session looks at refusing it at mount instead).
                if not rw or report.clean or "fsck" not in str(exc):
                    raise
                return "rw-close-refused"
        if sealed is not None:
            bad += sealed_violations(found, *sealed)
        if bad:
            raise AssertionError("; ".join(bad))
        if rw:
            dev.close()
            dev = EmulatedZonedDevice.open(path, read_only=True, io_mode="buffered")
            after = check_filesystem(dev, check_data=True)
            left = sealed[1] & sealed[0].named if sealed is not None else set()
            if sealed is not None and after.clean != (not left):
                raise AssertionError(f"fsck after a read-write mount "
                                     f"{'found nothing' if after.clean else after} with "
                                     f"{len(left)} unverifiable blocks of named files in "
                                     f"sealed zones")
            return "rw-mounted-fsck-clean" if after.clean else "rw-mounted-fsck-findings"
        return "mounted-fsck-clean" if report.clean else "mounted-fsck-findings"
    finally:
        dev.close()


class _LogCounter(logging.Handler):
    """Swallows the engine's log (damaged blocks log an error each: expected here)
    and counts the lines that call themselves an internal error."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.internal = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("internal error"):
            self.internal += 1


def run(workdir: Path, iterations: int, seed: int, *, quiet: bool = False) -> dict[str, int]:
    """Fuzz `iterations` times; return outcome counts (key 'bug' counts failures)."""
    logs = _LogCounter()
    logging.getLogger().addHandler(logs)
    try:
        outcomes = _run(workdir, iterations, seed, quiet)
    finally:
        logging.getLogger().removeHandler(logs)
    if logs.internal:
        # Not a failure (the reads failed with EIO): e.g. a forged ZONE_SEAL whose
        # summary lies past the zone's end is dropped at mount as stale, and the
        # zone's extents are left with no checksums anywhere.
        outcomes["internal-error-logged"] = logs.internal
    return outcomes


def _run(workdir: Path, iterations: int, seed: int, quiet: bool) -> dict[str, int]:
    rng = random.Random(seed)
    image = workdir / "fuzz.img"
    written, seals = trio.run(build, image, rng)
    ranges, block_size = metadata_ranges(image)
    blocks = written_blocks(written)
    base = trio.run(baseline, image, written, blocks, seals)
    summary_ranges = [(s.sum_off, s.nsum * block_size) for s in base.sealed]
    outcomes: collections.Counter[str] = collections.Counter()
    distinct: dict[str, str] = {}
    scratch = workdir / "fuzz-rw.img"
    fd = os.open(image, os.O_RDWR)
    records = find_records(fd, ranges, block_size)
    flags = [peek_header(os.pread(fd, RECORD_HEADER_SIZE, off))[1]  # type: ignore[index]
             for off, _len in records]
    if FLAG_ZLIB not in flags:
        raise AssertionError("the base image holds no compressed record to fuzz")
    coverage = log_coverage(fd, records, block_size)
    pages = find_pages(fd, ranges, block_size) if DISK_FORMAT >= 5 else []
    if pages:
        # Format 5: the inodes (EXTENT_SEALED ops among them) are in index pages.
        coverage["index pages"] = len(pages)
    if len(coverage) < 4:
        raise AssertionError(f"the base image's log lacks journal records inside its "
                             f"checkpoint or seals in or after it: {coverage}")
    if not quiet:
        print(f"base image: sealed zones {sorted(seals)}, {coverage}", flush=True)
    t0 = time.monotonic()
    try:
        for it in range(iterations):
            mode = rng.random()
            resigned = 0.25 <= mode < 0.625
            sealed = None
            if mode < 0.25:  # sealed zones only: the outcome is known exactly
                undo = mutate_sealed(fd, base.sealed, block_size, rng)
                sealed = (base, unverifiable_blocks(fd, base.sealed, base.live, block_size))
                outcomes["sealed-zone-iterations"] += 1
                outcomes["sealed-with-unverifiable-blocks"] += bool(sealed[1])
            elif resigned and pages and rng.random() < 0.5:
                undo = mutate_resigned_page(fd, pages, block_size, rng)
                outcomes["resigned-page-iterations"] += 1
            elif resigned:
                undo = mutate_resigned(fd, records, rng)
            else:
                undo = mutate(fd, ranges + summary_ranges, rng)
            rw = it % 4 == 3  # every 4th: a read-write mount of a copy
            if rw:
                shutil.copyfile(image, scratch)
            faulthandler.dump_traceback_later(60, exit=True)
            try:
                outcomes[trio.run(partial(check_once, scratch if rw else image, written,
                                          blocks, rw=rw, resigned=resigned,
                                          sealed=sealed))] += 1
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
