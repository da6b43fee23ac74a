"""Tuning of a fresh FUSE connection, and the proof that the mount serves.

`wait_serving` returns once the kernel's INIT reached the adapter (its `init`
handler ran; libfuse answers INIT right after it); then the readahead window
and background limits are set (best effort: they need root and fusectl, and
only warn when they cannot be set).

The daemon never sends a request to its own mount: a thread of the daemon
waiting for an answer of its own mount cannot exit, and once the request is
read from /dev/fuse (the C dispatcher reads every request as it arrives) the
kernel waits for that answer uninterruptibly, so a SIGKILL then left a zombie
holding /dev/fuse open and the mount hung until its connection was aborted
(seen in the integration tests when the proof of serving was a statvfs).
Everything here reads /proc and sysfs.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import time
from typing import Any

import trio

from zonefs_py.daemon.options import MountConfig, MountError

log = logging.getLogger("zonefs_py.daemon")


async def wait_serving(cfg: MountConfig, initialized: trio.Event) -> None:
    """Return once the kernel's INIT reached the adapter (`initialized`, set by its
    `init` handler); raise MountError if the mount went away before."""
    missed = 0  # a read of mountinfo can miss an entry while other mounts change
    while not initialized.is_set():
        with trio.move_on_after(1.0):
            await initialized.wait()
        if initialized.is_set():
            break
        present = await trio.to_thread.run_sync(_in_mountinfo, cfg.mountpoint)
        missed = 0 if present else missed + 1
        if missed >= 3:
            raise MountError(f"{cfg.mountpoint}: the new mount went away before it "
                             "answered the kernel's INIT")


def _resolved(mountpoint: str) -> str:
    """`mountpoint` with symlinks resolved in its parent only: realpath(3) of the
    mount point itself would lstat it, a request to this daemon's mount."""
    head, tail = os.path.split(os.path.abspath(mountpoint))
    return os.path.join(os.path.realpath(head), tail)


def _in_mountinfo(mountpoint: str, mountinfo: str = "/proc/self/mountinfo") -> bool:
    """True if `mountpoint` is a mount in /proc/self/mountinfo (no request to it)."""
    wanted = {mountpoint, _resolved(mountpoint)}
    with open(mountinfo, encoding="utf-8", errors="surrogateescape") as f:
        return any(len(fields) > 4 and _unescape_mountinfo(fields[4]) in wanted
                   for fields in (line.split() for line in f))


async def tune_after_init(cfg: MountConfig) -> None:
    """Set the readahead window and background limits once FUSE INIT is done.

    The kernel sets both at INIT (pyfuse3 offers no way to choose them then).
    """
    if cfg.readahead_kb:
        await trio.to_thread.run_sync(set_readahead, cfg.mountpoint, cfg.readahead_kb)
    if cfg.max_background:
        await trio.to_thread.run_sync(set_max_background, cfg.mountpoint, cfg.max_background)


