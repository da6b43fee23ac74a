"""`zonefs-py stat MOUNTPOINT [--json]`: live figures of a mounted filesystem.

Reads the virtual xattr `trusted.zonefs.status` of the mount root (see
`zonefs_py.control`): zones by condition, capacity, used and free space,
user bytes vs device bytes (write amplification), per-stream figures,
journal and cleaner state, and the daemon's own state (pid, failsafe).
Needs root (the kernel keeps `trusted.*` for CAP_SYS_ADMIN).

Human output is plain text: one section per top-level object, aligned
`key  value` lines, lists of objects as tables, byte counts humanised.
The layout follows whatever `fs.status()` returns, so new engine figures
show up without changes here.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from typing import Any

STATUS_XATTR = "trusted.zonefs.status"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `stat` subcommand."""
    p = subparsers.add_parser("stat", help="show live figures of a mounted filesystem",
                              description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("--json", action="store_true", help="print the raw JSON document")
    p.set_defaults(func=run)


def read_status(mountpoint: str) -> dict[str, Any]:
    """Return the status document of the zonefs-py mount at `mountpoint`.

    Raises SystemExit-worthy `RuntimeError` with a one-line message otherwise.
    """
    if not os.path.ismount(mountpoint):
        raise RuntimeError(f"{mountpoint} is not a mount point")
    try:
        blob = os.getxattr(mountpoint, STATUS_XATTR)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.EOPNOTSUPP, errno.ENOTSUP):
            hint = "" if os.geteuid() == 0 else " (or you are not root)"
            raise RuntimeError(f"{mountpoint} is not a zonefs-py mount{hint}") from None
        if exc.errno in (errno.EPERM, errno.EACCES):
            raise RuntimeError("zonefs-py stat needs root") from None
        raise RuntimeError(f"{mountpoint}: {exc.strerror}") from None
    doc: dict[str, Any] = json.loads(blob)
    return doc


def run(args: argparse.Namespace) -> int:
    """Entry point of `zonefs-py stat`."""
    try:
        doc = read_status(args.mountpoint)
    except RuntimeError as exc:
        print(f"zonefs-py stat: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        print(render(doc), end="")
    return 0


# -- rendering ----------------------------------------------------------------------------

#: Sections shown first, in this order; the rest follow alphabetically.
SECTION_ORDER = ("device", "filesystem", "zones_by_condition", "zones_by_role", "zones",
                 "space", "streams", "journal", "cleaner", "wear", "daemon")
#: Legend of the engine's one-character-per-zone map.
ZONE_MAP_LEGEND = ("S superblock, M/m metadata (used/empty), . empty data, d/D data "
                   "(partly/fully written), x dead awaiting reset, ! read-only/offline, "
                   "c conventional")


def human_bytes(n: int) -> str:
    """Format a byte count as '1.5 GiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_value(key: str, value: Any) -> str:
    """Format one scalar; keys that name bytes are humanised."""
    if isinstance(value, bool) or value is None:
        return {True: "yes", False: "no", None: "-"}[value]
    if isinstance(value, int) and ("bytes" in key or key.endswith("_size")):
        return f"{human_bytes(value)} ({value})"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def with_write_amplification(section: dict[str, Any]) -> dict[str, Any]:
    """Add `write_amplification` when a section has user and device byte counts but no ratio."""
    if "write_amplification" in section:
        return section
    user = next((v for k, v in section.items() if k.startswith("user_bytes")), None)
    dev = next((v for k, v in section.items() if k.startswith("device_bytes")), None)
    if isinstance(user, int) and isinstance(dev, int) and user > 0:
        return {**section, "write_amplification": dev / user}
    return section


def render_table(rows: list[dict[str, Any]], indent: str) -> list[str]:
    """Render a list of objects as an aligned table."""
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    cells = [[format_value(c, row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = [indent + "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += [indent + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True))
              for r in cells]
    return [line.rstrip() for line in lines]


def render_mapping(obj: dict[str, Any], indent: str) -> list[str]:
    """Render an object: scalars as aligned lines, nested objects and lists below them."""
    obj = with_write_amplification(obj)
    lines: list[str] = []
    scalars = {k: v for k, v in obj.items() if not isinstance(v, dict | list)}
    if scalars:
        width = max(len(k) for k in scalars)
        lines += [f"{indent}{k.ljust(width)}  {format_value(k, v)}" for k, v in scalars.items()]
    for key, value in obj.items():
        if isinstance(value, dict):
            lines.append(f"{indent}{key}:")
            lines += render_mapping(value, indent + "  ") or [indent + "  -"]
        elif isinstance(value, list):
            lines.append(f"{indent}{key}:")
            if value and all(isinstance(v, dict) for v in value):
                lines += render_table(value, indent + "  ")
            else:
                lines.append(indent + "  " + (", ".join(map(str, value)) or "-"))
    return lines


def render(doc: dict[str, Any]) -> str:
    """Render the whole status document as readable text."""
    keys = [k for k in SECTION_ORDER if k in doc] + sorted(k for k in doc if k not in
                                                           SECTION_ORDER)
    out: list[str] = []
    loose = {k: doc[k] for k in keys if not isinstance(doc[k], dict | list) and k != "zone_map"}
    if loose:
        out.append("Writes")
        out += render_mapping(loose, "  ")
        out.append("")
    if isinstance(doc.get("zone_map"), str):
        out.append("Zone map")
        zone_map = doc["zone_map"]
        out += ["  " + zone_map[i:i + 64] for i in range(0, len(zone_map), 64)]
        out.append("  (" + ZONE_MAP_LEGEND + ")")
        out.append("")
    for key in keys:
        value = doc[key]
        if isinstance(value, dict | list):
            out.append(key.replace("_", " ").capitalize())
            out += render_mapping({key: value}, "  ")[1:] if isinstance(value, list) \
                else render_mapping(value, "  ")
            out.append("")
    return "\n".join(out)
