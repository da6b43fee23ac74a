"""Issue 29: the request census, the round trips it removed, and caches that stay true.

Through a real mount: the census counts what the kernel sends; the kernel's
security.capability probe before every write(2) is answered without the
engine only while no file has the attribute (and a file that gets one has it
killed by the kernel's next write, as on any filesystem); what the kernel
caches (long attribute, entry and negative-entry timeouts) follows changes
made by another process, by the engine on its own (drain eviction: see
test_drain_s3.py) and by a remount at once.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import Mount, zonefs

pytestmark = pytest.mark.integration


def census(mnt: Path) -> dict[str, int]:
    return json.loads(os.getxattr(mnt, "trusted.zonefs.status"))["requests"]


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after
            if after.get(k, 0) != before.get(k, 0)}


def test_census_counts_every_request_by_opcode(mounted: Mount) -> None:
    mnt = mounted.path
    before = census(mnt)
    (mnt / "d").mkdir()
    for i in range(20):
        fd = os.open(mnt / "d" / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, b"x" * 3000)
        os.write(fd, b"y" * 3000)
        os.close(fd)
    got = delta(before, census(mnt))
    assert got["CREATE"] == 20
    assert got["MKDIR"] == 1
    assert got["FLUSH"] == 20
    assert got["RELEASE"] == 20
    # The kernel asks before each write(2) (two per file), by name.
    assert got["GETXATTR:security.capability"] == 40
    # The status read is a request like any other (os.getxattr may ask twice).
    assert got["GETXATTR:trusted.zonefs.status"] in (1, 2)
    # Written back through the writeback cache: one WRITE a file, not two.
    assert got["WRITE"] == 20
    out = zonefs("stat", str(mnt)).stdout
    assert "FUSE requests this mount" in out
    assert "CREATE" in out
    prom = zonefs("stat", str(mnt), "--format", "prometheus").stdout
    assert 'zonefs_fuse_requests_total{op="CREATE"}' in prom
    assert 'zonefs_fuse_getxattr_requests_total{name="security.capability"}' in prom


def _caps_v2(permitted: int) -> bytes:
    """A VFS_CAP_REVISION_2 security.capability value (linux/capability.h)."""
    return struct.pack("<IIIII", 0x02000000, permitted, 0, 0, 0)


def test_capability_probe_answer_follows_the_files(mounted: Mount) -> None:
    """While no file has security.capability the probe is answered in C; a file that
    gets one is seen by the probe (the kernel kills it on the next write, as
    file_remove_privs does everywhere), and then the C answer comes back."""
    mnt = mounted.path
    path = mnt / "tool"
    path.write_bytes(b"#!/bin/sh\n")
    value = _caps_v2(1 << 10)  # CAP_NET_BIND_SERVICE
    os.setxattr(path, "security.capability", value)
    assert os.getxattr(path, "security.capability") == value
    with open(path, "ab") as f:
        f.write(b"echo hi\n")
    with pytest.raises(OSError) as info:
        os.getxattr(path, "security.capability")
    assert info.value.errno == 61  # ENODATA: the write removed the capability
    # Without any capability left, writes go on and the attribute stays absent.
    with open(path, "ab") as f:
        f.write(b"echo again\n")
    assert path.read_bytes() == b"#!/bin/sh\necho hi\necho again\n"
    with pytest.raises(OSError):
        os.getxattr(path, "security.capability")


def _in_other_process(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_changes_by_another_process_are_seen_at_once(mounted: Mount) -> None:
    mnt = mounted.path
    f = mnt / "shared"
    f.write_bytes(b"a" * 100)
    assert f.stat().st_size == 100
    assert f.read_bytes() == b"a" * 100
    _in_other_process(f"open({str(f)!r}, 'ab').write(b'b' * 50)")
    assert f.stat().st_size == 150
    assert f.read_bytes() == b"a" * 100 + b"b" * 50
    _in_other_process(f"import os; os.truncate({str(f)!r}, 10); os.chmod({str(f)!r}, 0o600)")
    st = f.stat()
    assert st.st_size == 10
    assert st.st_mode & 0o777 == 0o600
    assert f.read_bytes() == b"a" * 10
    # A name created, removed and created again (negative entries are cached).
    gone = mnt / "again"
    assert not gone.exists()  # cached as absent
    _in_other_process(f"open({str(gone)!r}, 'wb').write(b'1')")
    assert gone.read_bytes() == b"1"
    _in_other_process(f"import os; os.unlink({str(gone)!r})")
    assert not gone.exists()
    _in_other_process(f"open({str(gone)!r}, 'wb').write(b'22')")
    assert gone.read_bytes() == b"22"
    assert gone.stat().st_size == 2
    # A directory renamed away and another made under its name.
    (mnt / "dir").mkdir()
    (mnt / "dir" / "x").write_bytes(b"x")
    assert (mnt / "dir" / "x").exists()
    _in_other_process(f"import os; os.rename({str(mnt / 'dir')!r}, {str(mnt / 'dir2')!r}); "
                      f"os.mkdir({str(mnt / 'dir')!r})")
    assert not (mnt / "dir" / "x").exists()
    assert (mnt / "dir2" / "x").read_bytes() == b"x"


def test_close_returns_before_the_device_and_the_data_is_there(mounted: Mount) -> None:
    """A close sends the file's last chunk without waiting for the device (DESIGN
    4.3); reads right after, a rewrite, an fsync and a remount all see the bytes."""
    mnt = mounted.path
    blobs = {f"f{i}": os.urandom(1000 + 4099 * i) for i in range(40)}
    for name, data in blobs.items():
        (mnt / name).write_bytes(data)
    for name, data in blobs.items():
        assert (mnt / name).read_bytes() == data
    # Overwrite the middle of a file whose last chunk may still be in flight.
    with open(mnt / "f7", "r+b") as f:
        f.seek(100)
        f.write(b"Z" * 50)
        f.flush()
        os.fsync(f.fileno())
    want = bytearray(blobs["f7"])
    want[100:150] = b"Z" * 50
    assert (mnt / "f7").read_bytes() == bytes(want)
    assert mounted.unmount() == 0
    mounted.start()
    for name, data in blobs.items():
        expect = bytes(want) if name == "f7" else data
        assert (mnt / name).read_bytes() == expect, name