def _unescape_mountinfo(field: str) -> str:
    r"""Undo mountinfo's octal escapes (a space is \040, a backslash \134)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


class MountGone(OSError):
    """The mount point is no longer a mount: it was unmounted before it was tuned
    (a short-lived mount; logged at debug level, not as a warning)."""


def _mount_dev(mountpoint: str, mountinfo: str = "/proc/self/mountinfo") -> str:
    """The mount's device number "major:minor", from /proc/self/mountinfo (the
    last mount on `mountpoint`: the one on top). Never stat(2): that would be a
    request to this daemon's own mount (module docstring)."""
    # The kernel records the path with symlinks resolved.
    wanted = {mountpoint, _resolved(mountpoint)}
    # A read of mountinfo can miss entries while other mounts come and go (seen in
    # test runs beside other mounting sessions): read it up to three times.
    for _ in range(3):
        dev = None
        with open(mountinfo, encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4 and _unescape_mountinfo(fields[4]) in wanted:
                    dev = fields[2]
        if dev is not None:
            return dev
    raise MountGone(f"{mountpoint} not found in /proc/self/mountinfo")


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
        # The threshold first: the kernel bounds it by its own ceiling, not by
        # max_background, so whoever sees the new limit sees the new threshold.
        with open(os.path.join(conn, "congestion_threshold"), "w") as f:
            f.write(str(threshold))
        with open(os.path.join(conn, "max_background"), "w") as f:
            f.write(str(limit))
        log.info("FUSE background limit %d, congestion threshold %d", limit, threshold)
    except MountGone as exc:
        log.debug("not raising the FUSE background limit: %s (unmounted already)", exc)
    except (OSError, subprocess.SubprocessError) as exc:
        if not _in_mountinfo(mountpoint):  # unmounted meanwhile: its fusectl dir went too
            log.debug("not raising the FUSE background limit: %s (unmounted already)", exc)
            return
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
    except MountGone as exc:
        log.debug("not setting the readahead window: %s (unmounted already)", exc)
    except OSError as exc:
        if not _in_mountinfo(mountpoint):  # unmounted meanwhile: its bdi went too
            log.debug("not setting the readahead window: %s (unmounted already)", exc)
            return
        log.warning("could not set the readahead window of %s: %s", mountpoint, exc)


# -- the kernel's dirty limit for the mount (the write gate, issue 42) ----------------

#: sysfs's scale for max_ratio_fine: parts per million of the global dirty limit.
RATIO_FINE_SCALE = 1_000_000


def dirty_max_bytes(proc_sys_vm: str = "/proc/sys/vm",
                    meminfo: str = "/proc/meminfo") -> int:
    """The most the kernel's global dirty limit can be: vm.dirty_bytes when set, else
    vm.dirty_ratio percent of all memory (the dirtyable memory it is taken of, free
    and file pages, is never more)."""
    with open(os.path.join(proc_sys_vm, "dirty_bytes")) as f:
        dirty_bytes = int(f.read())
    if dirty_bytes:
        return dirty_bytes
    with open(os.path.join(proc_sys_vm, "dirty_ratio")) as f:
        ratio = int(f.read())
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 * ratio // 100
    raise OSError(f"no MemTotal in {meminfo}")


class BdiLimit:
    """The mount's dirty limit in /sys/class/bdi/<dev>: the bound of what the kernel
    may hold dirty or under writeback for it (the FUSE bdi is strictlimit).

    The limit is a share of the global dirty limit (`max_ratio_fine`, ppm; the
    kernel gives FUSE 1%), which moves with free memory: its upper bound is that
    share of `dirty_max_bytes`. Writing `max_ratio_fine` needs root.
    """

    def __init__(self, bdi_dir: str, dirty_max: int) -> None:
        self.dir = bdi_dir
        self.dirty_max = dirty_max

    def _read(self, name: str) -> str:
        with open(os.path.join(self.dir, name)) as f:
            return f.read().strip()

    def _write(self, name: str, value: int) -> None:
        with open(os.path.join(self.dir, name), "w") as f:
            f.write(str(value))

    def ratio_fine(self) -> int:
        try:
            return int(self._read("max_ratio_fine"))
        except FileNotFoundError:  # before Linux 6.2: whole percents only
            return int(self._read("max_ratio")) * (RATIO_FINE_SCALE // 100)

    def bound_bytes(self) -> int:
        """The most the limit now in effect can come to, in bytes."""
        if self._read("strict_limit") != "1":
            # Without strictlimit a device may run past its share while the machine
            # is under its background limit: only the global limit bounds it.
            return self.dirty_max
        return self.ratio_fine() * self.dirty_max // RATIO_FINE_SCALE

    def tunable(self) -> bool:
        """Whether the limit can be set (root; Linux >= 6.2 for the fine ratio)."""
        try:
            self._write("max_ratio_fine", self.ratio_fine())
        except OSError:
            return False
        return True

    def set(self, limit_bytes: int) -> int | None:
        """Set the limit to at most `limit_bytes`; return the bound now in effect
        (None, and a warning, if it could not be set). Blocking (sysfs)."""
        ratio = max(1, limit_bytes * RATIO_FINE_SCALE // self.dirty_max)
        try:
            self._write("max_ratio_fine", ratio)
            return self.bound_bytes()
        except OSError as exc:
            if os.path.isdir(self.dir):
                log.warning("could not set the dirty limit in %s: %s", self.dir, exc)
            else:  # the mount went away meanwhile
                log.debug("could not set the dirty limit in %s: %s", self.dir, exc)
            return None


def open_bdi_limit(mountpoint: str) -> BdiLimit | None:
    """The mount's `BdiLimit`, or None (logged) when its bdi cannot be read.
    Call from a worker thread (it reads sysfs, and may sleep a little)."""
    for attempt in range(3):
        dev = "?"
        try:
            dev = _mount_dev(mountpoint)
            bdi = BdiLimit(f"/sys/class/bdi/{dev}", dirty_max_bytes())
            bdi.bound_bytes()
            return bdi
        except MountGone as exc:
            log.debug("no write gate: %s (unmounted already)", exc)
            return None
        except (OSError, ValueError) as exc:
            # A mount stopped right after it started takes its bdi away (ENOENT,
            # ENODEV from sysfs) while mountinfo may still list it for a moment:
            # look again shortly, and warn only about a live mount's missing knob.
            if attempt < 2:
                time.sleep(0.2)
                continue
            _warn_if_live(mountpoint, dev, exc)
    return None


def _warn_if_live(mountpoint: str, dev: str, exc: Exception) -> None:
    """Warn that the mount has no write gate, unless the mount is gone (a mount
    stopped right after it started takes its bdi away mid-read: that is no fault)."""
    if _in_mountinfo(mountpoint) and os.path.isdir(f"/sys/class/bdi/{dev}"):
        log.warning("no write gate (write(2) near full is not refused): the dirty "
                    "limit of %s cannot be read: %s", mountpoint, exc)
    else:
        log.debug("no write gate: %s (unmounted meanwhile)", exc)


async def setup_write_gate(cfg: MountConfig, ops: Any) -> None:
    """Give the engine's write gate the kernel's dirty limit for the mount, and the
    adapter a way to set it (when root); nothing without the writeback cache."""
    gate = ops.write_gate
    if not cfg.writeback_cache or gate.gate is None:
        return
    bdi = await trio.to_thread.run_sync(open_bdi_limit, cfg.mountpoint)
    if bdi is None:
        return
    try:
        default = await trio.to_thread.run_sync(bdi.bound_bytes)
        tunable = await trio.to_thread.run_sync(bdi.tunable)
    except (OSError, ValueError) as exc:  # the mount went away meanwhile, or a bad file
        dev = os.path.basename(bdi.dir)
        await trio.to_thread.run_sync(_warn_if_live, cfg.mountpoint, dev, exc)
        return
    if tunable:
        gate.set_limit = bdi.set
    gate.gate.configure(default, tunable)
    log.info("write gate: the kernel may hold %d MiB dirty for the mount%s; write(2) "
             "gets ENOSPC once under %.1f MiB are free", default >> 20,
             " (lowered as the device fills)" if tunable else " (not settable)",
             gate.gate.full_refuse_below_bytes / (1 << 20))


async def run_write_gate(cfg: MountConfig, ops: Any, serving: trio.Event) -> None:
    """Once the mount serves (its write gate set up by `setup_write_gate` before it
    reported ready), run the gate for the mount's life (`zonefs_py.writegate`)."""
    await serving.wait()
    await ops.write_gate.run()
