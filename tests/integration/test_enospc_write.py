"""ENOSPC from write(2) on a nearly full filesystem, under the writeback cache (issue 42).

The kernel takes write(2) into its page cache without asking the daemon; the
write gate (fs/spacegate.py, zonefs_py/writegate.py, DESIGN 4.3) refuses
write(2) once the free space falls under what the kernel may hold plus a
margin. What these tests hold it to, through a real mount:

* a writer that never calls fsync gets ENOSPC from write(2), after at least
  the free space less the gate's stated threshold (`full_refuse_below_bytes`
  in `zonefs-py stat`'s write_gate) and never more than the free space;
* every byte write(2) acknowledged is stored: close and fsync report nothing,
  the file's size is what was acknowledged, and the bytes read back after a
  remount are those written;
* data acknowledged by fsync before the device filled survives a kill -9;
* a second writer on the full filesystem gets ENOSPC from its first write(2);
* deleting a file opens the gate again.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import random
import signal
import time
from pathlib import Path

import pytest

from .conftest import Mount, make_image, zonefs

pytestmark = pytest.mark.integration

MiB = 1 << 20
#: 256 MiB of 8 MiB zones: ~190 MiB for users, filled in about a second.
IMAGE = {"size": "256M", "zone_size": "8M"}
#: How long the kernel may take to send the RELEASE of a closed handle.
RELEASE_DEADLINE_S = 10.0


def status(m: Mount) -> dict[str, object]:
    return dict(json.loads(zonefs("stat", "--json", str(m.path)).stdout))


def gate_status(m: Mount) -> dict[str, object]:
    gate = status(m)["write_gate"]
    assert isinstance(gate, dict)
    return gate


def mount_with_gate(workdir: Path, mount_factory: Mount) -> Mount:
    make_image(workdir, **IMAGE)
    m = mount_factory.start()
    gate = gate_status(m)
    assert gate["enabled"], gate  # set up before the daemon said it serves
    return m


def free_bytes(m: Mount) -> int:
    st = os.statvfs(m.path)
    return st.f_bavail * st.f_frsize


def block(seed: int, i: int) -> bytes:
    """The i-th MiB a writer writes: distinct bytes, so a lost or stale MiB shows."""
    return random.Random(seed * 1_000_003 + i).randbytes(MiB)


def fill(path: Path, seed: int, *, flags: int = os.O_WRONLY) -> tuple[int, OSError | None]:
    """Write 1 MiB blocks to `path` until write(2) fails; never fsync. Return the
    bytes acknowledged and the error (None if the loop ended without one)."""
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | flags, 0o644)
    written = 0
    error: OSError | None = None
    try:
        for i in range(4096):
            try:
                n = os.write(fd, block(seed, i))
            except OSError as exc:
                error = exc
                break
            assert n == MiB  # the gate refuses whole write(2) calls, never a part
            written += n
    finally:
        os.close(fd)  # raises if a writeback failed: the gate is there to prevent it
    return written, error


def digest_of(seed: int, nbytes: int) -> str:
    h = hashlib.sha256()
    for i in range(nbytes // MiB):
        h.update(block(seed, i))
    return h.hexdigest()


def digest_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(MiB):
            h.update(chunk)
    return h.hexdigest()


def test_writer_without_fsync_gets_enospc_from_write(workdir: Path,
                                                     mount_factory: Mount) -> None:
    m = mount_with_gate(workdir, mount_factory)
    free = free_bytes(m)
    bound = gate_status(m)["full_refuse_below_bytes"]
    assert isinstance(bound, int)
    written, error = fill(m.path / "big", seed=1)
    print(f"free {free / MiB:.1f} MiB, write(2) acknowledged {written / MiB} MiB, "
          f"stated bound {bound / MiB:.1f} MiB; gate {gate_status(m)}")
    assert error is not None
    assert error.errno == errno.ENOSPC
    assert free - bound - MiB <= written <= free
    assert (m.path / "big").stat().st_size == written
    assert gate_status(m)["closed"]


def test_acknowledged_bytes_are_stored(workdir: Path, mount_factory: Mount) -> None:
    """The file's size never runs past what was stored: after a remount (the kernel's
    cached size gone) size and bytes are those write(2) acknowledged."""
    m = mount_with_gate(workdir, mount_factory)
    written, error = fill(m.path / "big", seed=2)
    assert error is not None
    assert error.errno == errno.ENOSPC
    assert m.unmount() == 0
    m.start()
    assert (m.path / "big").stat().st_size == written
    assert digest_file(m.path / "big") == digest_of(2, written)


def test_fsynced_data_survives_the_fill_and_a_crash(workdir: Path,
                                                    mount_factory: Mount) -> None:
    m = mount_with_gate(workdir, mount_factory)
    kept = 16 * MiB
    fd = os.open(m.path / "kept", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        for i in range(kept // MiB):
            os.write(fd, block(3, i))
        os.fsync(fd)
    finally:
        os.close(fd)
    _written, error = fill(m.path / "filler", seed=4)
    assert error is not None
    assert error.errno == errno.ENOSPC
    assert m.signal(signal.SIGKILL) != 0
    m.start()
    assert digest_file(m.path / "kept") == digest_of(3, kept)


def test_second_writer_on_a_full_fs_gets_enospc_from_write(workdir: Path,
                                                           mount_factory: Mount) -> None:
    m = mount_with_gate(workdir, mount_factory)
    first, error = fill(m.path / "first", seed=5)
    assert error is not None
    assert error.errno == errno.ENOSPC
    second, error = fill(m.path / "second", seed=6)
    assert second == 0
    assert error is not None
    assert error.errno == errno.ENOSPC
    assert (m.path / "second").stat().st_size == 0
    # A handle open for reading and writing is refused the same way, and reading
    # the full file (also through a shared mmap) still works.
    third, error = fill(m.path / "third", seed=7, flags=os.O_RDWR)
    assert third == 0
    assert error is not None
    assert error.errno == errno.ENOSPC
    with open(m.path / "first", "rb") as f, mmap.mmap(f.fileno(), MiB,
                                                       prot=mmap.PROT_READ) as mm:
        assert mm[:] == block(5, 0)
    assert first > 0


def test_deleting_a_file_opens_the_gate(workdir: Path, mount_factory: Mount) -> None:
    """Once statfs shows the space of an unlinked file, write(2) passes: the request
    that gave it back (the RELEASE the kernel sends after close(2), or the unlink)
    reopened the gate before it was answered."""
    m = mount_with_gate(workdir, mount_factory)
    _written, error = fill(m.path / "big", seed=8)
    assert error is not None
    assert error.errno == errno.ENOSPC
    os.unlink(m.path / "big")
    # The file's space comes back when the kernel's RELEASE of the closed handle
    # arrives, a background request it sends after close(2) returned: watch statfs.
    deadline = time.monotonic() + RELEASE_DEADLINE_S
    while free_bytes(m) < 100 * MiB:
        assert time.monotonic() < deadline, gate_status(m)
        time.sleep(0.01)
    assert not gate_status(m)["closed"]
    again, error = fill(m.path / "again", seed=9)
    assert error is not None
    assert error.errno == errno.ENOSPC
    assert again > 100 * MiB
    assert digest_file(m.path / "again") == digest_of(9, again)


def test_truncating_open_of_a_big_file_gives_its_space_to_its_writer(
        workdir: Path, mount_factory: Mount) -> None:
    """Rewriting a file in place on a full filesystem (a checkpoint saved again under
    its name): the O_TRUNC open gives its space back, and its own write(2) pass."""
    m = mount_with_gate(workdir, mount_factory)
    first, error = fill(m.path / "ckpt", seed=10)
    assert error is not None
    assert error.errno == errno.ENOSPC
    again, error = fill(m.path / "ckpt", seed=11)  # O_TRUNC: the same file, rewritten
    assert error is not None
    assert error.errno == errno.ENOSPC
    assert again >= first - 2 * MiB
    assert digest_file(m.path / "ckpt") == digest_of(11, again)
