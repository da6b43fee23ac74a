"""A read (or stat) racing the writer's fsync must see every byte whose write() returned."""

from __future__ import annotations

import os
import random
from pathlib import Path

import trio
from helpers import CTX, OPTIONS, new_image

from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.fs.api import ROOT_INO
from zonefs_py.fs.filesystem import ZoneFS


async def test_reads_and_getattr_during_fsync_see_written_data(tmp_path: Path) -> None:
    image = tmp_path / "dev.img"
    new_image(image)
    rng = random.Random(5)
    dev = EmulatedZonedDevice.open(image)
    try:
        async with ZoneFS.mount(dev, OPTIONS) as fs:
            wrong: list[str] = []
            for n in range(40):
                data = rng.randbytes(rng.randrange(1, 64) << 10)
                fh, attr = await fs.create(ROOT_INO, f"f{n}".encode(), 0o644, os.O_RDWR, CTX)
                await fs.write(fh, 0, data)

                async def reader(delay: int, ino: int = attr.ino, data: bytes = data) -> None:
                    for _ in range(delay):  # land at every await point of the fsync
                        await trio.lowlevel.checkpoint()
                    size = (await fs.getattr(ino)).size
                    fh2 = await fs.open(ino, os.O_RDONLY)
                    got = await fs.read(fh2, 0, 128 << 10)
                    await fs.release(fh2)
                    if size != len(data) or got != data:
                        wrong.append(f"delay {delay}: size {size}, read {len(got)} of {len(data)}")

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(fs.fsync, fh, False)
                    for delay in range(12):
                        nursery.start_soon(reader, delay)
                await fs.release(fh)
    finally:
        dev.close()
    assert not wrong, wrong[:5]
