"""Emulator-only tests: image persistence, crash safety, power cuts, fault hooks, refusal.

The hypothesis state machine at the end drives the emulator against a small
in-memory model of null_blk zone semantics (seeded, derandomized).
"""

from __future__ import annotations

import errno
import os
import random
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from zonefs_py.device.base import ZoneCond
from zonefs_py.device.emu_format import (
    EMU_IMAGE_VERSION,
    HEADER_BYTES,
    TABLE_ENTRIES_AT,
    ImageFormatError,
    decode_table,
)
from zonefs_py.device.emulated import EmulatedZonedDevice, probe_image
from zonefs_py.errors import Busy, DeviceRefused

MiB = 1 << 20
BS = 4096
ZS = 1 * MiB


def blk(n: int, fill: int) -> bytes:
    return bytes([fill]) * (n * BS)


def make(path: Path, *, nr_zones: int = 8, cap: int | None = None, nr_conv: int = 1,
         max_open: int = 0, max_active: int = 0, **kw: object) -> EmulatedZonedDevice:
    return EmulatedZonedDevice.create(path, size_bytes=nr_zones * ZS, zone_size_bytes=ZS,
                                      zone_capacity_bytes=cap, nr_conventional=nr_conv,
                                      max_open=max_open, max_active=max_active,
                                      **kw)  # type: ignore[arg-type]


def zstate(dev: EmulatedZonedDevice, idx: int) -> tuple[ZoneCond, int]:
    z = dev.report_zones(idx, 1)[0]
    return z.cond, z.wp_bytes - z.start_bytes


@pytest.fixture
def img(tmp_path: Path) -> Path:
    return tmp_path / "dev.img"


# -- image, persistence -------------------------------------------------------------


def test_spec_version_matches_code() -> None:
    spec = (Path(__file__).parents[2] / "docs" / "SPEC.md").read_text()
    section = spec.split("## Emulator image", 1)[1].split("\n## ", 1)[0]
    assert f"Image version: {EMU_IMAGE_VERSION}" in section


def test_image_is_sparse_and_probed(tmp_path: Path) -> None:
    path = tmp_path / "big.img"
    dev = EmulatedZonedDevice.create(path, size_bytes=4 << 30, zone_size_bytes=64 * MiB)
    dev.close()
    st_ = os.stat(path)
    assert st_.st_size > 4 << 30
    assert st_.st_blocks * 512 < 1 * MiB
    assert probe_image(path)
    (tmp_path / "other").write_bytes(b"\0" * 8192)
    assert not probe_image(tmp_path / "other")
    assert not probe_image(tmp_path / "missing")


def test_create_rejects_bad_geometry(img: Path) -> None:
    with pytest.raises(ValueError, match="capacity"):
        EmulatedZonedDevice.create(img, size_bytes=8 * ZS, zone_size_bytes=ZS,
                                   zone_capacity_bytes=2 * ZS)
    with pytest.raises(ValueError, match="multiple of zone size"):
        EmulatedZonedDevice.create(img, size_bytes=8 * ZS + BS, zone_size_bytes=ZS)
    with pytest.raises(ValueError, match="power of two"):
        EmulatedZonedDevice.create(img, size_bytes=9 * 3 * MiB, zone_size_bytes=3 * MiB)
    assert not img.exists()
    make(img).close()
    with pytest.raises(FileExistsError):
        make(img)


