"""bench/run checks the programs its workloads and contenders run before it starts (issue 41).

A missing program is named with the Debian package that provides it, and the
run stops with exit status 2 before it creates anything, instead of a
traceback half way through (rsync missing used to fail in tree_rsync).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

BENCH_RUN = Path(__file__).resolve().parents[2] / "bench" / "run"


def _load_bench_run() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("bench_run", str(BENCH_RUN))
    spec = importlib.util.spec_from_loader("bench_run", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


bench_run = _load_bench_run()


@pytest.fixture
def empty_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """PATH is one empty directory (tests put fake programs into it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    return bin_dir


def test_missing_tools_are_named_with_their_packages(empty_path: Path) -> None:
    (empty_path / "fio").write_text("#!/bin/sh\n")
    (empty_path / "fio").chmod(0o755)
    tools = bench_run.missing_tools(["rsync", "fio", "mkfs.ext4", "rsync"])
    assert tools == ["mkfs.ext4", "rsync"]
    message = bench_run.missing_message(tools)
    assert "missing mkfs.ext4 (Debian package e2fsprogs)" in message
    assert "missing rsync (Debian package rsync)" in message
    assert message.endswith("apt-get install e2fsprogs rsync")


def test_only_the_selection_needs_its_tools(tmp_path: Path) -> None:
    contenders = {c.key: c for c in bench_run.all_contenders(tmp_path)}
    workloads = {w.name: w for w in bench_run.suite.WORKLOADS}
    assert bench_run.needed_tools([contenders["physical"]], [workloads["seq_write"]]) == {"fio"}
    assert bench_run.needed_tools([contenders["zonefs"]], [workloads["meta_create"]]) == {
        "fusermount3"}
    assert {"rsync", "tar"} <= bench_run.needed_tools([contenders["zonefs"]],
                                                      [workloads["tree_rsync"]])
    assert {"losetup", "mkfs.ext4", "fusermount3"} <= bench_run.needed_tools(
        [contenders["peer"]], [])


def test_bench_run_stops_before_it_starts(empty_path: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    work_dir = tmp_path / "work"
    status = bench_run.main(["--contenders", "ext4", "--workloads", "tree_rsync",
                             "--work-dir", str(work_dir), "--out", str(tmp_path / "out")])
    assert status == 2
    err = capsys.readouterr().err
    assert "missing rsync (Debian package rsync)" in err
    assert "missing mkfs.ext4 (Debian package e2fsprogs)" in err
    assert "missing fio" not in err  # not a tool of tree_rsync or ext4
    assert not work_dir.exists()
