"""`zonefs-py stat MOUNTPOINT [--all | --json | --format F | --watch [S]] [--zone-map FILE.png]
[--by-tenant]`.

Reads the virtual xattr `trusted.zonefs.status` (root) or `user.zonefs.status`
(the user who mounted) of the mount root (see `zonefs_py.control`). The default
is one screen for people (`statusview.summary_lines`: device and size, used /
free / reserve, write amplification, zones by role and condition, the declared
tenants (one line each: zones owned/min/max, bytes stored, written by its users
and its cleaner, write amplification, resets, wear; cut at
`statusview.TENANTS_SHOWN` with "+K more"), cleaner, journal, latency, drain
queue and lag, failsafe and last error, log file); `--all` lists every figure
of the document; `--json` and `--format prometheus` print it for programs
(`zonefs_py.metrics`); `--watch [SECONDS]` prints one line of rates per
interval (read and write MiB/s and IOPS, read p99, write amplification, cleaner
and drain MiB/s, drain queue, free space) until Ctrl-C or `--count` lines;
`--zone-map FILE.png` draws the zone map (`zonefs_py.zonemap`); `--by-tenant`
colours the zone map of `--all` and of `--zone-map` by the declared tenant
owning each zone. When the mount is gone or its daemon died, the daemon's state
record says why and where its log is. Every `stat` sweeps stale lock and state
files (`runstate.sweep_stale`).

Flags are checked before anything is read or printed. The `--all` layout
follows whatever `fs.status()` returns, so new engine figures show up
without changes here: one section per top-level object, aligned `key
value` lines, lists of objects as tables, byte counts humanised.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import sys
import time
from typing import Any

from zonefs_py import statusview, zonemap
from zonefs_py.statusview import human_bytes

STATUS_XATTR = "trusted.zonefs.status"
USER_STATUS_XATTR = "user.zonefs.status"
#: Per-zone strings of the status document drawn by the zone map, not printed as figures.
ZONE_KEYS = ("zone_map", "zone_streams", "zone_live", "zone_tenants", "zone_tenant_legend")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `stat` subcommand."""
    p = subparsers.add_parser("stat", help="show live figures of a mounted filesystem",
                              description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("--all", action="store_true",
                   help="every figure, section by section (the default is one screen)")
    p.add_argument("--json", action="store_true", help="print the raw JSON document "
                   "(same as --format json); with --watch, one JSON object per interval")
    p.add_argument("--format", choices=("text", "json", "prometheus"), default="text",
                   help="text (default), json, or prometheus (text exposition format)")
    p.add_argument("--watch", nargs="?", type=float, const=1.0, metavar="SECONDS",
                   help="print a line of rates every SECONDS (default 1) until Ctrl-C")
    p.add_argument("--count", type=int, metavar="N",
                   help="with --watch: stop after N lines")
    p.add_argument("--zone-map", metavar="FILE.png",
                   help="also draw the zone map into FILE.png (needs zonefs-py[plot])")
    p.add_argument("--by-tenant", action="store_true",
                   help="with --all or --zone-map: draw the zone map by the declared "
                        "tenant owning each zone instead of by stream")
    p.set_defaults(func=run)


def check_flags(args: argparse.Namespace) -> str | None:
    """Return why the flags cannot work together (or None): checked before any output."""
    fmt = "json" if args.json else args.format
    if args.json and args.format not in ("text", "json"):
        return "--json and --format prometheus exclude each other"
    if args.all and fmt != "text":
        return "--all is a text listing; --json and --format prometheus print every figure"
    if args.count is not None and args.watch is None:
        return "--count needs --watch"
    if args.watch is not None:
        if not args.watch > 0:
            return "--watch SECONDS must be positive"
        if args.count is not None and args.count < 1:
            return "--count must be at least 1"
        if fmt == "prometheus" or args.all or args.zone_map:
            return "--watch prints rates (text, or JSON lines with --json); it takes no " \
                   "--all, --format prometheus or --zone-map"
    if getattr(args, "by_tenant", False) and not (args.zone_map or (args.all and fmt == "text")):
        return "--by-tenant changes the zone map: give it with --all or --zone-map"
    if args.zone_map:
        try:
            zonemap.require_matplotlib()
        except zonemap.MissingExtra as exc:
            return str(exc)
        directory = os.path.dirname(os.path.abspath(args.zone_map))
        if not os.path.isdir(directory):
            return f"{args.zone_map}: no such directory {directory}"
    return None


def read_status(mountpoint: str) -> dict[str, Any]:
    """Return the status document of the zonefs-py mount at `mountpoint`.

    Raises SystemExit-worthy `RuntimeError` with a one-line message otherwise.
    """
    try:
        os.statvfs(mountpoint)
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise RuntimeError(f"{mountpoint}: the mount's daemon is gone (ENOTCONN); "
                               f"unmount with fusermount3 -u {mountpoint}") from None
        raise RuntimeError(f"{mountpoint}: {exc.strerror}") from None
    if not os.path.ismount(mountpoint):
        raise RuntimeError(f"{mountpoint} is not a mount point")
    name = STATUS_XATTR if os.geteuid() == 0 else USER_STATUS_XATTR
    try:
        blob = os.getxattr(mountpoint, name)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise RuntimeError(f"{mountpoint} is not a zonefs-py mount") from None
        if exc.errno in (errno.EPERM, errno.EACCES):
            raise RuntimeError(f"{mountpoint}: only root and the user who mounted it may "
                               "read its status") from None
        raise RuntimeError(f"{mountpoint}: {exc.strerror}") from None
    doc: dict[str, Any] = json.loads(blob)
    return doc


def run(args: argparse.Namespace) -> int:
    """Entry point of `zonefs-py stat`."""
    problem = check_flags(args)
    if problem:
        print(f"zonefs-py stat: {problem}", file=sys.stderr)
        return 2
    from zonefs_py.daemon.runstate import sweep_stale

    sweep_stale()
    try:
        doc = read_status(args.mountpoint)
    except RuntimeError as exc:
        print(f"zonefs-py stat: {exc}", file=sys.stderr)
        for line in last_daemon_lines(args.mountpoint):
            print(f"zonefs-py stat: {line}", file=sys.stderr)
        return 1
    fmt = "json" if args.json else args.format
    if args.watch is not None:
        return watch(args.mountpoint, doc, args.watch, args.count, as_json=fmt == "json")
    if fmt == "json":
        print(json.dumps(doc, indent=2, sort_keys=True))
    elif fmt == "prometheus":
        from zonefs_py.metrics import render as render_prometheus

        print(render_prometheus(doc), end="")
    elif args.all:
        print(render(doc, colour=zonemap.use_colour(sys.stdout),
                     by_tenant=args.by_tenant), end="")
    else:
        print("\n".join(statusview.summary_lines(doc)))
    if args.zone_map:
        try:
            zonemap.save_png(doc, args.zone_map, by_tenant=args.by_tenant)
        except (zonemap.MissingExtra, ValueError) as exc:
            print(f"zonefs-py stat: {exc}", file=sys.stderr)
            return 1
        except OSError as exc:
            print(f"zonefs-py stat: {args.zone_map}: {exc.strerror}", file=sys.stderr)
            return 1
    return 0


def watch(mountpoint: str, doc: dict[str, Any], interval_s: float, count: int | None,
          as_json: bool = False) -> int:
    """Print a line of rates every `interval_s` (a header every screenful) until Ctrl-C,
    `count` lines, or the mount goes away (exit 1)."""
    rows = max(5, shutil.get_terminal_size((100, 24)).lines - 2)
    prev, prev_t = doc, time.monotonic()
    printed = 0
    try:
        while count is None or printed < count:
            if not as_json and printed % rows == 0:
                print(statusview.watch_header(), flush=True)
            time.sleep(max(0.0, prev_t + interval_s - time.monotonic()))
            try:
                cur = read_status(mountpoint)
            except RuntimeError as exc:
                print(f"zonefs-py stat: {exc}", file=sys.stderr)
                return 1
            now = time.monotonic()
            figures = statusview.interval_figures(prev, cur, now - prev_t)
            figures["time"] = time.strftime("%H:%M:%S")
            print(json.dumps(figures, sort_keys=True) if as_json
                  else statusview.watch_line(figures), flush=True)
            prev, prev_t = cur, now
            printed += 1
    except KeyboardInterrupt:
        print(file=sys.stderr)  # end the line the ^C was echoed on
    except BrokenPipeError:  # `stat --watch | head`
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), sys.stdout.fileno())
    return 0


