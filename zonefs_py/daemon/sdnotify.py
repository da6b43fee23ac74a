"""systemd's service notification protocol (sd_notify(3)), spoken by the daemon itself.

When systemd starts `zonefs-py mount -f` from a `Type=notify` unit it sets
`$NOTIFY_SOCKET` (a path, or `@name` in the abstract namespace) and, with
`WatchdogSec=`, `$WATCHDOG_USEC` (and `$WATCHDOG_PID`). The daemon sends
newline-separated `KEY=VALUE` datagrams there:

  * `STATUS=loading ...` while the device is opened and the log replayed;
  * `READY=1` with a `STATUS=serving ...` line at the very moment a
    daemonizing mount would exit 0 (the mount answered INIT and a statfs,
    the connection is tuned: `serve._become_ready`);
  * `WATCHDOG=1` every half `$WATCHDOG_USEC`, from the trio loop (a loop
    stuck in a handler stops pinging and systemd restarts the unit), and
    the `STATUS=` line refreshed every `STATUS_REFRESH_S`;
  * `STOPPING=1` when the FUSE session ends (unmount or SIGTERM), before
    the filesystem is closed (checkpoint, flush);
  * `STATUS=failed: <reason>` when the mount fails.

Why our own ~30 lines rather than a package: the protocol is one
`sendto()` of a datagram on an AF_UNIX socket. The pure-Python `sdnotify`
package has had no release since 2017, hides send errors unless in debug
mode and knows nothing of the watchdog variables; `systemd-python` and
`cysystemd` build against libsystemd's headers (a C dependency and a
build step for a single syscall).

`$NOTIFY_SOCKET` and the watchdog variables are removed from the
environment once read (as `sd_notify(unset_environment=1)` does), so child
processes (fusermount3) never talk to systemd in our name. Sending is best
effort: a failure is logged once and never ends the mount. `vsock:`
addresses (systemd 253+, for VMs) are not supported: logged and ignored.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, MutableMapping

import trio

log = logging.getLogger("zonefs_py.daemon")

#: Seconds between refreshes of the `STATUS=` line while serving.
STATUS_REFRESH_S = 30.0
ENV_NAMES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Notifier:
    """The daemon's side of sd_notify: `send("READY=1", "STATUS=...")` and a watchdog.

    Does nothing (every method returns at once) when `$NOTIFY_SOCKET` was
    not set. Not thread-safe; called from the trio thread only.
    """

    def __init__(self, environ: MutableMapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        raw = env.get("NOTIFY_SOCKET", "")
        usec, wd_pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        for name in ENV_NAMES:
            env.pop(name, None)
        self.address: str | None = None
        if raw.startswith("@"):
            self.address = "\0" + raw[1:]  # abstract namespace
        elif raw.startswith("/"):
            self.address = raw
        elif raw:
            log.warning("NOTIFY_SOCKET=%s is not a unix socket address; not notifying", raw)
        #: Seconds between WATCHDOG=1 pings, None without a watchdog for this process.
        self.watchdog_interval_s: float | None = None
        if usec.isdigit() and int(usec) > 0 and (not wd_pid or wd_pid == str(os.getpid())):
            self.watchdog_interval_s = int(usec) / 1e6 / 2
        self._sock: socket.socket | None = None
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> bool:
        """Send `fields` (each `KEY=VALUE`, no newline inside) as one datagram; True if sent."""
        if self.address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(fields).encode(errors="replace"), self.address)
        except OSError as exc:
            if not self._warned:
                log.warning("cannot notify systemd at NOTIFY_SOCKET: %s", exc)
                self._warned = True
            return False
        return True

    def status(self, line: str) -> bool:
        """Send a one-line `STATUS=` (newlines folded)."""
        return self.send("STATUS=" + " ".join(line.split()))

    async def run(self, serving: trio.Event, status_line: Callable[[], str]) -> None:
        """Once `serving` is set, ping the watchdog and refresh STATUS= until cancelled."""
        if self.address is None:
            return
        await serving.wait()
        step = min(self.watchdog_interval_s or STATUS_REFRESH_S, STATUS_REFRESH_S)
        since_status = 0.0
        while True:
            await trio.sleep(step)
            since_status += step
            fields = ["WATCHDOG=1"] if self.watchdog_interval_s else []
            if since_status >= STATUS_REFRESH_S:
                since_status = 0.0
                try:
                    fields.append("STATUS=" + " ".join(status_line().split()))
                except Exception:  # noqa: BLE001 - a status line must never end the mount
                    log.exception("building the systemd status line failed")
            if fields:
                self.send(*fields)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