def test_state_persists_across_reopen(img: Path) -> None:
    dev = make(img, cap=ZS // 2)
    dev.write(0, blk(1, 1))
    dev.append(1, blk(2, 2))
    dev.open_zone(2)
    dev.append(3, bytes(ZS // 2))
    dev.finish_zone(4)
    dev.append(5, blk(1, 5))
    dev.reset_zone(5)
    dev.close()
    dev = EmulatedZonedDevice.open(img)
    assert zstate(dev, 1) == (ZoneCond.CLOSED, 2 * BS)  # open zones come back closed
    assert zstate(dev, 2) == (ZoneCond.EMPTY, 0)
    assert zstate(dev, 3) == (ZoneCond.FULL, ZS // 2)
    assert zstate(dev, 4) == (ZoneCond.FULL, ZS)
    assert dev.reset_count(5) == 1
    assert dev.read(0, BS) == blk(1, 1)
    assert dev.read(ZS, 3 * BS) == blk(2, 2) + bytes(BS)
    assert dev.append(1, blk(1, 9)) == ZS + 2 * BS
    dev.close()


def test_read_only_open(img: Path) -> None:
    make(img).close()
    dev = EmulatedZonedDevice.open(img, read_only=True)
    assert dev.info.read_only
    with pytest.raises(OSError) as info:
        dev.append(1, blk(1, 1))
    assert info.value.errno == errno.EBADF
    dev.close()


# -- locking and refusal -------------------------------------------------------------


def test_exclusive_lock(img: Path) -> None:
    dev = make(img)
    with pytest.raises(Busy):
        EmulatedZonedDevice.open(img)
    EmulatedZonedDevice.open(img, read_only=True).close()
    dev.close()
    EmulatedZonedDevice.open(img).close()


def _corrupt(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)


@pytest.mark.parametrize("damage", ["missing", "tiny", "random", "header", "version",
                                    "truncated", "both_tables"])
def test_damaged_images_refused(img: Path, damage: str) -> None:
    if damage != "missing":
        make(img).close()
    geo_table = HEADER_BYTES
    if damage == "tiny":
        img.write_bytes(b"ZNSEMU1\0")
    elif damage == "random":
        img.write_bytes(random.Random(1).randbytes(3 * MiB))
    elif damage == "header":
        _corrupt(img, 30, b"\xff")
    elif damage == "version":
        _corrupt(img, 8, struct.pack("<I", 99))
    elif damage == "truncated":
        os.truncate(img, os.path.getsize(img) - BS)
    elif damage == "both_tables":
        _corrupt(img, geo_table + TABLE_ENTRIES_AT, b"\x01")
        _corrupt(img, geo_table + 4096 + TABLE_ENTRIES_AT, b"\x01")
    with pytest.raises(DeviceRefused) as info:
        EmulatedZonedDevice.open(img)
    assert "\n" not in str(info.value)


def test_one_damaged_table_copy_falls_back(img: Path) -> None:
    dev = make(img)
    dev.append(1, blk(1, 1))
    dev.flush()  # table seq 2 in copy 0 holds wp 4K; seq 1 (copy 1) is gone: created as copy 0
    dev.append(1, blk(1, 2))
    dev.flush()  # seq 3 in copy 1
    dev.close()
    _corrupt(img, HEADER_BYTES + 4096 + TABLE_ENTRIES_AT, b"\x77")
    dev = EmulatedZonedDevice.open(img)
    assert zstate(dev, 1) == (ZoneCond.CLOSED, BS)
    dev.close()


# -- crash safety ---------------------------------------------------------------------


def test_unflushed_appends_lost_on_power_cut(img: Path) -> None:
    dev = make(img)
    dev.append(1, blk(2, 1))
    dev.flush()
    dev.append(1, blk(2, 2))
    dev.simulate_power_cut("drop")
    with pytest.raises(OSError, match="simulated power loss"):
        dev.read(ZS, BS)
    dev2 = EmulatedZonedDevice.open(img)  # the dead device released the lock
    assert zstate(dev2, 1) == (ZoneCond.CLOSED, 2 * BS)
    assert dev2.read(ZS, 4 * BS) == blk(2, 1) + bytes(2 * BS)
    dev.close()
    dev2.close()


@pytest.mark.parametrize("stage", ["before_table", "torn_table"])
def test_cut_between_data_sync_and_table_write(tmp_path: Path, stage: str) -> None:
    img = tmp_path / "t.img"
    dev = make(img, nr_zones=64)  # a table longer than one 512-byte sector
    dev.append(40, blk(1, 1))
    dev.flush()
    dev.append(40, blk(1, 2))
    dev.append(41, blk(1, 3))
    dev.faults.cut_in_next_flush(stage)  # type: ignore[arg-type]
    with pytest.raises(OSError, match="simulated power loss"):
        dev.flush()
    if stage == "torn_table":
        raw = img.read_bytes()
        from zonefs_py.device.emu_format import decode_header
        geo = decode_header(raw[:HEADER_BYTES])
        slots = [raw[geo.table_offset + i * geo.table_copy_bytes:][: geo.table_copy_bytes]
                 for i in range(2)]
        bad = 0
        for slot in slots:
            try:
                decode_table(geo, slot)
            except ImageFormatError:
                bad += 1
        assert bad == 1
    dev.close()
    dev = EmulatedZonedDevice.open(img)
    assert zstate(dev, 40) == (ZoneCond.CLOSED, BS)
    assert zstate(dev, 41) == (ZoneCond.EMPTY, 0)
    dev.close()


def test_reset_is_durable_without_claiming_other_zones(img: Path) -> None:
    dev = make(img)
    dev.append(1, blk(1, 1))
    dev.append(2, blk(3, 2))
    dev.flush()
    dev.append(1, blk(1, 4))  # unflushed
    dev.reset_zone(2)
    dev.finish_zone(3)
    dev.simulate_power_cut("drop")
    dev = EmulatedZonedDevice.open(img)
    assert zstate(dev, 1) == (ZoneCond.CLOSED, BS)
    assert zstate(dev, 2) == (ZoneCond.EMPTY, 0)
    assert zstate(dev, 3) == (ZoneCond.FULL, ZS)
    assert dev.read(2 * ZS, BS) == bytes(BS)
    dev.close()


def test_volatile_conventional_overlay(img: Path) -> None:
    dev = make(img, volatile_cache=True)
    dev.write(0, blk(1, 1))
    dev.flush()
    dev.write(0, blk(1, 2))
    dev.write(BS, blk(1, 3))
    assert dev.read(0, 2 * BS) == blk(1, 2) + blk(1, 3)
    dev.simulate_power_cut("drop")
    dev = EmulatedZonedDevice.open(img)
    assert dev.read(0, 2 * BS) == blk(1, 1) + bytes(BS)
    dev.close()


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_tear_keeps_block_prefix(img: Path, seed: int) -> None:
    dev = make(img, volatile_cache=True)
    dev.append(1, blk(2, 0xEE))
    dev.flush()
    for i in range(6):
        dev.append(1, blk(1, i + 1))
    dev.write(0, blk(4, 0x55))
    dev.simulate_power_cut("tear", rng=random.Random(seed))
    dev = EmulatedZonedDevice.open(img)
    cond, wp = zstate(dev, 1)
    assert 2 * BS <= wp <= 8 * BS
    assert wp % BS == 0
    kept = wp // BS - 2
    expect = blk(2, 0xEE) + b"".join(blk(1, i + 1) for i in range(kept))
    assert dev.read(ZS, 8 * BS) == expect + bytes(8 * BS - len(expect))
    assert cond is ZoneCond.CLOSED
    conv = dev.read(0, 4 * BS)
    assert all(conv[i * BS : (i + 1) * BS] in (blk(1, 0x55), bytes(BS)) for i in range(4))
    dev.close()


def test_cut_after_writes(img: Path) -> None:
    make(img).close()
    dev = EmulatedZonedDevice.open(img, cut_after_writes=3)
    dev.append(1, blk(1, 1))
    dev.flush()
    dev.append(1, blk(1, 2))
    dev.reset_zone(2)  # third counted call completes, then power is gone
    assert dev.faults.writes_seen == 3
    for call in (lambda: dev.append(1, blk(1, 3)), dev.flush, lambda: dev.read(0, BS)):
        with pytest.raises(OSError) as info:
            call()
        assert info.value.errno == errno.EIO
    dev2 = EmulatedZonedDevice.open(img)
    assert zstate(dev2, 1) == (ZoneCond.CLOSED, BS)
    dev2.close()
    dev.close()


def test_crash_sweep_never_claims_unwritten_data(tmp_path: Path) -> None:
    """Cut after every possible write count; the reopened WP never exceeds the synced data."""
    script = [("append", 1), ("append", 2), ("flush", 0), ("append", 1), ("reset", 2),
              ("append", 2), ("flush", 0), ("finish", 1), ("append", 3)]
    nr_counted = sum(op != "flush" for op, _zone in script)
    for cut in range(1, nr_counted + 1):
        img = tmp_path / f"s{cut}.img"
        make(img).close()
        dev = EmulatedZonedDevice.open(img, cut_after_writes=cut)
        flushed: dict[int, int] = {}
        live: dict[int, int] = {}
        failures: list[int | None] = []
        try:
            for op, zone in script:
                if op == "append":
                    dev.append(zone, blk(1, zone))
                    live[zone] = live.get(zone, 0) + BS
                elif op == "flush":
                    dev.flush()
                    flushed = dict(live)
                elif op == "reset":
                    dev.reset_zone(zone)
                    live[zone] = flushed[zone] = 0
                else:
                    dev.finish_zone(zone)
                    live[zone] = flushed[zone] = ZS
        except OSError as exc:
            failures.append(exc.errno)
        dev.close()
        dev = EmulatedZonedDevice.open(img)
        for zone in (1, 2, 3):
            _cond, wp = zstate(dev, zone)
            assert flushed.get(zone, 0) <= wp <= live.get(zone, 0), (cut, zone)
            data = dev.read(zone * ZS, BS)
            if 0 < wp < ZS:
                assert data == blk(1, zone)
        assert failures == ([errno.EIO] if cut < nr_counted else [])
        dev.close()


# -- fault injection ------------------------------------------------------------------------


def test_fail_writes(img: Path) -> None:
    dev = make(img)
    dev.faults.fail_writes(1, times=1)
    with pytest.raises(OSError) as info:
        dev.append(1, blk(1, 1))
    assert info.value.errno == errno.EIO
    assert zstate(dev, 1) == (ZoneCond.IMPLICIT_OPEN, 0)
    assert dev.append(1, blk(1, 1)) == ZS
    dev.faults.fail_writes(2, start_bytes=2 * BS, length_bytes=BS)
    dev.append(2, blk(2, 1))
    with pytest.raises(OSError):
        dev.append(2, blk(1, 1))
    dev.faults.clear()
    dev.append(2, blk(1, 1))
    dev.close()


def test_fail_reads_and_bit_flip(img: Path) -> None:
    dev = make(img)
    dev.append(1, blk(2, 0x0F))
    dev.faults.fail_reads(1, start_bytes=BS, length_bytes=BS)
    assert dev.read(ZS, BS) == blk(1, 0x0F)
    with pytest.raises(OSError) as info:
        dev.read(ZS, 2 * BS)
    assert info.value.errno == errno.EIO
    dev.faults.clear()
    dev.faults.flip_bit_on_read(ZS + 5, bit=4, times=1)
    data = dev.read(ZS, BS)
    assert data[5] == 0x1F
    assert data[:5] == b"\x0f" * 5
    assert dev.read(ZS, BS) == blk(1, 0x0F)
    dev.close()


def test_zone_turns_readonly(img: Path) -> None:
    dev = make(img, max_open=1)
    dev.append(1, blk(1, 3))
    dev.faults.set_zone_readonly(1)
    assert zstate(dev, 1)[0] is ZoneCond.READONLY
    assert dev.read(ZS, BS) == blk(1, 3)
    for call in (lambda: dev.append(1, blk(1, 1)), lambda: dev.reset_zone(1),
                 lambda: dev.finish_zone(1), lambda: dev.open_zone(1)):
        with pytest.raises(OSError) as info:
            call()
        assert info.value.errno == errno.EIO
    dev.append(2, blk(1, 1))  # the open resource was released
    dev.close()
    dev = EmulatedZonedDevice.open(img)
    assert zstate(dev, 1)[0] is ZoneCond.READONLY
    dev.faults.set_zone_readonly(1)  # again: back to EMPTY, as null_blk
    assert zstate(dev, 1) == (ZoneCond.EMPTY, 0)
    dev.close()


def test_zone_turns_offline(img: Path) -> None:
    dev = make(img)
    dev.append(2, blk(1, 3))
    dev.faults.set_zone_offline(2)
    with pytest.raises(OSError) as info:
        dev.read(2 * ZS, BS)
    assert info.value.errno == errno.EIO
    with pytest.raises(OSError):
        dev.append(2, blk(1, 1))
    with pytest.raises(ValueError, match="conventional"):
        dev.faults.set_zone_offline(0)
    dev.close()


def test_buffered_backend(tmp_path: Path) -> None:
    dev = make(tmp_path / "b.img", io_mode="buffered")
    assert not dev.direct_io
    dev.append(1, blk(1, 1))
    dev.close()
    dev = EmulatedZonedDevice.open(tmp_path / "b.img")
    assert dev.direct_io
    assert dev.read(ZS, BS) == blk(1, 1)
    dev.close()


def test_falls_back_to_buffered_when_o_direct_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels before 6.6 refuse O_DIRECT on tmpfs with EINVAL: "auto" must fall back."""
    from zonefs_py.device import emu_io

    def refuse(self: object, path: str, *, read_only: bool) -> None:
        raise OSError(errno.EINVAL, "O_DIRECT not supported")

    monkeypatch.setattr(emu_io.NativeImageIO, "__init__", refuse)
    dev = make(tmp_path / "f.img")
    assert not dev.direct_io
    dev.append(1, blk(1, 1))
    dev.close()
    with pytest.raises(OSError) as info:
        EmulatedZonedDevice.open(tmp_path / "f.img", io_mode="direct")
    assert info.value.errno == errno.EINVAL


# -- model-based test -------------------------------------------------------------------------

NZ, NCONV, CAP_BLOCKS, MAX_OPEN, MAX_ACTIVE = 6, 1, 4, 2, 3
_E, _IO, _EO, _CL, _F = (ZoneCond.EMPTY, ZoneCond.IMPLICIT_OPEN, ZoneCond.EXPLICIT_OPEN,
                         ZoneCond.CLOSED, ZoneCond.FULL)


class ZoneModel(RuleBasedStateMachine):
    """null_blk zone rules re-stated independently, compared after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"zonefs-hyp-{os.getpid()}"
        self.dir.mkdir(exist_ok=True)
        self.path = self.dir / "m.img"
        self.path.unlink(missing_ok=True)
        self.dev = EmulatedZonedDevice.create(
            self.path, size_bytes=NZ * ZS, zone_size_bytes=ZS, zone_capacity_bytes=CAP_BLOCKS * BS,
            nr_conventional=NCONV, max_open=MAX_OPEN, max_active=MAX_ACTIVE)
        self.cond = [ZoneCond.NOT_WP] * NCONV + [_E] * (NZ - NCONV)
        self.wp = [0] * NZ  # blocks
        self.data: list[list[int]] = [[] for _ in range(NZ)]
        self.rr = NCONV

    def teardown(self) -> None:
        self.dev.close()
        self.path.unlink(missing_ok=True)

    def _count(self, *conds: ZoneCond) -> int:
        return sum(c in conds for c in self.cond)

    def _need(self, idx: int) -> int:
        """Return 0 if resources allow opening zone idx (maybe closing an implicit one)."""
        active_ok = self._count(_IO, _EO, _CL) < MAX_ACTIVE
        if self.cond[idx] is _E and not active_ok:
            return errno.EOVERFLOW
        if self._count(_IO, _EO) < MAX_OPEN:
            return 0
        if self._count(_IO) and active_ok:
            order = list(range(self.rr, NZ)) + list(range(NCONV, self.rr))
            victim = next(i for i in order if self.cond[i] is _IO)
            self.cond[victim] = _CL if self.wp[victim] else _E
            self.rr = victim + 1 if victim + 1 < NZ else NCONV
            return 0
        return errno.ETOOMANYREFS

    def _expect(self, code: int, fn: object, *args: object) -> None:
        if code:
            with pytest.raises(OSError) as info:
                fn(*args)  # type: ignore[operator]
            assert info.value.errno == code
        else:
            fn(*args)  # type: ignore[operator]

    @initialize()
    def start(self) -> None:
        pass

    @rule(idx=st.integers(0, NZ - 1), n=st.integers(1, 3), fill=st.integers(1, 255))
    def append(self, idx: int, n: int, fill: int) -> None:
        cond = self.cond[idx]
        code = 0
        if idx < NCONV or cond in (_F,) or self.wp[idx] + n > CAP_BLOCKS:
            code = errno.EIO
        elif cond in (_E, _CL):
            code = self._need(idx)
            if not code:
                self.cond[idx] = _IO
        self._expect(code, self.dev.append, idx, blk(n, fill))
        if not code:
            self.wp[idx] += n
            self.data[idx] += [fill] * n
            if self.wp[idx] == CAP_BLOCKS:
                self.cond[idx] = _F

    @rule(idx=st.integers(NCONV, NZ - 1))
    def reset(self, idx: int) -> None:
        self.dev.reset_zone(idx)
        self.cond[idx], self.wp[idx], self.data[idx] = _E, 0, []

    @rule(idx=st.integers(NCONV, NZ - 1))
    def open(self, idx: int) -> None:
        cond, code = self.cond[idx], 0
        if cond is _F:
            code = errno.EIO
        elif cond in (_E, _CL):
            code = self._need(idx)
        self._expect(code, self.dev.open_zone, idx)
        if not code:
            self.cond[idx] = _EO

    @rule(idx=st.integers(NCONV, NZ - 1))
    def close(self, idx: int) -> None:
        cond = self.cond[idx]
        code = errno.EIO if cond in (_E, _F) else 0
        self._expect(code, self.dev.close_zone, idx)
        if cond in (_IO, _EO):
            self.cond[idx] = _CL if self.wp[idx] else _E

    @rule(idx=st.integers(NCONV, NZ - 1))
    def finish(self, idx: int) -> None:
        cond = self.cond[idx]
        code = self._need(idx) if cond in (_E, _CL) else 0
        self._expect(code, self.dev.finish_zone, idx)
        if not code:
            self.cond[idx] = _F

    @rule()
    def flush_and_reopen(self) -> None:
        self.dev.close()
        self.dev = EmulatedZonedDevice.open(self.path)
        self.rr = NCONV
        for i in range(NCONV, NZ):
            if self.cond[i] in (_IO, _EO):
                self.cond[i] = _CL if self.wp[i] else _E

    @invariant()
    def matches(self) -> None:
        for z in self.dev.report_zones():
            assert z.cond is self.cond[z.index], (z, self.cond)
            if z.index >= NCONV and z.cond is not _F:
                assert z.wp_bytes - z.start_bytes == self.wp[z.index] * BS
            expect = b"".join(blk(1, f) for f in self.data[z.index])
            got = self.dev.read(z.start_bytes, 4 * BS)
            if z.index >= NCONV:
                assert got == expect + bytes(4 * BS - len(expect))


ZoneModel.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, derandomize=True, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestZoneModel = ZoneModel.TestCase
