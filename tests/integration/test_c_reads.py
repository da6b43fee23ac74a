"""READs served in C by the data plane's dispatcher (issue 43, DESIGN 4.10), through the mount.

O_DIRECT reads reach the daemon every time (no page cache), so each test sees
what the dispatcher answers. Every test mounts with `-o c_reads=on`.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path

import pytest

from .conftest import Mount, zonefs

BS = 4096


def _odirect_read(path: Path, offset: int, length: int) -> bytes:
    buf = mmap.mmap(-1, max(length, BS))
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        n = os.preadv(fd, [memoryview(buf)[:length]], offset)
        return bytes(buf[:n])
    finally:
        os.close(fd)
        buf.close()


def _find_block(image: Path, block: bytes) -> int:
    """The image offset of the block-aligned copy of `block` (the device holds one)."""
    chunk = 16 << 20
    with open(image, "rb") as img:
        base = 0
        while data := img.read(chunk):
            for off in range(0, len(data), BS):
                if data[off:off + BS] == block:
                    return base + off
            base += len(data)
    raise AssertionError("block not found in the image")


def _dataplane(m: Mount) -> dict[str, object]:
    doc = json.loads(zonefs("stat", "--json", str(m.path)).stdout)
    return doc["dataplane"]


def _settle(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def test_reads_of_a_settled_file_are_served_in_c(image: Path, mount_factory: Mount) -> None:
    m = mount_factory.start("c_reads=on")
    data = random.Random(1).randbytes(3 * 1024 * 1024 + 123)
    f = m.path / "f"
    f.write_bytes(data)
    _settle(f)
    assert _odirect_read(f, 0, 65536) == data[:65536]  # Python serves it, publishes the map
    for off, n in ((0, 4096), (8192, 131072), (3 * 1024 * 1024, 8192), (100 * BS, 1 << 20)):
        assert _odirect_read(f, off, n) == data[off:off + n]
    st = _dataplane(m)
    assert st["running"] is True
    assert st["reads_c"] >= 4
    assert st["maps_published"] >= 1
    assert st["io"] == "io_uring"
    # one O_DIRECT read at a time: each the only request at hand, read by pread
    assert st["uring_reads"] + st["lone_reads"] >= 4  # type: ignore[operator]


def test_a_file_read_once_is_served_in_c(image: Path, mount_factory: Mount) -> None:
    """One READ per file (a DataLoader's one file per sample): the map is published at
    OPEN, so that READ is answered in C, before and after a remount."""
    m = mount_factory.start("c_reads=on")
    files = {f"s{i}": random.Random(i).randbytes(32 * 1024) for i in range(40)}
    for name, data in files.items():
        (m.path / name).write_bytes(data)
    for name in files:
        _settle(m.path / name)
    for rounds in range(2):
        before = _dataplane(m)
        for name, data in files.items():
            assert _odirect_read(m.path / name, 0, len(data)) == data
        after = _dataplane(m)
        served = after["reads_c"] - before["reads_c"]  # type: ignore[operator]
        # A cold mount's first files wait for their zone's checksums (no_checksums).
        assert served >= len(files) - (5 if rounds else 0), (rounds, before, after)
        m.unmount()
        m.start("c_reads=on")


def test_read_after_overwrite_truncate_punch_sees_new_bytes(image: Path,
                                                            mount_factory: Mount) -> None:
    m = mount_factory.start("c_reads=on")
    f = m.path / "g"
    f.write_bytes(b"a" * (1 << 20))
    _settle(f)
    _odirect_read(f, 0, BS)
    assert _odirect_read(f, 0, BS) == b"a" * BS
    with open(f, "r+b") as fh:
        fh.write(b"b" * BS)
    assert _odirect_read(f, 0, BS) == b"b" * BS
    _odirect_read(f, 0, BS)
    os.truncate(f, 2 * BS)
    assert _odirect_read(f, 0, 4 * BS) == b"b" * BS + b"a" * BS
    os.truncate(f, 4 * BS)
    assert _odirect_read(f, 0, 4 * BS) == b"b" * BS + b"a" * BS + bytes(2 * BS)
    _odirect_read(f, 0, BS)
    fd = os.open(f, os.O_RDWR)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
        assert libc.fallocate(fd, 0x03, ctypes.c_long(0), ctypes.c_long(BS)) == 0
    finally:
        os.close(fd)
    assert _odirect_read(f, 0, 2 * BS) == bytes(BS) + b"a" * BS


def test_after_a_remount_the_checksums_are_warmed(image: Path, mount_factory: Mount) -> None:
    """A cold mount has no zone summaries cached: the first map of a file lacks the
    checksums of its sealed zones. They are read in the background and the map
    published again, so the file's READs are then served in C, not one per summary
    block in Python."""
    m = mount_factory.start("c_reads=on")
    data = random.Random(5).randbytes(40 << 20)  # over two 16 MiB zones: sealed ones
    f = m.path / "w"
    f.write_bytes(data)
    _settle(f)
    assert m.unmount() == 0
    m.start("c_reads=on")
    assert _odirect_read(f, 0, BS) == data[:BS]  # Python serves it, publishes, warms
    while _dataplane(m)["maps_warmed"] < 1:  # type: ignore[operator]
        pass
    before = _dataplane(m)
    for off in range(0, len(data), 1 << 20):
        assert _odirect_read(f, off, 1 << 20) == data[off:off + (1 << 20)]
    after = _dataplane(m)
    assert after["reads_c"] - before["reads_c"] == 40  # type: ignore[operator]


@pytest.mark.expect_log("zonefs_py.fs.data.readpath", "ERROR", "checksum mismatch")
def test_damaged_block_is_eio_for_reads_covering_it(image: Path, mount_factory: Mount) -> None:
    m = mount_factory.start("c_reads=on")
    marker = b"zonefs-damage-43" * (BS // 16)
    blocks = [bytes([65 + i]) * BS for i in range(8)]
    blocks[5] = marker
    f = m.path / "d"
    f.write_bytes(b"".join(blocks))
    _settle(f)
    assert _odirect_read(f, 0, 8 * BS)[5 * BS:6 * BS] == marker
    pos = _find_block(image, marker)
    with open(image, "r+b") as img:
        img.seek(pos + 7)
        img.write(b"X")
        img.flush()
        os.fsync(img.fileno())
    for i in (0, 4, 6, 7):
        assert _odirect_read(f, i * BS, BS) == blocks[i]
    with pytest.raises(OSError) as exc:
        _odirect_read(f, 5 * BS, BS)
    assert exc.value.errno == 5
    with pytest.raises(OSError):
        _odirect_read(f, 4 * BS, 2 * BS)
    st = _dataplane(m)
    assert st["reads_python"]["checksum_mismatch"] >= 1  # type: ignore[index]
    (m.path / "still-writable").write_bytes(b"x")
    assert m.log_text().count("checksum mismatch") == 2  # one line per failed read
    f.unlink()  # fsck after the test checks every live block


def _reader(path: str, nblocks: int, done_gen: mp.Value, started_gen: mp.Value,  # type: ignore[valid-type]
            zero_gens: mp.Array, stop: mp.Event, out: mp.Queue, seed: int,  # type: ignore[valid-type]
            torn_pages: bool) -> None:
    rng = random.Random(seed)
    buf = mmap.mmap(-1, BS)
    bad: list[str] = []
    reads = 0
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    while not stop.is_set() and len(bad) < 5:
        b = rng.randrange(nblocks)
        lo = done_gen.value
        n = os.preadv(fd, [buf], b * BS)
        hi = started_gen.value
        reads += 1
        if n == 0:
            continue  # truncated to 0 meanwhile
        blk = bytes(buf[:n])
        v = blk[0]
        if blk != bytes([v]) * n:
            seen = sorted(set(blk))
            if torn_pages and all(lo <= g <= hi or (g == 0 and any(
                    zero_gens[x] for x in range(lo + 1, hi + 1))) for g in seen):
                continue  # a page written back while the writer copied into it (see the test)
            # Where the bytes change, and whether a second read is whole.
            runs = [i for i in range(1, n) if blk[i] != blk[i - 1]][:8]
            again = os.preadv(fd, [buf], b * BS)
            held = "still mixed" if len(set(buf[:again])) > 1 else "whole when read again"
            bad.append(f"block {b}: mixed bytes {seen[:4]} (gens {lo}..{hi}), "
                       f"changing at bytes {runs}, {held}")
        elif v == 0:
            if not any(zero_gens[g] for g in range(lo + 1, hi + 1)):
                bad.append(f"block {b}: zeros, no truncate/punch in gens {lo + 1}..{hi}")
        elif not lo <= v <= hi:
            bad.append(f"block {b}: generation byte {v}, expected gens {lo}..{hi}")
    os.close(fd)
    out.put((reads, bad))


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["direct", "buffered"])
def test_readers_never_see_bytes_the_file_did_not_hold(image: Path, mount_factory: Mount,
                                                       writer: str) -> None:
    """Readers hammer a file (O_DIRECT, served in C when settled) while a writer rewrites
    it generation by generation (by write or copy_file_range), truncates and punches
    it; the overwrites make the cleaner relocate and reset zones. Every block read
    must hold the byte of a generation written between the read's start and end (or
    zeros while a truncate or punch of one of those generations ran).

    The "direct" writer writes with O_DIRECT: the daemon gets each generation's bytes
    from the writer's own buffer, so a block never holds two generations. The
    "buffered" writer goes through the kernel's writeback cache, which writes a page
    back while the writer may still be copying into it: the daemon then receives (and
    stores, with its checksum) a page holding two generations, and the page's next
    writeback brings the whole one (seen: a WRITE of one 4 KiB page holding gens 243
    and 244, with C reads on and off; never with `-o writeback_cache=off`; DESIGN
    4.8). Such a page read meanwhile is what the file held, so there a block may mix
    generations of the read's window, and nothing else."""
    m = mount_factory.start("c_reads=on")
    nblocks = 512
    f = m.path / "h"
    f.write_bytes(bytes([1]) * nblocks * BS)  # generation 1
    _settle(f)
    ctx = mp.get_context("fork")
    done_gen, started_gen = ctx.Value("l", 1, lock=False), ctx.Value("l", 1, lock=False)
    zero_gens = ctx.Array("b", 257, lock=False)
    stop, out = ctx.Event(), ctx.Queue()
    readers = [ctx.Process(target=_reader, args=(str(f), nblocks, done_gen, started_gen,
                                                 zero_gens, stop, out, s, writer == "buffered"))
               for s in range(3)]
    for p in readers:
        p.start()
    libc = ctypes.CDLL(None, use_errno=True)
    rng = random.Random(7)
    src = m.path / "h.src"
    fd = os.open(f, os.O_RDWR | (os.O_DIRECT if writer == "direct" else 0))
    gen_buf = mmap.mmap(-1, nblocks * BS)  # page-aligned, as O_DIRECT needs
    try:
        for g in range(2, 256):  # the generation is the byte every block holds
            kind = rng.random()
            zero_gens[g] = 1 if kind < 0.1 else 0
            started_gen.value = g
            byte = bytes([g])
            if kind < 0.05:
                os.ftruncate(fd, rng.randrange(nblocks) * BS)
            elif kind < 0.1:
                b0 = rng.randrange(nblocks)
                libc.fallocate(fd, 0x03, ctypes.c_long(b0 * BS), ctypes.c_long(8 * BS))
            if kind > 0.8:  # the generation copied in (copy_file_range) from a source file
                src.write_bytes(byte * (nblocks * BS))
                sfd = os.open(src, os.O_RDONLY)
                try:
                    left = nblocks * BS
                    while left:
                        left -= os.copy_file_range(sfd, fd, left, nblocks * BS - left,
                                                   nblocks * BS - left)
                finally:
                    os.close(sfd)
            else:
                gen_buf[:] = byte * (nblocks * BS)
                assert os.pwritev(fd, [gen_buf], 0) == nblocks * BS
            if g % 16 == 0:
                os.fsync(fd)
            done_gen.value = g
    finally:
        os.close(fd)
        gen_buf.close()
        stop.set()
    results = [out.get(timeout=60) for _ in readers]
    for p in readers:
        p.join(timeout=60)
    bad = [b for _, bs in results for b in bs]
    assert not bad, (bad, _dataplane(m))
    assert sum(r for r, _ in results) > 1000
    assert _dataplane(m)["reads_c"] > 0


