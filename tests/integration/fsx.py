"""fsx for zonefs-py: random file operations through a real mount, against a model.

After xfstests' fsx: every operation is checked against an in-memory model of
the file, every operation is logged, and a mismatch saves the expected and
actual contents beside the log and prints the seed. A log replays
(`--replay LOG`), so a failure is a file one can shrink by deleting lines.

Operations, on files of up to `--max-size` bytes (default 8 MiB):
  write     pwrite of 1 B .. 2 MiB at an unaligned offset (overlapping others)
  read      pread, compared with the model
  truncate  ftruncate, growing or shrinking (through written data)
  fsync     fsync (or fdatasync)
  reopen    close and open again
  drop      posix_fadvise(DONTNEED): later reads reach the daemon, not the page cache
  mwrite    store through a shared mmap of the file, sometimes msync'ed
  mread     read through a mmap, compared
  dread     O_DIRECT read of aligned blocks into an aligned buffer, compared
  falloc    fallocate(2) with `--falloc` (issue 28): mode 0, KEEP_SIZE,
            PUNCH_HOLE|KEEP_SIZE, ZERO_RANGE with and without KEEP_SIZE, at an
            unaligned offset; the log's data-seed field holds the mode
  copy      copy_file_range from the process's other private file (with
            `--falloc`): aligned ones share blocks, others the daemon copies;
            a = destination offset, b = length, data seed = source offset
  copyself  the same within one file (ranges that do not overlap: the kernel
            refuses those), forwards, backwards and past EOF (issue 42)
  scopy     copy_file_range within one private file (with `--all-ops`):
            forwards and backwards, aligned or not, reaching past EOF; an
            overlapping one must fail with EINVAL (the kernel refuses it);
            a = destination offset, b = length, data seed = source offset
  clone     FICLONERANGE from the other private file (with `--all-ops`):
            a filesystem without it answers EOPNOTSUPP/EXDEV/EINVAL and nothing
            changes; if it clones, the model changes as for a copy
  dedupe    FIDEDUPERANGE of a range onto itself in the other private file
            (with `--all-ops`): never changes bytes, whatever it answers
  awrite    an O_DIRECT write of aligned blocks through Linux AIO (libaio's
  aread     io_submit; with `--all-ops`), and the same read, compared
  swrite    a sequential writer (with `--streams`, issue 44): 2-6 MiB from a
            block-aligned offset at or below the file's end, in 1 MiB pwrites,
            so that the daemon's C write streams take them (DESIGN 4.11) while
            the other operations cut in

Several processes (`--procs`) run at once, each on files of its own, and all
of them on one shared file, where each owns a disjoint, unaligned stripe (so
their read-modify-writes meet in the blocks at the stripe borders); no
truncate on the shared file.

Log lines: `<proc> <op> <file> <a> <b> <data-seed>`; `a`/`b` are offset and
length (truncate: size). Usage:

  python tests/integration/fsx.py DIR --seed 7 --ops 2000 --procs 3 [--no-mmap] [--falloc]
  python tests/integration/fsx.py DIR --replay DIR/fsx-7.log
"""

from __future__ import annotations

import argparse
import concurrent.futures
import concurrent.futures.process
import contextlib
import ctypes
import errno
import mmap
import multiprocessing
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

try:
    from . import fsstress
except ImportError:  # run as a script: tests/integration is on sys.path
    import fsstress  # type: ignore[no-redef]

BLOCK = 4096
#: A stripe of the shared file: unaligned, so neighbours share a block.
STRIPE = (1 << 20) + 1000
#: The size of each pwrite of an `swrite` (a writer's WRITEs as the kernel sends them).
STREAM_STEP = 1 << 20


