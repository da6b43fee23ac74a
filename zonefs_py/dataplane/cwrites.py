"""The data plane's write streams: sequential WRITEs taken in C (issue 44, DESIGN 4.11).

native/zonefs_cwrite.c lets the dispatcher answer the WRITEs of a file being
written sequentially in whole blocks: the payload is copied into a 4 MiB
staging buffer in C and the WRITE answered there, without pyfuse3, the trio
thread or a Python object per request. This is its Python side, the engine's
only door to it:

* `WriteStreams.arm(ino, next_off, credit)`, from the engine after a streaming
  WRITE it served (`CStreamEngine.after_write`, fs/cstreams.py, decides whether
  the file qualifies and admits the credit): arms the file's stream there with
  that credit; `credit` tops it up, `end` ends it before Python changes the file;
* `WriteStreams.absorb()`: takes what C staged (full buffers, partial ones a
  request of the file asked for, and the end of streams) and hands it to the
  engine (`sink.c_staged`, `sink.c_stream_ended`) in C's order. It runs at the
  start of every request handler (fuse_ops `_handler`), so a request Python
  serves sees every byte the kernel was told was written before it sent that
  request, and whenever the eventfd says records wait (`run`);
* `close()`: the serve ends: no WRITE is taken in C after it, and the last
  records are absorbed.

The engine still places, checksums and appends every chunk (fs/data/writepipe.py)
and applies its EXTENT ops in order: this step removes the per-WRITE cost
(pyfuse3's request object, the payload's copy into `bytes`, a handler task,
the admission per request), not the per-chunk one. A record's C buffer is the
chunk's data as it is (a cffi buffer, freed by the garbage collector's hook
once no view of it is left), not copied again.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import trio

from zonefs_py import fuseext

log = logging.getLogger(__name__)

#: Why a stream ended, in the C side's order (zdw_stats).
END_REASONS = ("not_sequential", "unaligned", "flags", "no_credit", "staged_full",
               "no_memory", "other_request", "closed", "python_change")
#: Records taken per C call.
TAKE_BATCH = 64


class StagedSink(Protocol):
    """What the engine offers the write streams (fs/cstreams.py, CStreamEngine)."""

    def c_staged(self, ino: int, offset: int, data: Any) -> None: ...

    def c_stream_ended(self, ino: int, credit_left: int) -> None: ...

    def c_batch_done(self, inos: set[int]) -> None: ...


class WriteStreams:
    """C write streams of one mount (module docstring). Trio thread only."""

    def __init__(self, sink: StagedSink, credit_bytes: int) -> None:
        ext = fuseext.extension()
        assert ext is not None
        self._ffi, self._lib = ext.ffi, ext.lib
        self.sink = sink
        #: Credit a stream is armed with and topped up to (bytes admitted ahead).
        self.credit_bytes = credit_bytes
        efd = self._lib.zdw_enable(1)
        if efd < 0:
            raise OSError(-efd, "zdw_enable")
        self.efd: int = efd
        self._out = self._ffi.new("struct zdw_out[]", TAKE_BATCH)
        self.closed = False
        #: Arming attempts refused, by reason (the engine's and C's).
        self.refused: dict[str, int] = {}
        self.absorbed_records = 0
        self.absorbed_bytes = 0

    # -- arming ------------------------------------------------------------------------
    def armed(self, ino: int) -> bool:
        """Whether C may take WRITEs of `ino` now (a C call: the stream may have ended)."""
        return bool(self._lib.zdw_armed(ino))

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1

    def arm(self, ino: int, next_off: int, credit: int) -> bool:
        """Arm `ino`'s stream at `next_off` with `credit` admitted bytes; False (counted)
        when C refused (a request that may change the file is queued for pyfuse3, the
        file has a stream, or all streams are taken)."""
        if self.closed:
            return False
        rc = int(self._lib.zdw_arm(ino, next_off, credit))
        if rc < 0:
            self.refuse({-11: "queued", -17: "armed", -28: "no_stream_free"}.get(rc, f"c{rc}"))
            return False
        return True

    def end(self, ino: int) -> None:
        """End `ino`'s stream (Python changes the file next) and absorb what C staged, its
        end included (no await)."""
        if self._lib.zdw_end(ino) == 0:
            self.absorb()

    def credit(self, ino: int, add: int) -> bool:
        """Add `add` bytes to the stream's credit; False when it has ended."""
        return int(self._lib.zdw_credit(ino, add)) == 0

    # -- absorbing ---------------------------------------------------------------------
    def absorb(self) -> None:
        """Hand every record C holds to the engine, oldest first (no await)."""
        lib, ffi, out, sink = self._lib, self._ffi, self._out, self.sink
        touched: set[int] = set()
        while True:
            n = lib.zdw_take(out, TAKE_BATCH)
            if n <= 0:
                break
            for i in range(n):
                r = out[i]
                ino = int(r.ino)
                if r.mem != ffi.NULL:
                    # The C buffer itself, freed when the last view of it goes (the
                    # chunk's, and a reader's of the chunk in flight): no copy.
                    mem = ffi.gc(r.mem, lib.zdw_free, size=int(r.len))
                    data = ffi.buffer(mem, r.len)
                    self.absorbed_records += 1
                    self.absorbed_bytes += len(data)
                    sink.c_staged(ino, int(r.file_off), data)
                    touched.add(ino)
                if r.kind == 1:
                    sink.c_stream_ended(ino, int(r.credit_left))
                    touched.discard(ino)
        if touched:
            sink.c_batch_done(touched)

    async def run(self) -> None:
        """Forever: absorb whenever the eventfd says records wait."""
        while not self.closed:
            await trio.lowlevel.wait_readable(self.efd)
            self.absorb()

    def close(self) -> None:
        """End every stream (no WRITE taken in C after this) and absorb the rest."""
        self.closed = True
        self._lib.zdw_close()
        self.absorb()

    # -- counters ----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out = c_stats()
        out["arm_refused"] = dict(self.refused)
        out["absorbed_bytes"] = self.absorbed_bytes
        return out


