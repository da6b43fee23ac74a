"""`zonefs-py fsck DEVICE [--repair]`: check every invariant of docs/DESIGN.md.

Exit status as fsck(8): 0 clean, 1 errors corrected, 4 errors left uncorrected,
8 operational error, 16 usage error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from zonefs_py import errors
from zonefs_py.progress import progress_printer


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fsck", help="check (and repair) a zonefs-py filesystem",
                       description="Check every numbered invariant of a zonefs-py filesystem. "
                       "Exit status: 0 clean, 1 corrected, 4 uncorrected, 8 operational error, "
                       "16 usage.")
    p.add_argument("device", help="zoned block device or emulator image (not mounted)")
    p.add_argument("--repair", action="store_true", help="fix what can be fixed safely")
    p.add_argument("--no-data", action="store_true",
                   help="skip reading every data block to verify its checksum (a format 5 "
                   "image's namespace index is streamed in bounded memory either way)")
    p.add_argument("--quiet", "-q", action="store_true", help="print only problems")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from zonefs_py.device import open_device
    from zonefs_py.fsck import check_filesystem, repair_filesystem

    try:
        dev = open_device(args.device, read_only=not args.repair)
    except (errors.ZoneFSError, OSError) as exc:
        print(f"zonefs-py fsck: {exc}", file=sys.stderr)
        return 8
    bars: dict[str, Callable[[int, int], None] | None] = {}

    def show(what: str, done: int, total: int) -> None:
        """One progress line per phase ("replaying the log", "checking data")."""
        if what not in bars:
            bars[what] = (progress_printer("checking data", "blocks") if what == "data"
                          else progress_printer(what, "B"))
        bar = bars[what]
        if bar is not None:
            bar(done, total)

    progress = show if sys.stderr.isatty() else None
    try:
        report = check_filesystem(dev, check_data=not args.no_data, progress=progress)
        for f in report.findings:
            print(f"{f.invariant}: {f.message}")
        if report.clean:
            if not args.quiet:
                print(f"{args.device}: clean ({report.inodes} inodes, {report.extents} extents, "
                      f"{report.data_blocks_checked} data blocks verified)")
            return 0
        if report.fatal and report.findings[0].invariant == "INV-1":
            return 8 if "no zonefs-py superblock" in report.findings[0].message else 4
        if not args.repair:
            print(f"{args.device}: {len(report.findings)} problem(s) found; "
                  "run 'zonefs-py fsck --repair' to fix what can be fixed")
            return 4
        fixed = repair_filesystem(dev)
        for line in fixed:
            print(f"repaired: {line}")
        after = check_filesystem(dev, check_data=not args.no_data)
        for f in after.findings:
            print(f"still wrong: {f.invariant}: {f.message}")
        return 1 if after.clean else 4
    except (errors.ZoneFSError, OSError) as exc:
        print(f"zonefs-py fsck: {exc}", file=sys.stderr)
        return 8
    finally:
        dev.close()
