"""Power cuts across drain -> evict -> rename (move) -> restore of a file (issue 30).

The scenario runs once to count its device writes, then again on a fresh image
for every k, with the power cut right after the k-th write (test_crash.py's
harness: the emulator's `cut_after_writes` in "drop" mode, CountingDevice's
"tear"). The fake store is another machine: it keeps what it was sent. After
every cut the image must pass fsck, and at the next mount:

* a file whose record says drained or evicted has a complete object in the
  store (exact bytes, under the record's key or, while a move is pending, the
  destination's): never marked drained or evicted without one;
* once the fsync of the write returned, the file reads back byte-exact
  (restored from the store if evicted), and the drainer, run again, takes it
  to drained (the drain resumes) under its current name.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio
import trio.testing
import xxhash
from engine_helpers import (
    CTX,
    CountingDevice,
    assert_fsck_clean,
    new_image,
    read_file,
    resolve,
    write_file,
)
from fake_store import FakeStore
from test_drain import (
    BUCKET,
    OPTIONS,
    PART,
    clock,
    drainer_running,
    payload,
    setup_dir,
    state_of,
    wait_for,
)
from test_drain_resume import rename

from zonefs_py import errors
from zonefs_py.device.emulated import EmulatedZonedDevice
from zonefs_py.drain.policy import STATE_XATTR
from zonefs_py.drain.store import parse_url
from zonefs_py.fs.api import XattrFlags
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.model.drain import DrainState

__all__ = ["clock"]

DATA = payload(3 * PART + 1234, 30)


class Progress:
    """How far the scenario got (what was acknowledged before the cut)."""

    def __init__(self) -> None:
        self.synced = False  # the fsync of the write returned
        self.renamed = False  # the rename's sync returned


async def until(cond: object, dead: object) -> None:
    """Wait (virtual time) for `cond()`, or return early once `dead()` (the cut)."""
    for _ in range(20000):
        if cond() or dead():  # type: ignore[operator]
            return
        await trio.sleep(0.05)
    raise AssertionError("scenario stuck")


async def scenario(fs: ZoneFS, store: FakeStore, p: Progress, dead: object) -> None:
    fs.drain.store = store
    fs.drain.part_bytes = PART
    await setup_dir(fs)
    await fs.sync()
    async with drainer_running(fs):
        await write_file(fs, "/ck/a.pt", DATA)
        p.synced = True
        ino = await resolve(fs, "/ck/a.pt")
        await until(lambda: state_of(fs, ino) == "drained", dead)
        await fs.setxattr(ino, STATE_XATTR, b"evicted", XattrFlags(0), CTX)
        await fs.sync()
        await rename(fs, "/ck/a.pt", "/ck/b.pt")
        await fs.sync()
        p.renamed = True
        await until(lambda: fs.drain.files_moved == 1, dead)
        await fs.sync()
        assert await read_file(fs, "/ck/b.pt") == DATA  # restore
        await fs.sync()


async def run_once(image: Path, store: FakeStore, cut_after: int | None, mode: str,
                   seed: int) -> tuple[int, bool, Progress]:
    drop = cut_after is not None and mode == "drop"
    dev = EmulatedZonedDevice.open(image, volatile_cache=True,
                                   cut_after_writes=cut_after if drop else None)
    cdev = CountingDevice(dev, cut_after=None if drop else cut_after, mode=mode,
                          rng=random.Random(seed))
    p = Progress()

    def was_cut() -> bool:
        return cut_after is not None and (cdev.writes >= cut_after or (
            drop and dev.faults.writes_seen >= cut_after))

    try:
        async with ZoneFS.mount(cdev, OPTIONS, close=False) as fs:  # type: ignore[arg-type]
            try:
                await scenario(fs, store, p, lambda: was_cut() or fs.failsafe is not None)
                await fs.close()
            except BaseExceptionGroup as group:
                exc: BaseException = group
                while isinstance(exc, BaseExceptionGroup):
                    exc = exc.exceptions[0]
                raise exc from None
    except (OSError, errors.ZoneFSError, AssertionError):
        if not was_cut():
            raise
    finally:
        dev.close()
    return cdev.writes, was_cut(), p


def object_of(store: FakeStore, url: bytes) -> bytes | None:
    bucket, key = parse_url(url.decode())
    found = store.objects.get((bucket, key))
    return found[0] if found is not None else None


async def verify(image: Path, store: FakeStore, p: Progress, where: str) -> str:
    """Check the image after a cut (see the module docstring); return the state the
    file was found in."""
    assert_fsck_clean(image)
    dev = EmulatedZonedDevice.open(image)
    try:
        async with ZoneFS.mount(dev, OPTIONS, close=False) as fs:
            fs.drain.store = store
            fs.drain.part_bytes = PART
            path = "/ck/b.pt"
            try:
                ino = await resolve(fs, path)
            except errors.NotFound:
                path = "/ck/a.pt"
                try:
                    ino = await resolve(fs, path)
                except errors.NotFound:
                    assert not p.synced, f"{where}: the fsync'ed file is gone"
                    await fs.close()
                    return "absent"
            assert not p.renamed or path == "/ck/b.pt", f"{where}: the rename was lost"
            rec = fs.state.drain.get(ino)
            found = "local" if rec is None else rec.state.name.lower()
            if rec is not None and rec.state in (DrainState.DRAINED, DrainState.EVICTED):
                obj = object_of(store, rec.url)
                if obj is None and rec.moving_to:
                    obj = object_of(store, rec.moving_to)
                    found += " (moving, old key gone)"
                assert obj is not None, f"{where}: {found} but no object under {rec.url!r}"
                assert len(obj) == rec.size, f"{where}: {found}: object of another size"
                assert xxhash.xxh3_64_intdigest(obj) == rec.xxh3, f"{where}: {found}: other xxh3"
                assert obj == DATA, f"{where}: the object holds other bytes"
            if p.synced or rec is not None:
                assert await read_file(fs, path) == DATA, f"{where}: {found}: wrong bytes"
                if fs.state.drain.get(ino) is not None:
                    async with drainer_running(fs):
                        await wait_for(lambda: state_of(fs, ino) == "drained"
                                       and not fs.drain.needs_move(fs.state.inodes[ino],
                                                                   fs.state.drain[ino]))
                    key = path.rsplit("/", 1)[1]
                    assert fs.state.drain[ino].url == f"s3://{BUCKET}/run1/{key}".encode()
                    assert object_of(store, fs.state.drain[ino].url) == DATA
            await fs.close()
    finally:
        dev.close()
    assert_fsck_clean(image)
    return found


@pytest.mark.expect_log("zonefs_py", "ERROR", "")
@pytest.mark.parametrize("mode", ["drop", "tear"])
async def test_power_cut_across_drain_evict_move_restore(
        tmp_path: Path, clock: trio.testing.MockClock, mode: str) -> None:
    base = tmp_path / "count.img"
    new_image(base)
    total, cut, p = await run_once(base, FakeStore(), None, mode, 0)
    assert not cut
    assert p.renamed
    assert total >= 20, f"only {total} device writes: the sweep would prove little"
    seen: dict[str, int] = {}
    for k in range(1, total + 1):
        seed = k * 7919
        where = f"mode={mode} cut_after={k}/{total} seed={seed}"
        image = tmp_path / f"k{k}.img"
        new_image(image)
        store = FakeStore()
        writes, cut, p = await run_once(image, store, k, mode, seed)
        assert cut, f"{where}: the scenario made only {writes} writes this time"
        found = await verify(image, store, p, where)
        seen[found] = seen.get(found, 0) + 1
        image.unlink()
    print(f"{mode}: {total} cut points; states found after the cut: {seen}")
    # The sweep must have cut inside each phase, not only before or after all of it.
    assert {"queued", "uploading", "drained", "evicted"} <= set(seen), seen
