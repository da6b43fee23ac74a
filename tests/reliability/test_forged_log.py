"""A log whose records are valid but whose ops break the tree (INV-11) is refused at mount.

Found by fuzz_images.py's re-signed mutations: a DIRENT_ADD giving a directory
a second name loaded fine and served the kernel a directory alias (a loop).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import CTX, OPTIONS, fsck_findings, new_image

from zonefs_py import errors
from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.format.constants import OpType
from zonefs_py.fs.api import ROOT_INO
from zonefs_py.fs.filesystem import ZoneFS


async def test_directory_with_two_names_in_the_log_is_refused(tmp_path: Path) -> None:
    image = tmp_path / "dev.img"
    new_image(image)
    dev = EmulatedZonedDevice.open(image)
    try:
        async with ZoneFS.mount(dev, OPTIONS, close=False) as fs:
            a = (await fs.mkdir(ROOT_INO, b"a", 0o755, CTX)).ino
            b = (await fs.mkdir(a, b"b", 0o755, CTX)).ino
            fs.journal.add([(OpType.DIRENT_ADD, b, a, b"loop")])  # forged: a inside its own child
            await fs.journal.commit()
            fh, _ = await fs.create(ROOT_INO, b"f", 0o644, os.O_RDWR, CTX)
            await fs.release(fh)
    finally:
        dev.close()  # no clean close: the forged op stays in the journal
    assert any(f.startswith("INV-11") for f in fsck_findings(image))
    dev = EmulatedZonedDevice.open(image, read_only=True)
    try:
        with pytest.raises(errors.CorruptionError, match="INV-11"):
            await ZoneFS.load(dev, OPTIONS.replace(read_only=True))
    finally:
        dev.close()
