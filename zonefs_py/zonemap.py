"""Pictures of the zone map: a coloured terminal grid and a PNG (matplotlib, optional).

Both read the status document (`zonefs-py stat --json`): `zone_map` has one
character per zone (S superblock, M/m metadata used/empty, . empty data,
d/D data partly/fully written, x dead awaiting reset, ! read-only/offline,
c conventional), `zone_streams` the stream of each data zone (STREAM_CHARS
of fs/status.py) and `zone_live` its live tenths ("0"-"9", "X" all). The
last two are missing past 8192 zones (the map is then run-length encoded):
the grid prints the encoded map, and the PNG is refused.

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


class MissingExtra(RuntimeError):
    """An optional dependency is not installed (the message names the pip extra)."""


def use_colour(stream: Any) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set (no-color.org)."""
    return bool(getattr(stream, "isatty", lambda: False)()) and "NO_COLOR" not in os.environ


def grid(doc: dict[str, Any], colour: bool, columns: int = GRID_COLUMNS) -> list[str]:
    """The zone map as lines of `columns` characters, ANSI-coloured by stream when asked."""
    zone_map = str(doc.get("zone_map", ""))
    streams = str(doc.get("zone_streams", ""))
    if " " in zone_map or len(streams) != len(zone_map):  # run-length encoded, or old daemon
        return [zone_map[i:i + columns] for i in range(0, len(zone_map), columns)]
    lines = []
    for start in range(0, len(zone_map), columns):
        cells = []
        for i in range(start, min(start + columns, len(zone_map))):
            ch = zone_map[i]
            if not colour:
                cells.append(ch)
                continue
            code = ANSI_STREAM.get(streams[i]) if ch in "dD" else ANSI_ROLE.get(ch)
            cells.append(f"\x1b[{code}m{ch}\x1b[0m" if code else ch)
        lines.append("".join(cells))
    return lines


def grid_legend(colour: bool) -> str:
    """One line naming the stream colours of the grid (empty without colour)."""
    if not colour:
        return ""
    names = [f"\x1b[{ANSI_STREAM[k]}m{STREAM_COLOURS[k][0]}\x1b[0m" for k in "cdlsfk"]
    return "data zones by stream: " + ", ".join(names)


def _cell_colour(ch: str, stream: str, live: str) -> tuple[float, float, float]:
    if ch in ROLE_COLOURS:
        return ROLE_COLOURS[ch][1]
    if ch in (".", "!") or stream not in STREAM_COLOURS:
        return EMPTY_COLOUR
    base = STREAM_COLOURS[stream][1]
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


def save_png(doc: dict[str, Any], path: str) -> None:
    """Draw the zone map into `path` (PNG). Raises MissingExtra, ValueError, OSError."""
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
    n = len(zone_map)
    cols = max(8, min(64, math.ceil(math.sqrt(n * 2))))
    rows = math.ceil(n / cols)
    image = [[(1.0, 1.0, 1.0)] * cols for _ in range(rows)]
    marks: dict[str, list[tuple[int, int]]] = {"D": [], "x": [], "!": []}
    for i, ch in enumerate(zone_map):
        r, c = divmod(i, cols)
        image[r][c] = _cell_colour(ch, streams[i], live[i])
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
    handles += [Patch(color=STREAM_COLOURS[s][1], label=f"data: {STREAM_COLOURS[s][0]}")
                for s in "cdlsfkm" if s in used_streams]
    handles.append(Patch(facecolor=EMPTY_COLOUR, edgecolor="0.6", label="empty data zone"))
    handles += [Line2D([], [], marker=m, color=c, linestyle="", label=lab)
                for ch, (m, c, lab) in marker_style.items() if marks[ch]]
    handles.append(Patch(facecolor="none", edgecolor="none",
                         label="paler = less live data"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              frameon=False)
    ax.set_title(title(doc), fontsize=9, loc="left")
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
