"""Inode generations (DESIGN 4.2a, issue 42): every inode a mount creates carries
that mount's generation, kept across remounts and checkpoints of both formats; an
inode number a crash lost is handed out again under another generation, so an
export handle of the lost inode no longer names the new one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from engine_helpers import CTX, SMALL, TEST_OPTIONS, Geometry, fsck, mounted, new_image

from zonefs_py import errors
from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.format.constants import OpType
from zonefs_py.format.ops import decode_ops, encode_ops
from zonefs_py.fs.api import ROOT_INO
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.model.state import State

FORMATS = [pytest.param(SMALL, id="format5"),
           pytest.param(Geometry(disk_version=4), id="format4")]


async def create(fs: ZoneFS, name: bytes) -> tuple[int, int]:
    """Create an empty file; return (ino, generation)."""
    fh, attr = await fs.create(ROOT_INO, name, 0o644, os.O_RDWR, CTX)
    fs.forget([(attr.ino, 1)])
    await fs.release(fh)
    return attr.ino, attr.generation


def test_generation_of_follows_the_table() -> None:
    state = State(4096, 1 << 20)
    assert state.generation_of(5) == 0  # an image older than generations
    for op in [(OpType.INO_GENERATION, 10, 7), (OpType.INO_GENERATION, 20, 9),
               (OpType.INO_GENERATION, 20, 11)]:  # the same first ino: the later wins
        state.apply(op)
    assert [state.generation_of(i) for i in (9, 10, 19, 20, 10**9)] == [0, 7, 7, 11, 11]
    assert state.ino_generations == [(10, 7), (20, 11)]


def test_ino_generation_op_round_trips() -> None:
    op = (OpType.INO_GENERATION, 2**40 + 3, 2**32 - 1)
    assert decode_ops(encode_ops([op])) == [op]


@pytest.mark.parametrize("geo", FORMATS)
async def test_generation_survives_remount_and_checkpoint(tmp_path: Path,
                                                          geo: Geometry) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, geo=geo, create=True) as fs:
        a, gen_a = await create(fs, b"a")
        b, gen_b = await create(fs, b"b")
        assert gen_a == gen_b != 0  # one generation per mount
        await fs.checkpoint()
        c, gen_c = await create(fs, b"c")  # in the journal after the checkpoint
    async with mounted(image, geo=geo) as fs:
        assert [fs.attr(fs.inode(i)).generation for i in (a, b, c)] == [gen_a] * 3
        d, gen_d = await create(fs, b"d")
        assert gen_d not in (0, gen_a)
        assert fs.attr(fs.inode(ROOT_INO)).generation == 0  # made by mkfs
        assert (await fs.lookup(a, b".")).generation == gen_a


@pytest.mark.parametrize("geo", FORMATS)
async def test_number_lost_in_a_crash_comes_back_with_another_generation(
        tmp_path: Path, geo: Geometry) -> None:
    image = tmp_path / "fs.img"
    new_image(image, geo)
    dev = EmulatedZonedDevice.open(image, volatile_cache=True)
    try:
        async with ZoneFS.mount(dev, TEST_OPTIONS, close=False) as fs:
            kept, gen_kept = await create(fs, b"kept")
            await fs.sync()
            lost, gen_lost = await create(fs, b"lost")  # never committed
            dev.simulate_power_cut("drop")
    finally:
        dev.close()
    async with mounted(image, geo=geo) as fs:
        assert fs.attr(fs.inode(kept)).generation == gen_kept
        again, gen_again = await create(fs, b"again")
        assert again == lost  # the number is handed out again...
        assert gen_again != gen_lost  # ...under another generation
    assert fsck(image).clean


async def test_lookup_of_dot_refuses_an_inode_without_links(tmp_path: Path) -> None:
    # The kernel's FORGET of a deleted inode may still be on its way when a handle
    # lookup comes: the inode must not be handed out again.
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        attr = await fs.mknod(ROOT_INO, b"f", 0o100644, 0, CTX)  # one kernel reference
        await fs.unlink(ROOT_INO, b"f")
        with pytest.raises(errors.NotFound):
            await fs.lookup(attr.ino, b".")  # the kernel answers the handle ESTALE
        fs.forget([(attr.ino, 1)])
        assert attr.ino not in fs.state.inodes
