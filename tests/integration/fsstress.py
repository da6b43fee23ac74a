"""fsstress for zonefs-py: every operation a filesystem takes, from several processes at once.

After xfstests' fsstress: no model of the contents, the point is that every
request is answered and nothing breaks. Each process works in a directory of
its own plus one directory that all of them share (so renames, links and
unlinks of one process meet the opens and writes of another), choosing at
random among:

  namespace  creat mkdir rmdir unlink rename (plain, RENAME_NOREPLACE,
             RENAME_EXCHANGE) link symlink readlink mknod(fifo) getdents stat
             chmod chown utimes
  xattrs     setxattr getxattr listxattr removexattr
  data       write read truncate fsync fdatasync sync dwrite dread (O_DIRECT)
             mwrite mread (shared mmap) awrite aread (libaio, O_DIRECT)
  space      fallocate (0, KEEP_SIZE, PUNCH_HOLE, ZERO_RANGE, ZERO_RANGE|KEEP_SIZE,
             COLLAPSE_RANGE, INSERT_RANGE) copy_range (between files and within
             one file) clone (FICLONERANGE) dedupe (FIDEDUPERANGE) statfs

An operation may fail with an errno a filesystem may give it (ENOENT when
another process got there first, EOPNOTSUPP for a mode the filesystem does
not offer, ...); those are counted by errno. Any other errno (EIO, EROFS,
ENOTCONN, ...) fails the run, with the operation's log line. A process that
does not finish within the deadline fails the run as a hang: the caller stuck
in the kernel is the worst failure a filesystem has.

Every operation is logged (`<proc> <op#> <op> <path> <args>`) to a file per
process, so a failure names the last operations before it.

  python tests/integration/fsstress.py DIR --seed 3 --ops 20000 --procs 4
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import fcntl
import mmap
import multiprocessing
import os
import random
import stat
import struct
import sys
import time
from collections import Counter
from pathlib import Path

BLOCK = 4096
MAX_FILE = 4 << 20
#: fallocate(2) modes (linux/falloc.h).
KEEP_SIZE, PUNCH_HOLE, COLLAPSE_RANGE, ZERO_RANGE, INSERT_RANGE = 0x01, 0x02, 0x08, 0x10, 0x20
FALLOC_MODES = (0, KEEP_SIZE, PUNCH_HOLE | KEEP_SIZE, ZERO_RANGE, ZERO_RANGE | KEEP_SIZE,
                COLLAPSE_RANGE, INSERT_RANGE)
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
#: ioctl numbers (linux/fs.h): _IOW(0x94, 13, struct file_clone_range),
#: _IOWR(0x94, 54, struct file_dedupe_range).
FICLONERANGE = 0x4020940D
FIDEDUPERANGE = 0xC0189436
AT_FDCWD = -100

#: errnos an operation may meet on a healthy filesystem under this workload.
EXPECTED = {errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR,
            errno.EINVAL, errno.EOPNOTSUPP, errno.EXDEV, errno.ENODATA, errno.ENOTTY,
            errno.ELOOP, errno.EMLINK, errno.ENOSPC, errno.EFBIG, errno.ETXTBSY,
            errno.EBADF, errno.ENXIO, errno.ENOSYS,
            errno.EPERM,  # user.* xattrs of a symlink or a FIFO
            errno.ENAMETOOLONG}  # through a symlink whose target is a 300-byte name

_libc = ctypes.CDLL(None, use_errno=True)
_libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                            ctypes.c_uint]


def _check(res: int, what: str) -> int:
    if res < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return res


def fallocate(fd: int, mode: int, off: int, length: int) -> None:
    _check(_libc.fallocate(fd, mode, ctypes.c_int64(off), ctypes.c_int64(length)),
           f"fallocate({mode:#x})")


def renameat2(old: str, new: str, flags: int) -> None:
    _check(_libc.renameat2(AT_FDCWD, old.encode(), AT_FDCWD, new.encode(), flags),
           f"renameat2({flags})")


def clone_range(src_fd: int, src_off: int, length: int, dst_fd: int, dst_off: int) -> None:
    """FICLONERANGE (struct file_clone_range {s64 src_fd; u64 src_offset, src_length,
    dest_offset})."""
    arg = bytearray(struct.pack("=qQQQ", src_fd, src_off, length, dst_off))
    fcntl.ioctl(dst_fd, FICLONERANGE, arg)


def dedupe_range(src_fd: int, src_off: int, length: int, dst_fd: int, dst_off: int) -> int:
    """FIDEDUPERANGE with one destination; return bytes deduped (its status checked)."""
    # struct file_dedupe_range {u64 src_offset, src_length; u16 dest_count, reserved1;
    # u32 reserved2; struct file_dedupe_range_info {s64 dest_fd; u64 dest_offset,
    # bytes_deduped; s32 status; u32 reserved;} info[]}
    arg = bytearray(struct.pack("=QQHHI", src_off, length, 1, 0, 0)
                    + struct.pack("=qQQiI", dst_fd, dst_off, 0, 0, 0))
    fcntl.ioctl(src_fd, FIDEDUPERANGE, arg)
    _fd, _off, done, status, _ = struct.unpack_from("=qQQiI", arg, 24)
    if status < 0:
        raise OSError(-status, f"dedupe status: {os.strerror(-status)}")
    return int(done)


class _IOCB(ctypes.Structure):
    """struct iocb (linux/aio_abi.h), little-endian x86-64 layout."""
    _fields_ = [("aio_data", ctypes.c_uint64), ("aio_key", ctypes.c_uint32),
                ("aio_rw_flags", ctypes.c_int32), ("aio_lio_opcode", ctypes.c_uint16),
                ("aio_reqprio", ctypes.c_int16), ("aio_fildes", ctypes.c_uint32),
                ("aio_buf", ctypes.c_uint64), ("aio_nbytes", ctypes.c_uint64),
                ("aio_offset", ctypes.c_int64), ("aio_reserved2", ctypes.c_uint64),
                ("aio_flags", ctypes.c_uint32), ("aio_resfd", ctypes.c_uint32)]


class _IOEvent(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64),
                ("res", ctypes.c_int64), ("res2", ctypes.c_int64)]


class Aio:
    """Linux native AIO through libaio (fio's dependency), one request at a time."""

    PREAD, PWRITE = 0, 1

    def __init__(self) -> None:
        try:
            self.lib: ctypes.CDLL | None = ctypes.CDLL("libaio.so.1", use_errno=True)
        except OSError:
            self.lib = None
            return
        self.ctx = ctypes.c_ulong(0)
        res = self.lib.io_setup(8, ctypes.byref(self.ctx))
        if res < 0:
            self.lib = None

    def submit_wait(self, opcode: int, fd: int, buf: mmap.mmap, length: int, off: int) -> int:
        """One aligned O_DIRECT request through io_submit; its result (bytes or -errno)."""
        assert self.lib is not None
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        cb = _IOCB(aio_lio_opcode=opcode, aio_fildes=fd, aio_buf=addr, aio_nbytes=length,
                   aio_offset=off)
        cbs = (ctypes.POINTER(_IOCB) * 1)(ctypes.pointer(cb))
        res = self.lib.io_submit(self.ctx, 1, cbs)
        if res < 0:
            raise OSError(-res, f"io_submit: {os.strerror(-res)}")
        ev = _IOEvent()
        while True:
            res = self.lib.io_getevents(self.ctx, 1, 1, ctypes.byref(ev), None)
            if res != -errno.EINTR:
                break
        if res < 0:
            raise OSError(-res, f"io_getevents: {os.strerror(-res)}")
        if ev.res < 0:
            raise OSError(-ev.res, f"aio: {os.strerror(-ev.res)}")
        return int(ev.res)

    def close(self) -> None:
        if self.lib is not None:
            self.lib.io_destroy(self.ctx)


class Worker:
    """One process's random operations in its own directory and the shared one."""

    def __init__(self, top: Path, proc: int, seed: int, log_path: Path) -> None:
        self.rnd = random.Random(seed * 1000 + proc)
        self.own = top / f"p{proc}"
        self.shared = top / "shared"
        self.own.mkdir(exist_ok=True)
        self.shared.mkdir(exist_ok=True)
        self.proc = proc
        self.log = open(log_path, "w", buffering=1)  # noqa: SIM115 - closed in close()
        self.count = 0
        self.errnos: Counter[str] = Counter()
        self.ops: Counter[str] = Counter()
        self.aio = Aio()
        self.names = [f"f{i}" for i in range(24)] + [f"d{i}" for i in range(6)]

    def close(self) -> None:
        self.aio.close()
        self.log.close()

    # -- choosing paths ---------------------------------------------------------------
    def path(self) -> str:
        base = self.own if self.rnd.random() < 0.75 else self.shared
        parts = [self.rnd.choice(self.names)]
        if self.rnd.random() < 0.3:
            parts.insert(0, f"d{self.rnd.randrange(6)}")
        return str(base.joinpath(*parts))

    def open_file(self, flags: int = os.O_RDWR) -> int:
        """Open (creating) a random path as a regular file. O_NONBLOCK: a FIFO that
        mknod made must not block the open; anything not regular is ENXIO."""
        fd = os.open(self.path(), flags | os.O_CREAT | os.O_NONBLOCK, 0o644)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.ENXIO, "not a regular file")
        return fd

    def span(self) -> tuple[int, int]:
        off = self.rnd.randrange(0, MAX_FILE)
        length = self.rnd.choice([self.rnd.randrange(1, BLOCK * 2),
                                  self.rnd.randrange(1, 512 << 10)])
        if self.rnd.random() < 0.4:
            off -= off % BLOCK
            length = -(-length // BLOCK) * BLOCK
        return off, min(length, MAX_FILE - off)

    # -- the operations ---------------------------------------------------------------
    def run_one(self) -> None:
        op = self.rnd.choice(OPS)
        self.count += 1
        self.ops[op] += 1
        seed = self.rnd.randrange(1 << 30)
        self.log.write(f"{self.proc} {self.count} {op} {seed}\n")
        try:
            getattr(self, f"op_{op}")(random.Random(seed))
        except OSError as exc:
            if exc.errno not in EXPECTED:
                raise OSError(exc.errno, f"proc {self.proc} op #{self.count} {op}: {exc}") \
                    from exc
            self.errnos[f"{op}:{errno.errorcode.get(exc.errno or 0, exc.errno)}"] += 1

    def op_creat(self, r: random.Random) -> None:
        os.close(os.open(self.path(), os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644))

    def op_mkdir(self, r: random.Random) -> None:
        base = self.own if r.random() < 0.75 else self.shared
        os.mkdir(base / f"d{r.randrange(6)}")

    def op_rmdir(self, r: random.Random) -> None:
        base = self.own if r.random() < 0.75 else self.shared
        os.rmdir(base / f"d{r.randrange(6)}")

    def op_unlink(self, r: random.Random) -> None:
        os.unlink(self.path())

    def op_rename(self, r: random.Random) -> None:
        flags = r.choice([0, 0, RENAME_NOREPLACE, RENAME_EXCHANGE])
        renameat2(self.path(), self.path(), flags)

    def op_link(self, r: random.Random) -> None:
        os.link(self.path(), self.path())

    def op_symlink(self, r: random.Random) -> None:
        os.symlink(r.choice(["f1", "../f2", "x" * r.randrange(1, 300)]), self.path())

    def op_readlink(self, r: random.Random) -> None:
        os.readlink(self.path())

    def op_mknod(self, r: random.Random) -> None:
        os.mkfifo(self.path(), 0o644)

    def op_getdents(self, r: random.Random) -> None:
        base = self.own if r.random() < 0.5 else self.shared
        for entry in os.scandir(base):
            with contextlib.suppress(FileNotFoundError):
                entry.stat(follow_symlinks=False)

    def op_stat(self, r: random.Random) -> None:
        os.lstat(self.path())

    def op_chmod(self, r: random.Random) -> None:
        p = self.path()
        if not stat.S_ISLNK(os.lstat(p).st_mode):
            os.chmod(p, r.choice([0o644, 0o600, 0o755, 0o2755, 0o4755]))

    def op_chown(self, r: random.Random) -> None:
        os.lchown(self.path(), r.choice([0, 1000, -1]), r.choice([0, 1000, -1]))

    def op_utimes(self, r: random.Random) -> None:
        os.utime(self.path(), ns=(r.randrange(1 << 40), r.randrange(1 << 40)),
                 follow_symlinks=False)

    def op_setxattr(self, r: random.Random) -> None:
        os.setxattr(self.path(), f"user.k{r.randrange(4)}", r.randbytes(r.randrange(0, 300)),
                    follow_symlinks=False)

    def op_getxattr(self, r: random.Random) -> None:
        os.getxattr(self.path(), f"user.k{r.randrange(4)}", follow_symlinks=False)

    def op_listxattr(self, r: random.Random) -> None:
        os.listxattr(self.path(), follow_symlinks=False)

    def op_removexattr(self, r: random.Random) -> None:
        os.removexattr(self.path(), f"user.k{r.randrange(4)}", follow_symlinks=False)

    def op_write(self, r: random.Random) -> None:
        fd = self.open_file()
        try:
            off, length = self.span()
            os.pwrite(fd, r.randbytes(length), off)
        finally:
            os.close(fd)

    def op_read(self, r: random.Random) -> None:
        fd = self.open_file(os.O_RDONLY)
        try:
            off, length = self.span()
            os.pread(fd, length, off)
        finally:
            os.close(fd)

    def op_truncate(self, r: random.Random) -> None:
        fd = self.open_file()
        try:
            os.ftruncate(fd, r.randrange(0, MAX_FILE))
        finally:
            os.close(fd)

    def op_fsync(self, r: random.Random) -> None:
        fd = self.open_file()
        try:
            (os.fdatasync if r.random() < 0.5 else os.fsync)(fd)
        finally:
            os.close(fd)

    def op_sync(self, r: random.Random) -> None:
        if r.random() < 0.1:  # a whole-system sync is slow; rarely
            os.sync()

    def _direct(self, r: random.Random, write: bool, use_aio: bool) -> None:
        if use_aio and self.aio.lib is None:
            return
        fd = self.open_file(os.O_RDWR | os.O_DIRECT)
        try:
            off = r.randrange(0, MAX_FILE // BLOCK) * BLOCK
            length = r.randrange(1, 64) * BLOCK
            length = min(length, MAX_FILE - off)
            buf = mmap.mmap(-1, length)
            try:
                if write:
                    buf.write(r.randbytes(length))
                if use_aio:
                    self.aio.submit_wait(Aio.PWRITE if write else Aio.PREAD, fd, buf, length,
                                         off)
                elif write:
                    os.pwritev(fd, [buf], off)
                else:
                    os.preadv(fd, [buf], off)
            finally:
                buf.close()
        finally:
            os.close(fd)

    def op_dwrite(self, r: random.Random) -> None:
        self._direct(r, True, False)

    def op_dread(self, r: random.Random) -> None:
        self._direct(r, False, False)

    def op_awrite(self, r: random.Random) -> None:
        self._direct(r, True, True)

    def op_aread(self, r: random.Random) -> None:
        self._direct(r, False, True)

    def _mmap(self, r: random.Random, write: bool) -> None:
        fd = self.open_file()
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                return
            with mmap.mmap(fd, size) as m:
                off = r.randrange(size)
                length = r.randrange(1, min(size - off, 256 << 10) + 1)
                if write:
                    m[off:off + length] = r.randbytes(length)
                    if r.random() < 0.5:
                        m.flush()
                else:
                    _ = m[off:off + length]
        finally:
            os.close(fd)

    def op_mwrite(self, r: random.Random) -> None:
        self._mmap(r, True)

    def op_mread(self, r: random.Random) -> None:
        self._mmap(r, False)

    def op_fallocate(self, r: random.Random) -> None:
        fd = self.open_file()
        try:
            off, length = self.span()
            fallocate(fd, r.choice(FALLOC_MODES), off, max(1, length))
        finally:
            os.close(fd)

    def _two(self) -> tuple[int, int]:
        a = self.open_file(os.O_RDONLY)
        try:
            b = self.open_file(os.O_RDWR)
        except OSError:
            os.close(a)
            raise
        return a, b

    def op_copy_range(self, r: random.Random) -> None:
        src, dst = self._two()
        try:
            off_in, length = self.span()
            off_out = r.randrange(0, MAX_FILE)
            if r.random() < 0.5:  # within one file: the kernel refuses overlaps (EINVAL)
                os.copy_file_range(dst, dst, length, off_in, off_out)
            else:
                os.copy_file_range(src, dst, length, off_in, off_out)
        finally:
            os.close(src)
            os.close(dst)

    def op_clone(self, r: random.Random) -> None:
        src, dst = self._two()
        try:
            off_in = r.randrange(0, MAX_FILE // BLOCK) * BLOCK
            clone_range(src, off_in, r.randrange(1, 64) * BLOCK, dst,
                        r.randrange(0, MAX_FILE // BLOCK) * BLOCK)
        finally:
            os.close(src)
            os.close(dst)

    def op_dedupe(self, r: random.Random) -> None:
        src, dst = self._two()
        try:
            dedupe_range(src, r.randrange(0, 64) * BLOCK, r.randrange(1, 16) * BLOCK, dst,
                         r.randrange(0, 64) * BLOCK)
        finally:
            os.close(src)
            os.close(dst)

    def op_statfs(self, r: random.Random) -> None:
        os.statvfs(self.own)


OPS = sorted(name[3:] for name in vars(Worker) if name.startswith("op_"))


def run_proc(top: str, seed: int, proc: int, ops: int, log_dir: str) -> tuple[str | None, dict]:
    """One worker: `ops` operations; (error message or None, counts by op and errno)."""
    log_path = Path(log_dir) / f"fsstress-{seed}.p{proc}.log"
    w = Worker(Path(top), proc, seed, log_path)
    err = None
    try:
        for _ in range(ops):
            w.run_one()
    except OSError as exc:
        err = f"seed {seed}: {exc}; log {log_path}"
    finally:
        w.close()
    return err, {"ops": dict(w.ops), "errnos": dict(w.errnos)}


def statfs_alive(path: Path, timeout_s: float = 30.0) -> str | None:
    """statfs in a child process with a deadline: None if answered, else why not.

    A child, not a thread: a caller stuck in the kernel on a dead FUSE server
    cannot be joined, and would keep this process from exiting."""
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=os.statvfs, args=(str(path),), daemon=True)
    p.start()
    p.join(timeout_s)
    if p.is_alive():
        return f"statfs of {path} not answered within {timeout_s:.0f} s"
    if p.exitcode != 0:
        return f"statfs of {path} failed (child exit {p.exitcode})"
    return None


def run(top: Path, seed: int, ops: int, procs: int = 4, rounds: int = 1,
        log_dir: Path | None = None, deadline_s: float = 3600.0) -> tuple[list[str], dict]:
    """`rounds` rounds of `procs` workers x `ops` operations each, a liveness check
    (statfs with a timeout) after each round; return (errors, counts summed)."""
    log_dir = log_dir or top
    total: dict[str, Counter[str]] = {"ops": Counter(), "errnos": Counter()}
    errors: list[str] = []
    ctx = multiprocessing.get_context("fork")
    for rnd in range(rounds):
        rseed = seed * 100 + rnd
        with ctx.Pool(procs) as pool:
            pending = pool.starmap_async(run_proc, [(str(top), rseed, p, ops, str(log_dir))
                                                    for p in range(procs)])
            try:
                results = pending.get(timeout=deadline_s)
            except multiprocessing.TimeoutError:
                # The pool's terminate() cannot end a caller stuck in the kernel: say so
                # and leave it to the harness's unmount/abort.
                return [f"seed {rseed}: workers did not finish within {deadline_s:.0f} s "
                        f"(a request not answered?); logs in {log_dir}"], total
        for err, counts in results:
            if err:
                errors.append(err)
            total["ops"].update(counts["ops"])
            total["errnos"].update(counts["errnos"])
        why = statfs_alive(top)
        if why:
            errors.append(f"after round {rnd}: {why}")
        if errors:
            break
    return errors, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="a directory on the filesystem under test")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ops", type=int, default=1000, help="operations per process per round")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--log-dir", type=Path)
    ap.add_argument("--deadline", type=float, default=3600.0,
                    help="seconds a round may take before it counts as a hang")
    args = ap.parse_args()
    t0 = time.monotonic()
    errors, total = run(args.dir, args.seed, args.ops, args.procs, args.rounds, args.log_dir,
                        args.deadline)
    for e in errors:
        print(e, file=sys.stderr)
    n = sum(total["ops"].values())
    print(f"seed {args.seed}: {n} operations in {args.procs} process(es) x {args.rounds} "
          f"round(s), {time.monotonic() - t0:.0f} s: {'FAILED' if errors else 'all answered'}")
    print("  expected errnos: " + ", ".join(f"{k} {v}" for k, v in
                                            sorted(total["errnos"].items())))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
