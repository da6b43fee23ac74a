"""Tuning of a fresh FUSE connection, and the proof that the mount serves.

`wait_serving` returns once the kernel's INIT was answered and a STATFS too
(a statvfs from a worker thread returns only then); then the readahead
window and background limits are set (best effort: they need root and
fusectl, and only warn when they cannot be set).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess

import trio

from zonefs_py.daemon.options import MountConfig, MountError

log = logging.getLogger("zonefs_py.daemon")


async def wait_serving(cfg: MountConfig) -> None:
    """Return once the mount answered INIT and a STATFS; raise MountError if it failed."""
    try:
        await trio.to_thread.run_sync(os.statvfs, cfg.mountpoint, abandon_on_cancel=True)
    except OSError as exc:
        raise MountError(f"{cfg.mountpoint}: the new mount does not answer statfs: "
                         f"{exc.strerror or exc}") from None


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
    """The mount's device number "major:minor", from /proc/self/mountinfo
    (the last mount on `mountpoint`: the one on top), else from stat(2).
    Call it from a worker thread: the stat reaches this daemon."""
    # The kernel records the path with symlinks resolved.
    wanted = {mountpoint, os.path.realpath(mountpoint)}
    dev = None
    with open(mountinfo, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and _unescape_mountinfo(fields[4]) in wanted:
                dev = fields[2]
    if dev is None:
        # A read of mountinfo can miss entries while other mounts come and go (seen
        # in test runs beside other mounting sessions). stat(2) of the mount point
        # names the same device; it is answered by this daemon, so it is called
        # from a worker thread (as every caller here is), never the trio thread.
        if not os.path.ismount(mountpoint):
            raise MountGone(f"{mountpoint} not found in /proc/self/mountinfo")
        st = os.stat(mountpoint)
        dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
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
        if not os.path.ismount(mountpoint):  # unmounted meanwhile: its fusectl dir went too
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
        if not os.path.ismount(mountpoint):  # unmounted meanwhile: its bdi went too
            log.debug("not setting the readahead window: %s (unmounted already)", exc)
            return
        log.warning("could not set the readahead window of %s: %s", mountpoint, exc)