#: fallocate(2) modes (linux/falloc.h) fsx uses.
KEEP_SIZE, PUNCH_HOLE, ZERO_RANGE = 0x01, 0x02, 0x10
FALLOC_MODES = (0, KEEP_SIZE, PUNCH_HOLE | KEEP_SIZE, ZERO_RANGE, ZERO_RANGE | KEEP_SIZE)
_libc = ctypes.CDLL(None, use_errno=True)


class Mismatch(AssertionError):
    pass


def _fallocate(fd: int, mode: int, off: int, length: int) -> None:
    if _libc.fallocate(fd, mode, ctypes.c_int64(off), ctypes.c_int64(length)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"fallocate(mode={mode:#x}, {off:#x}, {length:#x}): "
                      f"{os.strerror(code)}")


def _direct_read(path: Path, off: int, length: int) -> bytes:
    """[off, off+length) of `path` read with O_DIRECT (the aligned blocks around it)."""
    lo = off - off % BLOCK
    hi = -(-(off + length) // BLOCK) * BLOCK
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, hi - lo)
        try:
            n = os.preadv(fd, [buf], lo)
            return bytes(buf[off - lo:min(n, off - lo + length)])
        finally:
            buf.close()
    finally:
        os.close(fd)


def data_for(seed: int, length: int) -> bytes:
    return random.Random(seed).randbytes(length)


