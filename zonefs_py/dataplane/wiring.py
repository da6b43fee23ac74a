"""How the daemon switches the data plane on: arm before `pyfuse3.init`, attach the
read maps to the engine after it, report, and feed C reads' latencies to the QoS
controller. The only place outside dataplane/ that knows both the engine's and
the daemon's side (DESIGN 4.10)."""

from __future__ import annotations

import logging
from typing import Any

import trio

from zonefs_py import dataplane
from zonefs_py.dataplane.cwrites import WriteStreams, c_stats, census_extra, census_names
from zonefs_py.device.base import capabilities
from zonefs_py.fs.cstreams import CREDIT_BYTES, CStreamEngine

log = logging.getLogger(__name__)

#: How often the QoS controller takes the latencies of C reads.
QOS_SAMPLE_S = 0.05


def arm_before_init(fs: Any, on: bool) -> bool:
    """Arm the dispatcher for the next `pyfuse3.init` when `on` and the device can be
    read in C; False (and a log line saying why) otherwise."""
    if not on:
        dataplane.disarm()
        return False
    if capabilities(fs.dev).direct_read_target is None:
        log.warning("C reads off: the device offers no direct read target "
                    "(every READ is served in Python)")
        return False
    info = fs.dev.info
    if not dataplane.arm(info.nr_zones, info.block_size):
        log.warning("C reads off: the dispatcher could not be armed (%s)",
                    dataplane.why_not() or "extension unavailable")
        return False
    return True


def attach_after_init(fs: Any) -> bool:
    """After `pyfuse3.init`: give the engine its read maps if the dispatcher runs."""
    if not dataplane.started():
        log.warning("C reads off: the request dispatcher did not start (%s); every "
                    "request is served in Python", dataplane.why_not() or "unknown")
        return False
    reads = fs.data.reads
    maps = dataplane.ReadMaps(fs.dev, fs.state, fs.data.writes, reads.sums, fs.alloc)
    reads.maps = maps
    fs.alloc.c_pins = maps.zone_pins
    mode = dataplane.io_mode()
    log.info("C reads on: the request dispatcher reads /dev/fuse and serves READs of "
             "settled files (device reads: %s)", mode)
    if mode != "io_uring":
        log.warning("C reads: device reads by pread, one at a time (%s)", mode)
    return True


def attach_writes(fs: Any, on: bool) -> WriteStreams | None:
    """After `attach_after_init`: let C take sequential WRITEs (`-o c_writes`, on by
    default) when the dispatcher runs; the streams, or None. The caller makes
    every request handler absorb first (`fuse_ops.set_c_write_absorber`)."""
    if not on or fs.data.reads.maps is None:
        return None
    engine = CStreamEngine(fs, None)
    try:
        streams = WriteStreams(engine, CREDIT_BYTES)
    except OSError as exc:
        log.warning("C writes off: %s", exc)
        return None
    engine.streams = streams
    fs.c_streams = engine
    fs.data.writes.before_change = engine.before_change
    fs.data.writes.after_chunk = engine.after_chunk
    fs.data.reads.maps.c_streamed = streams.armed
    log.info("C writes on: the dispatcher takes the sequential WRITEs of files the "
             "engine arms (whole blocks at the file's end)")
    return streams


async def absorb_writes(fs: Any) -> None:
    """For the mount's life: take what C staged whenever it says so."""
    engine = getattr(fs, "c_streams", None)
    if engine is not None:
        await engine.streams.run()


def close_writes(fs: Any) -> None:
    """The FUSE session ended (pyfuse3.close ran): no WRITE is taken in C any more,
    and what C staged goes into the engine before it closes."""
    engine = getattr(fs, "c_streams", None)
    if engine is None:
        return
    engine.streams.close()
    fs.data.writes.after_chunk = None


def with_c_reads(fs: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """The adapter's status part with the data plane's counters: READs served in C
    join the census's READ counts, received and answered (the dispatcher answers
    each one it reads, in the same step), and `dataplane` says where each READ
    went."""
    data = getattr(fs, "data", None)
    maps = data.reads.maps if data is not None else None
    if maps is None:
        return extra
    stats = maps.stats()
    out = dict(extra)
    out["dataplane"] = stats
    for key in ("requests", "requests_answered"):
        census = dict(out.get(key) or {})
        if census and stats.get("reads_c"):
            census["READ"] = census.get("READ", 0) + stats["reads_c"]
        out[key] = census
    engine = getattr(fs, "c_streams", None)
    if engine is not None:
        wstats = engine.streams.stats()
        wstats.update(engine.figures())
        stats["writes"] = wstats
    else:  # no streams; the dispatcher answers the capability probes all the same
        wstats = c_stats()
        stats["caps_probes_c"] = wstats.get("caps_probes_c", 0)
    out["requests"] = census_names(wstats, out["requests"])
    out["requests_answered"] = census_extra(wstats, out["requests_answered"])
    return out


async def feed_qos(fs: Any) -> None:
    """Hand the latencies of C reads to the read QoS controller (fs/data/qos.py), which
    otherwise sees only the reads Python serves; and warm the checksums of maps
    published without them (`ReadMaps.warm_checksums`), beside it."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_warm, fs)
        await _feed_qos(fs)


async def _warm(fs: Any) -> None:
    while fs.data.reads.maps is None:
        if not dataplane.started():
            return
        await trio.sleep(QOS_SAMPLE_S)
    await fs.data.reads.maps.warm_checksums()


async def _feed_qos(fs: Any) -> None:
    qos = fs.data.writes.qos
    bandwidth = fs.data.writes.bandwidth
    while True:
        await trio.sleep(QOS_SAMPLE_S)
        maps = fs.data.reads.maps
        if maps is None:
            continue
        if fs.state.tenants:
            # The tenants' C reads: their read activity and rates (fs/data/tenantqos.py).
            bandwidth.add_c_reads(maps.tenant_served([0, *fs.state.tenants.by_id]))
        if not qos.enabled:
            continue
        samples = maps.qos_samples()
        if samples:
            qos.add_samples(samples)
