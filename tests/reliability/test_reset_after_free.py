"""A zone freed by the last release of an unlinked file is reset only once that free is durable.

INV-8. Found by the crash torture (seed 3000, cycle 126): after a power cut an
orphan's extents pointed into a zone that had already been reset, because the
pending reset was tagged with the transaction *before* the one that freed it.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from helpers import CTX, OPTIONS, MiB, fsck_findings, new_image

from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.fs.api import ROOT_INO
from zonefs_py.fs.filesystem import ZoneFS


async def test_zone_of_a_freed_orphan_is_not_reset_before_the_free_is_durable(
        tmp_path: Path) -> None:
    image = tmp_path / "dev.img"
    new_image(image)
    dev = EmulatedZonedDevice.open(image, volatile_cache=True)
    try:
        async with ZoneFS.mount(dev, OPTIONS, close=False) as fs:
            fh, attr = await fs.create(ROOT_INO, b"ckpt.pt", 0o644, os.O_RDWR, CTX)
            await fs.write(fh, 0, random.Random(1).randbytes(2 * MiB))  # owns a whole zone
            await fs.fsync(fh, False)
            await fs.unlink(ROOT_INO, b"ckpt.pt")
            await fs.sync()  # the unlink (nlink 0) is durable; the inode lives on, open
            fs.forget([(attr.ino, 1)])
            await fs.release(fh)  # INODE_FREE: its zone dies, in a transaction not yet durable
            await fs.reclaim.reset_dead_zones()  # a reset pass now must leave that zone alone
            dev.simulate_power_cut("drop")
    finally:
        dev.close()
    assert fsck_findings(image) == []
