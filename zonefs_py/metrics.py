"""Prometheus metrics, built from the status document that `zonefs-py stat --json` prints.

One source of truth: `StatusCollector` turns a status document (the JSON of
`control.status_document`) into metric families; prometheus-client formats
them. Three ways out:

  * `zonefs-py stat MOUNT --format prometheus` (the CLI reads the document
    through the status xattr and prints `render(doc)`);
  * mount option `metrics=[HOST:]PORT`: the daemon serves GET /metrics over
    HTTP (bound to 127.0.0.1 unless HOST says otherwise);
  * mount option `metrics_textfile=DIR`: the daemon rewrites
    DIR/zonefs_<device>.prom every `metrics_interval` seconds, atomically
    (write a temporary file, fsync, rename), for node_exporter's textfile
    collector.

Names follow Prometheus's guide: `zonefs_` prefix, base units (`_bytes`,
`_seconds`), `_total` on counters. Counters are "since mkfs" where the
engine keeps them on disk (bytes written) and "since mount" otherwise
(cleaner passes, journal commits, latencies); a restart resets the latter,
which Prometheus's rate() handles.

Threads: the HTTP server runs in its own thread (`ThreadingHTTPServer`);
each scrape asks the trio thread for a fresh document through
`trio.from_thread.run_sync`, so the engine is only ever read from the trio
thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    import trio

log = logging.getLogger("zonefs_py.metrics")

StatusFn = Callable[[], dict[str, Any]]

#: Byte counters at the top level of the status document -> metric name.
BYTE_COUNTERS = {
    "user_bytes_written": ("zonefs_user_written_bytes_total",
                           "Bytes written by users (file data accepted)."),
    "data_bytes_written": ("zonefs_data_written_bytes_total",
                           "File-data bytes appended to data zones."),
    "metadata_bytes_written": ("zonefs_metadata_written_bytes_total",
                               "Bytes written to the metadata log (journal, checkpoints)."),
    "cleaner_bytes_copied": ("zonefs_cleaner_written_bytes_total",
                             "Bytes the cleaner copied (live data moved out of victim zones)."),
    "device_bytes_written": ("zonefs_device_written_bytes_total",
                             "All bytes written to the device (data + metadata + cleaner)."),
    "padding_bytes": ("zonefs_padding_bytes_total",
                      "Bytes of padding written to keep appends block-aligned."),
    "user_bytes_read": ("zonefs_user_read_bytes_total",
                        "Bytes answered to read requests (since mount)."),
}
#: The `space` section -> gauge name.
SPACE_GAUGES = {
    "capacity_bytes": ("zonefs_capacity_bytes", "Data capacity of the filesystem."),
    "live_bytes": ("zonefs_used_bytes", "Bytes of live data."),
    "free_bytes": ("zonefs_free_bytes", "Bytes free for new data (reserve excluded)."),
    "reserve_bytes": ("zonefs_reserve_bytes", "Over-provisioning kept for the cleaner."),
    "dead_bytes": ("zonefs_dead_bytes", "Written bytes no file refers to (cleanable)."),
}


class StatusCollector(Collector):
    """A prometheus-client collector that reads a fresh status document on each collect."""

    def __init__(self, status: StatusFn) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        yield from families(self.status())

    def describe(self) -> list[Metric]:
        return []  # unknown until collected: the document decides the label values


def _num(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else 0.0


def families(doc: dict[str, Any]) -> Iterator[Metric]:
    """Yield the metric families of one status document."""
    space = doc.get("space", {})
    for key, (name, doc_s) in SPACE_GAUGES.items():
        yield GaugeMetricFamily(name, doc_s, value=_num(space.get(key)))
    for key, (name, doc_s) in BYTE_COUNTERS.items():
        yield CounterMetricFamily(name[:-len("_total")], doc_s, value=_num(doc.get(key)))
    wa = doc.get("write_amplification")
    yield GaugeMetricFamily("zonefs_write_amplification_ratio",
                            "Device bytes written per user byte (NaN before any user write).",
                            value=_num(wa) if wa is not None else float("nan"))
    yield from _zone_families(doc)
    yield from _stream_families(doc)
    yield from _cleaner_journal_families(doc)
    yield from _zone_summary_families(doc)
    for op in ("read", "write"):
        summary = doc.get("latency", {}).get(op, {})
        hist = summary.get("histogram")
        if not isinstance(hist, dict):
            continue
        fam = HistogramMetricFamily(f"zonefs_{op}_latency_seconds",
                                    f"Latency of FUSE {op} requests (since mount).")
        buckets = [(repr(float(le)), float(c))
                   for le, c in zip(hist["le_seconds"], hist["cumulative"], strict=True)]
        buckets.append(("+Inf", float(summary.get("count", 0))))
        fam.add_metric([], buckets, sum_value=float(hist["sum_seconds"]))
        yield fam
    census = doc.get("requests") or {}
    if census:
        req = CounterMetricFamily("zonefs_fuse_requests",
                                  "FUSE requests since the mount, by opcode (the census).",
                                  labels=["op"])
        for op, count in sorted(census.items()):
            if ":" not in op and op != "forgotten_inodes":
                req.add_metric([op], _num(count))
        yield req
        probe = CounterMetricFamily("zonefs_fuse_getxattr_requests",
                                    "GETXATTR requests since the mount, by attribute name.",
                                    labels=["name"])
        for op, count in sorted(census.items()):
            if op.startswith("GETXATTR:"):
                probe.add_metric([op.partition(":")[2]], _num(count))
        yield probe
    answered = doc.get("requests_answered")
    if isinstance(answered, dict):
        done = CounterMetricFamily("zonefs_fuse_requests_answered",
                                   "FUSE requests answered since the mount, by opcode (FORGET: "
                                   "done; it gets no answer by protocol).", labels=["op"])
        for op, count in sorted(answered.items()):
            done.add_metric([op], _num(count))
        yield done
        yield GaugeMetricFamily("zonefs_fuse_requests_in_flight",
                                "FUSE requests received and not answered yet.",
                                value=_num(doc.get("requests_in_flight")))
    stuck = doc.get("stuck_requests")
    if isinstance(stuck, dict):
        yield GaugeMetricFamily("zonefs_fuse_requests_stuck",
                                "FUSE requests unanswered for longer than stuck_request_s.",
                                value=_num(stuck.get("waiting_total")))
        yield CounterMetricFamily("zonefs_fuse_requests_stuck_reported",
                                  "FUSE requests logged as stuck since the mount.",
                                  value=_num(stuck.get("reported_total")))
        oldest = max((_num(r.get("age_s")) for r in stuck.get("waiting") or []
                      if isinstance(r, dict)), default=0.0)
        yield GaugeMetricFamily("zonefs_fuse_oldest_stuck_request_seconds",
                                "Age of the oldest stuck FUSE request (0: none).", value=oldest)
    yield from _dataplane_families(doc)
    daemon = doc.get("daemon", {})
    fs = doc.get("filesystem", {})
    yield GaugeMetricFamily("zonefs_failsafe", "1 while the mount is in read-only failsafe.",
                            value=1.0 if daemon.get("failsafe") or fs.get("failsafe") else 0.0)
    yield GaugeMetricFamily("zonefs_read_only", "1 if mounted read-only.",
                            value=1.0 if fs.get("read_only") else 0.0)
    wear = GaugeMetricFamily("zonefs_zone_resets", "Resets per data zone since mkfs.",
                             labels=["stat"])
    for stat in ("min", "mean", "max"):
        wear.add_metric([stat], _num(doc.get("wear", {}).get(stat)))
    yield wear
    info = GaugeMetricFamily("zonefs_info", "Constant 1, labelled with the device and fs.",
                             labels=["device", "uuid", "label"])
    info.add_metric([str(doc.get("device", {}).get("path", "")), str(fs.get("uuid", "")),
                     str(fs.get("label", ""))], 1.0)
    yield info


def _dataplane_families(doc: dict[str, Any]) -> Iterator[Metric]:
    """READs answered in C by the data plane (DESIGN 4.10) and why the others went to
    Python; absent without the dispatcher (`-o c_reads=off`, or it did not start)."""
    dp = doc.get("dataplane") or {}
    if not dp:
        return
    yield CounterMetricFamily("zonefs_c_reads", "READs answered in C (since mount).",
                              value=_num(dp.get("reads_c")))
    yield CounterMetricFamily("zonefs_c_read_bytes", "Bytes of READs answered in C.",
                              value=_num(dp.get("reads_c_bytes")))
    handed = CounterMetricFamily("zonefs_c_read_handed",
                                 "READs the dispatcher handed to Python, by reason.",
                                 labels=["reason"])
    for reason, count in sorted((dp.get("reads_python") or {}).items()):
        handed.add_metric([reason], _num(count))
    yield handed
    yield GaugeMetricFamily("zonefs_c_read_maps", "Files whose read map is published.",
                            value=_num(dp.get("maps_published")))
    writes = dp.get("writes") or {}
    if not writes:  # `-o c_writes=off`
        return
    yield CounterMetricFamily("zonefs_c_writes", "WRITEs taken by C write streams "
                              "(DESIGN 4.11; since mount).", value=_num(writes.get("writes_c")))
    yield CounterMetricFamily("zonefs_c_write_bytes", "Bytes of WRITEs taken in C.",
                              value=_num(writes.get("writes_c_bytes")))
    yield CounterMetricFamily("zonefs_c_writes_in_place", "WRITEs taken in C whose payload "
                              "was read from /dev/fuse straight into its staging buffer.",
                              value=_num(writes.get("writes_c_in_place")))
    ended = CounterMetricFamily("zonefs_c_write_streams_ended",
                                "C write streams ended (the next WRITE of the file goes "
                                "to Python), by reason.", labels=["reason"])
    for reason, count in sorted((writes.get("streams_ended") or {}).items()):
        ended.add_metric([reason], _num(count))
    yield ended
    refused = CounterMetricFamily("zonefs_c_write_arm_refused",
                                  "Files the engine did not give a C write stream after a "
                                  "streaming WRITE, by reason.", labels=["reason"])
    for reason, count in sorted((writes.get("arm_refused") or {}).items()):
        refused.add_metric([reason], _num(count))
    yield refused
    yield GaugeMetricFamily("zonefs_c_write_staged_bytes",
                            "Bytes C took and the engine has not taken yet.",
                            value=_num(writes.get("staged_bytes")))


def _zone_families(doc: dict[str, Any]) -> Iterator[Metric]:
    cond = GaugeMetricFamily("zonefs_zones", "Zones by condition (as the device reports).",
                             labels=["condition"])
    for name, count in sorted(doc.get("zones_by_condition", {}).items()):
        cond.add_metric([name.lower()], _num(count))
    yield cond
    role = GaugeMetricFamily("zonefs_zones_by_role", "Zones by role in the layout.",
                             labels=["role"])
    for name, count in sorted(doc.get("zones_by_role", {}).items()):
        role.add_metric([name], _num(count))
    yield role
    dev = doc.get("device", {})
    yield GaugeMetricFamily("zonefs_zone_size_bytes", "Zone size of the device.",
                            value=_num(dev.get("zone_size")))


def _stream_families(doc: dict[str, Any]) -> Iterator[Metric]:
    written = CounterMetricFamily("zonefs_stream_written_bytes",
                                  "Bytes appended to each stream's zones.", labels=["stream"])
    live = GaugeMetricFamily("zonefs_stream_live_bytes", "Live bytes in each stream's zones.",
                             labels=["stream"])
    zones = GaugeMetricFamily("zonefs_stream_zones", "Zones held by each stream.",
                              labels=["stream"])
    for name, s in sorted(doc.get("streams", {}).items()):
        written.add_metric([name], _num(s.get("device_bytes_written")))
        live.add_metric([name], _num(s.get("live_bytes")))
        zones.add_metric([name], _num(s.get("zones")))
    yield from (written, live, zones)
    t_written = CounterMetricFamily("zonefs_tenant_written_bytes",
                                    "Bytes written under each top-level directory.",
                                    labels=["tenant"])
    t_stored = GaugeMetricFamily("zonefs_tenant_stored_bytes",
                                 "Bytes stored under each top-level directory.",
                                 labels=["tenant"])
    t_quota = GaugeMetricFamily("zonefs_tenant_quota_bytes",
                                "Quota of each top-level directory that has one.",
                                labels=["tenant"])
    for name, t in sorted(doc.get("tenants", {}).items()):
        t_written.add_metric([name], _num(t.get("bytes_written")))
        t_stored.add_metric([name], _num(t.get("bytes_stored")))
        if t.get("quota_bytes") is not None:
            t_quota.add_metric([name], _num(t.get("quota_bytes")))
    yield from (t_written, t_stored, t_quota)
    yield from _declared_tenant_families(doc)


def _declared_tenant_families(doc: dict[str, Any]) -> Iterator[Metric]:
    """Declared tenants (issue 45): zones, device bytes by users and cleaner, wear."""
    zones = GaugeMetricFamily("zonefs_tenant_zones",
                              "Zones of each declared tenant: owned, reserved (min), max, "
                              "active (partly written), active_max.",
                              labels=["tenant", "kind"])
    device = CounterMetricFamily("zonefs_tenant_device_written_bytes",
                                 "Device bytes written for each declared tenant, by writer.",
                                 labels=["tenant", "writer"])
    resets = CounterMetricFamily("zonefs_tenant_zone_resets",
                                 "Resets of each declared tenant's zones.", labels=["tenant"])
    wear = GaugeMetricFamily("zonefs_tenant_zone_wear_resets",
                             "Resets of the zones a declared tenant owns: max and mean.",
                             labels=["tenant", "stat"])
    for name, t in sorted(doc.get("tenants", {}).items()):
        if not isinstance(t, dict) or not t.get("declared"):
            continue
        zones.add_metric([name, "owned"], _num(t.get("zones_owned")))
        zones.add_metric([name, "reserved"], _num(t.get("zones_reserved")))
        if t.get("zones_max") is not None:
            zones.add_metric([name, "max"], _num(t.get("zones_max")))
        zones.add_metric([name, "active"], _num(t.get("active_zones")))
        if t.get("active_zones_max") is not None:
            zones.add_metric([name, "active_max"], _num(t.get("active_zones_max")))
        device.add_metric([name, "users"], _num(t.get("device_bytes_written_users")))
        device.add_metric([name, "cleaner"], _num(t.get("device_bytes_written_cleaner")))
        resets.add_metric([name], _num(t.get("zone_resets")))
        w = t.get("wear", {})
        wear.add_metric([name, "max"], _num(w.get("max")))
        wear.add_metric([name, "mean"], _num(w.get("mean")))
    yield from (zones, device, resets, wear)
    yield from _tenant_bandwidth_families(doc)


def _tenant_bandwidth_families(doc: dict[str, Any]) -> Iterator[Metric]:
    """Declared tenants' bandwidth (fs/data/tenantqos.py): rates, policy, throttling."""
    rate = GaugeMetricFamily("zonefs_tenant_rate_bytes_per_second",
                             "File data a declared tenant wrote to / read from the device "
                             "over the last window (0.5 s).", labels=["tenant", "op"])
    cap = GaugeMetricFamily("zonefs_tenant_write_cap_bytes_per_second",
                            "A declared tenant's write cap, absolute or its share of the "
                            "device's write bandwidth (only tenants with one).",
                            labels=["tenant"])
    share = GaugeMetricFamily("zonefs_tenant_share_ratio",
                              "A declared tenant's write or read share (0 to 1; only "
                              "tenants with one).", labels=["tenant", "kind"])
    throttled = CounterMetricFamily("zonefs_tenant_throttled_seconds",
                                    "Time a declared tenant's appends waited at its "
                                    "bandwidth limits (since mount).", labels=["tenant"])
    for name, t in sorted(doc.get("tenants", {}).items()):
        if not isinstance(t, dict) or not t.get("declared") or "throttled_seconds" not in t:
            continue
        rate.add_metric([name, "write"], _num(t.get("write_bytes_per_s")))
        rate.add_metric([name, "read"], _num(t.get("read_bytes_per_s")))
        if t.get("write_cap_bytes_per_s") is not None:
            cap.add_metric([name], _num(t.get("write_cap_bytes_per_s")))
        for kind in ("write", "read"):
            pct = t.get(f"{kind}_share_pct")
            if pct is not None:
                share.add_metric([name, kind], _num(pct) / 100)
        throttled.add_metric([name], _num(t.get("throttled_seconds")))
    yield from (rate, cap, share, throttled)


