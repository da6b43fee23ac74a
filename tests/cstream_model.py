"""A Python model of the C side of write streams, for tests without FUSE.

native/zonefs_cwrite.c is what takes sequential WRITEs in a mount; the engine
sees it only through dataplane/cwrites.WriteStreams (arm, credit, end, close,
and the records it absorbs into `CStreamEngine.c_staged`). `ModelStreams`
keeps that contract in Python so that crash sweeps (tests/unit/test_crash.py)
and device-fault tests (tests/reliability/test_device_faults.py) can run the
engine's side of C writes on the emulator's hooks. Importable as
`cstream_model`: pytest puts tests/ on sys.path.
"""

from __future__ import annotations

import os

from zonefs_py.fs.api import ROOT_INO, Ctx
from zonefs_py.fs.cstreams import CStreamEngine
from zonefs_py.fs.filesystem import ZoneFS


class ModelStreams:
    """The C side of write streams (native/zonefs_cwrite.c), as the engine sees it
    through dataplane/cwrites.WriteStreams, modelled in Python so that a sweep
    can run the engine's side of C writes (fs/cstreams.py) without FUSE:
    arming, credit, ends; `stage` is the dispatcher answering one WRITE and the
    engine absorbing the record at once (what the next handler's absorb does)."""

    def __init__(self) -> None:
        self.closed = False
        self.next_off: dict[int, int] = {}
        self.credit_left: dict[int, int] = {}
        self.engine: CStreamEngine | None = None

    def armed(self, ino: int) -> bool:
        return ino in self.next_off

    def refuse(self, reason: str) -> None:
        pass

    def arm(self, ino: int, next_off: int, credit: int) -> bool:
        if self.closed or ino in self.next_off:
            return False
        self.next_off[ino] = next_off
        self.credit_left[ino] = credit
        return True

    def credit(self, ino: int, add: int) -> bool:
        if ino not in self.next_off:
            return False
        self.credit_left[ino] += add
        return True

    def end(self, ino: int) -> None:
        assert self.engine is not None
        if ino in self.next_off:
            del self.next_off[ino]
            self.engine.c_stream_ended(ino, self.credit_left.pop(ino))

    def close(self) -> None:
        self.closed = True
        for ino in list(self.next_off):
            self.end(ino)

    def stage(self, ino: int, data: bytes) -> bool:
        """A WRITE of `data` at the stream's next offset, answered in C and staged
        (True), or the stream ends and the WRITE would go to Python (False)."""
        assert self.engine is not None
        if ino not in self.next_off:
            return False
        if len(data) > self.credit_left[ino]:
            self.end(ino)
            return False
        off = self.next_off[ino]
        self.next_off[ino] += len(data)
        self.credit_left[ino] -= len(data)
        self.engine.c_staged(ino, off, data)
        self.engine.c_batch_done({ino})
        return True


def attach_model_streams(fs: ZoneFS, credit: int) -> ModelStreams:
    """Wire ModelStreams into the engine as dataplane/wiring.attach_writes wires C's."""
    streams = ModelStreams()
    engine = CStreamEngine(fs, streams)
    engine.credit_bytes = credit
    streams.engine = engine
    fs.c_streams = engine
    fs.data.writes.before_change = engine.before_change
    fs.data.writes.after_chunk = engine.after_chunk
    return streams


async def create_armed(fs: ZoneFS, name: bytes, first: bytes, ctx: Ctx, *,
                       credit: int) -> tuple[ModelStreams, int, int]:
    """Model streams wired in, then root's `name` created and `first` (a chunk or
    more) written to it through Python, which arms its stream; (streams, fh, ino).
    The handle is released again if the write fails (a power cut in a sweep)."""
    streams = attach_model_streams(fs, credit)
    fh, attr = await fs.create(ROOT_INO, name, 0o644, os.O_WRONLY, ctx)
    fs.forget([(attr.ino, 1)])
    try:
        await fs.write(fh, 0, first)
    except BaseException:
        streams.close()
        await fs.release(fh)
        raise
    assert streams.armed(attr.ino), "a whole-chunk write at the end arms the stream"
    return streams, fh, attr.ino