@dataclass
class FileState:
    path: Path
    model: bytearray = field(default_factory=bytearray)
    fd: int = -1
    #: Region this process may touch: (lo, hi) on the shared file, None otherwise.
    stripe: tuple[int, int] | None = None

    def open(self) -> None:
        if self.fd < 0:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Runner:
    """Apply logged operations to real files and to the model; check every read."""

    def __init__(self, directory: Path, proc: int, log_path: Path, use_mmap: bool,
                 use_direct: bool) -> None:
        self.aio: fsstress.Aio | None = None
        self.dir = directory
        self.proc = proc
        self.log_path = log_path
        self.log = open(log_path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        self.use_mmap = use_mmap
        self.use_direct = use_direct
        self.files: dict[str, FileState] = {}
        self.count = 0

    def file(self, name: str) -> FileState:
        st = self.files.get(name)
        if st is None:
            st = FileState(self.dir / name)
            if name == "shared":
                lo = self.proc * STRIPE
                st.stripe = (lo, lo + STRIPE)
            st.open()
            if name != "shared":
                os.ftruncate(st.fd, 0)
            self.files[name] = st
        return st

    def close(self) -> None:
        for st in self.files.values():
            st.close()
        if self.aio is not None:
            self.aio.close()
        self.log.close()

    def other(self, name: str) -> FileState:
        """The process's other private file."""
        return self.file(f"p{self.proc}-b" if name.endswith("-a") else f"p{self.proc}-a")

    # -- checking ----------------------------------------------------------------
    def expect(self, st: FileState, off: int, requested: int, got: bytes, what: str) -> None:
        """Check a read of `requested` bytes at `off` that returned `got`.

        A private file must return exactly the model's bytes up to its size. In
        a stripe of the shared file the size is the neighbours' business too:
        at least the model's bytes, and zeros past them up to the stripe's end.
        """
        have = bytes(st.model[off:off + requested])
        if st.stripe is None:
            want = have
        else:
            want = have + bytes(max(0, len(got) - len(have)))
        if got != want:
            n = min(len(got), len(want))
            first = next((i for i in range(n) if got[i] != want[i]), n)
            base = self.log_path.with_suffix("")
            good = Path(f"{base}.{st.path.name}.good")
            bad = Path(f"{base}.{st.path.name}.bad")
            good.write_bytes(bytes(st.model))
            # What the failing read itself returned (the file may read right later),
            # and the same range read again at once: through the page cache, and
            # with O_DIRECT from the daemon (which of the two still differs tells
            # a stale page in the kernel's cache from a stale reply of the daemon).
            Path(f"{base}.{st.path.name}.got@{off:#x}").write_bytes(got)
            again = []
            with contextlib.suppress(OSError):
                again.append(("buffered", os.pread(st.fd, requested, off)))
            with contextlib.suppress(OSError):
                again.append(("direct", _direct_read(st.path, off, requested)))
            for how, data in again:
                Path(f"{base}.{st.path.name}.{how}@{off:#x}").write_bytes(data)
            reread = ", ".join(f"{how} re-read {'matches' if d[:len(want)] == want else 'differs'}"
                               for how, d in again)
            with contextlib.suppress(OSError):
                bad.write_bytes(st.path.read_bytes())
            raise Mismatch(f"proc {self.proc} op #{self.count} {what} of {st.path.name} at "
                           f"{off:#x}+{requested:#x}: got {len(got):#x} bytes, expected "
                           f"{len(want):#x}, first difference at {off + first:#x} "
                           f"({reread}); log "
                           f"{self.log_path}, expected {good}, actual {bad}")

    # -- operations ----------------------------------------------------------------
    def apply(self, op: str, name: str, a: int, b: int, dseed: int) -> None:
        self.count += 1
        self.log.write(f"{self.proc} {op} {name} {a} {b} {dseed}\n")
        st = self.file(name)
        if op == "write":
            data = data_for(dseed, b)
            os.pwrite(st.fd, data, a)
            self._model_write(st, a, data)
        elif op == "swrite":
            data = data_for(dseed, b)
            for off in range(0, b, STREAM_STEP):
                os.pwrite(st.fd, data[off:off + STREAM_STEP], a + off)
            self._model_write(st, a, data)
        elif op == "read":
            self.expect(st, a, b, os.pread(st.fd, b, a), "read")
        elif op == "truncate":
            os.ftruncate(st.fd, a)
            del st.model[a:]
            st.model.extend(bytes(a - len(st.model)))
        elif op == "fsync":
            (os.fdatasync if b else os.fsync)(st.fd)
        elif op == "drop":
            # Clean pages leave the page cache: the next reads reach the daemon,
            # possibly while dirty pages are still being written back.
            os.posix_fadvise(st.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        elif op == "reopen":
            st.close()
            st.open()
        elif op == "mwrite":
            data = data_for(dseed, b)
            with mmap.mmap(st.fd, a + b) as m:
                m[a:a + b] = data
                if dseed % 2:
                    m.flush()
            self._model_write(st, a, data)
        elif op == "mread":
            with mmap.mmap(st.fd, a + b, prot=mmap.PROT_READ) as m:
                got = bytes(m[a:a + b])
            self.expect(st, a, b, got, "mmap read")
        elif op == "dread":
            self.expect(st, a, b, _direct_read(st.path, a, b), "O_DIRECT read")
        elif op in ("copy", "copyself"):
            other = st if op == "copyself" else self.file(
                f"p{self.proc}-b" if name.endswith("-a") else f"p{self.proc}-a")
            src_off, done = dseed, 0
            while done < b:
                n = os.copy_file_range(other.fd, st.fd, b - done, src_off + done, a + done)
                if n == 0:
                    break
                done += n
            self._model_write(st, a, bytes(other.model[src_off:src_off + done]))
        elif op == "scopy":
            self._same_file_copy(st, dseed, a, b)
        elif op == "clone":
            src = self.other(name)
            try:
                fsstress.clone_range(src.fd, dseed, b, st.fd, a)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL,
                                     errno.ENOTTY):
                    raise
            else:
                self._model_write(st, a, bytes(src.model[dseed:dseed + b]))
        elif op == "dedupe":
            # A range deduped with itself (same bytes by construction): success or
            # a refusal, the bytes stay as they are.
            with contextlib.suppress(OSError):
                fsstress.dedupe_range(st.fd, a, b, st.fd, a)
        elif op in ("awrite", "aread"):
            self._aio(st, op == "awrite", a, b, dseed)
        elif op == "falloc":
            _fallocate(st.fd, dseed, a, b)
            end = a + b
            if dseed & (PUNCH_HOLE | ZERO_RANGE):
                lo, hi = min(a, len(st.model)), min(end, len(st.model))
                st.model[lo:hi] = bytes(hi - lo)
            if not dseed & KEEP_SIZE and end > len(st.model):
                st.model.extend(bytes(end - len(st.model)))
        else:
            raise ValueError(f"unknown operation {op!r}")

    def _same_file_copy(self, st: FileState, src_off: int, dst_off: int, length: int) -> None:
        """copy_file_range within `st`. The kernel first shortens the copy to the
        source's end, then refuses ranges that overlap (EINVAL)."""
        data = bytes(st.model[src_off:src_off + length])
        count = len(data)
        overlap = count > 0 and dst_off + count > src_off and dst_off < src_off + count
        done = 0
        try:
            # Up to the source's end as it was: a copy that extends the file must
            # not go on to copy the bytes it just wrote.
            while done < count:
                n = os.copy_file_range(st.fd, st.fd, count - done, src_off + done,
                                       dst_off + done)
                if n == 0:
                    break
                done += n
        except OSError as exc:
            if overlap and done == 0 and exc.errno == errno.EINVAL:
                return
            raise
        if overlap:
            raise Mismatch(f"proc {self.proc} op #{self.count}: overlapping copy within "
                           f"{st.path.name} ({src_off:#x} -> {dst_off:#x}, {count:#x}) "
                           f"copied {done:#x} bytes instead of failing with EINVAL")
        self._model_write(st, dst_off, data[:done])

    def _aio(self, st: FileState, write: bool, off: int, length: int, dseed: int) -> None:
        """An O_DIRECT write or read of aligned blocks through io_submit."""
        if self.aio is None:
            self.aio = fsstress.Aio()
        if self.aio.lib is None:
            return  # no libaio on this machine: nothing done, nothing to check
        fd = os.open(st.path, os.O_RDWR | os.O_DIRECT)
        buf = mmap.mmap(-1, length)
        try:
            if write:
                data = data_for(dseed, length)
                buf.write(data)
                n = self.aio.submit_wait(fsstress.Aio.PWRITE, fd, buf, length, off)
                self._model_write(st, off, data[:n])
            else:
                # A limit of FUSE with the writeback cache (DESIGN 4.8): an AIO
                # O_DIRECT read of a hole past the size the daemon has seen (the file
                # grew by buffered writes still dirty in the kernel) comes back short;
                # the kernel zero-fills such a short read only on the synchronous path,
                # and the daemon cannot know the kernel's size. So, as a program that
                # mixes the two must, the file's dirty pages go out first.
                os.fdatasync(st.fd)
                n = self.aio.submit_wait(fsstress.Aio.PREAD, fd, buf, length, off)
                self.expect(st, off, length, bytes(buf[:n]), "aio read")
        finally:
            buf.close()
            os.close(fd)

    def _model_write(self, st: FileState, off: int, data: bytes) -> None:
        if not data:
            return  # nothing written (a copy of 0 bytes) extends nothing
        end = off + len(data)
        if end > len(st.model):
            st.model.extend(bytes(end - len(st.model)))
        st.model[off:end] = data

    def final_check(self) -> None:
        """Every byte of every file, read again from a fresh descriptor."""
        for st in self.files.values():
            with open(st.path, "rb") as f:
                if st.stripe is None:
                    got = f.read()
                    self.expect(st, 0, len(got) + 1, got, "final read")
                else:
                    lo, hi = st.stripe
                    f.seek(lo)
                    self.expect(st, lo, hi - lo, f.read(hi - lo), "final read")


def generate_more(rnd: random.Random, name: str, proc: int, max_size: int,
                  sizes: dict[str, int]) -> tuple[str, str, int, int, int]:
    """One of the `--all-ops` operations on a private file (module docstring)."""
    size = sizes.get(name, 0)
    other = f"p{proc}-b" if name == f"p{proc}-a" else f"p{proc}-a"
    op = rnd.choice(["scopy", "scopy", "scopy", "clone", "dedupe", "awrite", "aread"])
    if op == "scopy":
        length = rnd.choice([rnd.randrange(1, 8192), rnd.randrange(1, 1 << 20)])
        src = rnd.randrange(0, max(1, size + BLOCK))
        if rnd.random() < 0.15:  # overlapping: EINVAL
            dst = max(0, src + rnd.randrange(-length + 1, length))
        elif rnd.random() < 0.5 and src >= length:  # backwards
            dst = rnd.randrange(0, src - length + 1)
        else:  # forwards, possibly past EOF
            dst = src + length + rnd.randrange(0, 1 << 20)
        if rnd.random() < 0.5:
            src, dst = src - src % BLOCK, dst - dst % BLOCK
            length = -(-length // BLOCK) * BLOCK
        length = max(1, min(length, max_size - dst))
        if dst + length > max_size or src >= max_size:
            return "read", name, 0, 1, 0
        copied = max(0, min(length, size - src))  # the kernel shortens to the source's end
        overlap = copied > 0 and src < dst + copied and dst < src + copied
        if not overlap and copied:
            sizes[name] = max(size, dst + copied)
        return "scopy", name, dst, length, src
    if op in ("clone", "dedupe"):
        src_size = sizes.get(other, 0)
        src = rnd.randrange(0, max(1, src_size)) // BLOCK * BLOCK
        length = rnd.randrange(1, 64) * BLOCK
        dst = rnd.randrange(0, max_size // 2) // BLOCK * BLOCK
        if op == "dedupe":
            return "dedupe", name, src, length, 0
        # Cloning fails on this filesystem (FUSE has no clone); the sizes the
        # generator tracks stay, and Runner applies a success to the model.
        return "clone", name, dst, length, src
    first = rnd.randrange(0, max_size // BLOCK)
    count = rnd.randrange(1, min(max_size // BLOCK - first, 128) + 1)
    if op == "awrite":
        sizes[name] = max(size, (first + count) * BLOCK)
    return op, name, first * BLOCK, count * BLOCK, rnd.randrange(1 << 30)


def generate(rnd: random.Random, proc: int, max_size: int, use_mmap: bool, use_direct: bool,
             sizes: dict[str, int], use_falloc: bool = False, use_more: bool = False,
             use_streams: bool = False) -> tuple[str, str, int, int, int]:
    """One random operation (op, file, a, b, data seed); `sizes` tracks model sizes.
    Without `use_falloc` the sequence of a seed is what it was before `falloc`,
    without `use_more` what it was before `--all-ops`, and without `use_streams`
    what it was before `--streams`."""
    name = rnd.choice([f"p{proc}-a", f"p{proc}-b", "shared"])
    lo, hi = (proc * STRIPE, (proc + 1) * STRIPE) if name == "shared" else (0, max_size)
    size = sizes.get(name, 0)
    dseed = rnd.randrange(1 << 30)
    if use_streams and name != "shared" and rnd.random() < 0.15:
        length = rnd.randrange(2, 7) * STREAM_STEP
        off = max(0, min(size, max_size - length))
        off -= off % BLOCK
        if rnd.random() < 0.3:  # sometimes behind the end: over written bytes
            off = rnd.randrange(0, off + 1) // BLOCK * BLOCK
        sizes[name] = max(size, off + length)
        return "swrite", name, off, length, dseed
    if use_more and name != "shared" and rnd.random() < 0.08:
        return generate_more(rnd, name, proc, max_size, sizes)
    if use_falloc and name != "shared" and rnd.random() < 0.04:
        # One copy in four within the file itself (from dseed: the random sequence
        # of a seed stays what it was before).
        same = dseed % 4 == 0
        other = name if same else f"p{proc}-b" if name == f"p{proc}-a" else f"p{proc}-a"
        src_size = sizes.get(other, 0)
        aligned = rnd.random() < 0.7
        src_off = rnd.randrange(0, max(1, src_size))
        off = rnd.randrange(0, max_size // 2)
        length = rnd.randrange(1, 2 << 20)
        if aligned:
            src_off -= src_off % BLOCK
            off -= off % BLOCK
            length = -(-length // BLOCK) * BLOCK
        length = max(0, min(length, src_size - src_off, max_size - off))
        if same:  # the ranges must not overlap
            length = min(length, abs(off - src_off))
        if length:
            sizes[name] = max(size, off + length)
        return ("copyself" if same else "copy"), name, off, length, src_off
    if use_falloc and rnd.random() < 0.12:
        mode = rnd.choice(FALLOC_MODES)
        off = rnd.randrange(lo, hi - 1)
        if rnd.random() < 0.25:
            off = max(lo, off - off % BLOCK)
        length = min(rnd.choice([rnd.randrange(1, 8192), rnd.randrange(1, 1 << 20)]),
                     hi - off)
        if not mode & KEEP_SIZE:
            sizes[name] = max(size, off + length)
        return "falloc", name, off, length, mode
    r = rnd.random()
    if r < 0.55:
        length = rnd.choice([rnd.randrange(1, 8192), rnd.randrange(1, 256 << 10),
                             rnd.randrange(1, 1 << 20), 1 << 20, 2 << 20])
        length = min(length, hi - lo)
        off = rnd.randrange(lo, hi - length + 1)
        if rnd.random() < 0.25:
            off = max(lo, off - off % BLOCK)
        sizes[name] = max(size, off + length)
        return "write", name, off, length, dseed
    if r < 0.70:
        off = rnd.randrange(lo, hi)
        return "read", name, off, min(rnd.randrange(1, 1 << 20), hi - off), dseed
    if r < 0.85 and name != "shared":
        new = rnd.choice([rnd.randrange(0, max_size), rnd.randrange(0, max(1, size + 1))])
        sizes[name] = new
        return "truncate", name, new, 0, dseed
    if r < 0.87:
        return "fsync", name, 0, rnd.randrange(2), dseed
    if r < 0.89:
        return "reopen", name, 0, 0, dseed
    if r < 0.92:
        return "drop", name, 0, 0, dseed
    if use_mmap and r < 0.96 and size > lo:
        off = rnd.randrange(lo, min(size, hi))
        length = rnd.randrange(1, min(size, hi) - off + 1)
        return ("mwrite" if rnd.random() < 0.5 else "mread"), name, off, length, dseed
    if use_direct:
        blo = (lo + BLOCK - 1) // BLOCK
        bhi = hi // BLOCK
        first = rnd.randrange(blo, bhi)
        count = rnd.randrange(1, min(bhi - first, 256) + 1)
        return "dread", name, first * BLOCK, count * BLOCK, dseed
    off = rnd.randrange(lo, hi)
    return "read", name, off, min(rnd.randrange(1, 1 << 20), hi - off), dseed


def run_proc(directory: str, seed: int, proc: int, ops: int, max_size: int, use_mmap: bool,
             use_direct: bool, log_dir: str, use_falloc: bool = False,
             use_more: bool = False, use_streams: bool = False) -> str | None:
    """One worker: `ops` random operations; return an error message or None."""
    rnd = random.Random(seed * 1000 + proc)
    log_path = Path(log_dir) / f"fsx-{seed}.p{proc}.log"
    log_path.unlink(missing_ok=True)
    runner = Runner(Path(directory), proc, log_path, use_mmap, use_direct)
    sizes: dict[str, int] = {}
    try:
        for _ in range(ops):
            runner.apply(*generate(rnd, proc, max_size, use_mmap, use_direct, sizes,
                                   use_falloc, use_more, use_streams))
        runner.final_check()
    except Mismatch as exc:
        return f"seed {seed}: {exc}"
    except OSError as exc:
        return f"seed {seed}: proc {proc} op #{runner.count} failed: {exc!r}; log {log_path}"
    finally:
        runner.close()
    return None


def run(directory: Path, seed: int, ops: int, procs: int = 1, max_size: int = 8 << 20,
        use_mmap: bool = True, use_direct: bool = True, log_dir: Path | None = None,
        use_falloc: bool = False, use_more: bool = False,
        use_streams: bool = False) -> list[str]:
    """Run `procs` workers at once; return their error messages (empty: all passed)."""
    log_dir = log_dir or directory
    (directory / "shared").unlink(missing_ok=True)
    args = [(str(directory), seed, p, ops, max_size, use_mmap, use_direct, str(log_dir),
             use_falloc, use_more, use_streams) for p in range(procs)]
    if procs == 1:
        results = [run_proc(*args[0])]
    else:
        # Spawned, not forked: a fork of a process with threads (pytest's, the
        # mount's) can inherit a lock held mid-operation and never start, and
        # multiprocessing.Pool waits forever for a worker that died. An executor
        # raises BrokenProcessPool for that instead: a failure, never a hang.
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(procs, mp_context=ctx) as pool:
            futures = [pool.submit(run_proc, *a) for a in args]
            results = []
            for f in futures:
                try:
                    results.append(f.result())
                except concurrent.futures.process.BrokenProcessPool as exc:
                    results.append(f"seed {seed}: a worker process died: {exc}")
    return [r for r in results if r is not None]


def replay(directory: Path, log_path: Path, use_direct: bool = True) -> str | None:
    """Replay a log's operations in order (one process; each proc's stripe kept)."""
    runners: dict[int, Runner] = {}
    (directory / "shared").unlink(missing_ok=True)
    try:
        for line in log_path.read_text().splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            proc, op, name, a, b, dseed = line.split()
            p = int(proc)
            if p not in runners:
                runners[p] = Runner(directory, p, log_path.with_suffix(f".replay{p}.log"),
                                    True, use_direct)
            runners[p].apply(op, name, int(a), int(b), int(dseed))
        for r in runners.values():
            r.final_check()
    except (Mismatch, OSError) as exc:
        return str(exc)
    finally:
        for r in runners.values():
            r.close()
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="a directory on the filesystem under test")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ops", type=int, default=1000, help="operations per process")
    ap.add_argument("--procs", type=int, default=1)
    ap.add_argument("--max-size", type=int, default=8 << 20)
    ap.add_argument("--no-mmap", action="store_true")
    ap.add_argument("--no-direct", action="store_true")
    ap.add_argument("--falloc", action="store_true", help="add fallocate operations")
    ap.add_argument("--all-ops", action="store_true",
                    help="every operation: --falloc's, and copies within a file, clone, "
                         "dedupe, Linux AIO")
    ap.add_argument("--streams", action="store_true",
                    help="add sequential writers of 2-6 MiB in 1 MiB pwrites (swrite)")
    ap.add_argument("--log-dir", type=Path, help="where logs and good/bad copies go")
    ap.add_argument("--replay", type=Path, help="replay this operation log instead")
    args = ap.parse_args()
    if args.replay:
        err = replay(args.dir, args.replay, not args.no_direct)
        print(err or f"replay of {args.replay}: all operations matched the model")
        return 1 if err else 0
    errs = run(args.dir, args.seed, args.ops, args.procs, args.max_size, not args.no_mmap,
               not args.no_direct, args.log_dir, args.falloc or args.all_ops, args.all_ops,
               args.streams)
    for e in errs:
        print(e, file=sys.stderr)
    print(f"seed {args.seed}: {args.ops * args.procs} operations in {args.procs} process(es): "
          f"{'FAILED' if errs else 'all matched the model'}")
    return 1 if errs else 0


if __name__ == "__main__":
    sys.exit(main())
