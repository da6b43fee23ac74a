"""Figures for `zonefs-py stat` (JSON-serialisable), built from a mounted filesystem.

The builder reads the filesystem through `StatusSource`, the parts a mounted
ZoneFS exposes, so this module does not import filesystem.py (which calls
`build_status(self)`; docs/DESIGN.md §1). The dict's keys and values are an
interface: `zonefs-py stat` prints them and metrics are built from them.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol

from zonefs_py.alloc.allocator import Allocator
from zonefs_py.cleaner.cleaner import Cleaner
from zonefs_py.device.base import Zone, ZoneCond, ZonedDevice
from zonefs_py.format.constants import (
    C_CLEANER_BYTES,
    C_DATA_BYTES,
    C_PAD_BYTES,
    C_STREAM_BASE,
    C_USER_BYTES,
    Stream,
    ZoneRole,
)
from zonefs_py.format.superblock import Superblock
from zonefs_py.fs.data.datapath import DataPath
from zonefs_py.fs.latency import Histogram
from zonefs_py.fs.options import FsOptions
from zonefs_py.fs.quota import QuotaTracker
from zonefs_py.fs.tenants import TenantAdmin
from zonefs_py.journal.journal import Journal
from zonefs_py.model.lazy import InodeTable
from zonefs_py.model.state import State


class DrainFigures(Protocol):
    """The drain's part of the status (zonefs_py/drain/manager.py)."""

    def status(self) -> dict[str, object]: ...


class StatusSource(Protocol):
    """What the status is built from: the parts of a mounted filesystem (ZoneFS)."""

    dev: ZonedDevice
    #: Block size in bytes.
    bs: int
    sb: Superblock
    state: State
    options: FsOptions
    failsafe: str | None
    alloc: Allocator
    journal: Journal
    quota: QuotaTracker
    tenants: TenantAdmin
    cleaner: Cleaner
    read_latency: Histogram
    write_latency: Histogram
    data: DataPath
    #: Bytes answered to read requests since mount.
    bytes_read: int

    @property
    def drain(self) -> DrainFigures: ...

    def metadata_bytes_written(self) -> int: ...


def zone_roles(fs: StatusSource) -> dict[int, ZoneRole]:
    sb = fs.sb
    roles: dict[int, ZoneRole] = {}
    for z in range(sb.nr_zones):
        if z in (sb.sb_zone_a, sb.sb_zone_b):
            roles[z] = ZoneRole.SUPERBLOCK
        elif sb.meta_first_zone <= z < sb.meta_first_zone + sb.meta_zone_count:
            roles[z] = ZoneRole.META
        elif sb.data_first_zone <= z < sb.data_first_zone + sb.data_zone_count:
            roles[z] = ZoneRole.DATA
        else:
            roles[z] = ZoneRole.UNUSED
    return roles