def last_daemon_lines(mountpoint: str) -> list[str]:
    """What the state record of the last daemon on `mountpoint` says (pid, log, error)."""
    from zonefs_py.daemon.runstate import find_state, pid_alive

    state = find_state(mountpoint)
    if state is None:
        return []
    phase = state.get("state", "?")
    if pid_alive(state.get("pid")):
        how = f"running, {phase}"
    elif phase in ("stopped", "failed"):
        how = f"exited, {phase}"
    else:
        how = f"exited while {phase}, without shutting down (killed?)"
    log_to = state.get("log_file") or ("the systemd journal" if state.get("journal")
                                       else "stderr")
    lines = [f"last daemon on {mountpoint}: pid {state.get('pid')} ({how}), "
             f"device {state.get('device')}, log {log_to}"]
    if state.get("last_error"):
        lines.append(f"its last error: {state['last_error']}")
    return lines


# -- rendering ----------------------------------------------------------------------------

#: Sections shown first, in this order; the rest follow alphabetically.
SECTION_ORDER = ("device", "filesystem", "zones_by_condition", "data_zones_by_condition",
                 "zones_by_role", "zones",
                 "space", "streams", "journal", "cleaner", "wear", "daemon")
#: Legend of the engine's one-character-per-zone map.
ZONE_MAP_LEGEND = ("S superblock, M/m metadata (used/empty), . empty data, d/D data "
                   "(partly/fully written), x dead awaiting reset, ! read-only/offline, "
                   "c conventional")


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
    # Latency histograms are for Prometheus (--format prometheus); the text shows percentiles.
    obj = with_write_amplification({k: v for k, v in obj.items() if k != "histogram"})
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


