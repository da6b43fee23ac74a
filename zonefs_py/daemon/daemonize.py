"""Daemonizing: fork away from the caller, report readiness through a pipe, log to a file.

`zonefs-py mount` (not `-f`) double-forks. The original process waits on a
pipe for one line from the daemon, `OK` or `ERR <reason>`, and exits 0 or 1;
if the pipe closes with no line (the daemon died), it exits 1 and names the
log file. The daemon writes `OK` only once the mount is serving (see
`serve.serve`). Until then it keeps the caller's stderr, so libfuse's own
messages are seen; then stdio goes to /dev/null and everything goes to the
log file: `--log-file`, else `default_log_file()` (never nowhere).

Under systemd (`$JOURNAL_STREAM` names our stderr) a foreground daemon
without `--log-file` logs to stderr without timestamps or pids (journald
adds them) and with a `<N>` syslog priority prefix per record, so
`journalctl -p warning` works (`logs_to_journal`, `JournalFormatter`).
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from zonefs_py.daemon.options import MountConfig, MountError

#: `report(None)` once serving, `report("reason")` on failure; only the first call counts.
Reporter = Callable[[str | None], None]


def default_log_file(device: str) -> str:
    """The log of the daemon of `device` when no --log-file is given.

    Root: /var/log/zonefs-py/<device name>.log. Others:
    $XDG_STATE_HOME/zonefs-py/<device name>.log (~/.local/state by default).
    """
    name = os.path.basename(device.rstrip("/")) or "device"
    if os.geteuid() == 0:
        base = "/var/log/zonefs-py"
    else:
        state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
        base = os.path.join(state, "zonefs-py")
    return os.path.join(base, name + ".log")


def logs_to_journal(log_file: str | None) -> bool:
    """True when logging goes to stderr and stderr is systemd's journal stream.

    systemd sets `$JOURNAL_STREAM=DEV:INODE` for a service whose stderr (or
    stdout) is connected to the journal; it only counts if fd 2 is that file
    (a child whose stderr was redirected inherits the variable too).
    """
    if log_file:
        return False
    dev, sep, ino = os.environ.get("JOURNAL_STREAM", "").partition(":")
    if not (sep and dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(2)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


class JournalFormatter(logging.Formatter):
    """`<priority>logger: message`, the form journald reads from a service's stderr."""

    PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4),
                  (logging.INFO, 6))

    def __init__(self) -> None:
        super().__init__("%(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        prio = next((p for level, p in self.PRIORITIES if record.levelno >= level), 7)
        # Each line of a traceback is its own journal entry: give them all the priority.
        return f"<{prio}>" + super().format(record).replace("\n", f"\n<{prio}>")


def setup_logging(level: str, log_file: str | None) -> None:
    """Send the root logger to `log_file` (created with its directory), or stderr if None
    (in journald's form when stderr is the journal: `logs_to_journal`).

    Raises MountError for an unknown level or a log file that cannot be opened.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise MountError(f"unknown log level {level!r}")
    handler: logging.Handler
    if log_file:
        try:
            os.makedirs(os.path.dirname(log_file), mode=0o755, exist_ok=True)
            handler = logging.handlers.WatchedFileHandler(log_file)
        except OSError as exc:
            raise MountError(f"cannot open the log file {log_file}: {exc.strerror} "
                             "(choose one with --log-file)") from None
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JournalFormatter() if logs_to_journal(log_file) else logging.Formatter(
        "%(asctime)s.%(msecs)03d %(levelname)s %(name)s[%(process)d]: %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    # pyfuse3 logs every worker start at DEBUG: keep it quiet unless asked.
    logging.getLogger("pyfuse3").setLevel(max(numeric, logging.INFO))


def daemonize(cfg: MountConfig, serve: Callable[[MountConfig, Reporter], int]) -> int:
    """Double-fork and run `serve(cfg, report)` in the daemon; return the caller's status.

    The caller's status is 0 once the daemon reported ready, else 1 with the
    reason on stderr.
    """
    log_file = cfg.log_file or default_log_file(cfg.device)
    cfg.log_file = log_file
    try:  # open it here too, so a bad path is reported before forking
        setup_logging(cfg.log_level, log_file)
    except MountError as exc:
        print(f"zonefs-py: {exc}", file=sys.stderr)
        return 1
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
        msg = (line[4:] if line.startswith("ERR ")
               else "mount daemon died before the mount was ready")
        print(f"zonefs-py: {msg} (log: {log_file})", file=sys.stderr)
        return 1
    os.close(read_fd)
    _run_daemon(cfg, serve, write_fd)


def _run_daemon(cfg: MountConfig, serve: Callable[[MountConfig, Reporter], int],
                write_fd: int) -> NoReturn:
    """The first child: new session, fork again (no session leader), serve, never return."""
    status = 1
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
            with contextlib.suppress(OSError):
                pipe_w.write(b"OK\n" if error is None else f"ERR {error}\n".encode())
                pipe_w.close()
            # Ready or failed: let go of the caller's terminal / pipe.
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)

        status = serve(cfg, report)
        report("mount daemon stopped before it was ready")
    except BaseException:  # noqa: BLE001 - a forked child must never return to the caller
        logging.getLogger(__name__).exception("daemon crashed")
        os._exit(1)
    logging.shutdown()
    os._exit(status)