def test_sigterm_with_c_reads_in_flight_does_not_hang(image: Path,
                                                      mount_factory: Mount) -> None:
    m = mount_factory.start("c_reads=on")
    f = m.path / "s"
    f.write_bytes(random.Random(3).randbytes(8 << 20))
    _settle(f)
    _odirect_read(f, 0, BS)
    ctx = mp.get_context("fork")

    def spin(path: str) -> None:
        buf = mmap.mmap(-1, 1 << 20)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            while True:
                os.preadv(fd, [buf], random.randrange(8) << 20)
        except OSError:
            return

    procs = [ctx.Process(target=spin, args=(str(f),)) for _ in range(2)]
    for p in procs:
        p.start()
    while _dataplane(m)["reads_c"] < 50:  # type: ignore[operator]
        pass
    assert m.signal(signal.SIGTERM) == 0
    for p in procs:
        p.join(timeout=30)
        assert not p.is_alive()


def test_sigkill_with_c_reads_in_flight(image: Path, mount_factory: Mount) -> None:
    """The daemon killed while readers' READs are served in C: every reader gets an
    error (ENOTCONN), none hangs; the next mount is clean and reads the same bytes."""
    m = mount_factory.start("c_reads=on")
    f = m.path / "k"
    data = random.Random(4).randbytes(8 << 20)
    f.write_bytes(data)
    _settle(f)
    _odirect_read(f, 0, BS)
    ctx = mp.get_context("fork")
    errs = ctx.Queue()

    def spin(path: str) -> None:
        buf = mmap.mmap(-1, 1 << 20)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            while True:
                os.preadv(fd, [buf], random.randrange(8) << 20)
        except OSError as exc:
            errs.put(exc.errno)

    procs = [ctx.Process(target=spin, args=(str(f),)) for _ in range(3)]
    for p in procs:
        p.start()
    while _dataplane(m)["reads_c"] < 50:  # type: ignore[operator]
        pass
    m.signal(signal.SIGKILL)
    for p in procs:
        p.join(timeout=30)
        assert not p.is_alive(), "a reader hangs after the daemon was killed"
    got = {errs.get(timeout=10) for _ in procs}
    assert got <= {107, 103, 5}, got  # ENOTCONN (ECONNABORTED / EIO also an answer)
    m.start("c_reads=on")
    assert f.read_bytes() == data
    assert _odirect_read(f, 1 << 20, 1 << 20) == data[1 << 20:2 << 20]


