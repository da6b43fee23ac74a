"""The engine's side of C write streams (issue 44, DESIGN 4.11; dataplane/cwrites.py).

After a streaming WRITE the engine served (block-aligned, a chunk or more, at the
file's end), `after_write` offers the file to the data plane: C may then take
its next sequential WRITEs itself. The engine keeps every decision that is
policy:

* which files qualify (`refusal`): not inline, nothing buffered, block-aligned,
  no write error waiting for the next fsync, not evicted, not near a full
  device (the write gate must see every write then), not in a tenant with a
  zone cap (its ENOSPC at write(2) is admitted per request, fs/tenantspace.py);
* the credit: bytes C may take before it hands the file's WRITEs back, each
  admitted like a write request's (quota, the device's user capacity) and
  counted as used (`FileWrites.admitted_bytes`) until they arrive as staged
  bytes or come back unused at the stream's end, so concurrent admission
  checks see them (issue 42, item 6). When the credit runs out and the
  engine did not top it up (too much of the file in flight, no space), C
  hands the next WRITE to Python, which admits it (ENOSPC, EDQUOT exactly as
  before) and waits for the file's chunks in flight like any streaming write;
* staged bytes (`c_staged`) enter the write pipeline as chunks, in order,
  without an await between taking them from C and queuing them
  (`DataPath.queue_staged`), with the bookkeeping a write request does (user
  bytes, quota, the drain's dirty mark, the write gate).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from zonefs_py import errors
from zonefs_py.model.drain import DrainState

if TYPE_CHECKING:
    from zonefs_py.model.state import Inode

log = logging.getLogger(__name__)

#: Files whose highest streaming write end is kept (`CStreamEngine.high`).
HIGH_KEPT = 4096
#: Bytes a stream is armed with and topped up to.
CREDIT_BYTES = 16 << 20
#: All streams' credit together stays under this fraction of the free space.
CREDIT_SHARE_OF_FREE = 8
#: The credit is topped up once this much of it was used.
TOPUP_STEP = 4 << 20
#: A stream's credit is topped up only while the file has at most this many chunks in
#: flight (C's records are up to 4 MiB; topped up again as each is applied): beyond,
#: C hands the next WRITE back and the engine's own back-pressure (MAX_INFLIGHT)
#: holds it.
TOPUP_MAX_INFLIGHT = 6


class CStreamEngine:
    """Which files C may write, their credit, and what C staged into the pipeline."""

    def __init__(self, fs: Any, streams: Any) -> None:
        #: The engine (ZoneFS: state, data, falloc, alloc, quota, drain, space_gate).
        self.fs = fs
        #: dataplane.cwrites.WriteStreams.
        self.streams = streams
        #: Bytes a stream is armed with and topped up to (smaller in crash sweeps).
        self.credit_bytes = CREDIT_BYTES
        #: ino -> credit bytes admitted and not yet staged nor given back.
        self.granted: dict[int, int] = {}
        #: ino -> the highest end of its streaming writes served here (HIGH_KEPT at most).
        self.high: dict[int, int] = {}
        #: Staged bytes that met a buffer of their file (a write arriving when the
        #: stream was armed, below it; counted).
        self.behind_buffer = 0
        self.staged_for_freed = 0

    # -- arming --------------------------------------------------------------------------
    def after_write(self, inode: Inode, offset: int, nbytes: int, streaming: bool) -> None:
        """A WRITE of `inode` was served here: arm its stream if it qualifies, at its
        end, or, while other writes of the file are in flight, at the highest end
        of the file's writes (the kernel sends a sequential writer's WRITEs in
        order, several at once: the next one starts there)."""
        if not streaming or self.streams.closed or inode.ino in self.granted:
            return
        ino = inode.ino
        writes = self.fs.data.writes
        end = offset + nbytes
        high = self.high.get(ino, 0)
        if high > writes.visible_size(inode):
            high = 0  # truncated since, or another file's (a reused inode number)
        if end > high:
            if len(self.high) >= HIGH_KEPT:
                self.high.clear()
            self.high[ino] = high = end
        arriving = writes.arriving_end(ino)
        why = self.refusal(inode, end)
        if why is None and arriving is None:
            why = "other_changes_in_flight"
        if writes.arrivals_of(ino) > 1:
            # Others of the file in flight: the kernel's writeback, whose WRITEs may
            # finish out of order; the next one starts past the highest of them.
            end = max(end, high, arriving or 0)
        if why is None and end % self.fs.data.bs:
            why = "unaligned"
        credit = self.credit_bytes
        if why is None and not self._admit(inode, credit):
            why = "space"
        if why is not None:
            self.streams.refuse(why)
            return
        writes.admitted_bytes += credit
        if self.streams.arm(ino, end, credit):
            self.granted[ino] = credit
        else:
            writes.admitted_bytes -= credit

    def refusal(self, inode: Inode, end: int) -> str | None:
        """Why `inode` may not be streamed from `end` in C now, or None."""
        fs = self.fs
        writes = fs.data.writes
        ino = inode.ino
        if inode.inline or inode.extents is None:
            return "inline"
        if ino in writes.buffers:
            return "buffered"
        if end % fs.data.bs:
            return "unaligned"
        if ino in writes.write_errors:
            return "write_error"
        rec = fs.state.drain.get(ino)
        if rec is not None and rec.state is DrainState.EVICTED:
            return "evicted"
        if fs.space_gate.near:
            return "space_low"
        if fs.state.tenants:
            tid = fs.tenant_space.tenant_of(inode)
            if tid and fs.tenant_space.capacity_bytes(tid) is not None:
                return "tenant_cap"  # its writes stay admitted one by one (issue 45)
        return None

    def _admit(self, inode: Inode, nbytes: int) -> bool:
        """The admission a write request of `nbytes` new bytes passes, and the bound on
        all credit: an eighth of the space still free (no await)."""
        fs = self.fs
        try:
            fs._check_quota(inode, nbytes)
        except errors.ZoneFSError:
            return False
        free = fs.alloc.user_capacity_bytes() - fs.falloc.used_bytes()
        return sum(self.granted.values()) + nbytes <= free // CREDIT_SHARE_OF_FREE

    def stop(self) -> None:
        """The engine went read-only (failsafe): C takes no WRITE from now on, and what
        it staged is reported to the files' next fsync (c_staged)."""
        if not self.streams.closed:
            self.streams.close()

    def give_back(self) -> bool:
        """A write request found the device full: end every stream, so that the credit
        admitted ahead for them (space nobody wrote yet) is free again; True if there
        was any (no await)."""
        if not any(self.granted.values()):
            return False
        for ino in list(self.granted):
            self.streams.end(ino)
        return True

    # -- what C staged ---------------------------------------------------------------------
    def c_staged(self, ino: int, offset: int, data: bytes) -> None:
        """Bytes C took for file `ino` at `offset` (a buffer of whole blocks): into the
        pipeline now (no await)."""
        fs = self.fs
        writes = fs.data.writes
        n = len(data)
        took = min(self.granted.get(ino, 0), n)
        if ino in self.granted:
            self.granted[ino] -= took
        inode = fs.state.inodes.get(ino)
        if inode is None:  # freed meanwhile (its last handle closed): nobody can read it
            writes.admitted_bytes -= took
            self.staged_for_freed += n
            return
        if fs.failsafe is not None:  # answered before C stopped: the next fsync says so
            writes.admitted_bytes -= took
            writes.write_errors.setdefault(ino, errors.IOFailure(
                f"write not stored: the filesystem went read-only ({fs.failsafe})"))
            return
        if ino in writes.buffers:
            self.behind_buffer += 1
        try:
            fs.drain.on_write(inode)
        except errors.ZoneFSError as exc:
            writes.write_errors.setdefault(ino, exc)
        # From admitted to pending with no await between (FileWrites.admit).
        writes.admitted_bytes -= took
        fs.data.queue_staged(inode, offset, data)
        fs.quota.count_written(inode, n)

    def c_stream_ended(self, ino: int, credit_left: int) -> None:
        """C ended the stream: its unused credit is no longer counted as used."""
        left = self.granted.pop(ino, 0)
        self.fs.data.writes.admitted_bytes -= left

    def before_change(self, ino: int) -> None:
        """Python is about to change the file (FileWrites.before_change): its stream
        ends and what C staged enters the pipeline first, so the change lands after
        every WRITE C answered before it, and C takes no WRITE of the file that
        could land before the change (no await)."""
        if ino in self.granted:
            self.streams.end(ino)

    def after_chunk(self, ino: int) -> None:
        """A chunk of the file was applied: its stream's credit may grow again."""
        if ino in self.granted:
            self._top_up(ino)

    def c_batch_done(self, inos: set[int]) -> None:
        """After a batch of staged bytes: top up the credit of streams still armed,
        wake the engine's background work as a write request would."""
        fs = self.fs
        for ino in inos:
            self._top_up(ino)
        fs.space_gate.check()
        if fs.journal.pending_bytes > (4 << 20):
            fs.wake_background()

    def _top_up(self, ino: int) -> None:
        """Grow the stream's credit back to `credit_bytes` while the file has few chunks
        in flight and the bytes pass admission (no await)."""
        fs = self.fs
        writes = fs.data.writes
        have = self.granted.get(ino)
        inode = fs.state.inodes.get(ino)
        full = self.credit_bytes
        if have is None or inode is None or have > full - min(TOPUP_STEP, full // 4):
            return
        if len(writes.inflight.get(ino, ())) > TOPUP_MAX_INFLIGHT:
            return
        add = full - have
        if fs.space_gate.near or not self._admit(inode, add):
            return
        writes.admitted_bytes += add
        if self.streams.credit(ino, add):
            self.granted[ino] = have + add
        else:
            writes.admitted_bytes -= add

    def figures(self) -> dict[str, int]:
        return {"streams_granted": len(self.granted),
                "credit_bytes_granted": sum(self.granted.values()),
                "staged_behind_buffer": self.behind_buffer,
                "staged_for_freed_bytes": self.staged_for_freed}
