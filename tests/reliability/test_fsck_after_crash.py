"""fsck on an image right after a crash (before any mount recovered it) must be clean."""

from __future__ import annotations

import os
from pathlib import Path

from helpers import CTX, OPTIONS, fsck_findings, new_image, write_file

from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.fs.api import ROOT_INO
from zonefs_py.fs.filesystem import ZoneFS


async def test_fsck_of_crashed_image_with_unlinked_open_file_is_clean(tmp_path: Path) -> None:
    """A file unlinked while open and a crash: recovery frees it, so fsck must not flag it."""
    image = tmp_path / "a.img"
    new_image(image)
    dev = EmulatedZonedDevice.open(image, volatile_cache=True)
    try:
        async with ZoneFS.mount(dev, OPTIONS, close=False) as fs:
            await write_file(fs, b"keep", b"k" * 5000)
            fh, _attr = await fs.create(ROOT_INO, b"open-unlinked", 0o644, os.O_RDWR, CTX)
            await fs.write(fh, 0, b"x" * 10000)
            await fs.fsync(fh, False)
            await fs.unlink(ROOT_INO, b"open-unlinked")
            await fs.sync()
            dev.simulate_power_cut("drop")
    finally:
        dev.close()
    assert fsck_findings(image) == []
