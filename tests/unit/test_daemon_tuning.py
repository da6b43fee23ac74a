"""The daemon's post-INIT tuning helpers: finding the mount's device number, malloc."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from zonefs_py.daemon.options import MountConfig, MountError
from zonefs_py.daemon.serve import keep_buffers_warm
from zonefs_py.daemon.tuning import _mount_dev, _unescape_mountinfo

MOUNTINFO = (
    "22 1 254:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
    "70 22 0:51 / /mnt/with\\040space rw,nosuid,nodev shared:40 - fuse.zonefs-py "
    "/img rw,user_id=0,group_id=0\n"
    "71 22 0:52 / /mnt/back\\134slash rw - fuse.zonefs-py /img rw\n"
    "72 22 0:53 / /mnt/plain rw - fuse.zonefs-py /img rw\n"
    "73 72 0:54 / /mnt/plain rw - fuse.zonefs-py /img2 rw\n"
)


@pytest.fixture
def mountinfo(tmp_path: Path) -> str:
    path = tmp_path / "mountinfo"
    path.write_text(MOUNTINFO)
    return str(path)


def test_mountinfo_escapes_are_undone() -> None:
    assert _unescape_mountinfo("/a\\040b\\011c\\134d") == "/a b\tc\\d"
    assert _unescape_mountinfo("/plain") == "/plain"


def test_mount_dev_finds_paths_with_spaces_and_backslashes(mountinfo: str) -> None:
    assert _mount_dev("/mnt/with space", mountinfo) == "0:51"
    assert _mount_dev("/mnt/back\\slash", mountinfo) == "0:52"


def test_mount_dev_takes_the_mount_on_top(mountinfo: str) -> None:
    assert _mount_dev("/mnt/plain", mountinfo) == "0:54"


def test_mount_dev_of_an_unmounted_path_is_an_error(mountinfo: str) -> None:
    with pytest.raises(OSError, match="not found"):
        _mount_dev("/mnt/nothing", mountinfo)


def test_keep_buffers_warm_succeeds_on_glibc() -> None:
    assert keep_buffers_warm() is True


def test_min_tasks_option(tmp_path: Path) -> None:
    image = tmp_path / "img"
    image.write_bytes(b"")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    assert MountConfig.build(str(image), str(mnt), []).min_tasks == 16
    cfg = MountConfig.build(str(image), str(mnt), ["min_tasks=4,max_tasks=8"])
    assert (cfg.min_tasks, cfg.max_tasks) == (4, 8)
    for bad in ("min_tasks=0", "min_tasks=x", "min_tasks"):
        with pytest.raises(MountError, match="min_tasks"):
            MountConfig.build(str(image), str(mnt), [bad])


def test_mount_dev_reads_mountinfo_again_and_never_stats_the_mount(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read of mountinfo can miss a mount while others come and go: it is read
    again (up to three times), and the mount point is never stat'ed (that would be
    a request to the daemon's own mount: daemon/tuning.py)."""
    info = tmp_path / "mountinfo"
    line = "36 25 0:46 / /mnt/z rw,relatime - fuse.zonefs-py dev rw\n"
    reads = []
    real_open = open

    def flaky_open(path: object, *args: object, **kwargs: object) -> object:
        if str(path) == str(info):
            reads.append(1)
            info.write_text("" if len(reads) < 3 else line)
        return real_open(path, *args, **kwargs)  # type: ignore[call-overload]

    def no_stat(*args: object, **kwargs: object) -> None:
        raise AssertionError("stat(2) of the mount point")

    monkeypatch.setattr("builtins.open", flaky_open)
    monkeypatch.setattr(os, "stat", no_stat)
    assert _mount_dev("/mnt/z", str(info)) == "0:46"
    assert len(reads) == 3
    empty = tmp_path / "empty-mountinfo"
    empty.write_text("")
    reads.clear()
    with pytest.raises(OSError, match="not found"):
        _mount_dev(str(tmp_path), str(empty))  # not a mount point
