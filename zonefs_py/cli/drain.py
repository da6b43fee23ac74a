"""`zonefs-py drain status|pause|resume MOUNT`, `zonefs-py fetch|evict PATH...`.

* `drain status` prints the drain section of the mount's status (queue,
  lag, bytes drained, errors, files by state); `--json` for the raw object.
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

from zonefs_py.cli.stat import read_status, render

CTL_XATTR = "trusted.zonefs.ctl"
STATE_XATTR = "user.zonefs.state"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `drain`, `fetch` and `evict` subcommands."""
    p = subparsers.add_parser("drain", help="show or control uploads to the object store")
    p.add_argument("action", choices=("status", "pause", "resume"))
    p.add_argument("mountpoint", metavar="MOUNT")
    p.add_argument("--json", action="store_true", help="status: print the raw JSON object")
    p.set_defaults(func=run_drain)
    for name, word, text in (("fetch", "drained", "restore evicted files from the store now"),
                             ("evict", "evicted", "drop the local copy of drained files")):
        q = subparsers.add_parser(name, help=text)
        q.add_argument("paths", nargs="+", metavar="PATH")
        q.set_defaults(func=run_state, word=word, cmd=name)


def run_drain(args: argparse.Namespace) -> int:
    try:
        if args.action == "status":
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
