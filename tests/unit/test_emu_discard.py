"""The emulator's data-discarding mode (issue 19): data zones keep state, not zeros.

Device level: all-zero blocks written to a declared data zone are not stored
(the file stays sparse) while other blocks are and read back exactly, in
plain and zone-append mode; a reset, a power cut or a failed write never
lets an older generation's blocks show through skipped zeros (EMU-4);
metadata zones keep their bytes, the declaration survives reopening, a
version-1 header still opens. Engine level: a filesystem on a discarding
image mounts again, verifies the zeros it wrote and passes fsck, while the
image file stays sparse.
"""

from __future__ import annotations

import errno
import os
import random
import struct
from pathlib import Path

import pytest
import xxhash
from engine_helpers import TEST_OPTIONS, MiB, assert_fsck_clean, read_file, write_file

from zonefs_py.device import emu_io
from zonefs_py.device.emu_format import (
    HEADER_BYTES,
    HEADER_MAGIC,
    NO_DISCARD_ZONE,
    DataDiscard,
    Geometry,
    ImageFormatError,
    decode_header_full,
    encode_header,
)
from zonefs_py.device.emu_io import IOMode, nonzero_runs
from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.fs.mkfs import make_filesystem

BS = 4096
ZS = 1 * MiB


def make(path: Path, *, discard: bool = True, zone_append: bool = False,
         io_mode: IOMode = "auto") -> EmulatedZonedDevice:
    return EmulatedZonedDevice.create(path, size_bytes=16 * ZS, zone_size_bytes=ZS,
                                      discard_data=discard, zone_append=zone_append,
                                      io_mode=io_mode)


def test_declared_data_zones_drop_zeros_and_keep_state(tmp_path: Path) -> None:
    img = tmp_path / "d.img"
    dev = make(img)
    assert dev.discard == DataDiscard(enabled=True, first_zone=NO_DISCARD_ZONE)
    dev.append(3, b"\x11" * BS)  # nothing declared yet: stored
    dev.declare_data_zones(5)
    dev.append(4, b"\x22" * BS)  # before the data zones: stored
    off = dev.append(5, bytes(2 * BS))  # data zone: state moves, zeros dropped
    dev.write(5 * ZS + 2 * BS, b"\x44" * BS)  # anything else is stored
    dev.flush()
    assert dev.read(3 * ZS, BS) == b"\x11" * BS
    assert dev.read(4 * ZS, BS) == b"\x22" * BS
    assert off == 5 * ZS
    assert dev.read(5 * ZS, 3 * BS) == bytes(2 * BS) + b"\x44" * BS
    assert data_extents(img, dev, 5) == [(2 * BS, 3 * BS)]
    dev.close()
    dev = EmulatedZonedDevice.open(img, read_only=True)
    assert dev.discard.first_zone == 5
    zone = dev.report_zones(5, 1)[0]
    assert zone.wp_bytes - zone.start_bytes == 3 * BS
    assert dev.read(5 * ZS + 2 * BS, BS) == b"\x44" * BS
    dev.close()


def data_extents(img: Path, dev: EmulatedZonedDevice, zone_idx: int) -> list[tuple[int, int]]:
    """Return the allocated [start, end) ranges of the zone's file range, zone-relative."""
    base = dev.geometry.data_offset + zone_idx * ZS
    out: list[tuple[int, int]] = []
    fd = os.open(img, os.O_RDONLY)
    try:
        pos = base
        while pos < base + ZS:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno != errno.ENXIO:
                    raise
                break
            if start >= base + ZS:
                break
            end = min(os.lseek(fd, start, os.SEEK_HOLE), base + ZS)
            out.append((start - base, end - base))
            pos = end
    finally:
        os.close(fd)
    return out


def mixed(nr_blocks: int, nonzero: dict[int, int]) -> bytes:
    """`nr_blocks` blocks of zeros except block i filled with byte `nonzero[i]`."""
    buf = bytearray(nr_blocks * BS)
    for idx, fill in nonzero.items():
        buf[idx * BS : (idx + 1) * BS] = bytes([fill]) * BS
    return bytes(buf)


