"""Per-tenant write caps and read shares (fs/data/tenantqos.py), on trio's simulated clock.

The simulated device appends 1 MiB in 1 ms (~1 GB/s) when nothing holds a writer;
a cap of 10 MB/s must then show as ~10 MB/s while another tenant is busy, and
as the device's speed while it is alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
import trio.testing
from engine_helpers import CTX, MiB, mounted, pattern

from zonefs_py.format.constants import OpType
from zonefs_py.fs.api import ROOT_INO
from zonefs_py.fs.data.tenantqos import MIN_RATE, TenantBandwidth
from zonefs_py.model.tenants import TenantTable

MB = 1_000_000
APPEND_S = 0.001


class Tenants:
    def __init__(self) -> None:
        self.tenants = TenantTable()

    def declare(self, tid: int, cap_kbs: int = 0, write_share: int = 0,
                read_share: int = 0) -> None:
        op = (OpType.TENANT, tid, 0, 100 + tid, 0, 0, 0, cap_kbs, write_share, read_share)
        self.tenants.apply_set(op)


async def writer(bw: TenantBandwidth, tid: int, until: float,
                 log: list[tuple[float, int]]) -> None:
    """Append 1 MiB chunks of tenant `tid` until `until`, logging (time, bytes)."""
    while trio.current_time() < until:
        await bw.admit(tid, MiB)
        await trio.sleep(APPEND_S)
        bw.wrote(tid, MiB)
        log.append((trio.current_time(), MiB))


async def reader(bw: TenantBandwidth, tid: int, until: float) -> None:
    while trio.current_time() < until:
        bw.read_started(tid)
        await trio.sleep(0.002)
        bw.read_done(tid, 128 << 10)


def rate(log: list[tuple[float, int]], start: float, end: float) -> float:
    return sum(n for t, n in log if start <= t < end) / (end - start)


async def test_alone_a_capped_tenant_runs_at_full_speed(
        autojump_clock: trio.testing.MockClock) -> None:
    t = Tenants()
    t.declare(1, cap_kbs=10_000)
    bw = TenantBandwidth(t)
    t0 = trio.current_time()
    log: list[tuple[float, int]] = []
    await writer(bw, 1, t0 + 2, log)
    assert rate(log, t0, t0 + 2) > 500 * MB
    assert bw.figures[1].throttled_s == 0


async def test_the_cap_holds_while_another_tenant_writes_and_lifts_after(
        autojump_clock: trio.testing.MockClock) -> None:
    t = Tenants()
    t.declare(1, cap_kbs=10_000)  # 10 MB/s
    t.declare(2)
    bw = TenantBandwidth(t)
    t0 = trio.current_time()
    capped: list[tuple[float, int]] = []
    other: list[tuple[float, int]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer, bw, 1, t0 + 6, capped)
        nursery.start_soon(writer, bw, 2, t0 + 3, other)
    busy = rate(capped, t0 + 0.5, t0 + 3)
    assert 9 * MB <= busy <= 11 * MB  # within 10% of the cap
    assert rate(other, t0 + 0.5, t0 + 3) > 100 * MB  # the other is not held
    assert rate(capped, t0 + 3.5, t0 + 6) > 200 * MB  # B idle: full speed again
    assert bw.figures[1].throttled_s > 1
    assert bw.figures[2].throttled_s == 0
    report = bw.report(1)
    assert report["write_cap_bytes_per_s"] == 10 * MB
    assert report["throttled_seconds"] > 1


async def test_undeclared_files_count_as_another_tenant(
        autojump_clock: trio.testing.MockClock) -> None:
    t = Tenants()
    t.declare(1, cap_kbs=20_000)
    bw = TenantBandwidth(t)
    t0 = trio.current_time()
    capped: list[tuple[float, int]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer, bw, 1, t0 + 3, capped)
        nursery.start_soon(writer, bw, 0, t0 + 3, [])
    assert 18 * MB <= rate(capped, t0 + 0.5, t0 + 3) <= 22 * MB


async def test_a_share_is_of_the_measured_device_bandwidth(
        autojump_clock: trio.testing.MockClock) -> None:
    t = Tenants()
    t.declare(1, write_share=30)
    t.declare(2)
    bw = TenantBandwidth(t, device_write_bps=100 * MB)  # the mount's fixed figure
    t0 = trio.current_time()
    capped: list[tuple[float, int]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer, bw, 1, t0 + 3, capped)
        nursery.start_soon(reader, bw, 2, t0 + 3)  # B reads: busy too
    assert 27 * MB <= rate(capped, t0 + 0.5, t0 + 3) <= 33 * MB
    # Measured: alone, the writer shows the device's speed (1 MiB per ms).
    measured = TenantBandwidth(t)
    await writer(measured, 1, trio.current_time() + 1.2, [])
    assert measured.device_write_bps > 500 * MB


async def test_a_read_share_limits_everyone_else_while_its_tenant_reads(
        autojump_clock: trio.testing.MockClock) -> None:
    t = Tenants()
    t.declare(1, read_share=80)  # the dataset tenant: others get 20% while it reads
    t.declare(2)
    bw = TenantBandwidth(t, device_write_bps=100 * MB)
    t0 = trio.current_time()
    other: list[tuple[float, int]] = []
    undeclared: list[tuple[float, int]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader, bw, 1, t0 + 3)
        nursery.start_soon(writer, bw, 2, t0 + 6, other)
        nursery.start_soon(writer, bw, 0, t0 + 3, undeclared)
    together = rate(other, t0 + 0.5, t0 + 3) + rate(undeclared, t0 + 0.5, t0 + 3)
    assert 18 * MB <= together <= 22 * MB
    assert rate(other, t0 + 3.5, t0 + 6) > 200 * MB  # no reads: no limit
    # The reading tenant's own writes are not limited by its share.
    assert bw.limits(1, trio.current_time()) == []


async def test_a_writer_is_never_stopped(autojump_clock: trio.testing.MockClock) -> None:
    t = Tenants()
    t.declare(1, write_share=1)
    t.declare(2, read_share=100)
    bw = TenantBandwidth(t, device_write_bps=10 * MB)  # 1% of it: 0.1 MB/s
    t0 = trio.current_time()
    capped: list[tuple[float, int]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer, bw, 1, t0 + 21, capped)
        nursery.start_soon(reader, bw, 2, t0 + 21)
    # Both limits floor at MIN_RATE: 1 MiB per ~1.05 s.
    assert 0.9 * MIN_RATE <= rate(capped, t0 + 1, t0 + 21) <= 1.1 * MIN_RATE


async def test_fsync_of_a_capped_tenant_finishes_at_its_rate(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """Through the engine: a capped tenant's streaming chunks are held while another
    tenant reads; its fsync waits for them at the cap (not forever), and the bytes
    are right."""
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        a = await fs.mkdir(ROOT_INO, b"ckpt", 0o755, CTX)
        b = await fs.mkdir(ROOT_INO, b"data", 0o755, CTX)
        tid_a = fs.tenants.declare(a.ino, 0, 0, 0)
        tid_b = fs.tenants.declare(b.ino, 0, 0, 0)
        fs.tenants.change(a.ino, None, None, None, write_cap_kbs=2_000)
        bw = fs.data.writes.bandwidth
        bw.read_started(tid_b)  # a dataset read in flight all along
        fh, attr = await fs.create(a.ino, b"step1", 0o644, os.O_RDWR, CTX)
        data = pattern(5, 6 * MiB)
        t0 = trio.current_time()
        for off in range(0, len(data), MiB):
            await fs.write(fh, off, data[off:off + MiB])
        await fs.fsync(fh, False)
        took = trio.current_time() - t0
        # 6 MiB at 2 MB/s: ~3 s (the first chunk's burst aside); it finished.
        assert 2.0 < took < 4.5
        assert bw.figures[tid_a].throttled_s > 2
        bw.read_done(tid_b, 0)
        assert bytes(await fs.read(fh, 0, len(data))) == data
        await fs.release(fh)
        fs.forget([(attr.ino, 1)])


# -- the commands: CLI words, control parsing, refusals ----------------------------------

def _cli(*argv: str) -> tuple[int, str]:
    """Run `zonefs-py tenant ...` up to the control word (returned instead of sent)."""
    import argparse

    from zonefs_py.cli import tenant as cli
    from zonefs_py.cli.main import build_parser

    args = build_parser().parse_args(["tenant", *argv])
    assert isinstance(args, argparse.Namespace)
    words = cli.bandwidth_words(args)
    return (2, "") if words is None else (0, " ".join(words))


def test_cli_bandwidth_words() -> None:
    assert _cli("set", "/x", "--write-mbps", "30") == (0, "30000 - -")
    assert _cli("set", "/x", "--write-share", "30", "--read-share", "70") == (0, "- 30 70")
    assert _cli("set", "/x", "--write-mbps", "0") == (0, "0 - -")
    assert _cli("set", "/x", "--min-zones", "1") == (0, "")
    assert _cli("add", "/x", "--write-mbps", "0.0001") == (2, "")


def test_cli_refuses_both_caps_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    from zonefs_py.cli.main import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["tenant", "set", "/x", "--write-mbps", "3",
                                   "--write-share", "30"])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "why"), [
    (["--write-share", "101"], "at most 100"), (["--read-share", "120"], "at most 100"),
    (["--write-mbps", "-1"], "cannot be negative"), (["--read-share", "-5"], "negative"),
])
def test_cli_refuses_bad_values(flags: list[str], why: str,
                                capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    from zonefs_py.cli.main import main

    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert main(["tenant", "set", "/nonexistent", *flags]) == 2
    assert why in capsys.readouterr().err


async def test_control_sets_clears_and_refuses_bandwidth(tmp_path: Path) -> None:
    from zonefs_py import control, errors

    async with mounted(tmp_path / "fs.img", create=True) as fs:
        a = await fs.mkdir(ROOT_INO, b"a", 0o755, CTX)

        async def ctl(word: str) -> None:
            await control.command(fs, control.CTL_XATTR, word.encode(), CTX)

        def policy() -> tuple[int, int, int]:
            p = fs.state.tenants.by_id[fs.state.tenants.by_dir[a.ino]]
            return p.write_cap_kbs, p.write_share, p.read_share

        await ctl(f"tenant-add {a.ino} 0 0 0 30000 0 0")
        assert policy() == (30000, 0, 0)
        await ctl(f"tenant-set {a.ino} - - - - 25 -")  # a share replaces the absolute cap
        assert policy() == (0, 25, 0)
        await ctl(f"tenant-set {a.ino} - - - - - 70")
        assert policy() == (0, 25, 70)
        await ctl(f"tenant-set {a.ino} 1 - -")  # zone policy only: bandwidth kept
        assert policy() == (0, 25, 70)
        for bad, why in ((f"tenant-set {a.ino} - - - 5 5 -", "not both"),
                         (f"tenant-set {a.ino} - - - - 101 -", "at most 100"),
                         (f"tenant-set {a.ino} - - - - - 101", "at most 100"),
                         (f"tenant-set {a.ino} - - - -5 - -", "not a number")):
            with pytest.raises(errors.InvalidArgument, match=why):
                await ctl(bad)
        assert policy() == (0, 25, 70)
        await ctl(f"tenant-set {a.ino} - - - 0 - 0")  # cleared
        assert policy() == (0, 0, 0)
        figures = fs.tenants.report()["a"]
        assert figures["write_cap_bytes_per_s"] is None
        assert figures["throttled_seconds"] == 0


async def test_a_policy_survives_remount_through_journal_and_checkpoint(
        tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True) as fs:
        a = await fs.mkdir(ROOT_INO, b"a", 0o755, CTX)
        tid = fs.tenants.declare(a.ino, 0, 0, 0, write_share=30, read_share=10)
        await fs.sync()
    async with mounted(image) as fs:  # from the journal
        p = fs.state.tenants.by_id[tid]
        assert (p.write_cap_kbs, p.write_share, p.read_share) == (0, 30, 10)
        fs.tenants.change(a.ino, None, None, None, write_cap_kbs=12_000)
        await fs.checkpoint()
    async with mounted(image) as fs:  # from the checkpoint
        p = fs.state.tenants.by_id[tid]
        assert (p.write_cap_kbs, p.write_share, p.read_share) == (12_000, 0, 10)
        report = fs.tenants.report()["a"]
        assert report["write_cap_mb_s"] == 12.0
        assert report["read_share_pct"] == 10


def test_prometheus_shows_the_bandwidth_figures() -> None:
    from zonefs_py.metrics import render

    doc = {"tenants": {"ckpt": {"declared": True, "write_bytes_per_s": 5_000_000,
                                "read_bytes_per_s": 0, "write_cap_bytes_per_s": 30_000_000,
                                "write_share_pct": 30, "read_share_pct": None,
                                "throttled_seconds": 1.5}}}
    text = render(doc)
    assert 'zonefs_tenant_rate_bytes_per_second{op="write",tenant="ckpt"} 5e+06' in text
    assert 'zonefs_tenant_write_cap_bytes_per_second{tenant="ckpt"} 3e+07' in text
    assert 'zonefs_tenant_share_ratio{kind="write",tenant="ckpt"} 0.3' in text
    assert 'kind="read"' not in text.split("zonefs_tenant_share_ratio")[-1]
    assert 'zonefs_tenant_throttled_seconds_total{tenant="ckpt"} 1.5' in text


def test_mount_option_fixes_the_device_bandwidth() -> None:
    from zonefs_py.fs.options import FsOptions

    opts, _ = FsOptions.from_mount_options({"device_write_mb": "400"})
    assert opts.device_write_mb == 400
    with pytest.raises(ValueError, match="device_write_mb"):
        FsOptions.from_mount_options({"device_write_mb": "-1"})


def test_figures_outside_a_trio_run() -> None:
    t = Tenants()
    t.declare(1, write_share=20)
    report = TenantBandwidth(t).report(1)
    assert report["write_share_pct"] == 20
    assert report["write_cap_bytes_per_s"] is None  # no device figure yet
    assert report["write_capped_now"] is False
