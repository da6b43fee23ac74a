"""`zonefs-py mkfs DEVICE [--label L] [--force] [--root-owner UID:GID]`.

Exit 0 ok, 8 operational error, 16 usage.
"""

from __future__ import annotations

import argparse
import os
import sys

from zonefs_py import errors
from zonefs_py.progress import progress_printer


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("mkfs", help="create a zonefs-py filesystem on a zoned device",
                       description="Create a zonefs-py filesystem on a zoned block device or "
                       "emulator image. Exit status: 0 done, 8 operational error, 16 usage.")
    p.add_argument("device", help="zoned block device or emulator image")
    p.add_argument("--label", default="", help="filesystem label (at most 64 bytes)")
    p.add_argument("--force", action="store_true",
                   help="overwrite a device that already holds data or a filesystem")
    p.add_argument("--meta-zones", type=int, default=None,
                   help="zones for the metadata log and the namespace index (default: 3%% "
                        "of zones, at least 6 for format 5, 4 for format 4)")
    p.add_argument("--reserve", type=float, default=5.0, metavar="PERCENT",
                   help="over-provisioning kept free for the cleaner (default 5%%)")
    p.add_argument("--format", type=int, choices=(4, 5), default=None, dest="disk_version",
                   help="on-disk format: 5 (the default where the device has room for 6 meta "
                        "zones): the namespace in an on-device index, memory and checkpoints "
                        "that do not grow with the number of files; 4: the whole namespace in "
                        "memory and in every checkpoint (the default on smaller devices)")
    p.add_argument("--root-owner", metavar="UID:GID", type=parse_owner, default=None,
                   help="owner of the root directory (default: the user running mkfs, "
                        "as mke2fs does)")
    p.set_defaults(func=run)


def parse_owner(value: str) -> tuple[int, int]:
    """Parse `UID:GID` (numbers) for --root-owner."""
    uid_s, sep, gid_s = value.partition(":")
    try:
        if not sep:
            raise ValueError(value)
        uid, gid = int(uid_s), int(gid_s)
        if not (0 <= uid < 2**32 - 1 and 0 <= gid < 2**32 - 1):
            raise ValueError(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected UID:GID (numbers), got {value!r}") from None
    return uid, gid


def run(args: argparse.Namespace) -> int:
    from zonefs_py.device import open_device
    from zonefs_py.fs.mkfs import make_filesystem

    try:
        dev = open_device(args.device)
    except (errors.ZoneFSError, OSError) as exc:
        print(f"zonefs-py mkfs: {exc}", file=sys.stderr)
        return 8
    uid, gid = args.root_owner or (os.getuid(), os.getgid())
    try:
        sb = make_filesystem(dev, args.label.encode(), meta_zones=args.meta_zones,
                             reserve_percent=args.reserve, force=args.force,
                             progress=progress_printer("resetting zones", "zones"),
                             root_uid=uid, root_gid=gid, disk_version=args.disk_version)
    except errors.InvalidArgument as exc:
        print(f"zonefs-py mkfs: {exc}", file=sys.stderr)
        return 16
    except (errors.ZoneFSError, OSError) as exc:
        print(f"zonefs-py mkfs: {exc}", file=sys.stderr)
        return 8
    finally:
        dev.close()
    data_mib = sb.data_zone_count * sb.zone_size >> 20
    print(f"zonefs-py filesystem {sb.uuid_str} on {args.device}: {sb.nr_zones} zones of "
          f"{sb.zone_size >> 20} MiB, {sb.meta_zone_count} metadata zones, "
          f"{sb.data_zone_count} data zones ({data_mib} MiB), on-disk format "
          f"{sb.disk_version}")
    return 0