def c_stats() -> dict[str, Any]:
    """The C side's counters (also without streams: the capability probes), {} without
    the extension."""
    ext = fuseext.extension()
    if ext is None:
        return {}
    n = 7 + len(END_REASONS) + 1
    raw = ext.ffi.new("uint64_t[]", n)
    got = ext.lib.zdw_stats(raw, n)
    v = [int(raw[i]) for i in range(got)]
    served, nbytes, records, partials, arms, staged, probes = v[:7]
    return {
        "writes_c": served,
        "writes_c_bytes": nbytes,
        "records": records,
        "partial_records": partials,
        "streams_armed": arms,
        "staged_bytes": staged,
        "caps_probes_c": probes,
        "streams_ended": dict(zip(END_REASONS, v[7:7 + len(END_REASONS)], strict=True)),
        # of writes_c: read from /dev/fuse straight into the staging buffer (no copy)
        "writes_c_in_place": v[7 + len(END_REASONS)],
    }


def census_extra(stats: dict[str, Any], census: dict[str, int]) -> dict[str, int]:
    """The census with the WRITEs answered in C counted in."""
    out = dict(census)
    if not out:
        return out
    if stats.get("writes_c"):
        out["WRITE"] = out.get("WRITE", 0) + stats["writes_c"]
    return out


def census_names(stats: dict[str, Any], census: dict[str, int]) -> dict[str, int]:
    """`census_extra` for the received requests, whose GETXATTRs are also counted by
    attribute name: the probes C answered (the C side counts them in GETXATTR)."""
    out = census_extra(stats, census)
    probes = stats.get("caps_probes_c", 0)
    if out and probes:
        key = "GETXATTR:security.capability"
        out[key] = out.get(key, 0) + probes
    return out

