"""`zonefs-py drain status|pause|resume MOUNT`, `zonefs-py fetch|evict PATH...`.

* `drain status` prints the drain section of the mount's status (queue,
  lag, bytes drained, errors, files by state); `--json` for the raw object.
  `--wait` first waits until nothing is queued or uploading (exit 0; 1 if the
  store refuses the credentials meanwhile), with a progress bar of the bytes
  still to upload on a terminal (tqdm if installed, else a one-line counter),
  silent otherwise.
* `drain pause` / `drain resume` stop and restart uploads (resume also
  retries at once after a store or credentials error). Root only, through
  the control xattr `trusted.zonefs.ctl` of the mount root.
* `fetch PATH...` brings evicted files back now (reading them would too);
  `evict PATH...` drops the local copy of drained files now. Both write the
  file's `user.zonefs.state` xattr, so they need write permission on the
  file, not root; a file that is not drained cannot be evicted (EBUSY).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from zonefs_py.cli.stat import read_status, render
from zonefs_py.model.drain import STATE_XATTR

CTL_XATTR = "trusted.zonefs.ctl"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `drain`, `fetch` and `evict` subcommands."""
    p = subparsers.add_parser("drain", help="show or control uploads to the object store")
    p.add_argument("action", choices=("status", "pause", "resume"))
    p.add_argument("mountpoint", metavar="MOUNT")
    p.add_argument("--json", action="store_true", help="status: print the raw JSON object")
    p.add_argument("--wait", action="store_true",
                   help="status: wait until nothing is queued or uploading (progress on a tty)")
    p.set_defaults(func=run_drain)
    for name, word, text in (("fetch", "drained", "restore evicted files from the store now"),
                             ("evict", "evicted", "drop the local copy of drained files")):
        q = subparsers.add_parser(name, help=text)
        q.add_argument("paths", nargs="+", metavar="PATH")
        q.set_defaults(func=run_state, word=word, cmd=name)


def run_drain(args: argparse.Namespace) -> int:
    try:
        if args.action == "status":
            if getattr(args, "wait", False) and not wait_drained(args.mountpoint):
                return 1
            drain = read_status(args.mountpoint).get("drain", {})
            print(json.dumps(drain, indent=2, sort_keys=True) if args.json
                  else render({"drain": drain}), end="" if not args.json else "\n")
            return 0
        os.setxattr(args.mountpoint, CTL_XATTR, f"drain-{args.action}".encode())
        return 0
    except RuntimeError as exc:
        print(f"zonefs-py drain: {exc}", file=sys.stderr)
    except OSError as exc:
        print(f"zonefs-py drain {args.action}: {args.mountpoint}: {exc.strerror}",
              file=sys.stderr)
    return 1


WAIT_POLL_S = 0.5


def _pending(drain: dict[str, Any]) -> bool:
    return bool(drain.get("queue_files") or drain.get("uploading_files")
                or drain.get("uploading"))


def _progress_bar(total: int) -> tuple[Callable[[int, int], None], Callable[[], None]] | None:
    """(update(done, total), close) of a progress bar on stderr, or None if it is no tty."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        from zonefs_py.progress import progress_printer

        show = progress_printer("drain (bytes)")
        return (show, lambda: None) if show is not None else None
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="drain",
               file=sys.stderr)

    def update(done: int, new_total: int) -> None:
        bar.total = new_total
        bar.n = done
        bar.refresh()

    return update, bar.close


def wait_drained(mountpoint: str) -> bool:
    """Wait until the mount has nothing queued or uploading; False on an auth error.

    The bar counts bytes the store received (parts sent or found stored) against
    what was queued or uploading at the start, plus what was queued since."""
    drain = read_status(mountpoint).get("drain", {})
    start = int(drain.get("bytes_uploaded", 0))
    total = int(drain.get("queue_bytes", 0)) + int(drain.get("uploading_bytes", 0))
    bar = _progress_bar(total) if _pending(drain) else None
    try:
        while _pending(drain):
            if drain.get("auth_error"):
                print(f"zonefs-py drain: the store refuses the credentials: "
                      f"{drain['auth_error']}", file=sys.stderr)
                return False
            time.sleep(WAIT_POLL_S)
            drain = read_status(mountpoint).get("drain", {})
            done = int(drain.get("bytes_uploaded", 0)) - start
            left = int(drain.get("queue_bytes", 0)) + int(drain.get("uploading_bytes", 0))
            total = max(total, done + left if _pending(drain) else done)
            if bar is not None:
                bar[0](min(done, total), total)
    finally:
        if bar is not None:
            bar[1]()
    return True


def run_state(args: argparse.Namespace) -> int:
    from zonefs_py.progress import FileProgress

    status = 0
    # A fetch waits for the store: a bar on a terminal (zonefs_py/progress.py).
    bar = FileProgress("fetching", args.paths if args.cmd == "fetch" else [])
    try:
        for path in args.paths:
            try:
                bar.run(path, os.setxattr, path, STATE_XATTR, args.word.encode())
            except OSError as exc:
                print(f"zonefs-py {args.cmd}: {path}: {exc.strerror}", file=sys.stderr)
                status = 1
    finally:
        bar.close()
    return status
