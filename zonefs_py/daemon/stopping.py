"""Stopping the FUSE loop in bounded time, even with a request that never returns
(issue 42; DESIGN 4.5).

pyfuse3 runs each request's handler inside one of its loop tasks, and
`pyfuse3.main` returns only once every loop task has: `pyfuse3.terminate()`
stops the idle ones, but a task whose handler never returns kept the daemon
from ever reaching its clean close (SIGTERM logged and nothing more; the
unmount unnoticed). `Stopper` bounds that: a stop (SIGTERM / SIGINT, the
session's end, an unmount with requests stuck) ends the loop at once where it
can, and after `grace_s` cancels the loop and the FALLOCATE / COPY_FILE_RANGE
tasks still running (`loop_scope`). The daemon then closes the session while
nothing runs a handler: its callers get ECONNABORTED from the kernel (or the
error their cancelled handler answered) instead of waiting for good, and the
clean close (buffered data, checkpoint) runs as usual. A last resort,
`HARD_DEADLINE_S` after the stop began, ends the process without the close
(the next mount recovers), for a close that cannot finish.

`watch_unmount` notices an unmount the kernel does not tell us about: a lazy
unmount (`umount -l`, `fusermount3 -uz`) of a mount where a caller sits in a
request that was never answered (its open file keeps the connection alive,
so the session never ends; a plain unmount is EBUSY then). Once our mount
(its device number) is gone from /proc/self/mountinfo it reads the kernel's
count of unanswered requests (`/sys/fs/fuse/connections/N/waiting`): while
files stay open and requests come and go the daemon serves on, as the kernel
expects after a lazy unmount; when requests have waited for `grace_s` with
none arriving and no byte written to the device (a long fsync writes), or
the connection is gone, it stops.

Caveats: the watch polls once a second (only a file read); without fusectl
(/sys/fs/fuse/connections) a lazily unmounted mount with a stuck request is
seen only by SIGTERM; a daemon in a mount namespace of its own sees unmounts
of that namespace only.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import trio

log = logging.getLogger("zonefs_py.daemon")

#: Seconds between two looks at the mount table once serving.
POLL_S = 1.0
#: Seconds the clean close (buffered data, checkpoint, flush) may take after a stop.
CLOSE_DEADLINE_S = 60.0
#: Seconds after a stop began at which the process ends anyway (the grace added).
HARD_DEADLINE_S = 90.0
FUSECTL = "/sys/fs/fuse/connections"


class Stopper:
    """Ends the FUSE loop for a stop, within `grace_s` even if a handler never returns.

    Run the loop (`pyfuse3.main` and the nursery of fuseext's requests) inside
    `loop_scope`, call `loop_ended()` after it, and `finished()` once the close
    is over. `stop()` never awaits.
    """

    def __init__(self, nursery: trio.Nursery, grace_s: float, closing: trio.Event,
                 terminate: Callable[[], None]) -> None:
        self.nursery = nursery
        self.grace_s = grace_s
        #: Set once the session is being closed: terminating then crashed (serve.py).
        self.closing = closing
        self._terminate = terminate
        self.loop_scope = trio.CancelScope()
        #: Why the stop began (None: not stopping).
        self.reason: str | None = None
        #: Handlers cancelled by the grace's end (status, tests).
        self.cancelled = False
        #: Set by `watch_unmount` once our mount is in no mount table (nothing to unmount).
        self.detached = False
        self._loop_done = False
        self._hard: threading.Timer | None = None

    def stop(self, reason: str, terminate: bool = True, grace_s: float | None = None) -> None:
        """Begin a stop (once): end the loop (`terminate`: pyfuse3.terminate; False
        when the session already ended), cancel what still runs after `grace_s`
        (None: the mount's)."""
        if self.reason is not None or self.closing.is_set():
            return
        self.reason = reason
        if terminate:
            self._terminate()
        if not self._loop_done:
            self.nursery.start_soon(self._cancel_after_grace,
                                    self.grace_s if grace_s is None else grace_s)
        self._hard = threading.Timer(self.grace_s + HARD_DEADLINE_S, self._give_up)
        self._hard.daemon = True
        self._hard.start()

    def loop_ended(self) -> None:
        """The loop and every request task of it are over."""
        self._loop_done = True

    def finished(self) -> None:
        """The close is over: the last resort is not needed."""
        if self._hard is not None:
            self._hard.cancel()

    async def _cancel_after_grace(self, grace_s: float) -> None:
        await trio.sleep(grace_s)
        if self._loop_done:
            return
        log.warning("stopping (%s): requests still unanswered %g s later: cancelled, "
                    "their callers get an error", self.reason, grace_s)
        self.cancelled = True
        self.loop_scope.cancel()

    def _give_up(self) -> None:
        log.error("stopping (%s): not done %g s later: exiting without a clean close "
                  "(the next mount recovers)", self.reason, self.grace_s + HARD_DEADLINE_S)
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        os._exit(1)


def mount_device(mountpoint: str) -> str | None:
    """The device number ("0:NN") of the FUSE mount at `mountpoint` (a path without
    symlinks: resolved before the mount), the last mounted there, from
    /proc/self/mountinfo; None if there is none."""
    found = None
    target = _escape(mountpoint)
    for fields in _mountinfo():
        if fields[4] == target and _fstype(fields).startswith("fuse"):
            found = fields[2]
    return found


def is_mounted(device: str) -> bool:
    """Whether any mount of device number `device` is in our mount table."""
    return any(fields[2] == device for fields in _mountinfo())


def unanswered(device: str) -> int | None:
    """The kernel's count of the connection's requests not yet answered (fusectl's
    `waiting`); None if the connection is gone or fusectl is not mounted."""
    major, _, minor = device.partition(":")
    if major != "0":
        return None
    try:
        with open(f"{FUSECTL}/{minor}/waiting") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def has_fusectl() -> bool:
    return os.path.isdir(FUSECTL) and bool(os.listdir(FUSECTL))


async def watch_unmount(mountpoint: str, stopper: Stopper, serving: trio.Event,
                        progress: Callable[[], int]) -> None:
    """Stop once our mount left the mount table and its connection is gone, or its
    requests wait unanswered with none arriving for `stopper.grace_s` (module
    docstring). `mountpoint`: its path with symlinks resolved *before* the
    mount: nothing here may touch the mount (a stat of it from the trio thread
    would wait for an answer only this thread can give). `progress`: a number
    that moves while the daemon gets anywhere (requests received, bytes
    written to the device). The device number is read at once: the mount is in the
    table from the moment pyfuse3 mounted, while `serving` comes after the tuning
    and the write gate's setup, by which time a quick `umount -l` may have taken
    the entry away (a loaded CI run met that)."""
    device = mount_device(mountpoint)
    await serving.wait()
    if device is None:
        log.info("%s not found in /proc/self/mountinfo: unmounts are seen only when the "
                 "session ends", mountpoint)
        return
    detached_logged = False
    stuck_since: float | None = None
    last = progress()
    while True:
        await trio.sleep(POLL_S)
        if is_mounted(device):
            continue
        if not detached_logged:
            detached_logged = stopper.detached = True
            log.info("%s (%s) is no longer in the mount table (lazy unmount?): serving "
                     "the files still open", mountpoint, device)
        waiting = unanswered(device)
        if waiting is None:
            if has_fusectl():
                stopper.stop(f"{mountpoint} unmounted, its FUSE connection gone")
                return
            continue
        now, count = trio.current_time(), progress()
        if waiting > 0 and count == last:
            stuck_since = now if stuck_since is None else stuck_since
            if now - stuck_since >= stopper.grace_s:  # they had their grace: cancel now
                stopper.stop(f"{mountpoint} unmounted with {waiting} request(s) unanswered "
                             f"for {now - stuck_since:.0f} s", grace_s=0)
                return
        else:
            stuck_since = None
        last = count


def _mountinfo() -> list[list[str]]:
    with open("/proc/self/mountinfo") as f:
        return [line.split() for line in f]


def _fstype(fields: list[str]) -> str:
    """The filesystem type of a mountinfo line (the field after the " - ")."""
    try:
        return fields[fields.index("-") + 1]
    except (ValueError, IndexError):
        return ""


def _escape(path: str) -> str:
    """A path as mountinfo writes it (space, tab, newline, backslash octal-escaped)."""
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in path)
