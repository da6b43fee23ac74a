"""The copy-on-write checkpoint snapshot (`State.Snapshot`): encoded a slice at a
time while requests change the namespace, it must still be the State of the
moment it began; and a checkpoint must let other tasks run while it encodes."""

from __future__ import annotations

import random
import stat
from pathlib import Path

import pytest
import trio
from engine_helpers import CTX, TEST_OPTIONS, mounted, new_image, pattern, read_tree, write_file

from zonefs_py import errors
from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.format.ops import Op, decode_ops, encode_op
from zonefs_py.fs.api import ROOT_INO, RenameFlags, SetAttrRequest, XattrFlags
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.journal import journal as journal_mod
from zonefs_py.model.state import Snapshot, State, StateError


def canonical(ops: list[Op]) -> list[str]:
    """Snapshot ops without their order (names across directories may come in any)."""
    return sorted(repr(op) for op in ops)


def load(encoded: list[bytes], block_size: int, zone_size: int) -> State:
    state = State(block_size, zone_size)
    for blob in encoded:
        for op in decode_ops(blob):
            state.apply(op)
    return state


async def populate(fs: ZoneFS, rng: random.Random) -> None:
    """Directories, files with data, xattrs, a symlink and a hard link."""
    for d in range(3):
        dino = (await fs.mkdir(ROOT_INO, b"d%d" % d, 0o755, CTX)).ino
        for f in range(8):
            await write_file(fs, f"/d{d}/f{f}", pattern(d * 10 + f, rng.randrange(1, 20000)),
                             fsync=False)
        await fs.setxattr(dino, b"user.tag", b"dir%d" % d, XattrFlags.NONE, CTX)
    await fs.symlink(ROOT_INO, b"link", b"d0/f0", CTX)
    f1 = (await fs.lookup(ROOT_INO, b"d1")).ino
    target = (await fs.lookup(f1, b"f1")).ino
    await fs.link(target, ROOT_INO, b"hard")
    await fs.sync()


async def one_change(fs: ZoneFS, rng: random.Random, serial: int) -> None:
    """A random namespace or data change; a change that does not apply is skipped."""
    d = rng.randrange(3)
    dino = (await fs.lookup(ROOT_INO, b"d%d" % d)).ino
    name = b"f%d" % rng.randrange(10)
    kind = rng.randrange(8)
    try:
        if kind == 0:
            await fs.unlink(dino, name)
        elif kind == 1:
            other = (await fs.lookup(ROOT_INO, b"d%d" % rng.randrange(3))).ino
            await fs.rename(dino, name, other, b"r%d" % serial, RenameFlags.NONE)
        elif kind == 2:
            await write_file(fs, f"/d{d}/{name.decode()}", pattern(serial, 7000), fsync=False)
        elif kind == 3:
            ino = (await fs.lookup(dino, name)).ino
            await fs.setxattr(ino, b"user.n", b"%d" % serial, XattrFlags.NONE, CTX)
        elif kind == 4:
            ino = (await fs.lookup(dino, name)).ino
            await fs.setattr(ino, SetAttrRequest(size=rng.randrange(0, 9000)), CTX)
        elif kind == 5:
            ino = (await fs.lookup(dino, name)).ino
            await fs.setattr(ino, SetAttrRequest(mode=stat.S_IFREG | 0o600), CTX)
        elif kind == 6:
            await fs.mknod(dino, b"n%d" % serial, stat.S_IFREG | 0o644, 0, CTX)
        else:
            await fs.setxattr(dino, b"user.tag", b"changed%d" % serial, XattrFlags.NONE, CTX)
    except (errors.NotFound, errors.Exists):
        pass


