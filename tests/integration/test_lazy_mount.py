"""Format 5's lazy namespace through a real mount (DESIGN.md 3.15).

The daemon keeps 8 inodes beyond those in use (`-o inode_cache=8`); the
test writes checkpoints (`trusted.zonefs.ctl`) and makes the kernel let go
of its dentries and inodes (drop_caches: a FORGET for each), so nearly
every name and inode is evicted and read back from the namespace index,
while threads create, rename, unlink, write, read, list and stat through
real syscalls against a model. After a remount the tree
equals the model; the teardown runs fsck.
"""

from __future__ import annotations

import json
import os
import random
import threading
from pathlib import Path

import pytest

from .conftest import Mount, make_image, zonefs

pytestmark = pytest.mark.integration


def _drop_kernel_caches() -> None:
    """Make the kernel forget dentries and inodes (root only; skipped otherwise)."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("2\n")
    except OSError:
        pass


def _tree(root: Path) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for d in dirnames:
            out[os.path.normpath(os.path.join(rel, d))] = None
        for f in filenames:
            out[os.path.normpath(os.path.join(rel, f))] = Path(dirpath, f).read_bytes()
    return out


def test_a_tiny_inode_cache_under_threads_matches_a_model(
        workdir: Path, mount_factory: Mount) -> None:
    make_image(workdir)  # the session's format; make it 5 below if it is not
    image = workdir / "dev.img"
    zonefs("mkfs", "--force", str(image), "--format", "5")
    m = mount_factory.start("inode_cache=8", "checkpoint_mb=1")
    root = m.path
    lock = threading.Lock()
    model: dict[str, bytes | None] = {}
    errors: list[BaseException] = []
    dirs = [f"t{t}" for t in range(3)]
    for d in dirs:
        (root / d).mkdir()
        model[d] = None

    def worker(t: int) -> None:
        rng = random.Random(3200 + t)
        mine = dirs[t]
        try:
            for step in range(250):
                files = sorted(p for p, v in model.items() if v is not None
                               and p.startswith(mine + "/"))
                r = rng.random()
                if r < 0.4 or not files:
                    rel = f"{mine}/f{step:04d}-{'x' * rng.randrange(0, 40)}"
                    data = rng.randbytes(rng.choice([0, 100, 700, 5000, 70000]))
                    (root / rel).write_bytes(data)
                    with lock:
                        model[rel] = data
                elif r < 0.55:
                    src = rng.choice(files)
                    dst = f"{mine}/r{step:04d}"
                    os.rename(root / src, root / dst)
                    with lock:
                        model[dst] = model.pop(src)
                elif r < 0.65:
                    rel = rng.choice(files)
                    os.unlink(root / rel)
                    with lock:
                        del model[rel]
                elif r < 0.75:
                    rel = rng.choice(files)
                    off = rng.randrange(0, len(model[rel] or b"") + 1)
                    data = rng.randbytes(rng.randrange(1, 3000))
                    fd = os.open(root / rel, os.O_WRONLY)
                    try:
                        os.pwrite(fd, data, off)
                    finally:
                        os.close(fd)
                    with lock:
                        old = bytearray(model[rel] or b"")
                        old.extend(bytes(max(0, off + len(data) - len(old))))
                        old[off:off + len(data)] = data
                        model[rel] = bytes(old)
                elif r < 0.9:
                    rel = rng.choice(files)
                    assert (root / rel).read_bytes() == model[rel], rel
                    assert os.stat(root / rel).st_size == len(model[rel] or b"")
                else:
                    names = sorted(os.listdir(root / mine))
                    want = sorted(p.split("/", 1)[1] for p in model
                                  if p.startswith(mine + "/"))
                    assert names == want
                if step % 25 == 0:
                    # A checkpoint publishes what changed (it may be evicted from
                    # then on), then the kernel lets go of its inodes.
                    os.setxattr(root, "trusted.zonefs.ctl", b"checkpoint")
                    _drop_kernel_caches()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    _drop_kernel_caches()
    assert _tree(root) == model
    ns = _namespace(root)
    assert ns["lazy"] is True
    if os.geteuid() == 0:  # drop_caches made the kernel forget: evictions, faults
        assert ns["evictions"] > 100, ns
        assert ns["faults"] > 100, ns
    assert m.unmount() == 0
    m.start("inode_cache=8")
    _drop_kernel_caches()
    assert _tree(root) == model
    assert _namespace(root)["lazy"] is True


def _namespace(root: Path) -> dict[str, object]:
    proc = zonefs("stat", "--json", str(root), check=False)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    ns = doc.get("namespace") or doc.get("status", {}).get("namespace")
    assert isinstance(ns, dict), sorted(doc)
    return ns


def test_the_mount_command_converts_a_format4_image_and_serves_it_lazily(
        workdir: Path, mount_factory: Mount) -> None:
    """`zonefs-py mount` of a format 4 image (format=5 here: the default would do
    the same, and a format 4 test run adds format=4 to mounts that name none)
    converts it, mounts the converted image again lazily before serving, and
    serves the same files; stat says format 5; fsck (the fixture's) is clean."""
    make_image(workdir)
    image = workdir / "dev.img"
    # 8 meta zones: format 4's mkfs gives a device of 32 zones 4 (3%, at least
    # 4), and such an image stays format 4 (format 5 needs 6).
    zonefs("mkfs", "--force", str(image), "--format", "4", "--meta-zones", "8")
    m = mount_factory
    root = m.path
    m.start("format=4")
    rng = random.Random(32)
    model: dict[str, bytes] = {}
    for d in range(4):
        (root / f"d{d}").mkdir()
        for i in range(50):
            data = rng.randbytes(rng.choice([0, 300, 5000, 200_000]))
            (root / f"d{d}" / f"f{i}").write_bytes(data)
            model[f"d{d}/f{i}"] = data
    os.symlink("d0/f1", root / "link")
    os.link(root / "d1" / "f2", root / "d2" / "hard")
    model["d2/hard"] = model["d1/f2"]
    assert m.unmount() == 0
    m.start("format=5")
    doc = json.loads(zonefs("stat", "--json", str(root)).stdout)
    assert doc["filesystem"]["disk_version"] == 5
    assert _namespace(root)["lazy"] is True
    _drop_kernel_caches()
    for rel, data in model.items():
        assert (root / rel).read_bytes() == data, rel
    assert os.readlink(root / "link") == "d0/f1"
    assert os.stat(root / "d2" / "hard").st_nlink == 2
    log = m.log.read_text()
    # root, 4 directories, 200 files, a symlink; 206 names with the hard link
    assert "converted on-disk format 4 to 5: 206 inodes, 206 names" in log, log
    assert "mounting the converted image again" in log
    assert m.unmount() == 0
