"""Pictures of the zone map: a coloured terminal grid and a PNG (matplotlib, optional).

Both read the status document (`zonefs-py stat --json`): `zone_map` has one
character per zone (S superblock, M/m metadata used/empty, . empty data,
d/D data partly/fully written, x dead awaiting reset, ! read-only/offline,
c conventional), `zone_streams` the stream of each data zone (STREAM_CHARS
of fs/status.py) and `zone_live` its live tenths ("0"-"9", "X" all). With
declared tenants (issue 45) `zone_tenants` gives the tenant owning each data
zone (a character, "." nobody's, "-" no data zone) and `zone_tenant_legend`
the characters' tenant paths; `by_tenant` draws those instead of the streams
(`zonefs-py stat --all --by-tenant`, `--zone-map F.png --by-tenant`). The
per-zone strings are missing past 8192 zones (the map is then run-length
encoded): the grid prints the encoded map, and the PNG is refused.

Caveats: the PNG needs matplotlib (`pip install 'zonefs-py[plot]'`); without
it `save_png` raises MissingExtra naming the extra.
"""

from __future__ import annotations

import math
import os
from typing import Any

#: Stream character -> (name, RGB colour) for data zones.
STREAM_COLOURS = {
    "c": ("checkpoint", (0.90, 0.55, 0.05)),
    "d": ("dataset", (0.15, 0.60, 0.25)),
    "l": ("log", (0.10, 0.55, 0.75)),
    "s": ("scratch", (0.55, 0.45, 0.70)),
    "f": ("default", (0.35, 0.35, 0.35)),
    "k": ("cleaner", (0.80, 0.20, 0.50)),
    "m": ("metadata", (0.15, 0.25, 0.65)),
}
#: Map characters of non-data zones -> (name, RGB colour).
ROLE_COLOURS = {
    "S": ("superblock", (0.55, 0.10, 0.10)),
    "M": ("metadata log", (0.15, 0.25, 0.65)),
    "m": ("metadata log", (0.15, 0.25, 0.65)),
    "c": ("conventional (unused)", (0.85, 0.85, 0.85)),
}
EMPTY_COLOUR = (0.97, 0.97, 0.97)
#: ANSI colours of the terminal grid, by map character or stream character.
ANSI_ROLE = {"S": "35", "M": "34", "m": "34;2", "c": "2", ".": "2", "x": "31", "!": "1;41"}
ANSI_STREAM = {"c": "33", "d": "32", "l": "36", "s": "35;2", "f": "37", "k": "31;1", "m": "34"}
GRID_COLUMNS = 64
#: ANSI colours of declared tenants in the `by_tenant` grid, in legend order (cycled).
ANSI_TENANT = ("32;1", "33;1", "36;1", "35;1", "34;1", "31;1", "32", "33", "36", "35")
#: RGB colours of declared tenants in the `by_tenant` PNG, in legend order (cycled;
#: matplotlib's tab10 without its grey).
TENANT_COLOURS = ((0.12, 0.47, 0.71), (1.00, 0.50, 0.05), (0.17, 0.63, 0.17),
                  (0.84, 0.15, 0.16), (0.58, 0.40, 0.74), (0.55, 0.34, 0.29),
                  (0.89, 0.47, 0.76), (0.74, 0.74, 0.13), (0.09, 0.75, 0.81))
#: Data zones of nobody (shared) in the `by_tenant` PNG.
SHARED_COLOUR = (0.55, 0.55, 0.55)


class MissingExtra(RuntimeError):
    """An optional dependency is not installed (the message names the pip extra)."""


