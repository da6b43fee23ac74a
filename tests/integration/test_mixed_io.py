"""Training-shaped I/O through a real mount: a dataset reader beside a checkpoint
writer, and readers of a file that is being overwritten and truncated. Every byte
is compared (reads use O_DIRECT, so the daemon, not the page cache, answers them)."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import random
import threading
from collections.abc import Callable, Iterator

import pytest

from .conftest import Mount, zonefs

pytestmark = pytest.mark.integration

MiB = 1 << 20
BLOCK = 4096


def pattern(tag: int, length: int) -> bytes:
    """`length` bytes that differ between tags and never repeat within 1021 bytes."""
    rng = random.Random(tag)
    unit = bytes(rng.randrange(1, 256) for _ in range(1021))
    return (unit * (length // len(unit) + 1))[:length]


class DirectReader:
    """O_DIRECT reads into a page-aligned buffer (what fio's direct=1 does)."""

    def __init__(self, path: str, max_len: int) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        self.buf = mmap.mmap(-1, max_len)

    def pread(self, offset: int, length: int) -> bytes:
        view = memoryview(self.buf)[:length]
        try:
            n = os.preadv(self.fd, [view], offset)
            return bytes(view[:n])
        finally:
            view.release()

    def close(self) -> None:
        os.close(self.fd)
        self.buf.close()


def run_threads(*targets: Callable[[], None]) -> None:
    """Run the targets in threads; re-raise the first failure."""
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported to the test thread
                errors.append(exc)
        return run

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a reader or writer thread hung"
    if errors:
        raise errors[0]


def test_dataset_reader_beside_checkpoint_writer(mounted: Mount) -> None:
    """A random 4-128 KiB reader of a dataset file while a 48 MiB checkpoint is written
    in 1 MiB writes and fsynced: every read and the checkpoint match, and the read-QoS
    controller's state is in the status."""
    dataset = pattern(1, 16 * MiB)
    ds_path = str(mounted.path / "dataset.bin")
    with open(ds_path, "wb") as f:
        f.write(dataset)
        os.fsync(f.fileno())
    ckpt = pattern(2, 48 * MiB)
    ck_path = str(mounted.path / "ckpt.bin")
    done = threading.Event()
    reads = [0]

    def writer() -> None:
        try:
            with open(ck_path, "wb") as f:
                for off in range(0, len(ckpt), MiB):
                    f.write(ckpt[off:off + MiB])
                os.fsync(f.fileno())
        finally:
            done.set()

    def reader() -> None:
        rng = random.Random(3)
        r = DirectReader(ds_path, 128 << 10)
        try:
            while not done.is_set() or reads[0] < 200:
                length = rng.choice((4096, 16384, 131072))
                off = rng.randrange(0, len(dataset) - length) // BLOCK * BLOCK
                assert r.pread(off, length) == dataset[off:off + length], off
                reads[0] += 1
        finally:
            r.close()

    run_threads(writer, reader)
    r = DirectReader(ck_path, MiB)
    try:
        digest = hashlib.sha256()
        for off in range(0, len(ckpt), MiB):
            digest.update(r.pread(off, MiB))
    finally:
        r.close()
    assert digest.hexdigest() == hashlib.sha256(ckpt).hexdigest()
    if os.geteuid() == 0:  # the status xattr is trusted.* (root only)
        status = json.loads(zonefs("stat", str(mounted.path), "--json").stdout)
        qos = status["read_qos"]
        assert qos["read_latency_target_ms"] == 2.0
        assert qos["read_latency_p90_ms"] is not None  # it saw the reads
        assert "write_allowance_mb_s" in qos


def _offsets(kind: str, rng: random.Random, size_hint: int) -> Iterator[tuple[int, int]]:
    """Endless (offset, length) of one access pattern, block aligned (O_DIRECT)."""
    while True:
        if kind == "sequential":
            off = 0
            while off < size_hint:
                length = rng.choice((4096, 65536, 131072, MiB))
                yield off, length
                off += length
        elif kind == "strided":
            stride = rng.choice((2, 3)) * 65536
            for off in range(rng.randrange(0, 4) * BLOCK, size_hint, stride):
                yield off, 65536
        else:  # backward
            length = rng.choice((4096, 65536))
            for off in range(size_hint // length * length, -1, -length):
                yield off, length


@pytest.mark.parametrize("seed", [11, 12])
def test_readers_of_a_file_being_overwritten_and_truncated(mounted: Mount, seed: int) -> None:
    """Sequential, strided and backward O_DIRECT readers keep reading one file while a
    writer overwrites ranges of it (unaligned, buffered, then fsync) and truncates it
    shorter and longer. Each operation and each read runs under one lock, so every
    read must equal the model of the file at that moment, byte for byte."""
    rng = random.Random(seed)
    print(f"seed {seed}")
    path = str(mounted.path / "mutating.bin")
    size = 6 * MiB
    model = bytearray(pattern(seed, size))
    with open(path, "wb") as f:
        f.write(model)
        os.fsync(f.fileno())
    lock = threading.Lock()
    done = threading.Event()
    log: list[str] = []

    def writer() -> None:
        try:
            fd = os.open(path, os.O_WRONLY)
            try:
                for gen in range(40):
                    with lock:
                        if rng.random() < 0.25:
                            new_size = rng.randrange(0, 8 * MiB)
                            os.ftruncate(fd, new_size)
                            del model[new_size:]
                            model.extend(bytes(new_size - len(model)))
                            log.append(f"truncate {new_size}")
                        else:
                            off = rng.randrange(0, 7 * MiB)
                            length = rng.randrange(1, 2 * MiB)
                            data = pattern(seed * 1000 + gen, length)
                            os.pwrite(fd, data, off)
                            if off > len(model):
                                model.extend(bytes(off - len(model)))
                            model[off:off + length] = data
                            log.append(f"write {off} {length}")
                        os.fsync(fd)
                    # Let the readers in between operations.
                    threading.Event().wait(0.01)
            finally:
                os.close(fd)
        finally:
            done.set()

    def reader(kind: str) -> Callable[[], None]:
        def run() -> None:
            krng = random.Random(f"{seed}-{kind}")
            r = DirectReader(path, MiB)
            try:
                for off, length in _offsets(kind, krng, 8 * MiB):
                    if done.is_set():
                        return
                    with lock:
                        got = r.pread(off, length)
                        want = bytes(model[off:off + length])
                    if got != want:
                        bad = next((i for i, (a, b) in enumerate(zip(got, want, strict=False))
                                    if a != b), min(len(got), len(want)))
                        pytest.fail(f"{kind} read at {off}+{length} differs from the model at "
                                    f"byte {off + bad} (got {len(got)} bytes, want "
                                    f"{len(want)}); ops so far: {log[-5:]}")
            finally:
                r.close()
        return run

    run_threads(writer, reader("sequential"), reader("strided"), reader("backward"))
    with open(path, "rb") as f:
        assert f.read() == bytes(model)
