"""Random file operations through a real mount, against a model (tests/integration/fsx.py).

Every run prints its seed; a failure names the operation log (kept under
pytest's tmp_path) and the expected/actual copies saved beside it. Replay:
`python tests/integration/fsx.py MOUNTDIR --replay LOG`. The teardown fsck
checks every invariant of the result, INV-5 (an extent's checksums cover
exactly its blocks) among them.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from . import fsx
from .conftest import Mount

pytestmark = pytest.mark.integration

#: Issue 18's reproduction (pwrite/ftruncate/pread, one file, default options):
#: two runs in three turned the mount read-only before the fix.
ISSUE18_OPS = [("write", 0x19CB4, 0x98330), ("truncate", 0, 0x5AAD9E),
               ("write", 0x246CB, 0x1DACF), ("write", 0x159A11, 0x51F65),
               ("write", 0xDC087, 0xA1D5C), ("write", 0xACE4E, 0x7E881),
               ("truncate", 0, 0x1E4D74), ("read", 0x22FFC, 0x8F02B)]


def test_issue18_sequence_repeated(mounted: Mount) -> None:
    path = mounted.path / "f"
    for run in range(10):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        rnd = random.Random(1)
        model = bytearray()
        try:
            for op, a, b in ISSUE18_OPS:
                if op == "write":
                    d = rnd.randbytes(b)
                    os.pwrite(fd, d, a)
                    model.extend(bytes(max(0, a + b - len(model))))
                    model[a:a + b] = d
                elif op == "truncate":
                    os.ftruncate(fd, b)
                    del model[b:]
                    model.extend(bytes(b - len(model)))
                else:
                    assert os.pread(fd, b, a) == bytes(model[a:a + b]), f"run {run}"
        finally:
            os.close(fd)
    # Still writable: no failsafe switch.
    (mounted.path / "after").write_bytes(b"ok")
    assert "failsafe" not in mounted.log_text()


def _run(mounted: Mount, tmp_path: Path, seed: int, ops: int, procs: int, **kw: object) -> None:
    d = mounted.path / f"fsx-{seed}"
    d.mkdir()
    print(f"fsx seed {seed}: {ops} operations x {procs} process(es), logs in {tmp_path}")
    errors = fsx.run(d, seed, ops, procs, log_dir=tmp_path, **kw)  # type: ignore[arg-type]
    assert not errors, "\n".join(errors)
    assert "failsafe" not in mounted.log_text()


@pytest.mark.parametrize("seed", [1801, 1802, 1803])
def test_fsx_one_process(mounted: Mount, tmp_path: Path, seed: int) -> None:
    _run(mounted, tmp_path, seed, 400, 1)


def test_fsx_three_processes(image: Path, mount_factory: Mount, tmp_path: Path) -> None:
    """With the emulator's zone appends (slices landing out of order, several
    appends to one zone in flight; `-o zone_append=on`, not the default there)."""
    _run(mount_factory.start("zone_append=on"), tmp_path, 1811, 300, 3)


def test_fsx_small_files_no_mmap(mounted: Mount, tmp_path: Path) -> None:
    """Files of at most 256 KiB, plain syscalls only: denser overlaps and truncates."""
    _run(mounted, tmp_path, 1821, 500, 2, max_size=256 << 10, use_mmap=False,
         use_direct=False)


@pytest.mark.parametrize("seed", [2801, 2802])
def test_fsx_with_fallocate(mounted: Mount, tmp_path: Path, seed: int) -> None:
    """fallocate (reserve, keep size, punch hole, zero range) and copy_file_range
    (shared or copied by the daemon) among the other operations, two processes,
    one file shared between them (issue 28)."""
    _run(mounted, tmp_path, seed, 400, 2, use_falloc=True)


def test_fsx_survives_remount(image: Path, mount_factory: Mount, tmp_path: Path) -> None:
    """The files fsx leaves are the same after a clean unmount and mount."""
    mount_factory.start()
    d = mount_factory.path / "fsx"
    d.mkdir()
    assert not fsx.run(d, 1831, 300, 1, log_dir=tmp_path)
    before = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
    assert mount_factory.unmount() == 0
    mount_factory.proc = None
    mount_factory.start()
    after = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
    assert after == before


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1851, 1852])
def test_fsx_long(image: Path, mount_factory: Mount, tmp_path: Path, seed: int) -> None:
    # One seed with the emulator's out-of-order zone appends, one without.
    _run(mount_factory.start(*(["zone_append=on"] if seed == 1852 else [])), tmp_path, seed,
         3000, 2)
