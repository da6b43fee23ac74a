"""daemon/gcpolicy.py: the model needs no cycle collector, so the daemon
freezes it out of the collector's walks (issue 15)."""

from __future__ import annotations

import gc
from pathlib import Path

from engine_helpers import mounted, write_file

from zonefs_py.daemon.gcpolicy import GcFreezer, loading
from zonefs_py.fs.api import ROOT_INO


async def test_the_model_leaves_no_garbage_cycles(tmp_path: Path) -> None:
    """What the freeze relies on: unlinking files (inline and block ones), the
    commits and a checkpoint free every model object by reference counting."""
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        for i in range(300):
            await write_file(fs, f"/f{i}", b"x" * (100 if i % 2 else 9000), fsync=False)
        await fs.sync()
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for i in range(300):
                await fs.unlink(ROOT_INO, b"f%d" % i)
            await fs.sync()
            await fs.journal.checkpoint()
            gc.collect()
            ours = [type(o).__module__ + "." + type(o).__qualname__ for o in gc.garbage
                    if type(o).__module__.startswith("zonefs_py")]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        assert ours == []


def test_loading_freezes_and_restores_the_collector() -> None:
    gc.unfreeze()
    try:
        with loading():
            assert not gc.isenabled()
            built = [[i] for i in range(1000)]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= len(built)
    finally:
        gc.unfreeze()


def test_freezer_step_collects_cycles_before_freezing() -> None:
    gc.unfreeze()
    try:
        class Node:
            pass

        a, b = Node(), Node()
        a.other, b.other = b, a  # type: ignore[attr-defined]
        del a, b
        freezer = GcFreezer()
        assert freezer.step() >= 2  # the cycle was collected, not frozen
        assert gc.get_count()[0] < 10
        assert freezer.steps == 1
    finally:
        gc.unfreeze()
