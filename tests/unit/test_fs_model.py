"""Seeded random operations on ZoneFS against an in-memory model.

Each run drives ZoneFS and a model (file paths -> file ids -> bytes, so hard
links share content; directories) with random create / write / truncate /
rename / unlink / mkdir / rmdir / link, interleaved with fsync, clean
unmount + load, and power cuts (drop or tear) + load. After a clean reload
the tree must equal the model; after a power cut it must equal the model as
of the last `fs.sync()` (taken just before the unsynced tail of operations).
The seed is in every failure message.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from engine_helpers import (
    CTX,
    TEST_OPTIONS,
    assert_fsck_clean,
    lookup,
    new_image,
    parent_and_name,
    read_tree,
    resolve,
)

from zonefs_py import errors
from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.fs.api import RenameFlags, SetAttrRequest
from zonefs_py.fs.filesystem import ZoneFS

NAMES = ["a", "b", "c", "dd", "e"]


@dataclass
class FsModel:
    paths: dict[str, int] = field(default_factory=dict)  # file path -> file id
    data: dict[int, bytes] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=set)
    next_id: int = 1

    def copy(self) -> FsModel:
        return FsModel(dict(self.paths), dict(self.data), set(self.dirs), self.next_id)

    def tree(self) -> tuple[dict[str, bytes], set[str]]:
        return {p: self.data[f] for p, f in self.paths.items()}, set(self.dirs)

    def exists(self, p: str) -> bool:
        return p in self.paths or p in self.dirs

    def children(self, d: str) -> list[str]:
        pre = d + "/"
        return [p for p in [*self.paths, *self.dirs]
                if p.startswith(pre) and "/" not in p[len(pre):]]

    def drop_link(self, p: str) -> None:
        fid = self.paths.pop(p)
        if fid not in self.paths.values():
            del self.data[fid]


class Runner:
    def __init__(self, seed: int, image: Path) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.image = image
        self.model = FsModel()
        self.log: list[str] = []

    def where(self) -> str:
        return f"seed={self.seed} last ops={self.log[-8:]}"

    def pick_dir(self) -> str:
        return self.rng.choice(["", *sorted(self.model.dirs)])

    def new_path(self) -> str | None:
        for _ in range(10):
            d = self.pick_dir()
            if d.count("/") >= 3:
                continue
            p = f"{d}/{self.rng.choice(NAMES)}"
            if not self.model.exists(p):
                return p
        return None

    def pick_file(self) -> str | None:
        return self.rng.choice(sorted(self.model.paths)) if self.model.paths else None

    def data(self, n: int) -> bytes:
        return self.rng.randbytes(n).replace(b"\0", b"\1")

    async def step(self, fs: ZoneFS, *, durable: bool = True) -> None:
        """One random operation; `durable=False` leaves out fsync (it commits everything)."""
        m, rng = self.model, self.rng
        kind = rng.choice(["create", "create", "write", "write", "truncate", "rename", "unlink",
                           "mkdir", "rmdir", "link"] + (["fsync"] if durable else []))
        if kind == "create" and (p := self.new_path()):
            parent, name = await parent_and_name(fs, p)
            fh, attr = await fs.create(parent, name, 0o644, os.O_WRONLY, CTX)
            fs.forget([(attr.ino, 1)])
            data = self.data(rng.choice([0, 10, 3000, 9000]))
            if data:
                await fs.write(fh, 0, data)
            await fs.release(fh)
            m.paths[p], m.data[m.next_id] = m.next_id, data
            m.next_id += 1
        elif kind in ("write", "truncate", "fsync") and (p := self.pick_file()):
            fid = m.paths[p]
            old = m.data[fid]
            ino = await resolve(fs, p)
            fh = await fs.open(ino, os.O_WRONLY)
            try:
                if kind == "write":
                    off = rng.randrange(0, len(old) + 5000)
                    data = self.data(rng.choice([1, 100, 4096, 7000]))
                    await fs.write(fh, off, data)
                    padded = old + bytes(max(0, off - len(old)))
                    m.data[fid] = padded[:off] + data + padded[off + len(data):]
                elif kind == "truncate":
                    size = rng.randrange(0, len(old) + 6000)
                    await fs.setattr(ino, SetAttrRequest(size=size), CTX)
                    m.data[fid] = old[:size] + bytes(max(0, size - len(old)))
                else:
                    await fs.fsync(fh, False)
            finally:
                await fs.release(fh)
        elif kind == "rename":
            await self.rename(fs)
        elif kind == "unlink" and (p := self.pick_file()):
            parent, name = await parent_and_name(fs, p)
            await fs.unlink(parent, name)
            m.drop_link(p)
        elif kind == "mkdir" and (p := self.new_path()):
            parent, name = await parent_and_name(fs, p)
            attr = await fs.mkdir(parent, name, 0o755, CTX)
            fs.forget([(attr.ino, 1)])
            m.dirs.add(p)
        elif kind == "rmdir" and m.dirs:
            d = rng.choice(sorted(m.dirs))
            parent, name = await parent_and_name(fs, d)
            if m.children(d):
                with pytest.raises(errors.NotEmpty):
                    await fs.rmdir(parent, name)
            else:
                await fs.rmdir(parent, name)
                m.dirs.discard(d)
        elif kind == "link" and (p := self.pick_file()) and (q := self.new_path()):
            parent, name = await parent_and_name(fs, q)
            attr = await fs.link(await resolve(fs, p), parent, name)
            fs.forget([(attr.ino, 1)])
            m.paths[q] = m.paths[p]
        else:
            return
        self.log.append(f"{kind}")

    async def rename(self, fs: ZoneFS) -> None:
        m, rng = self.model, self.rng
        srcs = sorted([*m.paths, *m.dirs])
        if not srcs:
            return
        src = rng.choice(srcs)
        dst = self.new_path() if rng.random() < 0.6 else rng.choice(srcs)
        if dst is None or dst == src:
            return
        sp, sn = await parent_and_name(fs, src)
        dp, dn = await parent_and_name(fs, dst)
        if src in m.dirs:
            if dst == src or dst.startswith(src + "/"):
                with pytest.raises(errors.LoopDetected):
                    await fs.rename(sp, sn, dp, dn, RenameFlags.NONE)
                return
            if dst in m.paths or (dst in m.dirs and m.children(dst)):
                return
            await fs.rename(sp, sn, dp, dn, RenameFlags.NONE)
            m.dirs.discard(dst)
            moved = {p for p in m.dirs if p == src or p.startswith(src + "/")}
            m.dirs = (m.dirs - moved) | {dst + p[len(src):] for p in moved}
            for p in [p for p in m.paths if p.startswith(src + "/")]:
                m.paths[dst + p[len(src):]] = m.paths.pop(p)
        else:
            if dst in m.dirs:
                return
            await fs.rename(sp, sn, dp, dn, RenameFlags.NONE)
            if dst in m.paths and m.paths[dst] == m.paths[src]:
                return  # hard links of one file: rename does nothing
            if dst in m.paths:
                m.drop_link(dst)
            m.paths[dst] = m.paths.pop(src)
        self.log.append(f"rename {src} -> {dst}")

    async def check(self, fs: ZoneFS, expect: FsModel) -> None:
        files, dirs = await read_tree(fs)
        want_files, want_dirs = expect.tree()
        assert dirs == want_dirs, f"{self.where()}: dirs {sorted(dirs)} != {sorted(want_dirs)}"
        assert sorted(files) == sorted(want_files), f"{self.where()}: file names differ"
        for p, content in want_files.items():
            assert files[p] == content, f"{self.where()}: content of {p} differs"
        for p, fid in expect.paths.items():
            links = sum(1 for f in expect.paths.values() if f == fid)
            assert (await lookup(fs, *(await parent_and_name(fs, p)))).nlink == links


async def run(seed: int, tmp_path: Path, *, rounds: int, ops: int) -> None:
    image = tmp_path / f"model{seed}.img"
    new_image(image)
    r = Runner(seed, image)
    for rnd in range(rounds):
        dev = EmulatedZonedDevice.open(image, volatile_cache=True)
        try:
            async with ZoneFS.mount(dev, TEST_OPTIONS, close=False) as fs:
                await r.check(fs, r.model)
                for _ in range(ops):
                    await r.step(fs)
                ending = r.rng.choice(["close", "cut"])
                r.log.append(f"round {rnd} ends with {ending}")
                if ending == "close":
                    await fs.close()
                else:
                    await fs.sync()
                    durable = r.model.copy()
                    for _ in range(r.rng.randrange(1, 6)):  # not synced: may vanish
                        await r.step(fs, durable=False)
                    dev.simulate_power_cut(r.rng.choice(["drop", "tear"]),
                                           rng=random.Random(seed * 1000 + rnd))
                    r.model = durable
        finally:
            dev.close()
        try:
            assert_fsck_clean(image)
        except AssertionError as exc:
            raise AssertionError(f"{r.where()}: {exc}") from None
    dev = EmulatedZonedDevice.open(image)
    try:
        async with ZoneFS.mount(dev, TEST_OPTIONS) as fs:
            await r.check(fs, r.model)
    finally:
        dev.close()


@pytest.mark.parametrize("seed", range(12))
async def test_random_ops_match_the_model(tmp_path: Path, seed: int) -> None:
    await run(seed, tmp_path, rounds=5, ops=40)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 160))
async def test_random_ops_match_the_model_long(tmp_path: Path, seed: int) -> None:
    await run(seed, tmp_path, rounds=10, ops=80)