def render(doc: dict[str, Any], colour: bool = False, by_tenant: bool = False) -> str:
    """Render the whole status document as readable text (ANSI colours in the zone map
    if `colour`; the map by declared tenant if `by_tenant`)."""
    keys = [k for k in SECTION_ORDER if k in doc] + sorted(k for k in doc if k not in
                                                           SECTION_ORDER)
    out: list[str] = []
    loose = {k: doc[k] for k in keys
             if not isinstance(doc[k], dict | list) and k not in ZONE_KEYS}
    if loose:
        out.append("Writes")
        out += render_mapping(loose, "  ")
        out.append("")
    if isinstance(doc.get("zone_map"), str):
        out.append("Zone map")
        out += ["  " + line for line in zonemap.grid(doc, colour, by_tenant=by_tenant)]
        out.append("  (" + ZONE_MAP_LEGEND + ")")
        if colour or by_tenant:
            out.append("  " + zonemap.grid_legend(colour, doc, by_tenant))
        out.append("")
    for key in keys:
        value = doc[key]
        if isinstance(value, dict | list) and key not in ZONE_KEYS:
            out.append(key.replace("_", " ").capitalize())
            out += render_mapping({key: value}, "  ")[1:] if isinstance(value, list) \
                else render_mapping(value, "  ")
            out.append("")
    return "\n".join(out)
