"""The mount daemon: `run_mount(config)` is everything `zonefs-py mount` does after parsing.

One job per module:

  * `options`:   `-o` strings -> a validated `MountConfig` (or `MountError`);
  * `daemonize`: fork away from the caller, wait for the daemon's ready line,
                 logging to a file (`default_log_file`) or stderr;
  * `serve`:     lock, load (recovery), FUSE init, the request loop, shutdown;
  * `tuning`:    prove the fresh mount serves, then tune its FUSE connection;
  * `runstate`:  the device lock and the state record `zonefs-py stat` reads.
"""

from __future__ import annotations

import sys

from zonefs_py.daemon.daemonize import daemonize, setup_logging
from zonefs_py.daemon.options import DAEMON_OPTIONS, MountConfig, MountError
from zonefs_py.daemon.runstate import DeviceLock
from zonefs_py.daemon.serve import serve_reporting


def run_mount(cfg: MountConfig) -> int:
    """Mount and serve until unmounted (`-f`) or until ready (daemon); return the exit status."""
    if cfg.foreground:
        try:
            setup_logging(cfg.log_level, cfg.log_file)
        except MountError as exc:
            print(f"zonefs-py: {exc}", file=sys.stderr)
            return 1
        return serve_reporting(cfg, report=None)
    return daemonize(cfg, serve_reporting)


__all__ = ["DAEMON_OPTIONS", "DeviceLock", "MountConfig", "MountError", "run_mount"]