@pytest.mark.parametrize("seed", range(6))
async def test_snapshot_is_the_state_of_its_start(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        await populate(fs, rng)
        state = fs.state
        expected = canonical(list(state.snapshot_ops()))
        snap = Snapshot(state, encode_op)
        serial = 0
        try:
            while not snap.step(rng.choice([1, 1, 2, 5])):
                for _ in range(rng.randrange(0, 4)):
                    serial += 1
                    await one_change(fs, rng, serial)
        finally:
            snap.close()
        assert state.snapshot is None
        got = load(snap.encoded_ops(), state.block_size, state.zone_size)
        assert canonical(list(got.snapshot_ops())) == expected
        assert canonical(list(state.snapshot_ops())) != expected, "nothing changed meanwhile"
        assert snap.copied > 0, "no change reached an inode before the cursor did"
        await fs.sync()


async def test_snapshot_is_exclusive_and_must_be_complete(tmp_path: Path) -> None:
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        await fs.mknod(ROOT_INO, b"a", stat.S_IFREG | 0o644, 0, CTX)
        snap = Snapshot(fs.state, encode_op)
        try:
            with pytest.raises(StateError):
                Snapshot(fs.state, encode_op)
            with pytest.raises(StateError):
                snap.encoded_ops()
            assert snap.step(1) is False  # root, then "a"
            assert snap.step(1) is True
        finally:
            snap.close()
        assert fs.state.snapshot is None


async def test_checkpoint_lets_requests_run_and_recovers_exactly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint of many inodes in small slices: another task gets turns while it
    encodes, commits wait for it, and a mount from the result sees every change."""
    monkeypatch.setattr(journal_mod, "CHECKPOINT_SLICE_INODES", 10)
    image = tmp_path / "fs.img"
    new_image(image)
    turns = 0
    dev = EmulatedZonedDevice.open(image)
    try:
        async with ZoneFS.mount(dev, TEST_OPTIONS, close=False) as fs:
            for i in range(300):
                await fs.mknod(ROOT_INO, b"m%03d" % i, stat.S_IFREG | 0o644, 0, CTX)
            await fs.sync()
            before = fs.journal.checkpoints_written

            async def meanwhile() -> None:
                nonlocal turns
                while fs.journal.checkpoints_written == before:
                    turns += 1
                    await fs.unlink(ROOT_INO, b"m%03d" % turns)
                    await write_file(fs, f"/w{turns}", pattern(turns, 5000), fsync=False)
                    await trio.lowlevel.checkpoint()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(meanwhile)
                await fs.journal.checkpoint()
            assert turns >= 3, f"only {turns} turns for other requests during the checkpoint"
            await fs.sync()
            expected = await read_tree(fs)
    finally:
        # No clean unmount (it would write a checkpoint of its own): recovery must
        # rebuild the state from this checkpoint plus the journal written after it.
        dev.close()
    async with mounted(image) as fs:
        assert await read_tree(fs) == expected


async def test_a_zone_sealed_while_the_snapshot_is_encoded(tmp_path: Path) -> None:
    """The snapshot's head says the zone is unsealed; a ZONE_SEAL applied before the
    cursor reaches the zone's files must not let them be encoded without their
    checksums (EXTENT_SEALED in an unsealed zone is refused at recovery)."""
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        fs.data.sealer.automatic = False  # the test seals by hand, mid-snapshot
        data = pattern(7, 3 * (1 << 20))
        await write_file(fs, "/big", data)
        state = fs.state
        ino = (await fs.lookup(ROOT_INO, b"big")).ino
        inode = state.inodes[ino]
        assert inode.extents is not None
        zone = inode.extents.exts[0].dev // state.zone_size
        assert fs.alloc.seal_queue == [zone]  # full, its seal decided, not written
        assert zone not in state.zone_seals
        expected = canonical(list(state.snapshot_ops()))
        snap = Snapshot(state, encode_op)
        try:
            assert snap.step(1) is False  # the root only: "big" is not encoded yet
            await fs.data.sealer.seal(fs.alloc.seal_queue.pop(0), finish=True)
            assert zone in state.zone_seals
            assert any(e.csums is None for e in inode.extents)
            while not snap.step(3):
                pass
        finally:
            snap.close()
        got = load(snap.encoded_ops(), state.block_size, state.zone_size)  # no StateError
        assert canonical(list(got.snapshot_ops())) == expected
        assert zone not in got.zone_seals
        await fs.sync()