def use_colour(stream: Any) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set (no-color.org)."""
    return bool(getattr(stream, "isatty", lambda: False)()) and "NO_COLOR" not in os.environ


def zone_tenants(doc: dict[str, Any]) -> str | None:
    """The tenant character of each zone (`zone_tenants`), None when the document has
    no per-zone detail; all "." (nobody's) when no tenant is declared."""
    zone_map = str(doc.get("zone_map", ""))
    if " " in zone_map or len(str(doc.get("zone_streams", ""))) != len(zone_map):
        return None
    owners = doc.get("zone_tenants")
    if isinstance(owners, str) and len(owners) == len(zone_map):
        return owners
    return "".join("." if ch in ".dDx!" else "-" for ch in zone_map)


def tenant_legend(doc: dict[str, Any]) -> dict[str, str]:
    """Tenant character -> its path (`zone_tenant_legend`)."""
    legend = doc.get("zone_tenant_legend")
    return {str(k): str(v) for k, v in legend.items()} if isinstance(legend, dict) else {}


def _tenant_ansi(ch: str, legend: dict[str, str]) -> str:
    keys = sorted(legend)
    return ANSI_TENANT[keys.index(ch) % len(ANSI_TENANT)] if ch in legend else "2"


def grid(doc: dict[str, Any], colour: bool, columns: int = GRID_COLUMNS,
         by_tenant: bool = False) -> list[str]:
    """The zone map as lines of `columns` characters, ANSI-coloured by stream when asked.
    `by_tenant`: a declared tenant's data zone shows its character (`zone_tenant_legend`),
    coloured per tenant; other zones show the map's character, dimmed."""
    zone_map = str(doc.get("zone_map", ""))
    streams = str(doc.get("zone_streams", ""))
    owners = zone_tenants(doc) if by_tenant else None
    if " " in zone_map or len(streams) != len(zone_map):  # run-length encoded, or old daemon
        return [zone_map[i:i + columns] for i in range(0, len(zone_map), columns)]
    legend = tenant_legend(doc)
    lines = []
    for start in range(0, len(zone_map), columns):
        cells = []
        for i in range(start, min(start + columns, len(zone_map))):
            ch = zone_map[i]
            if owners is not None:
                owner = owners[i]
                shown = owner if owner not in ".-" else ch
                tcode = (_tenant_ansi(owner, legend) if owner not in ".-"
                         else ANSI_ROLE.get(ch, "2") if ch not in "dD" else "2")
                cells.append(f"\x1b[{tcode}m{shown}\x1b[0m" if colour else shown)
                continue
            if not colour:
                cells.append(ch)
                continue
            code = ANSI_STREAM.get(streams[i]) if ch in "dD" else ANSI_ROLE.get(ch)
            cells.append(f"\x1b[{code}m{ch}\x1b[0m" if code else ch)
        lines.append("".join(cells))
    return lines


def grid_legend(colour: bool, doc: dict[str, Any] | None = None,
                by_tenant: bool = False) -> str:
    """One line naming the colours of the grid: the streams (empty without colour), or
    with `by_tenant` each tenant's character and path (coloured when asked)."""
    if by_tenant:
        legend = tenant_legend(doc or {})
        if not legend:
            return "zones by tenant: no tenant declared (every data zone is shared)"
        names = [f"\x1b[{_tenant_ansi(k, legend)}m{k}\x1b[0m {v}" if colour else f"{k} {v}"
                 for k, v in sorted(legend.items())]
        return "zones by tenant: " + ", ".join(names) + "; others shared or not data"
    if not colour:
        return ""
    names = [f"\x1b[{ANSI_STREAM[k]}m{STREAM_COLOURS[k][0]}\x1b[0m" for k in "cdlsfk"]
    return "data zones by stream: " + ", ".join(names)


def _cell_colour(ch: str, stream: str, live: str,
                 base: tuple[float, float, float] | None = None) -> tuple[float, float, float]:
    """A cell's colour: its role's, or its data's (`base`, else its stream's) paler
    with less live data."""
    if ch in ROLE_COLOURS:
        return ROLE_COLOURS[ch][1]
    if ch in (".", "!") or (base is None and stream not in STREAM_COLOURS):
        return EMPTY_COLOUR
    base = STREAM_COLOURS[stream][1] if base is None else base
    frac = 1.0 if live == "X" else (int(live) + 0.5) / 10 if live.isdigit() else 0.0
    shade = 0.18 + 0.82 * frac  # dead data stays visible as a pale cell
    return (1 - shade + shade * base[0], 1 - shade + shade * base[1], 1 - shade + shade * base[2])


def title(doc: dict[str, Any]) -> str:
    """The device's figures for the picture's title."""
    dev, fs, space = doc.get("device", {}), doc.get("filesystem", {}), doc.get("space", {})
    gib = 1 << 30
    wa = doc.get("write_amplification")
    return (f"{dev.get('path', '?')}  label {fs.get('label') or '-'}  "
            f"{dev.get('nr_zones', '?')} zones x {int(dev.get('zone_size', 0)) >> 20} MiB\n"
            f"capacity {space.get('capacity_bytes', 0) / gib:.2f} GiB, "
            f"live {space.get('live_bytes', 0) / gib:.2f} GiB, "
            f"free {space.get('free_bytes', 0) / gib:.2f} GiB, "
            f"write amplification {wa if wa is not None else '-'}")


def require_matplotlib() -> None:
    """Raise MissingExtra unless matplotlib can be imported (checked before any output)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingExtra("--zone-map needs matplotlib: pip install 'zonefs-py[plot]'") \
            from None


def tenant_colour(ch: str, legend: dict[str, str]) -> tuple[float, float, float]:
    """The PNG colour of a tenant character (SHARED_COLOUR for nobody's)."""
    keys = sorted(legend)
    if ch not in keys:
        return SHARED_COLOUR
    return TENANT_COLOURS[keys.index(ch) % len(TENANT_COLOURS)]


def save_png(doc: dict[str, Any], path: str, by_tenant: bool = False) -> None:
    """Draw the zone map into `path` (PNG), data zones coloured by stream, or with
    `by_tenant` by the declared tenant owning them. Raises MissingExtra, ValueError,
    OSError."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError:
        raise MissingExtra("--zone-map needs matplotlib: pip install 'zonefs-py[plot]'") \
            from None
    zone_map = str(doc.get("zone_map", ""))
    streams, live = str(doc.get("zone_streams", "")), str(doc.get("zone_live", ""))
    if " " in zone_map or not (len(zone_map) == len(streams) == len(live)):
        raise ValueError("this status has no per-zone detail (more than 8192 zones, or an "
                         "older daemon): no picture")
    owners = zone_tenants(doc) if by_tenant else None
    legend = tenant_legend(doc)
    n = len(zone_map)
    cols = max(8, min(64, math.ceil(math.sqrt(n * 2))))
    rows = math.ceil(n / cols)
    image = [[(1.0, 1.0, 1.0)] * cols for _ in range(rows)]
    marks: dict[str, list[tuple[int, int]]] = {"D": [], "x": [], "!": []}
    for i, ch in enumerate(zone_map):
        r, c = divmod(i, cols)
        base = tenant_colour(owners[i], legend) if owners is not None else None
        image[r][c] = _cell_colour(ch, streams[i], live[i], base)
        if ch in marks:
            marks[ch].append((c, r))
    fig, ax = plt.subplots(figsize=(min(14.0, 2 + cols * 0.22), 2.2 + rows * 0.22), dpi=100)
    ax.imshow(image, interpolation="nearest", aspect="equal")
    ax.set_xticks([x - 0.5 for x in range(cols + 1)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(rows + 1)], minor=True)
    ax.grid(which="minor", color="white", linewidth=1.0)
    ax.tick_params(which="both", length=0, labelbottom=False, labelleft=False)
    marker_style = {"D": ("o", "black", "full (FULL)"), "x": ("x", "red", "dead, awaiting reset"),
                    "!": ("X", "black", "read-only / offline")}
    for ch, (marker, colour, _label) in marker_style.items():
        if marks[ch]:
            xs, ys = zip(*marks[ch], strict=True)
            ax.scatter(xs, ys, marker=marker, c=colour, s=12 if marker == "o" else 30,
                       linewidths=1.2)
    present = set(zone_map)
    used_streams = {streams[i] for i, ch in enumerate(zone_map) if ch in "dDx"}
    handles: list[Any] = []
    for ch in ("S", "M", "c"):
        if ch in present or (ch == "M" and "m" in present):
            handles.append(Patch(color=ROLE_COLOURS[ch][1], label=ROLE_COLOURS[ch][0]))
    if owners is not None:
        present_owners = set(owners)
        handles += [Patch(color=tenant_colour(k, legend), label=f"tenant {k}: {v}")
                    for k, v in sorted(legend.items()) if k in present_owners]
        if "." in {owners[i] for i, ch in enumerate(zone_map) if ch in "dDx"}:
            handles.append(Patch(color=SHARED_COLOUR, label="data of no tenant (shared)"))
    else:
        handles += [Patch(color=STREAM_COLOURS[s][1], label=f"data: {STREAM_COLOURS[s][0]}")
                    for s in "cdlsfkm" if s in used_streams]
    handles.append(Patch(facecolor=EMPTY_COLOUR, edgecolor="0.6", label="empty data zone"))
    handles += [Line2D([], [], marker=m, color=c, linestyle="", label=lab)
                for ch, (m, c, lab) in marker_style.items() if marks[ch]]
    handles.append(Patch(facecolor="none", edgecolor="none",
                         label="paler = less live data"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              frameon=False)
    ax.set_title(title(doc) + ("\ndata zones by tenant" if by_tenant else ""), fontsize=9,
                 loc="left")
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
