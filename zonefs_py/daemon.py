"""Mount orchestration: options, device lock, daemonizing, serving, clean shutdown.

`run_mount(config)` is everything `zonefs-py mount` does after parsing:

  1. (unless foreground) double-fork; the parent waits on a pipe until the
     daemon reports "ready" or a one-line error, and exits 0 or 1 accordingly.
     Until it is ready the daemon keeps the caller's stderr, so libfuse's own
     messages are seen; then stdio goes to /dev/null.
  2. take the device lock (`DeviceLock`), open the device, `ZoneFS.load`
     (which runs crash recovery), `pyfuse3.init` (the mount(2) call);
  3. serve: `pyfuse3.main` plus the engine's `serve_background` plus a signal
     watcher, in one trio nursery;
  4. on `fusermount3 -u` / `umount` (the session ends) or SIGTERM / SIGINT
     (we call `pyfuse3.terminate`): unmount, then `fs.close()` (buffered data
     written, journal checkpointed, device flushed), release the lock, exit 0.

A `kill -9` skips step 4; the next mount's `ZoneFS.load` recovers.

Caveats:
  * After `umount` returns the daemon still runs `fs.close()`; a script that
    wants to reopen the device (fsck) must wait for the daemon to exit (the
    device lock is released last).
  * An exception from the engine's background task puts the mount in
    read-only failsafe instead of ending the daemon.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import logging.handlers
import os
import re
import signal
import stat
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import trio

from zonefs_py import errors
from zonefs_py.fs.options import FsOptions

log = logging.getLogger("zonefs_py.daemon")

#: FUSE/VFS options passed to libfuse unchanged (libfuse 3 `fuse_mount_opts` and mount flags).
FUSE_PASSTHROUGH = frozenset({
    "allow_other", "allow_root", "ro", "default_permissions",
    "dev", "nodev", "suid", "nosuid", "exec", "noexec", "sync", "async", "dirsync",
    "atime", "noatime", "diratime", "nodiratime", "relatime", "norelatime",
    "strictatime", "nostrictatime", "lazytime", "nolazytime",
})
#: FUSE options that take a value and are passed through.
FUSE_VALUED = frozenset({"fsname", "subtype"})
#: mount(8) / fstab options that mean nothing to the daemon and are dropped.
IGNORED = frozenset({
    "rw", "defaults", "auto", "noauto", "_netdev", "user", "users", "nouser", "owner",
    "group", "nofail", "loop", "silent", "loud",
})
#: Options of the daemon itself, with their help text.
DAEMON_OPTIONS = {
    "writeback_cache": "on|off: kernel writeback cache (default on; see DESIGN.md 4.3)",
    "max_tasks": "N: most FUSE requests handled at once (default 64)",
    "min_tasks": "N: FUSE request tasks kept waiting while idle (default 16, at most "
                 "max_tasks; fewer makes pyfuse3 start a task for most requests under load)",
    "attr_timeout": "S: seconds the kernel caches attributes and entries (default 60)",
    "readahead_kb": "N: kernel readahead window of the mount in KiB (default 4096; 0 keeps "
                    "the kernel's 128)",
    "max_background": "N: FUSE background requests (async reads, writeback) in flight "
                      "(default 64; the kernel's 12 lets O_DIRECT readers starve writeback; "
                      "0 keeps it)",
}
DEFAULT_SUBTYPE = "zonefs-py"


class MountError(Exception):
    """A one-line reason why the mount could not be set up."""


def parse_option_strings(option_strings: Iterable[str]) -> dict[str, str | None]:
    """Parse repeated `-o a,b=c` strings into an ordered name -> value dict."""
    opts: dict[str, str | None] = {}
    for option_string in option_strings:
        for item in option_string.split(","):
            item = item.strip()
            if not item:
                continue
            name, sep, value = item.partition("=")
            opts[name] = value if sep else None
    return opts


def is_ignored(name: str) -> bool:
    """True for fstab/mount(8) options that the daemon drops."""
    return name in IGNORED or name.startswith(("x-", "comment"))


@dataclass(slots=True)
class MountConfig:
    """Everything the daemon needs, parsed and validated."""

    device: str
    mountpoint: str
    fs_options: FsOptions
    fuse_options: set[str]
    foreground: bool = False
    log_level: str = "INFO"
    log_file: str | None = None
    writeback_cache: bool = True
    max_tasks: int = 64
    min_tasks: int = 16
    attr_timeout_s: float = 60.0
    readahead_kb: int = 4096
    max_background: int = 64
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, device: str, mountpoint: str, option_strings: Iterable[str],
              **kwargs: Any) -> MountConfig:
        """Validate paths and split `-o` options; raise MountError with a one-line reason."""
        device = os.path.abspath(device)
        mountpoint = os.path.abspath(mountpoint)
        if not os.path.exists(device):
            raise MountError(f"{device}: no such device or image")
        try:
            # statfs always reaches the filesystem (stat may be answered from the
            # kernel's cache), so a FUSE mount whose daemon died shows here.
            os.statvfs(mountpoint)
            is_dir = stat.S_ISDIR(os.stat(mountpoint).st_mode)
        except OSError as exc:
            if exc.errno == errno.ENOTCONN:
                raise MountError(f"{mountpoint}: stale FUSE mount (its daemon is gone); "
                                 f"run fusermount3 -u {mountpoint}") from None
            is_dir = False
        if not is_dir:
            raise MountError(f"{mountpoint}: mount point is not a directory")
        opts = parse_option_strings(option_strings)
        try:
            fs_options, rest = FsOptions.from_mount_options(opts)
        except ValueError as exc:
            raise MountError(str(exc)) from None
        cfg = cls(device=device, mountpoint=mountpoint, fs_options=fs_options,
                  fuse_options=set(), **kwargs)
        fsname, subtype = device, DEFAULT_SUBTYPE
        for name, value in rest.items():
            if is_ignored(name):
                continue
            if name in DAEMON_OPTIONS:
                cfg._set_daemon_option(name, value)
            elif name in FUSE_PASSTHROUGH and value is None:
                cfg.fuse_options.add(name)
            elif name == "fsname" and value:
                fsname = value
            elif name == "subtype" and value:
                subtype = value
            else:
                raise MountError(f"unknown mount option {name!r}"
                                 + ("" if value is None else f" (={value})"))
        cfg.min_tasks = min(cfg.min_tasks, cfg.max_tasks)
        cfg.fuse_options.add("default_permissions")  # always: the kernel checks modes
        cfg.fuse_options.add(f"fsname={fsname}")
        cfg.fuse_options.add(f"subtype={subtype}")
        return cfg

    def _set_daemon_option(self, name: str, value: str | None) -> None:
        if value is None:
            raise MountError(f"mount option {name} needs a value ({name}=...)")
        try:
            if name == "writeback_cache":
                if value not in ("on", "off", "1", "0"):
                    raise ValueError(value)
                self.writeback_cache = value in ("on", "1")
            elif name == "max_tasks":
                self.max_tasks = int(value)
                if self.max_tasks < 1:
                    raise ValueError(value)
            elif name == "min_tasks":
                self.min_tasks = int(value)
                if self.min_tasks < 1:
                    raise ValueError(value)
            elif name == "attr_timeout":
                self.attr_timeout_s = float(value)
                if self.attr_timeout_s < 0:
                    raise ValueError(value)
            elif name == "readahead_kb":
                self.readahead_kb = int(value)
                if not 0 <= self.readahead_kb <= 65536:
                    raise ValueError(value)
            elif name == "max_background":
                self.max_background = int(value)
                if not 0 <= self.max_background <= 65535:
                    raise ValueError(value)
        except ValueError:
            raise MountError(f"bad value for mount option {name}: {value!r}") from None


# -- device lock ---------------------------------------------------------------------------

def lock_dir() -> str:
    """Directory of the device lock files: /run/zonefs-py for root, else a per-user one."""
    if os.geteuid() == 0:
        return "/run/zonefs-py"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(runtime, "zonefs-py") if runtime else f"/tmp/zonefs-py-{os.geteuid()}"


class DeviceLock:
    """An exclusive flock on /run/zonefs-py/<device id>.lock, held while mounted.

    The id is the block device number (so two paths to one device collide) or
    the image file's (st_dev, st_ino). The file holds the daemon's pid. This
    complements the emulator's own flock on its image and covers block devices.
    """

    def __init__(self, device: str) -> None:
        st = os.stat(device)
        if stat.S_ISBLK(st.st_mode):
            key = f"blk-{os.major(st.st_rdev)}-{os.minor(st.st_rdev)}"
        else:
            key = f"file-{st.st_dev}-{st.st_ino}"
        self.device = device
        self.path = os.path.join(lock_dir(), key + ".lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise MountError naming the holder."""
        os.makedirs(os.path.dirname(self.path), mode=0o755, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise MountError(f"{self.device} is already mounted by zonefs-py "
                             f"(daemon pid {holder})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (the file stays; its content is only a hint)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None


# -- logging -------------------------------------------------------------------------------

def setup_logging(level: str, log_file: str | None, foreground: bool) -> str | None:
    """Configure the root logger; return a warning to show if daemon logs go nowhere."""
    handler: logging.Handler
    warning = None
    fmt = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s"
    if log_file:
        handler = logging.handlers.WatchedFileHandler(log_file)
    elif foreground:
        handler = logging.StreamHandler(sys.stderr)
    elif os.path.exists("/dev/log"):
        handler = logging.handlers.SysLogHandler("/dev/log")
        fmt = "zonefs-py[%(process)d]: %(levelname)s %(name)s: %(message)s"
    else:
        handler = logging.NullHandler()
        warning = "no syslog (/dev/log) here: daemon logs are discarded; use --log-file"
    handler.setFormatter(logging.Formatter(fmt, datefmt="%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise MountError(f"unknown log level {level!r}")
    root.setLevel(numeric)
    # pyfuse3 logs every worker start at DEBUG: keep it quiet unless asked.
    logging.getLogger("pyfuse3").setLevel(max(numeric, logging.INFO))
    return warning


# -- daemonizing ---------------------------------------------------------------------------

Reporter = Callable[[str | None], None]


def run_mount(cfg: MountConfig) -> int:
    """Mount and serve until unmounted; return the exit status of `zonefs-py mount`."""
    if cfg.foreground:
        try:
            setup_logging(cfg.log_level, cfg.log_file, foreground=True)
        except MountError as exc:
            print(f"zonefs-py: {exc}", file=sys.stderr)
            return 1
        return _serve_reporting(cfg, report=None)
    return _daemonize(cfg)


def _daemonize(cfg: MountConfig) -> int:
    """Double-fork; the original process waits for the daemon's ready line."""
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as pipe:
            line = pipe.readline().decode(errors="replace").strip()
        os.waitpid(pid, 0)
        if line == "OK":
            return 0
        if line.startswith("WARN "):
            print(f"zonefs-py: warning: {line[5:]}", file=sys.stderr)
            return 0
        msg = line[4:] if line.startswith("ERR ") else (
            "mount daemon exited before the mount was ready (see its log)")
        print(f"zonefs-py: {msg}", file=sys.stderr)
        return 1
    # First child: new session, then fork again so the daemon is no session leader.
    os.close(read_fd)
    try:
        os.setsid()
        if os.fork():
            os._exit(0)
        os.chdir("/")
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        pipe_w = os.fdopen(write_fd, "wb", buffering=0)
        reported = False

        def report(error: str | None) -> None:
            nonlocal reported
            if reported:
                return
            reported = True
            line = "OK" if error is None else f"ERR {error}"
            if error is None and log_warning:
                line = f"WARN {log_warning}"
            with contextlib.suppress(OSError):
                pipe_w.write(line.encode() + b"\n")
                pipe_w.close()
            # Ready or failed: let go of the caller's terminal / pipe.
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)

        try:
            log_warning = setup_logging(cfg.log_level, cfg.log_file, foreground=False)
        except (MountError, OSError) as exc:
            log_warning = None
            report(str(exc))
            os._exit(1)
        status = _serve_reporting(cfg, report)
        report("mount daemon stopped before it was ready")
    except BaseException:  # noqa: BLE001 - a forked child must never return to the caller
        logging.getLogger(__name__).exception("daemon crashed")
        os._exit(1)
    os._exit(status)


#: glibc mallopt() parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Allocations below this come from the heap, not a fresh mmap.
MALLOC_MMAP_THRESHOLD = 8 << 20
#: Free memory kept at the top of the heap before it is given back to the kernel.
MALLOC_TRIM_THRESHOLD = 128 << 20


def keep_buffers_warm() -> bool:
    """Make glibc reuse freed 1 MiB request buffers instead of unmapping them.

    pyfuse3 copies every WRITE into a new bytes object, and glibc serves
    blocks of 128 KiB and more (until its dynamic threshold grows) from
    fresh mmaps that are unmapped on free: every request then faults in
    256 new pages. On the 2-vCPU VM we measured, a no-op pyfuse3 server
    that allocates a new 1 MiB object per read drops from ~3 GB/s to
    ~0.6 GB/s. Serving them from the heap and keeping up to
    MALLOC_TRIM_THRESHOLD of freed memory reuses warm pages. It also keeps
    the heap from fragmenting: after a 2 GiB sequential write through the
    mount the daemon's RSS was 150-204 MB with these settings, 344 MB (peak
    445 MB) with glibc's defaults. Best effort: False where the C library
    has no mallopt (not glibc).
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)
                and mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD))


def _serve_reporting(cfg: MountConfig, report: Reporter | None) -> int:
    """Run the daemon; turn setup failures into one line (reported or printed)."""
    if not keep_buffers_warm():
        log.debug("mallopt unavailable: request buffers use the C library's defaults")
    try:
        return trio.run(serve, cfg, report or (lambda _err: None))
    except (MountError, errors.ZoneFSError, OSError, RuntimeError) as exc:
        msg = f"{cfg.device}: {exc}" if not isinstance(exc, MountError) else str(exc)
        if report is not None or cfg.log_file:
            # Into the log file / syslog; in the foreground without one, stderr gets one line.
            log.error("mount failed: %s", msg)
        if report is not None:
            report(msg)
        else:
            print(f"zonefs-py: {msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - a bug during setup: traceback to the log, one line out
        log.exception("mount failed with an internal error")
        msg = f"internal error: {type(exc).__name__}: {exc}"
        if report is not None:
            report(msg)
        else:
            print(f"zonefs-py: {msg}", file=sys.stderr)
        return 1


# -- serving -------------------------------------------------------------------------------

async def serve(cfg: MountConfig, report: Reporter) -> int:
    """Lock, open, recover, mount and serve until unmounted; return the exit status.

    Setup failures raise (MountError, a ZoneFSError, OSError, RuntimeError);
    `report(None)` is called once the kernel mount exists.
    """
    import pyfuse3

    from zonefs_py.device import open_device
    from zonefs_py.fs.filesystem import ZoneFS
    from zonefs_py.fuse_ops import Operations

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        lock = DeviceLock(cfg.device)
        lock.acquire()
        try:
            device = open_device(cfg.device, read_only=cfg.fs_options.read_only)
            try:
                log.info("loading %s (recovery runs if the last unmount was not clean)",
                         cfg.device)
                fs = await ZoneFS.load(device, cfg.fs_options)
                ops = Operations(fs, writeback_cache=cfg.writeback_cache,
                                 attr_timeout_s=cfg.attr_timeout_s,
                                 entry_timeout_s=cfg.attr_timeout_s,
                                 negative_timeout_s=cfg.attr_timeout_s)
                try:
                    pyfuse3.init(ops, cfg.mountpoint, cfg.fuse_options)
                except RuntimeError:
                    await fs.close()
                    raise MountError(f"{cfg.mountpoint}: the FUSE mount failed "
                                     "(libfuse's message is above)") from None
                log.info("mounted %s on %s (options %s, writeback_cache=%s, max_tasks=%d, "
                         "min_tasks=%d)",
                         cfg.device, cfg.mountpoint, ",".join(sorted(cfg.fuse_options)),
                         cfg.writeback_cache, cfg.max_tasks, cfg.min_tasks)
                report(None)
                return await _serve_mounted(cfg, fs, ops, signals)
            finally:
                device.close()
        finally:
            lock.release()


async def _tune_after_init(cfg: MountConfig) -> None:
    """Set the readahead window and background limits once FUSE INIT is done.

    The kernel sets both at INIT (pyfuse3 offers no way to choose them then).
    A statvfs from a worker thread returns only after the FUSE loop answered
    INIT and then the STATFS itself.
    """
    try:
        await trio.to_thread.run_sync(os.statvfs, cfg.mountpoint, abandon_on_cancel=True)
    except OSError as exc:
        log.warning("could not tune the FUSE connection of %s: %s", cfg.mountpoint, exc)
        return
    if cfg.readahead_kb:
        await trio.to_thread.run_sync(set_readahead, cfg.mountpoint, cfg.readahead_kb)
    if cfg.max_background:
        await trio.to_thread.run_sync(set_max_background, cfg.mountpoint, cfg.max_background)


def _unescape_mountinfo(field: str) -> str:
    r"""Undo mountinfo's octal escapes (a space is \040, a backslash \134)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mount_dev(mountpoint: str, mountinfo: str = "/proc/self/mountinfo") -> str:
    """The mount's device number "major:minor", from /proc/self/mountinfo
    (the last mount on `mountpoint`: the one on top)."""
    # The kernel records the path with symlinks resolved.
    wanted = {mountpoint, os.path.realpath(mountpoint)}
    dev = None
    with open(mountinfo, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and _unescape_mountinfo(fields[4]) in wanted:
                dev = fields[2]
    if dev is None:
        raise OSError(f"{mountpoint} not found in /proc/self/mountinfo")
    return dev


FUSECTL = "/sys/fs/fuse/connections"


def set_max_background(mountpoint: str, limit: int) -> None:
    """Raise the connection's background request limit (best effort, needs root).

    Async O_DIRECT reads and page writeback both travel as FUSE background
    requests, at most `max_background` (kernel default 12) in flight; past
    `congestion_threshold` (9) the bdi counts as congested. A QD16 O_DIRECT
    reader then holds every slot and a buffered writer waits in
    balance_dirty_pages: measured 10 MB/s for the writer against 147 MB/s with
    64. The knobs live in fusectl, mounted here if it is not.
    """
    try:
        minor = _mount_dev(mountpoint).split(":")[1]
        conn = os.path.join(FUSECTL, minor)
        if not os.path.isdir(conn) and os.geteuid() == 0:
            subprocess.run(["mount", "-t", "fusectl", "fusectl", FUSECTL], check=False,
                           capture_output=True, timeout=10)
        if not os.path.isdir(conn):
            raise OSError(f"{conn} is missing (fusectl not mounted, or not root)")
        threshold = max(1, limit * 3 // 4)
        with open(os.path.join(conn, "max_background"), "w") as f:
            f.write(str(limit))
        with open(os.path.join(conn, "congestion_threshold"), "w") as f:
            f.write(str(threshold))
        log.info("FUSE background limit %d, congestion threshold %d", limit, threshold)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("could not raise the FUSE background limit of %s: %s (O_DIRECT "
                    "readers may slow buffered writers)", mountpoint, exc)


def set_readahead(mountpoint: str, kib: int) -> None:
    """Widen the kernel's readahead window for this FUSE mount (best effort).

    The kernel gives a FUSE mount a 128 KiB window, so a sequential reader
    sends 128 KiB requests; 4 MiB lets it send 1 MiB requests (max_read) and
    keep several in flight: checkpoint restore measured 179 -> 580 MB/s. The
    mount's bdi is named by its device number, read from /proc/self/mountinfo.
    """
    try:
        dev = _mount_dev(mountpoint)
        with open(f"/sys/class/bdi/{dev}/read_ahead_kb", "w") as f:
            f.write(str(kib))
    except OSError as exc:
        log.warning("could not set the readahead window of %s: %s", mountpoint, exc)


async def _serve_mounted(cfg: MountConfig, fs: Any, ops: Any, signals: Any) -> int:
    """Run the FUSE loop, the engine's background work and the signal watcher; shut down."""
    import pyfuse3

    status = 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_run_background, fs, ops)
        if getattr(fs, "drain", None) is not None:  # uploads to an object store (drain/)
            from zonefs_py.drain.drainer import Drainer

            nursery.start_soon(Drainer(fs.drain).run)
        nursery.start_soon(_watch_signals, signals)
        nursery.start_soon(_tune_after_init, cfg)
        try:
            # pyfuse3 ends a task that finds more than min_tasks others waiting
            # for a request, and starts one whenever none waits: with min_tasks=1
            # a queue-depth-16 reader made it start and end a task per request or
            # so (Nursery.start_soon and the idle tasks' lock hand-offs in py-spy).
            await pyfuse3.main(min_tasks=cfg.min_tasks, max_tasks=cfg.max_tasks)
        except OSError as exc:
            # An unmount racing requests still in flight (e.g. RELEASEDIR of many
            # descriptors closed just before fusermount3 -u) aborts the session with
            # ECONNABORTED instead of ENODEV: it ended all the same.
            if exc.errno != errno.ECONNABORTED:
                raise
            log.info("FUSE session aborted by the unmount (%s)", exc)
        finally:
            # Unmount first so no request can arrive, then make everything durable.
            with trio.CancelScope(shield=True):
                pyfuse3.close(unmount=True)
                log.info("unmounted %s; closing the filesystem", cfg.mountpoint)
                try:
                    await fs.close()
                except Exception:  # noqa: BLE001 - report, exit non-zero, recovery on next mount
                    log.exception("closing the filesystem failed; the next mount will recover")
                    status = 1
                nursery.cancel_scope.cancel()
    if status == 0:
        log.info("clean shutdown of %s", cfg.device)
    return status


async def _run_background(fs: Any, ops: Any) -> None:
    """Run the engine's periodic work; a crash there puts the mount in failsafe."""
    try:
        await fs.serve_background()
    except Exception as exc:  # noqa: BLE001 - the failsafe boundary for background work
        ops.failsafe(f"background task failed: {type(exc).__name__}: {exc}", exc)


async def _watch_signals(signals: Any) -> None:
    """SIGTERM / SIGINT end the FUSE loop (then the clean shutdown runs); SIGHUP is ignored."""
    import pyfuse3

    async for signum in signals:
        if signum == signal.SIGHUP:
            log.info("SIGHUP ignored (the daemon has no terminal)")
            continue
        log.info("%s received: unmounting", signal.Signals(signum).name)
        pyfuse3.terminate()
