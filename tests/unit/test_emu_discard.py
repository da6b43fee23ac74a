"""The emulator's data-discarding mode (issue 19): data zones keep state, not bytes.

Device level: blocks appended to a declared data zone read back as zeros,
metadata zones keep their bytes, the declaration survives reopening, a
version-1 header still opens. Engine level: a filesystem on a discarding
image mounts again, verifies the zeros it wrote and passes fsck, while the
image file stays sparse.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import xxhash
from engine_helpers import TEST_OPTIONS, MiB, assert_fsck_clean, read_file, write_file

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
from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.fs.mkfs import make_filesystem

BS = 4096
ZS = 1 * MiB


def make(path: Path, *, discard: bool = True) -> EmulatedZonedDevice:
    return EmulatedZonedDevice.create(path, size_bytes=16 * ZS, zone_size_bytes=ZS,
                                      discard_data=discard)


def test_declared_data_zones_drop_bytes_and_keep_state(tmp_path: Path) -> None:
    img = tmp_path / "d.img"
    dev = make(img)
    assert dev.discard == DataDiscard(enabled=True, first_zone=NO_DISCARD_ZONE)
    dev.append(3, b"\x11" * BS)  # nothing declared yet: stored
    dev.declare_data_zones(5)
    dev.append(4, b"\x22" * BS)  # before the data zones: stored
    off = dev.append(5, b"\x33" * 2 * BS)  # data zone: state moves, bytes dropped
    dev.write(5 * ZS + 2 * BS, b"\x44" * BS)
    dev.flush()
    assert dev.read(3 * ZS, BS) == b"\x11" * BS
    assert dev.read(4 * ZS, BS) == b"\x22" * BS
    assert off == 5 * ZS
    assert dev.read(5 * ZS, 3 * BS) == bytes(3 * BS)
    dev.close()
    dev = EmulatedZonedDevice.open(img, read_only=True)
    assert dev.discard.first_zone == 5
    zone = dev.report_zones(5, 1)[0]
    assert zone.wp_bytes - zone.start_bytes == 3 * BS
    dev.close()


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
    fs = await ZoneFS.load(dev, TEST_OPTIONS)
    await write_file(fs, "/zeros", bytes(6 * MiB))
    await fs.close()
    dev.close()
    # The 6 MiB of data never reached the image file; the metadata did.
    assert os.stat(img).st_blocks * 512 < 2 * MiB
    dev = EmulatedZonedDevice.open(img)
    fs = await ZoneFS.load(dev, TEST_OPTIONS)
    assert await read_file(fs, "/zeros") == bytes(6 * MiB)  # checksums of zeros verify
    await fs.close()
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
