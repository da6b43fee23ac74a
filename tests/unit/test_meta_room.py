"""The meta area bounds the namespace: creates get ENOSPC, the mount stays writable.

A namespace whose checkpoint outgrows what the meta zones can rotate used to
make the engine checkpoint back to back and then turn read-only (LogFull).
`NamespaceOps._check_meta_room` refuses new names first
(`Journal.checkpoint_budget_bytes`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import CTX, Geometry, KiB, MiB, create_files, mounted

from zonefs_py import errors
from zonefs_py.fs.api import ROOT_INO
from zonefs_py.fs.filesystem import ZoneFS

#: 4 meta zones of 128 KiB: checkpoints of at most ~115 KiB on the device, a few
#: thousand files (records are compressed).
GEO = Geometry(size_bytes=16 * MiB, zone_size_bytes=128 * KiB, meta_zones=4)


async def fill(fs: ZoneFS, parent: int, prefix: bytes, inline: bytes) -> int:
    """Create files (with `inline` bytes each) until ENOSPC; return how many."""
    n = await create_files(fs, parent, prefix, 100_000, inline)
    assert n < 100_000, "never refused"
    return n


@pytest.mark.expect_log("zonefs_py.fs.namespace", "WARNING", "the metadata area is full")
@pytest.mark.parametrize("inline", [b"", b"y" * 200])
async def test_creates_get_enospc_and_the_mount_stays_writable(tmp_path: Path,
                                                               inline: bytes) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, geo=GEO, create=True) as fs:
        d = await fs.mkdir(ROOT_INO, b"d", 0o755, CTX)
        n = await fill(fs, d.ino, b"file-", inline)
        assert n > 100
        with pytest.raises(errors.NoSpace):
            await fs.mkdir(ROOT_INO, b"e", 0o755, CTX)
        with pytest.raises(errors.NoSpace):
            await fs.symlink(ROOT_INO, b"s", b"target", CTX)
        with pytest.raises(errors.Exists):  # the request's own error comes first
            await fs.mkdir(d.ino, b"file-000000", 0o755, CTX)
        # Still writable: commits and checkpoints go on, deletes make room again.
        assert fs.failsafe is None
        await fs.journal.commit()
        await fs.journal.checkpoint()
        for i in range(n // 2):
            await fs.unlink(d.ino, b"file-%06d" % i)
        await fs.journal.checkpoint()
        again = await fill(fs, d.ino, b"more-", inline)
        assert again >= n // 4
        assert fs.failsafe is None
    # A remount (the estimate starts from the checkpoint it loads) refuses too.
    async with mounted(image, geo=GEO) as fs:
        d_ino = fs.state.inodes[ROOT_INO].entries[b"d"]  # type: ignore[index]
        late = 0
        while late < 10_000:
            try:
                await fs.mknod(d_ino, b"late-%04d" % late, 0o100644, 0, CTX)
            except errors.NoSpace:
                break
            late += 1
        assert late < 10_000
        assert fs.failsafe is None