def test_nonzero_runs() -> None:
    mib = 1 << 20
    assert nonzero_runs(bytes(4 * mib), BS) == []
    buf = bytearray(3 * mib)
    buf[5] = 1  # one byte marks its whole block
    buf[mib - 512 : mib + 512] = b"\xff" * 1024  # a run across the 1 MiB scan step
    buf[-1] = 7
    assert nonzero_runs(buf, 512) == [(0, 512), (mib - 512, mib + 512), (3 * mib - 512, 3 * mib)]
    assert nonzero_runs(memoryview(buf)[: 2 * BS], BS) == [(0, BS)]
    assert nonzero_runs(os.urandom(3 * BS), BS) == [(0, 3 * BS)]


@pytest.mark.parametrize("io_mode", ["auto", "buffered"])
@pytest.mark.parametrize("zone_append", [False, True])
def test_nonzero_blocks_amid_zeros_are_stored(tmp_path: Path, io_mode: IOMode,
                                              zone_append: bool) -> None:
    img = tmp_path / "m.img"
    dev = make(img, zone_append=zone_append, io_mode=io_mode)
    dev.declare_data_zones(2)
    blocks_before = os.stat(img).st_blocks
    writes: list[tuple[int, int]] = []
    real_pwrite = dev._io.pwrite

    def counting_pwrite(offset_bytes: int, data: emu_io.Buffer) -> None:
        writes.append((offset_bytes, memoryview(data).nbytes))
        real_pwrite(offset_bytes, data)

    dev._io.pwrite = counting_pwrite  # type: ignore[method-assign]
    zeros = bytes(ZS // 2)
    dev.append(2, zeros)
    dev.write(3 * ZS, zeros)
    assert writes == []
    assert os.stat(img).st_blocks == blocks_before  # zeros use no space
    # One non-zero block in a 512 KiB write; then runs of 3 and 1 blocks.
    payload = mixed(128, {64: 0xA5})
    off = dev.append(2, payload)
    runs = mixed(16, {2: 1, 3: 2, 4: 3, 9: 4})
    dev.write(3 * ZS + ZS // 2, runs)
    base = dev.geometry.data_offset
    assert writes == [(base + off + 64 * BS, BS), (base + 3 * ZS + ZS // 2 + 2 * BS, 3 * BS),
                      (base + 3 * ZS + ZS // 2 + 9 * BS, BS)]
    dev.flush()
    assert dev.read(off, len(payload)) == payload
    assert dev.read(3 * ZS + ZS // 2, len(runs)) == runs
    assert dev.read(2 * ZS, ZS // 2) == zeros
    assert data_extents(img, dev, 2) == [(ZS // 2 + 64 * BS, ZS // 2 + 65 * BS)]
    assert data_extents(img, dev, 3) == [(ZS // 2 + 2 * BS, ZS // 2 + 5 * BS),
                                         (ZS // 2 + 9 * BS, ZS // 2 + 10 * BS)]
    dev.close()
    dev = EmulatedZonedDevice.open(img, read_only=True)
    assert dev.read(off, len(payload)) == payload
    dev.close()


@pytest.mark.parametrize("zone_append", [False, True])
def test_reset_zone_reads_zeros_over_older_blocks(tmp_path: Path, zone_append: bool) -> None:
    img = tmp_path / "r.img"
    dev = make(img, zone_append=zone_append)
    dev.declare_data_zones(2)
    old = mixed(64, {0: 1, 10: 2, 63: 3})
    dev.append(4, old)
    dev.finish_zone(4)
    dev.flush()
    assert data_extents(img, dev, 4) != []
    dev.reset_zone(4)
    assert data_extents(img, dev, 4) == []  # the reset punched the zone's range
    assert dev.read(4 * ZS, len(old)) == bytes(len(old))
    # A new generation of zeros with a block elsewhere: the old blocks stay gone.
    new = mixed(64, {20: 9})
    pieces = dev.append_scattered(4, new)
    assert sum(length for _off, length in pieces) == len(new)
    dev.flush()
    got = b"".join(dev.read(off, length) for off, length in pieces)
    assert got == new
    assert dev.reset_count(4) == 1
    dev.close()
    dev = EmulatedZonedDevice.open(img, read_only=True)
    assert b"".join(dev.read(off, length) for off, length in pieces) == new
    dev.close()


@pytest.mark.parametrize("mode", ["drop", "tear"])
def test_power_cut_leftovers_never_show_through_zeros(tmp_path: Path, mode: str) -> None:
    """Blocks past the recorded write pointer after a cut are punched by the next write."""
    img = tmp_path / "p.img"
    dev = make(img)
    dev.declare_data_zones(2)
    dev.append(5, mixed(4, {1: 0x77}))
    dev.flush()
    dev.append(5, mixed(8, {i: 0x88 for i in range(8)}))  # unflushed
    dev.simulate_power_cut(mode, rng=random.Random(3))  # type: ignore[arg-type]
    dev.close()
    dev = EmulatedZonedDevice.open(img)
    rel = dev.report_zones(5, 1)[0].wp_bytes - 5 * ZS
    assert rel in range(4 * BS, 12 * BS + 1, BS)
    dev.write(5 * ZS + rel, bytes(12 * BS - rel + 4 * BS))
    assert dev.read(5 * ZS, 4 * BS) == mixed(4, {1: 0x77})  # below the WP: kept
    expect = mixed(8, {i: 0x88 for i in range(8)})[: rel - 4 * BS]
    assert dev.read(5 * ZS + 4 * BS, 12 * BS) == expect + bytes(12 * BS - len(expect))
    dev.close()


def test_failed_write_leftovers_never_show_through_zeros(tmp_path: Path) -> None:
    img = tmp_path / "f.img"
    dev = make(img, io_mode="buffered")
    dev.declare_data_zones(2)
    real_pwrite = dev._io.pwrite
    calls = 0

    def failing_second_pwrite(offset_bytes: int, data: emu_io.Buffer) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise OSError(errno.EIO, "injected")
        real_pwrite(offset_bytes, data)

    dev._io.pwrite = failing_second_pwrite  # type: ignore[method-assign]
    with pytest.raises(OSError, match="injected"):
        dev.append(3, mixed(8, {1: 5, 6: 6}))  # first run stored, second fails
    dev._io.pwrite = real_pwrite  # type: ignore[method-assign]
    assert dev.report_zones(3, 1)[0].wp_bytes == 3 * ZS  # nothing acknowledged
    dev.append(3, bytes(8 * BS))
    assert dev.read(3 * ZS, 8 * BS) == bytes(8 * BS)
    dev.close()


def test_no_punch_hole_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(_fd: int, _offset: int, _length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    img = tmp_path / "n.img"
    dev = make(img)
    dev.declare_data_zones(2)
    monkeypatch.setattr(emu_io, "punch_hole", refuse)
    with pytest.raises(OSError, match="cannot punch holes") as info:
        dev.append(2, bytes(BS))  # the zone's range is unknown after open
    assert info.value.errno == errno.EOPNOTSUPP
    dev.close()
    monkeypatch.setattr("zonefs_py.device.emu_discard.punch_hole", refuse)  # create's probe
    with pytest.raises(OSError, match="cannot punch holes"):
        make(tmp_path / "n2.img")
    assert not (tmp_path / "n2.img").exists()
    make(tmp_path / "n3.img", discard=False).close()  # only the mode needs it


def test_declare_is_a_no_op_without_the_mode(tmp_path: Path) -> None:
    dev = make(tmp_path / "n.img", discard=False)
    dev.declare_data_zones(2)
    dev.append(3, b"\x55" * BS)
    assert dev.read(3 * ZS, BS) == b"\x55" * BS
    assert not dev.discard.enabled
    dev.close()


def test_declare_refuses_a_zone_out_of_range(tmp_path: Path) -> None:
    dev = make(tmp_path / "r.img")
    with pytest.raises(OSError, match="out of range"):
        dev.declare_data_zones(16)
    dev.close()


def _v1_header(geo: Geometry) -> bytes:
    """A version-1 header as the previous code wrote it (80 bytes of fields)."""
    head = struct.pack("<8sIIIIQQIIIIQQQ", HEADER_MAGIC, 1, 80, geo.block_size,
                       geo.nr_conventional, geo.zone_size_bytes, geo.zone_capacity_bytes,
                       geo.nr_zones, geo.max_open, geo.max_active, 0, geo.table_offset,
                       geo.table_copy_bytes, geo.data_offset)
    block = bytearray(HEADER_BYTES)
    block[: len(head)] = head
    block[120:128] = xxhash.xxh64_intdigest(bytes(block[:120])).to_bytes(8, "little")
    return bytes(block)


def test_version_1_image_still_opens(tmp_path: Path) -> None:
    img = tmp_path / "v1.img"
    dev = make(img, discard=False)
    geo = dev.geometry
    dev.append(2, b"\x66" * BS)
    dev.close()
    with open(img, "r+b") as fh:
        fh.write(_v1_header(geo))
    dev = EmulatedZonedDevice.open(img)
    assert not dev.discard.enabled
    assert dev.read(2 * ZS, BS) == b"\x66" * BS
    dev.close()


def test_unknown_flags_and_bad_discard_zone_refused() -> None:
    geo = Geometry(BS, ZS, ZS, 16, 0, 0, 0)
    good = encode_header(geo, DataDiscard(enabled=True, first_zone=4))
    assert decode_header_full(good)[1] == DataDiscard(True, 4)

    def forged(flags: int, first_zone: int) -> bytes:
        block = bytearray(good)
        block[52:56] = flags.to_bytes(4, "little")
        block[80:84] = first_zone.to_bytes(4, "little")
        block[120:128] = xxhash.xxh64_intdigest(bytes(block[:120])).to_bytes(8, "little")
        return bytes(block)

    with pytest.raises(ImageFormatError, match="unknown header flags"):
        decode_header_full(forged(3, 4))
    with pytest.raises(ImageFormatError, match="out of range"):
        decode_header_full(forged(1, 16))


async def test_filesystem_on_a_discarding_image(tmp_path: Path) -> None:
    img = tmp_path / "fs.img"
    dev = EmulatedZonedDevice.create(img, size_bytes=64 * MiB, zone_size_bytes=2 * MiB,
                                     discard_data=True)
    sb = make_filesystem(dev)
    assert dev.discard.first_zone == sb.data_first_zone
    async with ZoneFS.mount(dev, TEST_OPTIONS) as fs:
        await write_file(fs, "/zeros", bytes(6 * MiB))
    dev.close()
    # The 6 MiB of data never reached the image file; the metadata did.
    assert os.stat(img).st_blocks * 512 < 2 * MiB
    dev = EmulatedZonedDevice.open(img)
    async with ZoneFS.mount(dev, TEST_OPTIONS) as fs:
        assert await read_file(fs, "/zeros") == bytes(6 * MiB)  # checksums of zeros verify
    dev.close()
    assert_fsck_clean(img)


def test_cli_create_mkfs_info(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from zonefs_py.cli.main import main

    img = str(tmp_path / "c.img")
    assert main(["emu", "create", img, "--size", "64M", "--zone-size", "2M",
                 "--discard-data"]) == 0
    assert "data zones discarded after mkfs" in capsys.readouterr().out
    assert main(["emu", "info", img]) == 0
    assert "discard data:    no zone yet" in capsys.readouterr().out
    assert main(["mkfs", img]) == 0
    capsys.readouterr()
    assert main(["emu", "info", img]) == 0
    dev = EmulatedZonedDevice.open(img, read_only=True)
    first = dev.discard.first_zone
    dev.close()
    assert f"discard data:    zones >= {first}" in capsys.readouterr().out
