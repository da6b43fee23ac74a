"""What a running daemon leaves on disk: its device lock and its state record.

Both live in `lock_dir()` (/run/zonefs-py for root, $XDG_RUNTIME_DIR/zonefs-py
or /tmp/zonefs-py-UID otherwise), named after the device's identity:

  * `<key>.lock`: an exclusive flock held while mounted, holding the pid.
  * `<key>.json`: the state record: device, mount point, pid, log file, and
    the last fatal error once the daemon dies of one. `zonefs-py stat` reads
    it to say where the log is and why a mount is gone (a dead daemon can no
    longer answer the status xattr).

Tidy: a clean unmount removes both. A daemon that failed or was killed
leaves its record (that is how `stat` can say why) but not a held lock.
`sweep_stale`, run by every mount and every `stat`, removes what no live
daemon holds and nothing needs: lock files nobody has locked, records of
daemons that stopped cleanly, records whose device is gone (a deleted
image) and temporary files of dead writers. A failed or killed daemon's
record stays until the next mount of its device replaces it.

Light on imports on purpose: `zonefs-py stat` uses it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import time
from typing import Any


class LockHeld(Exception):
    """The device is already mounted by another daemon (message names its pid)."""


def lock_dir() -> str:
    """Directory of the lock and state files: /run/zonefs-py for root, else a per-user one."""
    if os.geteuid() == 0:
        return "/run/zonefs-py"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(runtime, "zonefs-py") if runtime else f"/tmp/zonefs-py-{os.geteuid()}"


def device_key(device: str) -> str:
    """The block device number (two paths to one device collide) or the image's inode."""
    st = os.stat(device)
    if stat.S_ISBLK(st.st_mode):
        return f"blk-{os.major(st.st_rdev)}-{os.minor(st.st_rdev)}"
    return f"file-{st.st_dev}-{st.st_ino}"


class DeviceLock:
    """An exclusive flock on `lock_dir()/<device key>.lock`, held while mounted.

    The file holds the daemon's pid. This complements the emulator's own
    flock on its image and covers block devices.
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self.path = os.path.join(lock_dir(), device_key(device) + ".lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise LockHeld naming the holder.

        A clean unmount unlinks the file while holding it (`release(remove=True)`)
        and so may a sweep of stale files (`sweep_stale`): a lock taken on a file
        that is no longer the one at `path` is dropped and taken again.
        """
        os.makedirs(os.path.dirname(self.path), mode=0o755, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise LockHeld(f"{self.device} is already mounted by zonefs-py "
                               f"(daemon pid {holder})") from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # unlinked after we opened it: take the one there now
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self, remove: bool = False) -> None:
        """Drop the lock; with `remove` (a clean unmount) unlink the file first."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                if remove and _same_file(self._fd, self.path):
                    os.unlink(self.path)
                else:
                    os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None


def _same_file(fd: int, path: str) -> bool:
    """True if `path` names the file open as `fd`."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


class RunState:
    """The state record of one daemon; written only once it holds the device lock."""

    def __init__(self, device: str, mountpoint: str, log_file: str | None) -> None:
        self.fields: dict[str, Any] = {"device": device, "mountpoint": mountpoint,
                                       "log_file": log_file}
        self.path: str | None = None

    def claim(self, lock: DeviceLock) -> None:
        """Start recording (the caller holds `lock`): a fresh record with our pid."""
        self.path = lock.path[:-len(".lock")] + ".json"
        self.update(pid=os.getpid(), started=time.time(), state="starting", last_error=None)

    def update(self, **fields: Any) -> None:
        """Merge `fields` and rewrite the record atomically (best effort; no-op unclaimed)."""
        self.fields.update(fields)
        if self.path is None:
            return
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with contextlib.suppress(OSError):
            with open(tmp, "w") as f:
                json.dump(self.fields, f, sort_keys=True)
            os.replace(tmp, self.path)

    def remove(self) -> None:
        """Delete the record (a clean unmount: nothing is left to explain)."""
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.path = None


def find_state(mountpoint: str) -> dict[str, Any] | None:
    """The newest state record (in this user's lock_dir) whose mount point is `mountpoint`."""
    wanted = {os.path.abspath(mountpoint), os.path.realpath(mountpoint)}
    best: dict[str, Any] | None = None
    try:
        names = os.listdir(lock_dir())
    except OSError:
        return None
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(lock_dir(), name)) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("mountpoint") in wanted and (
                best is None or doc.get("started", 0) > best.get("started", 0)):
            best = doc
    return best


def pid_alive(pid: object) -> bool:
    """True if `pid` names a live process (one we may signal or not)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: str | None = None) -> list[str]:
    """Remove stale entries of `directory` (default `lock_dir()`); return their names.

    Stale: a `.lock` no process holds (checked by taking it; unlinked while
    held, so a daemon that opened it meanwhile retries, `DeviceLock.acquire`),
    a `.json` record whose daemon is dead and that stopped cleanly or whose
    device no longer exists (or is another file now), a `.tmp` of a dead
    pid. Never raises: a sweep is housekeeping.
    """
    directory = directory or lock_dir()
    removed: list[str] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return removed
    for name in names:
        path = os.path.join(directory, name)
        try:
            if name.endswith(".lock"):
                stale = _sweep_lock(path)  # unlinks it itself, under the lock
            elif name.endswith((".json", ".tmp")):
                stale = (_record_stale(path, name[:-len(".json")]) if name.endswith(".json")
                         else not pid_alive(_tmp_pid(name)))
                if stale:
                    os.unlink(path)
            else:
                stale = False
            if stale:
                removed.append(name)
        except OSError:
            continue
    return removed


def _sweep_lock(path: str) -> bool:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live daemon holds it
        if not _same_file(fd, path):
            return False
        os.unlink(path)
        return True
    finally:
        os.close(fd)


def _record_stale(path: str, key: str) -> bool:
    try:
        with open(path) as f:
            doc = json.load(f)
    except ValueError:
        doc = {}
    if not isinstance(doc, dict):
        doc = {}
    if pid_alive(doc.get("pid")) and doc.get("state") not in ("stopped", "failed"):
        return False
    if doc.get("state") == "stopped" and not doc.get("last_error"):
        return True
    device = doc.get("device")
    try:
        return not isinstance(device, str) or device_key(device) != key
    except OSError:
        return True  # the device (an image, most often) is gone


def _tmp_pid(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[-2]) if len(parts) >= 3 and parts[-2].isdigit() else None