def build_status(fs: StatusSource) -> dict[str, object]:
    """Return zones by condition, space, write amplification, streams and journal state."""
    zones = fs.dev.report_zones()
    roles = zone_roles(fs)
    by_cond = Counter(z.cond.name for z in zones)
    bs = fs.bs
    c = fs.state.counters
    user = c.get(C_USER_BYTES, 0)
    data = c.get(C_DATA_BYTES, 0)
    meta = fs.metadata_bytes_written()
    cleaner = c.get(C_CLEANER_BYTES, 0)
    device_total = data + meta + cleaner
    # Distinct blocks: a block an instant copy shares counts once (DESIGN 3.13).
    live = (sum(fs.state.zone_live_blocks.values()) - fs.state.shared.extra_total) * bs
    streams = {}
    for s in Stream:
        written = c.get(C_STREAM_BASE + s, 0)
        zones_of = [dz for dz in fs.alloc.zones.values() if dz.stream == s and dz.reserved]
        if written or zones_of:
            streams[s.name.lower()] = {
                "device_bytes_written": written,
                "zones": len(zones_of),
                "live_bytes": sum(fs.alloc.live_bytes(dz.idx) for dz in zones_of),
            }
    zone_map = "".join(_zone_char(fs, z, roles[z.index]) for z in zones)
    zone_detail = _zone_detail(fs, zones) if len(zone_map) <= MAP_CHARS_MAX else {}
    if len(zone_map) > MAP_CHARS_MAX:
        zone_map = _run_length(zone_map)
    total = fs.alloc.total_capacity()
    return {
        "device": {"path": fs.dev.info.path, "kind": fs.dev.info.kind,
                   "block_size": bs, "zone_size": fs.dev.info.zone_size_bytes,
                   "nr_zones": fs.dev.info.nr_zones,
                   "max_open_zones": fs.dev.info.max_open_zones,
                   "max_active_zones": fs.dev.info.max_active_zones,
                   "zone_append": fs.dev.info.zone_append},
        "filesystem": {"uuid": fs.sb.uuid_str, "label": fs.sb.label.decode(errors="replace"),
                       "read_only": fs.options.read_only, "failsafe": fs.failsafe,
                       "inodes": fs.state.inode_count,
                       "disk_version": fs.sb.disk_version},
        "namespace": _namespace(fs),
        "zones_by_condition": dict(sorted(by_cond.items())),
        # Data zones only (meta zones fill too: the log, format 5's index pages).
        "data_zones_by_condition": dict(sorted(Counter(
            z.cond.name for z in zones if roles[z.index] is ZoneRole.DATA).items())),
        "zones_by_role": dict(Counter(r.name.lower() for r in roles.values())),
        "space": {"capacity_bytes": total, "reserve_bytes": fs.alloc.reserve_bytes,
                  "live_bytes": live, "free_bytes": fs.alloc.free_bytes(),
                  "dead_bytes": max(0, sum(dz.reserved for dz in fs.alloc.zones.values())
                                    - live),
                  "wasted_by_finish_bytes": fs.alloc.wasted_bytes,
                  "dead_zones": _dead_zones(fs)},
        "user_bytes_written": user,
        "user_bytes_read": fs.bytes_read,
        "device_bytes_written": device_total,
        "data_bytes_written": data,
        "metadata_bytes_written": meta,
        "cleaner_bytes_copied": cleaner,
        "padding_bytes": c.get(C_PAD_BYTES, 0),
        "write_amplification": round(device_total / user, 4) if user else None,
        "streams": streams,
        "wear": fs.alloc.wear(),
        "tenants": _tenants(fs),
        "cleaner": {"policy": fs.cleaner.policy,
                    "rate_mb_s": fs.options.cleaner_rate_mb_s,
                    "running": fs.cleaner.busy,
                    "low_watermark_zones": fs.cleaner.low_watermark,
                    "zones_cleaned": fs.cleaner.stats.zones_cleaned,
                    "bytes_copied_this_mount": fs.cleaner.stats.bytes_copied,
                    "background_passes": fs.cleaner.stats.passes,
                    "foreground_passes": fs.cleaner.stats.foreground_passes,
                    "reserve_zones": fs.alloc.reserve_zones,
                    "empty_zones": len(fs.alloc.empty_zones())},
        "journal": {"commits": fs.journal.commits,
                    "checkpoints": fs.journal.checkpoints_written,
                    "checkpoint_running": fs.journal.checkpoint_running,
                    "commits_during_checkpoints": fs.journal.commits_during_checkpoints,
                    "pending_bytes": fs.journal.pending_bytes,
                    "bytes_since_checkpoint": fs.journal.journal_bytes_since_checkpoint,
                    "durable_txn": fs.journal.durable_txn, "added_txn": fs.journal.added_txn,
                    "meta_zones_free": fs.journal.log.free_zone_count(),
                    "meta_zones": fs.sb.meta_zone_count,
                    # Format 6: data zones lent to the namespace index, and the
                    # metadata area's share of the device (meta zones + lent).
                    "data_zones_lent_to_index": len(fs.alloc.lent),
                    "meta_area_bytes": (fs.sb.meta_zone_count * fs.sb.zone_size
                                        + fs.alloc.lent_bytes()),
                    "meta_area_share": round((fs.sb.meta_zone_count * fs.sb.zone_size
                                              + fs.alloc.lent_bytes())
                                             / max(1, fs.sb.nr_zones * fs.sb.zone_size), 4),
                    "broken": fs.journal.broken},
        "latency": {"read": fs.read_latency.summary(), "write": fs.write_latency.summary()},
        "read_qos": fs.data.qos.status(),
        "tenant_bandwidth": fs.data.writes.bandwidth.status(),
        "prefetch": fs.data.prefetch.status() if fs.data.prefetch is not None else None,
        "zone_summaries": {"sealed_zones": len(fs.state.zone_seals),
                           "sealed_this_mount": fs.data.sealer.sealed,
                           "summary_bytes_written": fs.data.sealer.summary_bytes,
                           "cache_bytes": fs.data.sums.used_bytes,
                           "cache_limit_bytes": fs.data.sums.cache_bytes,
                           "cache_hits": fs.data.sums.hits,
                           "cache_misses": fs.data.sums.misses,
                           "summary_blocks_read": fs.data.sums.blocks_read,
                           "damaged_blocks_seen": fs.data.sums.damaged},
        "drain": fs.drain.status(),
        "zone_map": zone_map,
        **zone_detail,
    }


#: One character per stream in `zone_streams` (the stream name's initial; DEFAULT is "f").
STREAM_CHARS: dict[int, str] = {Stream.DEFAULT: "f", Stream.METADATA: "m", Stream.CHECKPOINT: "c",
                Stream.DATASET: "d", Stream.LOG: "l", Stream.SCRATCH: "s", Stream.CLEANER: "k"}


#: Characters of declared tenants in `zone_tenants`, given in tenant-id order: letters
#: and digits but those of `zone_map` (the grid by tenant shows both); tenants past the
#: last share TENANT_CHAR_MORE ("other tenants").
TENANT_CHARS = "".join(ch for ch in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                       "0123456789" if ch not in "SMmdDxc")
TENANT_CHAR_MORE = "+"


