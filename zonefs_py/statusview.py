"""Views of the status document for people: the one-screen summary, `--watch` rates, one line.

Pure functions of the JSON document that `zonefs-py stat --json` prints
(`control.status_document`); no I/O, light imports (the CLI and the daemon's
systemd status line both use it). Every figure shown is one of the
document's, formatted (bytes by `human_bytes`, one decimal), or a rate
derived from two documents (`interval_figures`), so what a person reads is
what `--json` and Prometheus say.

Caveats: rates are over the time between the two reads of the status, as
measured by the reader (`zonefs-py stat --watch`), not by the daemon; a read
p99 over an interval comes from the log-linear latency buckets
(`fs/latency.py`: the bucket's upper edge, within 19% above the truth), or
from the coarser Prometheus buckets of a daemon that does not send them.
The drain rate counts files when their upload completes, so a large file
shows as one burst.
"""

from __future__ import annotations

import textwrap
import time
from typing import Any

#: The default `stat` fits this screen.
SUMMARY_COLUMNS = 100
SUMMARY_LINES = 30
LABEL_WIDTH = 12
MIB = 1 << 20


def human_bytes(n: int | float) -> str:
    """Format a byte count as '1.5 GiB' ('512 B' below a KiB)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_seconds(s: float) -> str:
    """Format a duration as '45 s', '12m 5s', '3h 2m', '4d 1h'."""
    s = max(0, int(s))
    if s < 60:
        return f"{s} s"
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60),
                                      ("m", 60, "s", 1)):
        if s >= size:
            return f"{s // size}{unit} {(s % size) // sub_size}{sub}"
    raise AssertionError("unreachable")


def human_us(us: float | None) -> str:
    """Format microseconds as '98 us', '1.6 ms' or '2.10 s' ('-' for None)."""
    if us is None:
        return "-"
    if us < 1000:
        return f"{us:.0f} us"
    if us < 1e6:
        return f"{us / 1000:.1f} ms"
    return f"{us / 1e6:.2f} s"


def _section(doc: dict[str, Any], key: str) -> dict[str, Any]:
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def failsafe_reason(doc: dict[str, Any]) -> str | None:
    """Why the mount is in read-only failsafe, or None."""
    reason = _section(doc, "daemon").get("failsafe") or _section(doc, "filesystem").get(
        "failsafe")
    return str(reason) if reason else None


def last_error(doc: dict[str, Any]) -> str | None:
    """The newest error the daemon reports (journal broken, drain errors), or None."""
    broken = _section(doc, "journal").get("broken")
    if broken:
        return f"journal: {broken}"
    drain = _section(doc, "drain")
    for key in ("auth_error", "last_error"):
        if drain.get(key):
            return f"drain: {drain[key]}"
    return None


def log_target(daemon: dict[str, Any]) -> str:
    """Where the daemon logs: its file, the systemd journal, or stderr."""
    if daemon.get("log_file"):
        return str(daemon["log_file"])
    return "the systemd journal (journalctl)" if daemon.get("journal") else "stderr"


def _counts(counts: dict[str, Any]) -> str:
    items = sorted(((k, _int(v)) for k, v in counts.items()), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{k} {v}" for k, v in items if v) or "-"


def _percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def cleaner_state(cleaner: dict[str, Any]) -> str:
    """'off', 'cleaning' or 'idle', from the cleaner section."""
    if not cleaner.get("rate_mb_s"):
        return "off (cleaner_rate=0: cleans only when writers run out of zones)"
    return "cleaning" if cleaner.get("running") else "idle"


def summary_lines(doc: dict[str, Any], now: float | None = None) -> list[str]:
    """The default `zonefs-py stat`: one screen (SUMMARY_LINES x SUMMARY_COLUMNS at most)."""
    now = time.time() if now is None else now
    dev, fs, daemon = (_section(doc, k) for k in ("device", "filesystem", "daemon"))
    space, cleaner, journal = (_section(doc, k) for k in ("space", "cleaner", "journal"))
    drain, latency = _section(doc, "drain"), _section(doc, "latency")
    size = _int(dev.get("nr_zones")) * _int(dev.get("zone_size"))
    rows: list[tuple[str, str]] = []
    rows.append(("device", f"{dev.get('path', '?')} ({dev.get('kind', '?')}, "
                 f"{human_bytes(size)}: {dev.get('nr_zones', '?')} zones of "
                 f"{human_bytes(_int(dev.get('zone_size')))}, "
                 f"zone append {'on' if dev.get('zone_append') else 'off'})"))
    mode = "read-only" if fs.get("read_only") else "read-write"
    rows.append(("filesystem", f"{fs.get('uuid', '?')}"
                 + (f" '{fs['label']}'" if fs.get("label") else "")
                 + f", {mode}, {_int(fs.get('inodes'))} inodes"
                 + (f", format {fs['disk_version']}" if fs.get("disk_version") else "")))
    up = f", up {human_seconds(now - daemon['started'])}" if isinstance(
        daemon.get("started"), int | float) else ""
    rows.append(("daemon", f"pid {daemon.get('pid', '?')}{up}, mounted on "
                 f"{daemon.get('mountpoint', '?')}"))
    cap, live = _int(space.get("capacity_bytes")), _int(space.get("live_bytes"))
    rows.append(("space", f"{human_bytes(cap)} for data: {human_bytes(live)} used "
                 f"({_percent(live, cap)}), {human_bytes(_int(space.get('free_bytes')))} free, "
                 f"{human_bytes(_int(space.get('reserve_bytes')))} reserve"))
    dead = _int(space.get("dead_bytes"))
    if dead:
        waiting = _counts(space.get("dead_zones") or {})
        rows.append(("", f"{human_bytes(dead)} dead (cleanable)"
                     + (f"; dead zones waiting: {waiting}" if waiting != "-" else "")))
    wa = doc.get("write_amplification")
    rows.append(("writes", "write amplification "
                 + (f"{wa:.3f}" if isinstance(wa, int | float) else "-")
                 + f" since mkfs: user {human_bytes(_int(doc.get('user_bytes_written')))}, "
                 f"device {human_bytes(_int(doc.get('device_bytes_written')))} (data "
                 f"{human_bytes(_int(doc.get('data_bytes_written')))}, metadata "
                 f"{human_bytes(_int(doc.get('metadata_bytes_written')))}, cleaner "
                 f"{human_bytes(_int(doc.get('cleaner_bytes_copied')))})"))
    by_role, by_cond = doc.get("zones_by_role") or {}, doc.get("zones_by_condition") or {}
    rows.append(("zones", f"{sum(_int(v) for v in by_role.values())}: {_counts(by_role)} | "
                 f"{_counts({k.lower(): v for k, v in by_cond.items()})}"))
    tenants_at = len(rows)  # the declared tenants' lines go here (`tenant_lines`)
    rows.append(("cleaner", f"{cleaner_state(cleaner)}, {cleaner.get('policy', '?')} at "
                 f"{cleaner.get('rate_mb_s', '?')} MB/s; {_int(cleaner.get('empty_zones'))} "
                 "empty zones"
                 + (f" (cleans below {cleaner['low_watermark_zones']})"
                    if "low_watermark_zones" in cleaner else "")
                 + f"; this mount {_int(cleaner.get('zones_cleaned'))} zones cleaned, "
                 f"{human_bytes(_int(cleaner.get('bytes_copied_this_mount')))} copied"))
    rows.append(("journal", f"{_int(journal.get('commits'))} commits, "
                 f"{_int(journal.get('checkpoints'))} checkpoints this mount; "
                 f"{_int(journal.get('meta_zones_free'))} of {_int(journal.get('meta_zones'))} "
                 "metadata zones free"))
    lat = []
    for op in ("read", "write"):
        s = latency.get(op) or {}
        if _int(s.get("count")):
            lat.append(f"{op} p50 {human_us(s.get('p50_us'))}, p99 {human_us(s.get('p99_us'))}"
                       f" ({_int(s.get('count'))} {op}s)")
    rows.append(("latency", "; ".join(lat) or "no reads or writes yet this mount"))
    rows.append(("requests", requests_line(doc.get("requests") or {})))
    if isinstance(doc.get("stuck_requests"), dict):
        rows.append(("stuck", stuck_line(doc)))
    rows.append(("drain", drain_line(drain)))
    reason = failsafe_reason(doc)
    rows.append(("health", f"READ-ONLY failsafe: {reason}" if reason else
                 "ok (read-only mount)" if fs.get("read_only") else "ok"))
    rows.append(("last error", last_error(doc) or "-"))
    rows.append(("log", log_target(daemon)))
    before, after = _wrap_rows(rows[:tenants_at]), _wrap_rows(rows[tenants_at:])
    head = [f"zonefs-py on {daemon.get('mountpoint', '?')}"]
    foot = ["(--all: every figure; --watch: rates; --json, --format prometheus)"]
    room = SUMMARY_LINES - len(head) - len(before) - len(after) - len(foot)
    return head + before + tenant_lines(doc, room) + after + foot


def _wrap_rows(rows: list[tuple[str, str]]) -> list[str]:
    out: list[str] = []
    for label, value in rows:
        out += textwrap.wrap(value, SUMMARY_COLUMNS,
                             initial_indent=f"  {label.ljust(LABEL_WIDTH)}"[:LABEL_WIDTH + 2],
                             subsequent_indent=" " * (LABEL_WIDTH + 2),
                             break_on_hyphens=False, max_lines=3,
                             placeholder=" [...]") or [f"  {label}"]
    return out


#: Declared tenants the summary lists at most (one line each; `tenant list` has all).
TENANTS_SHOWN = 6
#: Columns of a tenant line: name, zones owned/min/max, bytes stored, written by its
#: users and by its cleaner, write amplification, zone resets, wear (max/mean resets).
_TENANT_COLS = (18, 11, 10, 10, 10, 5, 6, 9)
_TENANT_HEAD = ("", "own/min/max", "stored", "by users", "by cleaner", "WA", "resets", "wear")


def _tenant_row(cells: tuple[str, ...]) -> str:
    name, width = cells[0], _TENANT_COLS[0]
    if len(name) > width:  # its start and its end: where tenants' paths differ
        name = name[:7] + "~" + name[-(width - 8):]
    return " ".join([name.ljust(_TENANT_COLS[0])]
                    + [c.rjust(w) for c, w in zip(cells[1:], _TENANT_COLS[1:], strict=True)])


def tenant_lines(doc: dict[str, Any], room: int = SUMMARY_LINES) -> list[str]:
    """The declared tenants (`tenants` objects with `declared`), one line each after a
    header, the most zones first, at most TENANTS_SHOWN and `room` lines in all: the
    rest are "+K more". Empty when none is declared."""
    tenants = sorted(((str(k), v) for k, v in _section(doc, "tenants").items()
                      if isinstance(v, dict) and v.get("declared")),
                     key=lambda kv: (-_int(kv[1].get("zones_owned")), kv[0]))
    if not tenants:
        return []
    indent = " " * (LABEL_WIDTH + 2)
    label = f"  {'tenants'.ljust(LABEL_WIDTH)}"
    if room < 3:  # no room for a header and a tenant: say how many
        return [f"{label}{len(tenants)} declared (zonefs-py tenant list)"][:max(0, room)]
    shown = min(len(tenants), TENANTS_SHOWN, room - 1)
    if shown < len(tenants):
        shown = min(shown, room - 2)
    out = [label + _tenant_row(_TENANT_HEAD).rstrip()]
    for name, t in tenants[:shown]:
        wear = _section(t, "wear")
        wa = t.get("write_amplification")
        mean = wear.get("mean")
        out.append(indent + _tenant_row((
            name or "/",
            f"{_int(t.get('zones_owned'))}/{_int(t.get('zones_reserved'))}/"
            + (str(_int(t["zones_max"])) if t.get("zones_max") else "-"),
            human_bytes(_int(t.get("bytes_stored"))),
            human_bytes(_int(t.get("device_bytes_written_users"))),
            human_bytes(_int(t.get("device_bytes_written_cleaner"))),
            f"{wa:.2f}" if isinstance(wa, int | float) else "-",
            str(_int(t.get("zone_resets"))),
            f"{_int(wear.get('max'))}/"
            + (f"{mean:.1f}" if isinstance(mean, int | float) else "-"))))
    if shown < len(tenants):
        out.append(f"{indent}+{len(tenants) - shown} more (zonefs-py tenant list)")
    return out


def total_requests(census: dict[str, Any]) -> int:
    """FUSE requests in a census (`forgotten_inodes` and per-name counts are not)."""
    return sum(_int(v) for k, v in census.items() if ":" not in k and k != "forgotten_inodes")


def requests_line(census: dict[str, Any]) -> str:
    """FUSE requests since the mount, the most frequent opcodes first (the census)."""
    if not census:
        return "not counted (zonefs_py._fuseext is not built)"
    ops = {k: v for k, v in census.items() if ":" not in k and k != "forgotten_inodes"}
    top = sorted(ops.items(), key=lambda kv: (-_int(kv[1]), kv[0]))[:8]
    return (f"{total_requests(census)} FUSE requests this mount: "
            + ", ".join(f"{k} {_int(v)}" for k, v in top))


def stuck_line(doc: dict[str, Any]) -> str:
    """Requests in flight and those waiting longer than the threshold (issue 42)."""
    stuck = _section(doc, "stuck_requests")
    threshold = stuck.get("threshold_s")
    threshold = f"{threshold:g}" if isinstance(threshold, int | float) else "?"
    # The GETXATTR that asked for this document is one of those in flight.
    text = (f"{_int(doc.get('requests_in_flight'))} in flight (this status request is one); "
            f"{_int(stuck.get('waiting_total'))} waiting over {threshold} s")
    rows = stuck.get("waiting") or []
    if rows:
        text += ": " + ", ".join(f"{r.get('opcode', '?')} of inode {r.get('inode', '?')} "
                                 f"for {human_seconds(float(r.get('age_s') or 0))}"
                                 for r in rows[:4] if isinstance(r, dict))
    reported = _int(stuck.get("reported_total"))
    return text + (f"; {reported} logged this mount" if reported else "")


def drain_line(drain: dict[str, Any]) -> str:
    """Queue and lag, what was drained, errors: one line of the drain section."""
    if not drain:
        return "-"
    text = (f"queue {_int(drain.get('queue_files'))} files "
            f"({human_bytes(_int(drain.get('queue_bytes')))}), lag "
            f"{human_seconds(float(drain.get('lag_seconds') or 0))}; this mount "
            f"{_int(drain.get('files_drained'))} files drained "
            f"({human_bytes(_int(drain.get('bytes_drained')))}), "
            f"{_int(drain.get('files_evicted'))} evicted, {_int(drain.get('errors'))} errors")
    return ("PAUSED; " if drain.get("paused") else "") + text


def serving_line(doc: dict[str, Any]) -> str:
    """One line for `systemctl status`: where, used/free, WA, drain queue, failsafe."""
    daemon, space = _section(doc, "daemon"), _section(doc, "space")
    parts = [f"serving {daemon.get('mountpoint', '?')}: "
             f"{human_bytes(_int(space.get('live_bytes')))} used of "
             f"{human_bytes(_int(space.get('capacity_bytes')))}, "
             f"{human_bytes(_int(space.get('free_bytes')))} free"]
    wa = doc.get("write_amplification")
    if isinstance(wa, int | float):
        parts.append(f"WA {wa:.3f}")
    queue = _int(_section(doc, "drain").get("queue_files"))
    if queue:
        parts.append(f"drain queue {queue} files")
    reason = failsafe_reason(doc)
    if reason:
        parts.append(f"READ-ONLY failsafe: {reason}")
    return ", ".join(parts)


# -- rates between two documents (`stat --watch`) ---------------------------------------------

def _interval_p99_us(prev: dict[str, Any], cur: dict[str, Any]) -> float | None:
    """p99 (us) of the reads between two latency summaries; None if there were none."""
    ph, ch = prev.get("histogram") or {}, cur.get("histogram") or {}
    if "log_linear" in ch:  # {upper edge in ns: count}, only non-empty buckets
        before = {int(k): _int(v) for k, v in (ph.get("log_linear") or {}).items()}
        diff = sorted((int(k), _int(v) - before.get(int(k), 0))
                      for k, v in ch["log_linear"].items())
        edges = [(edge / 1000.0, n) for edge, n in diff if n > 0]
    else:  # Prometheus buckets (cumulative): a coarser answer
        pc, cc = ph.get("cumulative") or [], ch.get("cumulative") or []
        bounds = ch.get("le_seconds") or []
        per = [c - (pc[i] if i < len(pc) else 0) for i, c in enumerate(cc)]
        edges = [(b * 1e6, n - (per[i - 1] if i else 0)) for i, (b, n) in
                 enumerate(zip(bounds, per, strict=False))]
        edges = [(b, n) for b, n in edges if n > 0]
    total = sum(n for _, n in edges)
    if total <= 0:
        return None
    seen = 0
    for edge_us, n in edges:
        seen += n
        if seen >= total * 0.99:
            return edge_us
    return edges[-1][0]


def interval_figures(prev: dict[str, Any], cur: dict[str, Any], seconds: float) -> dict[str, Any]:
    """Rates between two status documents taken `seconds` apart (the `--watch` line)."""
    dt = max(seconds, 1e-6)

    def delta(get: Any) -> int:
        return max(0, _int(get(cur)) - _int(get(prev)))

    def lat(doc: dict[str, Any], op: str) -> dict[str, Any]:
        return _section(_section(doc, "latency"), op)

    user_w = delta(lambda d: d.get("user_bytes_written"))
    dev_w = delta(lambda d: d.get("device_bytes_written"))
    drain = _section(cur, "drain")
    return {
        "seconds": round(seconds, 3),
        "read_mib_s": round(delta(lambda d: d.get("user_bytes_read")) / MIB / dt, 2),
        "read_iops": round(delta(lambda d: lat(d, "read").get("count")) / dt, 1),
        "read_p99_us": _interval_p99_us(lat(prev, "read"), lat(cur, "read")),
        "write_mib_s": round(user_w / MIB / dt, 2),
        "write_iops": round(delta(lambda d: lat(d, "write").get("count")) / dt, 1),
        "write_amplification": round(dev_w / user_w, 3) if user_w else None,
        "cleaner_mib_s": round(delta(lambda d: d.get("cleaner_bytes_copied")) / MIB / dt, 2),
        "drain_mib_s": round(delta(lambda d: _section(d, "drain").get("bytes_drained"))
                             / MIB / dt, 2),
        "drain_queue_files": _int(drain.get("queue_files")),
        "drain_queue_bytes": _int(drain.get("queue_bytes")),
        "free_bytes": _int(_section(cur, "space").get("free_bytes")),
        "requests_per_s": round(max(0, total_requests(cur.get("requests") or {})
                                    - total_requests(prev.get("requests") or {})) / dt, 1),
    }


#: `--watch` columns: (title, width, figure key, format).
WATCH_COLUMNS: tuple[tuple[str, int, str], ...] = (
    ("time", 8, "time"), ("rd MiB/s", 8, "read_mib_s"), ("rd IOPS", 7, "read_iops"),
    ("rd p99", 7, "read_p99_us"), ("wr MiB/s", 8, "write_mib_s"), ("wr IOPS", 7, "write_iops"),
    ("WA", 5, "write_amplification"), ("cl MiB/s", 8, "cleaner_mib_s"),
    ("dr MiB/s", 8, "drain_mib_s"), ("dr queue", 8, "drain_queue_files"),
    ("free", 9, "free_bytes"), ("req/s", 6, "requests_per_s"),
)


def watch_header() -> str:
    return " ".join(title.rjust(width) for title, width, _ in WATCH_COLUMNS)


def _cell(key: str, value: Any) -> str:
    if key == "time":
        return str(value)
    if value is None:
        return "-"
    # Columns hold one word each ("1.6ms", "754.0MiB"): `awk '{print $5}'` works.
    if key == "read_p99_us":
        return human_us(value).replace(" ", "")
    if key == "free_bytes":
        return human_bytes(value).replace(" ", "")
    if key == "write_amplification":
        return f"{value:.2f}"
    if key.endswith("_iops") or key in ("drain_queue_files", "requests_per_s"):
        return f"{value:.0f}"
    return f"{value:.1f}"


def watch_line(figures: dict[str, Any]) -> str:
    """One `--watch` row (`figures` from interval_figures, plus `time`)."""
    return " ".join(_cell(key, figures.get(key)).rjust(width)
                    for _, width, key in WATCH_COLUMNS)
