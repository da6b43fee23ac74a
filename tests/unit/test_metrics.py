"""Prometheus rendering of a status document, the metrics mount options, the textfile."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from zonefs_py.daemon.options import MountError, parse_host_port
from zonefs_py.fs.latency import PROM_BOUNDS_S, Histogram
from zonefs_py.metrics import render, textfile_name, write_textfile

pytestmark = pytest.mark.smoke  # also run on the lowest prometheus-client (.ci/floor-smoke)

DOC = {
    "device": {"path": "/dev/nullb0", "zone_size": 64 << 20, "nr_zones": 8},
    "filesystem": {"uuid": "u", "label": "l", "read_only": False, "failsafe": None},
    "zones_by_condition": {"EMPTY": 5, "FULL": 3},
    "zones_by_role": {"superblock": 2, "meta": 2, "data": 4},
    "space": {"capacity_bytes": 1000, "live_bytes": 300, "free_bytes": 600,
              "reserve_bytes": 50, "dead_bytes": 100},
    "user_bytes_written": 400, "data_bytes_written": 410, "metadata_bytes_written": 20,
    "cleaner_bytes_copied": 30, "device_bytes_written": 460, "padding_bytes": 2,
    "write_amplification": 1.15,
    "streams": {"checkpoint": {"device_bytes_written": 200, "zones": 1, "live_bytes": 150}},
    "tenants": {"team-a": {"bytes_written": 70, "bytes_stored": 60, "quota_bytes": None}},
    "wear": {"min": 0, "mean": 0.5, "max": 2},
    "cleaner": {"background_passes": 3, "foreground_passes": 1, "zones_cleaned": 2,
                "bytes_copied_this_mount": 30},
    "journal": {"commits": 9, "checkpoints": 1, "pending_bytes": 0, "meta_zones_free": 1},
    "latency": {"read": {"count": 0}, "write": {"count": 0}},
    "daemon": {"failsafe": "boom"},
}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_render_names_units_and_values() -> None:
    hist = Histogram()
    for ns in (5_000, 40_000, 2_000_000, 3_000_000_000):
        hist.record(ns)
    doc = {**DOC, "latency": {"read": Histogram().summary(), "write": hist.summary()}}
    got = samples(render(doc))
    assert got[("zonefs_user_written_bytes_total", ())] == 400
    assert got[("zonefs_cleaner_written_bytes_total", ())] == 30
    assert got[("zonefs_used_bytes", ())] == 300
    assert got[("zonefs_zones", (("condition", "full"),))] == 3
    assert got[("zonefs_stream_live_bytes", (("stream", "checkpoint"),))] == 150
    assert got[("zonefs_tenant_written_bytes_total", (("tenant", "team-a"),))] == 70
    assert ("zonefs_tenant_quota_bytes", (("tenant", "team-a"),)) not in got  # no quota
    assert got[("zonefs_cleaner_passes_total", (("kind", "background"),))] == 3
    assert got[("zonefs_failsafe", ())] == 1
    assert got[("zonefs_write_amplification_ratio", ())] == pytest.approx(1.15)
    assert got[("zonefs_write_latency_seconds_count", ())] == 4
    assert got[("zonefs_write_latency_seconds_sum", ())] == pytest.approx(3.002045)
    buckets = {float(dict(k[1])["le"]): v for k, v in got.items()
               if k[0] == "zonefs_write_latency_seconds_bucket"}
    assert len(buckets) == len(PROM_BOUNDS_S) + 1
    assert buckets[1e-5] == 1 and buckets[5e-5] == 2  # noqa: PT018 - one picture
    assert buckets[0.0025] == 3 and buckets[5.0] == 4  # noqa: PT018
    assert buckets[float("inf")] == 4
    assert got[("zonefs_read_latency_seconds_count", ())] == 0
    for name, _labels in got:
        assert name.startswith("zonefs_")


def test_c_reads_and_the_reasons_reads_went_to_python() -> None:
    dp = {"running": True, "reads_c": 120, "reads_c_bytes": 4096 * 120,
          "reads_python": {"not_published": 3, "checksum_mismatch": 1},
          "maps_published": 2}
    got = samples(render({**DOC, "dataplane": dp}))
    assert got[("zonefs_c_reads_total", ())] == 120
    assert got[("zonefs_c_read_bytes_total", ())] == 4096 * 120
    assert got[("zonefs_c_read_handed_total", (("reason", "not_published"),))] == 3
    assert got[("zonefs_c_read_handed_total", (("reason", "checksum_mismatch"),))] == 1
    assert got[("zonefs_c_read_maps", ())] == 2
    assert not any(name.startswith("zonefs_c_read") for name, _ in samples(render(DOC)))


def test_c_writes_and_why_streams_ended() -> None:
    dp = {"reads_c": 0, "reads_c_bytes": 0, "reads_python": {}, "maps_published": 0,
          "writes": {"writes_c": 40, "writes_c_bytes": 40 << 20, "staged_bytes": 4096,
                     "writes_c_in_place": 39,
                     "streams_ended": {"no_credit": 2, "other_request": 1},
                     "arm_refused": {"space_low": 3}}}
    got = samples(render({**DOC, "dataplane": dp}))
    assert got[("zonefs_c_writes_total", ())] == 40
    assert got[("zonefs_c_write_bytes_total", ())] == 40 << 20
    assert got[("zonefs_c_writes_in_place_total", ())] == 39
    assert got[("zonefs_c_write_streams_ended_total", (("reason", "no_credit"),))] == 2
    assert got[("zonefs_c_write_arm_refused_total", (("reason", "space_low"),))] == 3
    assert got[("zonefs_c_write_staged_bytes", ())] == 4096
    dp_off = {k: v for k, v in dp.items() if k != "writes"}
    assert not any(name.startswith("zonefs_c_write")
                   for name, _ in samples(render({**DOC, "dataplane": dp_off})))


def test_write_amplification_before_any_write_is_nan() -> None:
    got = samples(render({**DOC, "write_amplification": None}))
    value = got[("zonefs_write_amplification_ratio", ())]
    assert value != value  # NaN


def test_parse_host_port() -> None:
    assert parse_host_port("9464") == ("127.0.0.1", 9464)
    assert parse_host_port("0.0.0.0:80") == ("0.0.0.0", 80)
    assert parse_host_port("[::1]:9000") == ("::1", 9000)
    for bad in ("x", "70000", ":0", "host:"):
        with pytest.raises(ValueError):
            parse_host_port(bad)


def test_metrics_options(tmp_path: Path) -> None:
    from zonefs_py.daemon.options import MountConfig

    dev = tmp_path / "d.img"
    dev.write_bytes(b"")
    cfg = MountConfig.build(str(dev), str(tmp_path), [
        f"metrics=9464,metrics_textfile={tmp_path},metrics_interval=2"])
    assert cfg.metrics_addr == ("127.0.0.1", 9464)
    assert cfg.metrics_textfile_dir == str(tmp_path)
    assert cfg.metrics_interval_s == 2
    with pytest.raises(MountError, match="not a directory"):
        MountConfig.build(str(dev), str(tmp_path), [f"metrics_textfile={dev}"])
    with pytest.raises(MountError, match="bad value"):
        MountConfig.build(str(dev), str(tmp_path), ["metrics=nope"])


def test_textfile_write_is_atomic(tmp_path: Path) -> None:
    name = textfile_name("/var/tmp/my.img")
    assert name == "zonefs_my_img.prom"
    path = write_textfile(str(tmp_path), name, "a 1\n")
    ino = os.stat(path).st_ino
    write_textfile(str(tmp_path), name, "a 2\n")
    assert Path(path).read_text() == "a 2\n"
    assert os.stat(path).st_ino != ino  # replaced by rename, never rewritten in place
    assert sorted(os.listdir(tmp_path)) == [name]
