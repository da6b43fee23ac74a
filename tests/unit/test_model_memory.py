"""The in-memory model's compact layouts (issue 15): extent maps without a list of
starts, int objects shared across inodes, the rare inode fields in one slot.

Each layout must keep the behaviour of the plain one it replaced: the extent
map is checked against a per-block reference under seeded random inserts and
truncates; the sharing is checked on a State rebuilt from encoded ops, as
recovery does.
"""

from __future__ import annotations

import random
import stat

import pytest

from zonefs_py.format.constants import OpType
from zonefs_py.format.ops import decode_ops, encode_op
from zonefs_py.model.extents import ExtentMap
from zonefs_py.model.state import Inode, State

BS = 4096
ZONE = 64 * BS


def _csum(dev: int) -> bytes:
    return (dev // BS).to_bytes(4, "little")


@pytest.mark.parametrize("seed", range(20))
def test_extent_map_matches_a_per_block_reference(seed: int) -> None:
    rng = random.Random(seed)
    m = ExtentMap()
    ref: dict[int, int] = {}  # file block -> device offset
    live: dict[int, int] = {}  # device offset -> references (must stay 0 or 1)
    next_dev = 0
    for _ in range(200):
        if rng.random() < 0.8:
            fblock, n = rng.randrange(40), rng.randrange(1, 9)
            if rng.random() < 0.3 and next_dev % ZONE:
                dev = next_dev  # contiguous with the previous insert: may merge
            else:
                dev = next_dev = -(-next_dev // BS) * BS + rng.randrange(0, 3) * BS
            if dev // ZONE != (dev + n * BS - 1) // ZONE:
                dev = next_dev = -(-dev // ZONE) * ZONE
            next_dev = dev + n * BS
            csums = b"".join(_csum(dev + i * BS) for i in range(n))
            freed = m.insert(fblock, n, dev, csums, BS, ZONE)
            for i in range(n):
                ref[fblock + i] = dev + i * BS
                live[dev + i * BS] = live.get(dev + i * BS, 0) + 1
        else:
            first = rng.randrange(45)
            freed = m.truncate(first, BS)
            for b in [b for b in ref if b >= first]:
                del ref[b]
        for dev, nblocks in freed:
            for i in range(nblocks):
                live[dev + i * BS] -= 1
        assert all(v in (0, 1) for v in live.values()), seed
        exts = list(m)
        assert all(a.fend <= b.fblock for a, b in zip(exts, exts[1:], strict=False)), seed
        assert m.mapped_blocks == len(ref) == sum(e.nblocks for e in exts), seed
        for piece in m.lookup(0, 48, BS):
            for i in range(piece.nblocks):
                want = ref.get(piece.fblock + i)
                if piece.dev is None:
                    assert want is None, seed
                else:
                    assert piece.dev + i * BS == want, seed
                    assert piece.csums[i * 4:i * 4 + 4] == _csum(want), seed


def test_extent_map_of_one_extent_holds_a_list_of_one() -> None:
    m = ExtentMap()
    m.insert(0, 3, 5 * BS, bytes(12), BS, ZONE)
    m.insert(3, 2, 8 * BS, bytes(8), BS, ZONE)  # contiguous: merged into the first
    assert len(m) == 1
    assert m.mapped_blocks == 5
    assert m.exts.__sizeof__() == [None].__sizeof__()


def test_recovered_state_shares_int_objects() -> None:
    now = 1_764_000_000_123_456_789  # an int object of 36 bytes
    later = now + 1000
    ops = [
        (OpType.INODE, 1000, stat.S_IFDIR | 0o755, 1000, 1000, 2, 0, 0, now, now, now, 0),
        (OpType.INODE, 1001, stat.S_IFREG | 0o644, 1000, 1000, 1, 0, 300, now, later,
         later, 0),
        (OpType.INODE, 1002, stat.S_IFREG | 0o644, 1000, 1000, 1, 0, 300, now, now, now, 0),
        (OpType.DIRENT_ADD, 1000, 1001, b"a"),
        (OpType.DIRENT_ADD, 1000, 1002, b"b"),
        (OpType.EXTENT, 1001, 0, 1, ZONE * 3, bytes(4)),
        (OpType.INLINE, 1002, 300, later, later, b"x" * 300),
    ]
    state = State(BS, ZONE)
    for op in decode_ops(b"".join(encode_op(op) for op in ops)):
        state.apply(op)
    d, a, b = (state.inodes[i] for i in (1000, 1001, 1002))
    assert d.entries == {b"a": 1001, b"b": 1002}
    assert d.entries[b"a"] is a.ino
    assert d.entries[b"b"] is b.ino
    assert a.parent is d.ino
    assert b.parent is d.ino
    assert a.mode is b.mode
    assert a.uid is b.gid is d.uid
    assert d.atime is d.mtime is d.ctime
    assert a.mtime == a.ctime == later
    assert a.ctime is a.mtime
    assert a.atime == now
    assert b.ctime is b.mtime
    (owner,) = state.zone_owners[3]
    assert owner is a.ino


def test_rare_fields_take_an_object_only_while_one_is_set() -> None:
    f = Inode(300, stat.S_IFREG | 0o644)
    assert f.rare is None
    assert (f.rdev, f.target, f.xattrs) == (0, None, None)
    state = State(BS, ZONE)
    state.inodes[300] = f
    state.apply((OpType.XATTR_SET, 300, b"user.a", b"1"))
    assert f.xattrs == {b"user.a": b"1"}
    state.apply((OpType.XATTR_DEL, 300, b"user.a"))
    assert f.xattrs is None
    assert f.rare is None
    node = Inode(301, stat.S_IFCHR | 0o600, rdev=0x0801)
    assert node.rdev == 0x0801
    assert node.xattrs is None
    node.rdev = 0
    assert node.rare is None
    link = Inode(302, stat.S_IFLNK | 0o777)
    link.target = b"somewhere"
    link.xattrs = {}
    link.target = None
    assert link.rare is not None  # an empty xattr dict is still held
    assert link.xattrs == {}