def _cleaner_journal_families(doc: dict[str, Any]) -> Iterator[Metric]:
    cleaner = doc.get("cleaner", {})
    passes = CounterMetricFamily("zonefs_cleaner_passes", "Cleaner passes (since mount).",
                                 labels=["kind"])
    passes.add_metric(["background"], _num(cleaner.get("background_passes")))
    passes.add_metric(["foreground"], _num(cleaner.get("foreground_passes")))
    yield passes
    yield CounterMetricFamily("zonefs_cleaner_zones_cleaned",
                              "Zones the cleaner emptied (since mount).",
                              value=_num(cleaner.get("zones_cleaned")))
    yield CounterMetricFamily("zonefs_cleaner_copied_bytes",
                              "Bytes the cleaner copied (since mount).",
                              value=_num(cleaner.get("bytes_copied_this_mount")))
    journal = doc.get("journal", {})
    yield CounterMetricFamily("zonefs_journal_commits", "Journal commits (since mount).",
                              value=_num(journal.get("commits")))
    yield CounterMetricFamily("zonefs_journal_checkpoints",
                              "Journal checkpoints written (since mount).",
                              value=_num(journal.get("checkpoints")))
    yield GaugeMetricFamily("zonefs_journal_pending_bytes",
                            "Journal bytes added but not yet durable.",
                            value=_num(journal.get("pending_bytes")))
    yield GaugeMetricFamily("zonefs_journal_meta_zones_free", "Free metadata-log zones.",
                            value=_num(journal.get("meta_zones_free")))