def _image_offsets(image: Path, block: bytes) -> set[int]:
    """Every image offset holding a block-aligned copy of `block`."""
    found: set[int] = set()
    chunk = 16 << 20
    with open(image, "rb") as img:
        base = 0
        while data := img.read(chunk):
            pos = data.find(block[:64])
            while pos >= 0:
                if pos % BS == 0 and data[pos:pos + BS] == block:
                    found.add(base + pos)
                pos = data.find(block[:64], pos + 1)
            base += len(data)
    return found


def _static_reader(path: str, blocks: int, stop: mp.Event, out: mp.Queue) -> None:  # type: ignore[valid-type]
    rng = random.Random(os.getpid())
    buf = mmap.mmap(-1, 4 * BS)
    bad: list[str] = []
    reads = 0
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    while not stop.is_set() and len(bad) < 5:
        b = rng.randrange(blocks - 3)
        n = os.preadv(fd, [buf], b * BS)
        reads += 1
        for i in range(n // BS):
            if buf[i * BS:(i + 1) * BS] != _static_block(b + i):
                bad.append(f"block {b + i}: {bytes(buf[i * BS:i * BS + 16])!r}")
    os.close(fd)
    out.put((reads, bad))


def _static_block(i: int) -> bytes:
    return (f"static block {i:08d} ".encode() * BS)[:BS]


@pytest.mark.slow
def test_readers_of_a_file_the_cleaner_relocates(image: Path, mount_factory: Mount) -> None:
    """Readers hammer a settled file in C while its first zone is made mostly dead
    (the rest of the file rewritten with the same bytes) and the device is filled
    until the cleaner must relocate the live rest: its first block moves in the image,
    `stat` counts zones cleaned and bytes copied. Every read returns the file's bytes
    (never a reset zone's), and reads of the relocated file are served in C again."""
    m = mount_factory.start("c_reads=on", "cleaner_rate=1000", "commit=0.5")
    blocks = 6144  # 24 MiB: its first zone is full
    f = m.path / "r"
    content = b"".join(_static_block(i) for i in range(blocks))
    f.write_bytes(content)
    _settle(f)
    first = _static_block(0)
    before = _image_offsets(image, first)
    assert len(before) == 1
    ctx = mp.get_context("fork")
    stop, out = ctx.Event(), ctx.Queue()
    readers = [ctx.Process(target=_static_reader, args=(str(f), blocks, stop, out))
               for _ in range(2)]
    for p in readers:
        p.start()
    moved = False
    try:
        with open(f, "r+b") as fh:  # the same bytes again: all but the first 64 blocks
            fh.seek(64 * BS)
            fh.write(content[64 * BS:])
            fh.flush()
            os.fsync(fh.fileno())
        deadline = time.monotonic() + 120
        n = 0
        while time.monotonic() < deadline:  # fill (kept live) until the cleaner must run
            doc = json.loads(zonefs("stat", "--json", str(m.path)).stdout)
            cleaner = doc["cleaner"]
            if cleaner["zones_cleaned"] > 0 and doc["cleaner_bytes_copied"] > 0:
                os.sync()
                if _image_offsets(image, first) - before:
                    moved = True
                    break
            if cleaner["empty_zones"] < cleaner["low_watermark_zones"]:
                continue  # the cleaner's next background pass (every commit interval)
            more = m.path / f"more-{n:04d}"
            more.write_bytes(os.urandom(8 << 20))
            _settle(more)
            n += 1
        if moved:
            _odirect_read(m.path / "r", 0, BS)  # Python serves it once, publishes the map
            served_before = _dataplane(m)["reads_c"]
            while _dataplane(m)["reads_c"] < served_before + 100:  # type: ignore[operator]
                pass  # the readers' reads of the relocated file, in C
    finally:
        stop.set()
        results = [out.get(timeout=60) for _ in readers]
        for p in readers:
            p.join(timeout=60)
    assert moved, "the cleaner did not relocate the file being read"
    bad = [b for _, bs in results for b in bs]
    assert not bad, bad
    assert f.read_bytes() == content


def test_reads_served_in_c_are_counted_for_their_tenant(image: Path,
                                                        mount_factory: Mount) -> None:
    """A tenant's file read in C (issue 45): its bytes count as that tenant's reads
    (the map carries the tenant; the data plane's poll hands the totals over)."""
    m = mount_factory.start("c_reads=on")
    d = m.path / "data"
    d.mkdir()
    zonefs("tenant", "add", str(d), "--read-share", "60")
    data = random.Random(2).randbytes(2 * 1024 * 1024)
    f = d / "shard"
    f.write_bytes(data)
    _settle(f)
    assert _odirect_read(f, 0, 65536) == data[:65536]  # Python serves it, publishes the map
    before = _dataplane(m)["reads_c"]
    for off in range(0, len(data), 1 << 20):
        assert _odirect_read(f, off, 1 << 20) == data[off:off + (1 << 20)]
    assert _dataplane(m)["reads_c"] >= before + 2  # type: ignore[operator]
    deadline = time.monotonic() + 10
    while True:  # the poll runs every 50 ms
        t = json.loads(zonefs("tenant", "list", str(m.path), "--json").stdout)["data"]
        if t["bytes_read"] >= 65536 + len(data) or time.monotonic() > deadline:
            break
    assert t["bytes_read"] >= 65536 + len(data)
    assert t["read_share_pct"] == 60