def tenant_chars(fs: StatusSource) -> dict[int, str]:
    """tenant id -> its character in `zone_tenants` (ids in order)."""
    ids = sorted(fs.state.tenants.by_id)
    return {tid: TENANT_CHARS[i] if i < len(TENANT_CHARS) else TENANT_CHAR_MORE
            for i, tid in enumerate(ids)}


def _zone_detail(fs: StatusSource, zones: list) -> dict[str, Any]:
    """Per zone, for pictures: `zone_streams` (STREAM_CHARS, "-" for no data zone or
    none written) and `zone_live` (live tenths of the capacity, "0"-"9" and "X" for all,
    "-" for no data zone). With declared tenants (issue 45), `zone_tenants` too: the
    character of the tenant owning each data zone ("." nobody, "-" no data zone), and
    `zone_tenant_legend`, character -> the tenant's path (as keyed in `tenants`)."""
    streams, live, owners = [], [], []
    chars = tenant_chars(fs) if fs.state.tenants else {}
    for z in zones:
        dz = fs.alloc.zones.get(z.index)
        if dz is None:
            streams.append("-")
            live.append("-")
            owners.append("-")
            continue
        streams.append(STREAM_CHARS.get(dz.stream, "f") if dz.reserved else "-")
        frac = fs.alloc.live_bytes(dz.idx) / dz.capacity if dz.capacity else 0.0
        live.append("X" if frac >= 0.999 else str(min(9, int(frac * 10))))
        owned = dz.tenant and (dz.reserved or dz.head_of is not None)
        owners.append(chars.get(dz.tenant, TENANT_CHAR_MORE) if owned else ".")
    out: dict[str, Any] = {"zone_streams": "".join(streams), "zone_live": "".join(live)}
    if chars:
        legend: dict[str, str] = {}
        for tid, ch in chars.items():
            path = fs.tenants.path_of(fs.state.tenants.by_id[tid].dir_ino).lstrip("/")
            legend[ch] = path if ch not in legend else "other tenants"
        out["zone_tenants"] = "".join(owners)
        out["zone_tenant_legend"] = legend
    return out


def _dead_zones(fs: StatusSource) -> dict[str, object]:
    """Zones written but holding no live data, by why they are not reset yet."""
    pending = {z for z, _ in fs.alloc.pending_resets}
    why: Counter[str] = Counter()
    for dz in fs.alloc.zones.values():
        if dz.reserved == 0 or fs.alloc.live_bytes(dz.idx):
            continue
        if dz.unusable:
            why["unusable"] += 1
        elif dz.head_of is not None:
            why["write_head"] += 1
        elif dz.inflight:
            why["append_in_flight"] += 1
        elif dz.idx in pending:
            why["awaiting_commit"] += 1
        else:
            why["unqueued"] += 1
    return dict(sorted(why.items()))


#: Beyond this many zones the map is run-length encoded ("D*120 .*30"), so that the
#: status stays well under the 64 KiB an xattr can carry.
MAP_CHARS_MAX = 8192


def _run_length(chars: str) -> str:
    runs: list[str] = []
    i = 0
    while i < len(chars):
        j = i
        while j < len(chars) and chars[j] == chars[i]:
            j += 1
        runs.append(chars[i] if j - i == 1 else f"{chars[i]}*{j - i}")
        i = j
    return " ".join(runs)


def _zone_char(fs: StatusSource, z: Zone, role: ZoneRole) -> str:
    """One character per zone: S superblock, M metadata, . empty data, d/D data
    (partly / fully written), x dead awaiting reset, ! read-only or offline, c conventional."""
    if z.cond in (ZoneCond.READONLY, ZoneCond.OFFLINE):
        return "!"
    if role == ZoneRole.SUPERBLOCK:
        return "S"
    if role == ZoneRole.META:
        return "M" if z.written_bytes else "m"
    if role == ZoneRole.UNUSED:
        return "c"
    if z.written_bytes == 0:
        return "."
    if fs.alloc.live_bytes(z.index) == 0:
        return "x"
    return "D" if z.cond == ZoneCond.FULL else "d"


def _namespace(fs: StatusSource) -> dict[str, object]:
    """Format 5's lazy namespace (model/lazy.py): what is in memory and what was read."""
    table = fs.state.inodes
    if not isinstance(table, InodeTable):
        return {"lazy": False, "resident_inodes": len(table)}
    reader = table.reader
    return {"lazy": True, "resident_inodes": len(table), "inode_cache": table.capacity,
            "faults": table.faults, "evictions": table.evictions,
            "faults_read_in_threads": table.thread_reads,
            "index_device_reads": getattr(reader, "device_reads", 0),
            "index_cached_pages": getattr(getattr(reader, "cache", None), "clean_pages", 0)}


def _tenants(fs: StatusSource) -> dict[str, object]:
    """Top-level directories (implicit tenants) and declared tenants (issue 45), keyed
    by path relative to the mount root; a declared top-level one has both's figures."""
    out: dict[str, object] = dict(fs.quota.tenant_report())
    for path, figures in fs.tenants.report().items():
        implicit = out.get(path)
        out[path] = {**(implicit if isinstance(implicit, dict) else {}), **figures}
    return out