def _zone_summary_families(doc: dict[str, Any]) -> Iterator[Metric]:
    sums = doc.get("zone_summaries") or {}
    yield GaugeMetricFamily("zonefs_sealed_zones",
                            "Data zones whose checksums are in their summary blocks.",
                            value=_num(sums.get("sealed_zones")))
    yield GaugeMetricFamily("zonefs_summary_cache_bytes",
                            "Memory held by checksums read from zone summaries.",
                            value=_num(sums.get("cache_bytes")))
    lookups = CounterMetricFamily("zonefs_summary_cache_lookups",
                                  "Reads needing summary checksums (since mount).",
                                  labels=["result"])
    lookups.add_metric(["hit"], _num(sums.get("cache_hits")))
    lookups.add_metric(["miss"], _num(sums.get("cache_misses")))
    yield lookups


def registry_for(status: StatusFn) -> CollectorRegistry:
    """A registry holding only a StatusCollector over `status` (no process metrics)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(status))
    return registry


def render(doc: dict[str, Any]) -> str:
    """The text exposition format of one status document."""
    return generate_latest(registry_for(lambda: doc)).decode()


def textfile_name(device: str) -> str:
    """`zonefs_<device name>.prom`, with characters node_exporter dislikes replaced."""
    base = os.path.basename(device.rstrip("/")) or "device"
    return "zonefs_" + "".join(c if c.isalnum() or c in "-_" else "_" for c in base) + ".prom"


def write_textfile(directory: str, name: str, text: str) -> str:
    """Write `text` to directory/name atomically (temp file, fsync, rename); return the path."""
    path = os.path.join(directory, name)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


# -- in the daemon -------------------------------------------------------------------------

async def start_exporters(nursery: trio.Nursery, device: str, metrics_addr: tuple[str, int] | None,
                          textfile_dir: str | None, interval_s: float, status: StatusFn) -> None:
    """Start what the mount options ask for: the HTTP endpoint (`metrics=`) and/or the
    textfile writer (`metrics_textfile=`, every `interval_s`) for `device`'s mount.

    Raises OSError if the HTTP port cannot be bound (the mount then fails
    before it reports ready).
    """
    from zonefs_py import control

    if metrics_addr is not None:
        server = serve_http(metrics_addr, status)
        host, port = str(server.server_address[0]), server.server_address[1]
        control.DAEMON_INFO["metrics"] = f"http://{host}:{port}/metrics"
        nursery.start_soon(_stop_http_on_cancel, server)
        log.info("serving Prometheus metrics on http://%s:%d/metrics", host, port)
    if textfile_dir is not None:
        path = os.path.join(textfile_dir, textfile_name(device))
        control.DAEMON_INFO["metrics_textfile"] = path
        nursery.start_soon(_textfile_loop, textfile_dir, textfile_name(device), interval_s,
                           status)


def serve_http(addr: tuple[str, int], status: StatusFn) -> ThreadingHTTPServer:
    """Serve /metrics from a thread; each scrape reads the document in the trio thread."""
    import trio
    from prometheus_client import MetricsHandler

    token = trio.lowlevel.current_trio_token()

    def from_trio() -> dict[str, Any]:
        return trio.from_thread.run_sync(status, trio_token=token)

    handler = MetricsHandler.factory(registry_for(from_trio))
    server = ThreadingHTTPServer(addr, handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="zonefs-metrics", daemon=True).start()
    return server


async def _stop_http_on_cancel(server: ThreadingHTTPServer) -> None:
    import trio

    try:
        await trio.sleep_forever()
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(server.shutdown)
        server.server_close()


async def _textfile_loop(directory: str, name: str, interval_s: float,
                         status: StatusFn) -> None:
    """Rewrite the textfile every `interval_s` (first at once); a failed write only warns."""
    import trio

    warned = False
    while True:
        text = render(status())
        try:
            await trio.to_thread.run_sync(write_textfile, directory, name, text)
            warned = False
        except OSError as exc:
            if not warned:
                log.warning("cannot write the metrics textfile in %s: %s", directory, exc)
            warned = True
        await trio.sleep(interval_s)
