"""cleaner/: victim choice, copying and passes, over a fake CleanerHost and the real engine.

The fake (`FakeHost`) keeps zones as lists of (inode, file block) slots in
memory, so the cleaner's own decisions are tested without a device; the engine
tests drive the same Cleaner over `fs/reclaim.py` on an emulated image and end
with fsck.
"""

from __future__ import annotations

import os
import random
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio
from engine_helpers import CTX, KiB, mounted, pattern, read_file, resolve, write_file

from zonefs_py import errors
from zonefs_py.cleaner.cleaner import COPY_UNIT, Cleaner
from zonefs_py.cleaner.host import CleanerHost, LivePiece, ZoneUsage
from zonefs_py.format.constants import Stream
from zonefs_py.fs.api import ROOT_INO
from zonefs_py.fs.filesystem import ZoneFS

BS = 4096
Key = tuple[int, int]  # (inode, file block)
Slot = tuple[int, int]  # (zone, block within zone)


def block_data(key: Key, version: int = 0) -> bytes:
    return bytes([(key[0] * 31 + key[1] * 7 + version) % 251 + 1]) * BS


@dataclass
class FakeZone:
    capacity_blocks: int
    slots: list[Key] = field(default_factory=list)
    last_write_ns: int = 0


class FakeHost:
    """A CleanerHost in memory: files map blocks to zone slots; a slot is live while
    its file still maps to it. Reads and relocations are recorded for the tests."""

    block_size = BS

    def __init__(self, nzones: int = 10, capacity_blocks: int = 128, reserve: int = 2) -> None:
        self.zones = [FakeZone(capacity_blocks) for _ in range(nzones)]
        self.where: dict[Key, Slot] = {}
        self.data: dict[Slot, bytes] = {}
        self.reserve = reserve
        self.head: int | None = None
        self.bad: set[Slot] = set()
        self.cleaned_bytes = 0
        self.commits = 0
        self.reads: list[int] = []
        self.rng = random.Random(7)
        self.pins: list[int] = []

    # -- building the picture -------------------------------------------------------
    def write(self, zone: int, ino: int, fblocks: range, *, age_s: float = 0.0) -> None:
        z = self.zones[zone]
        for fb in fblocks:
            assert len(z.slots) < z.capacity_blocks
            slot = (zone, len(z.slots))
            z.slots.append((ino, fb))
            self.where[(ino, fb)] = slot
            self.data[slot] = block_data((ino, fb))
        z.last_write_ns = time.time_ns() - int(age_s * 1e9)

    def delete(self, ino: int) -> None:
        for key in [k for k in self.where if k[0] == ino]:
            del self.where[key]

    def live_blocks(self, zone: int) -> int:
        return sum(1 for s, key in enumerate(self.zones[zone].slots)
                   if self.where.get(key) == (zone, s))

    def read_file(self, ino: int, nblocks: int) -> bytes:
        return b"".join(self.data[self.where[(ino, fb)]] for fb in range(nblocks))

    # -- CleanerHost ------------------------------------------------------------------------
    @property
    def reserve_zones(self) -> int:
        return self.reserve

    def data_zone_count(self) -> int:
        return len(self.zones)

    def _is_empty(self, idx: int) -> bool:
        return not self.zones[idx].slots and idx != self.head

    def empty_zone_count(self) -> int:
        return sum(1 for i in range(len(self.zones)) if self._is_empty(i))

    def tenant_cleaner_room_bytes(self, tenant: int) -> int:
        return 0  # (no tenants here)

    def tenant_full(self, tenant: int) -> bool:
        return False

    def tenants_near_cap(self) -> list[int]:
        return []

    def cleaner_room_bytes(self) -> int:
        room = 0
        if self.head is not None:
            z = self.zones[self.head]
            room = (z.capacity_blocks - len(z.slots)) * BS
        return room + sum(self.zones[i].capacity_blocks * BS for i in range(len(self.zones))
                          if self._is_empty(i))

    def candidate_zones(self) -> list[ZoneUsage]:
        out = []
        for i, z in enumerate(self.zones):
            live = self.live_blocks(i) * BS
            written = len(z.slots) * BS
            if i != self.head and written and 0 < live < written:
                out.append(ZoneUsage(i, z.capacity_blocks * BS, written, live, z.last_write_ns))
        return out

    async def warm_zone(self, zone_idx: int) -> None:
        pass

    def live_pieces(self, zone_idx: int, max_bytes: int) -> list[LivePiece]:
        pieces: list[LivePiece] = []
        run: list[int] = []

        def close_run() -> None:
            if run:
                ino, fb = self.zones[zone_idx].slots[run[0]]
                csums = b"".join(zlib.crc32(self.data[(zone_idx, s)]).to_bytes(4, "little")
                                 for s in run)
                pieces.append(LivePiece(self.dev_offset((zone_idx, run[0])), ino, fb, len(run),
                                        csums))
                run.clear()

        for s, key in enumerate(self.zones[zone_idx].slots):
            live = self.where.get(key) == (zone_idx, s)
            if run:
                prev = self.zones[zone_idx].slots[run[-1]]
                if (not live or key != (prev[0], prev[1] + 1) or s != run[-1] + 1
                        or len(run) * BS >= max_bytes):
                    close_run()
            if live:
                run.append(s)
        close_run()
        self.rng.shuffle(pieces)  # the cleaner, not the host, puts them in device order
        return pieces

    def pin_zone(self, zone_idx: int) -> None:
        self.pins.append(zone_idx)

    def unpin_zone(self, zone_idx: int) -> None:
        self.pins.remove(zone_idx)

    def dev_offset(self, slot: Slot) -> int:
        return (slot[0] * self.zones[0].capacity_blocks + slot[1]) * BS

    def slot_at(self, dev_offset: int) -> Slot:
        return divmod(dev_offset // BS, self.zones[0].capacity_blocks)

    async def read_verified(self, piece: LivePiece) -> bytes | None:
        await trio.lowlevel.checkpoint()
        self.reads.append(piece.dev_offset_bytes)
        zone, first = self.slot_at(piece.dev_offset_bytes)
        slots = [(zone, first + i) for i in range(piece.nblocks)]
        if self.bad & set(slots):
            return None
        return b"".join(self.data[s] for s in slots)

    async def relocate(self, piece: LivePiece, data: bytes) -> int:
        await trio.lowlevel.checkpoint()
        for i in range(piece.nblocks):
            if self.head is None or len(self.zones[self.head].slots) == \
                    self.zones[self.head].capacity_blocks:
                self.head = next(z for z in range(len(self.zones)) if self._is_empty(z))
            key = (piece.ino, piece.fblock + i)
            old = self.slot_at(piece.dev_offset_bytes + i * BS)
            head = self.zones[self.head]
            new = (self.head, len(head.slots))
            head.slots.append(key)
            self.data[new] = data[i * BS:(i + 1) * BS]
            if self.where.get(key) == old:
                self.where[key] = new
        return len(data)

    def count_cleaned(self, nbytes: int) -> None:
        self.cleaned_bytes += nbytes

    async def commit_and_reset(self) -> None:
        await trio.lowlevel.checkpoint()
        self.commits += 1
        for i, z in enumerate(self.zones):
            if i != self.head and z.slots and self.live_blocks(i) == 0:
                z.slots.clear()


def test_fake_host_is_a_cleaner_host() -> None:
    host: CleanerHost = FakeHost()  # mypy checks the protocol here
    assert host.empty_zone_count() == 10


def fresh(policy: str = "greedy", rate_mb_s: float = 1e6, **kw: int) -> tuple[FakeHost, Cleaner]:
    host = FakeHost(**kw)
    return host, Cleaner(host, policy, rate_mb_s)


# -- choosing ---------------------------------------------------------------------------

async def test_greedy_picks_most_dead_and_cost_benefit_prefers_old_cold_zones() -> None:
    host, cleaner = fresh()
    host.write(0, 1, range(32), age_s=1)       # zone 0: 32 live, 96 dead, fresh
    host.write(0, 2, range(96), age_s=1)
    host.write(1, 3, range(64), age_s=10_000)  # zone 1: 64 live, 64 dead, old
    host.write(1, 4, range(64), age_s=10_000)
    host.delete(2)
    host.delete(4)
    assert cleaner.pick_victim("greedy").zone_idx == 0  # type: ignore[union-attr]
    assert cleaner.pick_victim("cost-benefit").zone_idx == 1  # type: ignore[union-attr]


async def test_a_victim_must_fit_where_the_cleaner_can_write() -> None:
    host, cleaner = fresh(nzones=3, capacity_blocks=64)
    for zone in range(3):
        host.write(zone, 10 + zone, range(60))
        host.write(zone, 20 + zone, range(4))
        host.delete(20 + zone)
    assert len(cleaner.candidates()) == 3
    assert host.cleaner_room_bytes() == 0
    assert cleaner.pick_victim() is None


async def test_zones_without_dead_or_without_live_data_are_no_candidates() -> None:
    host, cleaner = fresh()
    host.write(0, 1, range(10))  # all live
    host.write(1, 2, range(10))  # all dead
    host.delete(2)
    assert cleaner.candidates() == []


# -- copying ------------------------------------------------------------------------------

async def test_clean_zone_copies_every_live_block_in_device_order() -> None:
    host, cleaner = fresh()
    host.write(0, 1, range(100))  # more than one COPY_UNIT: two pieces
    host.write(0, 2, range(8))
    host.write(0, 3, range(20))
    host.delete(2)
    before = {ino: host.read_file(ino, n) for ino, n in ((1, 100), (3, 20))}
    copied = await cleaner.clean_zone(0, throttle=True)
    assert copied == 120 * BS
    assert host.reads == sorted(host.reads)
    assert len(host.reads) == 3  # 100 blocks = 64 + 36 (COPY_UNIT), then file 3's 20
    assert COPY_UNIT == 64 * BS
    assert host.live_blocks(0) == 0
    await host.commit_and_reset()
    assert host.zones[0].slots == []
    assert {ino: host.read_file(ino, n) for ino, n in ((1, 100), (3, 20))} == before
    assert (cleaner.stats.zones_cleaned, cleaner.stats.bytes_copied) == (1, 120 * BS)
    assert host.cleaned_bytes == 120 * BS


@pytest.mark.expect_log("zonefs_py.cleaner.cleaner", "ERROR", "fails its checksum")
async def test_an_unreadable_zone_is_left_alone_and_never_picked_again() -> None:
    host, cleaner = fresh()
    host.write(0, 1, range(10))
    host.write(0, 2, range(10))
    host.write(0, 3, range(10))
    host.delete(2)
    host.bad.add((0, 25))  # inside file 3's blocks
    copied = await cleaner.clean_zone(0, throttle=False)
    assert copied == 10 * BS  # file 1 went before the bad piece was met
    assert cleaner.skip == {0}
    assert cleaner.stats.checksum_failures == 1
    assert cleaner.stats.zones_cleaned == 0
    assert host.cleaned_bytes == 0
    assert cleaner.pick_victim() is None


# -- passes --------------------------------------------------------------------------------

async def test_clean_for_space_cleans_until_users_have_an_empty_zone() -> None:
    host, cleaner = fresh(nzones=6, capacity_blocks=32, reserve=2)
    for zone in range(4):  # 4 zones half dead: 2 empty = reserve, users are short
        host.write(zone, 10 + zone, range(16))
        host.write(zone, 20 + zone, range(16))
        host.delete(20 + zone)
    assert await cleaner.clean_for_space()
    assert host.empty_zone_count() > host.reserve_zones
    assert cleaner.stats.foreground_passes == 1
    assert cleaner.stats.zones_cleaned >= 1
    for zone in range(4):
        assert host.read_file(10 + zone, 16) == b"".join(block_data((10 + zone, fb))
                                                         for fb in range(16))


async def test_clean_for_space_is_false_when_nothing_can_be_freed() -> None:
    host, cleaner = fresh(nzones=4, capacity_blocks=16, reserve=2)
    host.write(0, 1, range(16))
    host.write(1, 2, range(16))  # all live: nothing to gain
    assert not await cleaner.clean_for_space()
    assert host.commits == 1


async def test_clean_for_space_stops_when_a_commit_alone_frees_a_zone() -> None:
    host, cleaner = fresh(nzones=4, capacity_blocks=16, reserve=2)
    host.write(0, 1, range(16))
    host.write(1, 2, range(16))
    host.delete(2)  # zone 1 dead, reset at the next commit
    assert await cleaner.clean_for_space()
    assert cleaner.stats.zones_cleaned == 0
    assert host.commits == 1


async def test_background_pass_runs_only_below_the_watermark_and_with_a_rate() -> None:
    host, cleaner = fresh(nzones=10, capacity_blocks=32, reserve=2)
    assert cleaner.low_watermark == 4
    host.write(0, 1, range(16))
    host.write(0, 2, range(16))
    host.delete(2)
    assert await cleaner.background_pass() == 0  # 9 empty zones: nothing to do
    for zone in range(1, 7):
        host.write(zone, 10 + zone, range(32))
    assert host.empty_zone_count() == 3
    idle = Cleaner(host, "greedy", 0)
    assert await idle.background_pass() == 0  # cleaner_rate=0 turns it off
    assert await cleaner.background_pass() == 16 * BS
    assert cleaner.stats.passes == 1
    assert host.zones[0].slots == []  # cleaned and reset by the pass's commit


# -- the real engine ---------------------------------------------------------------------------

async def _fill_and_punch(fs: ZoneFS, tag: int) -> dict[str, bytes]:
    """Four files over shared zones, the second one deleted: a zone worth cleaning."""
    files = {f"/k{i}": pattern(tag + i, 600 * KiB) for i in range(4)}
    for path, data in files.items():
        await write_file(fs, path, data)
    await fs.unlink(ROOT_INO, b"k1")
    await fs.sync()
    del files["/k1"]
    return files


async def test_engine_cleaning_relocates_live_data_and_frees_the_zone(tmp_path: Path) -> None:
    image = tmp_path / "fs.img"
    async with mounted(image, create=True) as fs:
        files = await _fill_and_punch(fs, 90)
        victim = fs.cleaner.pick_victim()
        assert victim is not None
        assert victim.live_bytes == fs.alloc.live_bytes(victim.zone_idx)
        copied = await fs.cleaner.clean_zone(victim.zone_idx, throttle=False)
        assert copied == victim.live_bytes
        await fs.reclaim.commit_and_reset()
        assert fs.alloc.zones[victim.zone_idx].reserved == 0
        for path, data in files.items():
            assert await read_file(fs, path) == data
        status = fs.status()
        assert status["cleaner_bytes_copied"] == copied
        assert status["cleaner"]["zones_cleaned"] == 1  # type: ignore[index]
    async with mounted(image) as fs:  # relocated and durable
        for path, data in files.items():
            assert await read_file(fs, path) == data


async def test_engine_relocate_keeps_a_block_rewritten_after_the_read(tmp_path: Path) -> None:
    """INV-15: a write landing between the cleaner's read and its re-point wins."""
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        files = await _fill_and_punch(fs, 40)
        victim = fs.cleaner.pick_victim()
        assert victim is not None
        piece = next(p for p in sorted(fs.reclaim.live_pieces(victim.zone_idx, COPY_UNIT))
                     if p.nblocks > 1)
        data = await fs.reclaim.read_verified(piece)
        assert data is not None
        fresh_block = b"\xa5" * BS
        fh = await fs.open(piece.ino, os.O_WRONLY)
        await fs.write(fh, piece.fblock * BS, fresh_block)
        await fs.fsync(fh, False)
        await fs.release(fh)
        assert await fs.reclaim.relocate(piece, data) == len(data)
        extents = fs.state.inodes[piece.ino].extents
        assert extents is not None
        zsize = fs.state.zone_size
        (first,) = extents.lookup(piece.fblock, 1, BS)
        (second,) = extents.lookup(piece.fblock + 1, 1, BS)
        assert first.dev is not None
        assert second.dev is not None
        assert fs.alloc.zones[first.dev // zsize].stream != Stream.CLEANER
        assert fs.alloc.zones[second.dev // zsize].stream == Stream.CLEANER
        inos = {await resolve(fs, p): p for p in files}
        path = inos[piece.ino]
        expect = bytearray(files[path])
        expect[piece.fblock * BS:(piece.fblock + 1) * BS] = fresh_block
        assert await read_file(fs, path) == bytes(expect)
        await fs.sync()


async def test_a_writer_finds_the_room_another_writers_pass_made(tmp_path: Path) -> None:
    """Two writers find no empty zone at once and ask the cleaner. The first one's
    pass commits, resets the zone a delete left dead and opens a head there;
    the second one's pass then frees nothing. It must still find room (the
    first one's head, which it may share while empty zones are scarce), not
    ENOSPC: the flaky mount test `test_writes_into_a_reservation_never_get_enospc`."""
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        cap = max(z.capacity for z in fs.alloc.zones.values())
        await write_file(fs, "/dead", pattern(1, cap))
        fh, attr = await fs.create(ROOT_INO, b"k", 0o644, os.O_WRONLY, CTX)
        fs.forget([(attr.ino, 1)])
        off = 0
        while True:  # fill to the admission limit
            try:
                await fs.write(fh, off, pattern(2, 256 * KiB))
            except errors.NoSpace:
                break
            off += 256 * KiB
        await fs.fsync(fh, False)
        await fs.release(fh)
        await fs.unlink(ROOT_INO, b"dead")  # dead, reset only after a commit (INV-8)
        # A file of another stream takes the last zone users may open.
        await write_file(fs, "/fill.log", pattern(3, cap))
        assert len(fs.alloc.empty_zones()) == fs.alloc.reserve_zones
        assert fs.alloc.pending_resets

        async def writer(name: bytes) -> None:
            await write_file(fs, "/" + name.decode(), pattern(4, 16 * KiB))

        async with trio.open_nursery() as nursery:
            for name in (b"a.log", b"b.log"):
                nursery.start_soon(writer, name)
        assert fs.cleaner.stats.foreground_passes == 2
        for name in ("/a.log", "/b.log"):
            assert await read_file(fs, name) == pattern(4, 16 * KiB)
