"""`zonefs-py emu`: create and inspect emulated zoned device images.

    zonefs-py emu create IMAGE --size 4G --zone-size 64M [--zone-capacity 48M]
                         [--conventional N] [--max-open 14] [--max-active 14]
                         [--block-size 4096] [--discard-data] [--force]
    zonefs-py emu info IMAGE
    zonefs-py emu report IMAGE [--json]

Errors are one line on stderr with exit status 1 (2 for usage errors, from
argparse). `info` and `report` open the image read-only and take no lock, so
they work on an image in use and show its last flushed state.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from typing import Any

from zonefs_py.device.base import ZoneCond
from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.errors import Busy, DeviceRefused

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Parse "4G", "64M", "512K", "4096" (binary units; optional trailing "B" or "iB").

    Raises argparse.ArgumentTypeError for anything else.
    """
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (use e.g. 4096, 512K, 64M, 4G)")
    return int(match.group(1)) * _SUFFIX[match.group(2).upper()]


def _fmt_size(nbytes: int) -> str:
    for unit, mult in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= mult and nbytes % mult == 0:
            return f"{nbytes // mult}{unit}"
    return str(nbytes)


def register(subparsers: Any) -> None:
    """Add the `emu` subcommand and its `create` / `info` / `report` actions."""
    parser = subparsers.add_parser("emu", help="create and inspect emulated zoned device images")
    sub = parser.add_subparsers(dest="emu_command", metavar="ACTION")
    parser.set_defaults(func=lambda _args: _usage(parser))

    create = sub.add_parser("create", help="create a sparse emulated zoned device image")
    create.add_argument("image")
    create.add_argument("--size", type=parse_size, required=True, help="device size, e.g. 4G")
    create.add_argument("--zone-size", type=parse_size, required=True, help="e.g. 64M")
    create.add_argument("--zone-capacity", type=parse_size, default=None,
                        help="writable bytes per sequential zone (default: zone size)")
    create.add_argument("--conventional", type=int, default=0, metavar="N",
                        help="number of conventional zones at the start (default 0)")
    create.add_argument("--max-open", type=int, default=0, help="0 = no limit (default)")
    create.add_argument("--max-active", type=int, default=0, help="0 = no limit (default)")
    create.add_argument("--block-size", type=parse_size, default=4096)
    create.add_argument("--discard-data", action="store_true",
                        help="keep zone states, metadata zones and non-zero blocks but do "
                             "not store the all-zero blocks of data zones (they stay holes); "
                             "for benchmarks writing zeros at sizes the backing disk cannot "
                             "hold (needs a file system that can punch holes)")
    create.add_argument("--force", action="store_true", help="overwrite an existing file")
    create.set_defaults(func=cmd_create)

    info = sub.add_parser("info", help="print geometry and zone counts by condition")
    info.add_argument("image")
    info.set_defaults(func=cmd_info)

    report = sub.add_parser("report", help="list every zone")
    report.add_argument("image")
    report.add_argument("--json", action="store_true", help="print JSON instead of a table")
    report.set_defaults(func=cmd_report)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _fail(msg: str) -> int:
    print(f"zonefs-py emu: {msg}", file=sys.stderr)
    return 1


def cmd_create(args: argparse.Namespace) -> int:
    """Create the image; return the exit status."""
    try:
        dev = EmulatedZonedDevice.create(
            args.image, size_bytes=args.size, zone_size_bytes=args.zone_size,
            zone_capacity_bytes=args.zone_capacity, nr_conventional=args.conventional,
            max_open=args.max_open, max_active=args.max_active, block_size=args.block_size,
            overwrite=args.force, discard_data=args.discard_data,
        )
    except FileExistsError:
        return _fail(f"{args.image} exists (use --force to overwrite it)")
    except ValueError as exc:
        return _fail(str(exc))
    except (Busy, DeviceRefused) as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"{args.image}: {exc.strerror or exc}")
    with dev:
        info = dev.info
        print(f"created {args.image}: {info.nr_zones} zones of {_fmt_size(info.zone_size_bytes)}"
              f" ({_fmt_size(dev.geometry.zone_capacity_bytes)} capacity), "
              f"{dev.geometry.nr_conventional} conventional, "
              f"{'O_DIRECT' if dev.direct_io else 'buffered'} I/O"
              + (", data zones discarded after mkfs" if args.discard_data else ""))
    return 0


def _open_ro(image: str) -> EmulatedZonedDevice | str:
    try:
        return EmulatedZonedDevice.open(image, read_only=True)
    except (DeviceRefused, Busy) as exc:
        return str(exc)
    except OSError as exc:
        return f"{image}: {exc.strerror or exc}"


def cmd_info(args: argparse.Namespace) -> int:
    """Print geometry and zone counts by condition; return the exit status."""
    dev = _open_ro(args.image)
    if isinstance(dev, str):
        return _fail(dev)
    with dev:
        geo, zones, discard = dev.geometry, dev.report_zones(), dev.discard
    counts = collections.Counter(z.cond for z in zones)
    written = sum(z.written_bytes for z in zones if z.is_sequential)
    print(f"image:           {args.image}")
    print(f"size:            {_fmt_size(geo.zone_size_bytes * geo.nr_zones)}")
    print(f"block size:      {geo.block_size}")
    print(f"zone size:       {_fmt_size(geo.zone_size_bytes)}")
    print(f"zone capacity:   {_fmt_size(geo.zone_capacity_bytes)}")
    print(f"zones:           {geo.nr_zones} ({geo.nr_conventional} conventional)")
    print(f"max open:        {geo.max_open or 'no limit'}")
    print(f"max active:      {geo.max_active or 'no limit'}")
    print(f"written (seq):   {_fmt_size(written)}")
    if discard.enabled:
        where = ("no zone yet (mkfs declares the data zones)"
                 if discard.first_zone >= geo.nr_zones else f"zones >= {discard.first_zone}")
        print(f"discard data:    {where}")
    for cond in ZoneCond:
        if counts[cond]:
            print(f"  {cond.name:<14} {counts[cond]}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Print one line (or JSON object) per zone; return the exit status."""
    dev = _open_ro(args.image)
    if isinstance(dev, str):
        return _fail(dev)
    with dev:
        rows: list[dict[str, Any]] = [
            {"zone": z.index, "start": z.start_bytes, "size": z.size_bytes,
             "capacity": z.capacity_bytes, "wp": z.wp_bytes, "type": z.type.name,
             "cond": z.cond.name, "resets": dev.reset_count(z.index)}
            for z in dev.report_zones()
        ]
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    print(f"{'zone':>6} {'start':>14} {'wp(rel)':>12} {'capacity':>10} {'type':<18} "
          f"{'cond':<14} {'resets':>6}")
    for r in rows:
        print(f"{r['zone']:>6} {r['start']:>14} {r['wp'] - r['start']:>12} {r['capacity']:>10} "
              f"{r['type']:<18} {r['cond']:<14} {r['resets']:>6}")
    return 0
