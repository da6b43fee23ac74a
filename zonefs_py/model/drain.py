"""The drain state of one file, and the only legal ways it changes. Pure: no I/O, no trio.

A file below a directory with a drain policy (`user.zonefs.drain`) goes

    LOCAL --queue--> QUEUED --start--> UPLOADING(upload id) --done--> DRAINED(ETag)
                        ^                  |  fail/restart              |  evict
                        +------------------+                            v
                                                         DRAINED <--restore-- EVICTED(ETag)

A DRAINED or EVICTED file whose path (so its object key) changed moves
its object (`start_move` .. `move_done`, DESIGN 6.3): while the move is in
flight the record keeps the old URL and names the destination in
`moving_to`; the state stays DRAINED or EVICTED (eviction and restore work
as before), so only the encoding sees it (bit 7 of the state byte, with the
destination URL as the token instead of the ETag).

Any change of its content or size (`modify`) sends it back to LOCAL,
except from EVICTED, which must be restored first (there is nothing local
to modify). LOCAL is "no record": files without a policy never have one.

Every state but LOCAL is a `DrainRecord`, journaled as one DRAIN op
(docs/SPEC.md "Operations"); LOCAL is a DRAIN op with state 0, which drops
the record. The record carries what a restart needs: the object's URL (where
it was or is being uploaded), the size and xxh3 of the version uploaded, and
a token (the multipart upload id while UPLOADING, the ETag once DRAINED or
EVICTED).

Crash argument (docs/DESIGN.md "Drain to an object store"): the journal is a
prefix-ordered log, and the ops that change a file's content are always
queued after the DRAIN op that made it LOCAL (`modify` runs before the write
is accepted), so any recovered state that holds the new content also holds
LOCAL; DRAINED is journaled only after the store confirmed the complete
object; EVICTED shares one transaction with the TRUNCATE that frees the data.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from zonefs_py.format.constants import OpType
from zonefs_py.format.ops import Op

#: The per-file xattr that shows a file's drain state and takes `evict` / `fetch`
#: (read by the drain, written by `zonefs-py evict|fetch`; not stored).
STATE_XATTR = b"user.zonefs.state"

#: Bit 7 of a DRAIN op's state byte: a move is in flight; the token is its destination.
MOVING_BIT = 0x80


class DrainState(enum.IntEnum):
    """Where a file is in the drain: local, queued, uploading, drained (also in the store), evicted
    (only in the store).
    """

    LOCAL = 0
    QUEUED = 1
    UPLOADING = 2
    DRAINED = 3
    EVICTED = 4


class DrainTransitionError(Exception):
    """An event that the current state does not allow (a bug in the caller)."""


@dataclass(frozen=True, slots=True)
class DrainRecord:
    """The drain record of one file (the DRAIN op): its state, object URL, size and xxh3, and the
    upload id or ETag.
    """

    state: DrainState
    #: s3://bucket/key of the object (empty while QUEUED: decided at upload start).
    url: bytes = b""
    #: Size and xxh3 of the version being uploaded / in the store.
    size: int = 0
    xxh3: int = 0
    #: Upload id (UPLOADING, empty for a single PUT) or ETag (DRAINED, EVICTED).
    token: bytes = b""
    #: DRAINED/EVICTED only: s3://bucket/key the object is being moved to (a rename);
    #: the object is complete under `url` or under this, never missing from both.
    moving_to: bytes = b""

    def op(self, ino: int) -> Op:
        if self.moving_to:
            return (OpType.DRAIN, ino, int(self.state) | MOVING_BIT, self.size, self.xxh3,
                    self.url, self.moving_to)
        return (OpType.DRAIN, ino, int(self.state), self.size, self.xxh3, self.url, self.token)

    @classmethod
    def from_op(cls, op: Op) -> DrainRecord | None:
        """The record an op sets (None for LOCAL). Raises ValueError for an unknown state
        (also the moving bit on a state other than DRAINED/EVICTED)."""
        _, _ino, state, size, xxh, url, token = op
        if state & MOVING_BIT:
            st = DrainState(state & ~MOVING_BIT)
            if st not in (DrainState.DRAINED, DrainState.EVICTED) or not token:
                raise ValueError(f"moving bit on state {st.name}")
            return cls(st, url, size, xxh, b"", token)
        st = DrainState(state)
        if st == DrainState.LOCAL:
            return None
        return cls(st, url, size, xxh, token)


def local_op(ino: int) -> Op:
    return (OpType.DRAIN, ino, int(DrainState.LOCAL), 0, 0, b"", b"")


def _need(rec: DrainRecord | None, *states: DrainState) -> DrainRecord:
    cur = rec.state if rec is not None else DrainState.LOCAL
    if cur not in states:
        raise DrainTransitionError(f"{cur.name} does not allow this "
                                   f"(needs {'/'.join(s.name for s in states)})")
    assert rec is not None or DrainState.LOCAL in states
    return rec if rec is not None else DrainRecord(DrainState.LOCAL)


def queue(rec: DrainRecord | None) -> DrainRecord:
    """A complete version exists locally (closed after fsync, or renamed into place)."""
    _need(rec, DrainState.LOCAL, DrainState.QUEUED)
    return DrainRecord(DrainState.QUEUED)


def start_upload(rec: DrainRecord | None, url: bytes, size: int, xxh3: int,
                 upload_id: bytes) -> DrainRecord:
    """The drainer begins (or restarts) uploading the queued version."""
    _need(rec, DrainState.QUEUED, DrainState.UPLOADING)
    return DrainRecord(DrainState.UPLOADING, url, size, xxh3, upload_id)


def upload_done(rec: DrainRecord | None, etag: bytes) -> DrainRecord:
    """The store confirmed the complete object (size, checksum, ETag)."""
    r = _need(rec, DrainState.UPLOADING)
    return replace(r, state=DrainState.DRAINED, token=etag)


def upload_failed(rec: DrainRecord | None) -> DrainRecord:
    """The upload will be retried from the start (its upload id is abandoned; a
    transient failure keeps UPLOADING instead, to resume the same upload)."""
    _need(rec, DrainState.UPLOADING, DrainState.QUEUED)
    return DrainRecord(DrainState.QUEUED)


def evict(rec: DrainRecord | None) -> DrainRecord:
    """The local copy is dropped; the object is the only copy."""
    r = _need(rec, DrainState.DRAINED)
    return replace(r, state=DrainState.EVICTED)


def restored(rec: DrainRecord | None) -> DrainRecord:
    """The object was fetched back, verified, and is local again."""
    r = _need(rec, DrainState.EVICTED)
    return replace(r, state=DrainState.DRAINED)


def start_move(rec: DrainRecord | None, dest_url: bytes) -> DrainRecord:
    """The file's object key changed (a rename): its object is to be copied to
    `dest_url`, then the old one deleted. The state (drained/evicted) stays."""
    r = _need(rec, DrainState.DRAINED, DrainState.EVICTED)
    return replace(r, moving_to=dest_url, token=b"")


def move_done(rec: DrainRecord | None, etag: bytes) -> DrainRecord:
    """The object is complete under the destination and gone from the old key."""
    r = _need(rec, DrainState.DRAINED, DrainState.EVICTED)
    if not r.moving_to:
        raise DrainTransitionError("no move in flight")
    return replace(r, url=r.moving_to, moving_to=b"", token=etag)


def modify(rec: DrainRecord | None) -> None:
    """The file's content or size changes: the record goes (LOCAL). EVICTED is refused."""
    _need(rec, DrainState.LOCAL, DrainState.QUEUED, DrainState.UPLOADING, DrainState.DRAINED)
    return None


def after_recovery(rec: DrainRecord) -> DrainRecord:
    """The state to resume from after a mount: a multipart upload in flight resumes
    (UPLOADING with its upload id: ListParts, then only the missing parts); a single
    PUT in flight restarts (QUEUED); a move in flight resumes as it is."""
    if rec.state == DrainState.UPLOADING and not rec.token:
        return DrainRecord(DrainState.QUEUED)
    return rec


def state_name(rec: DrainRecord | None) -> str:
    """The value of the `user.zonefs.state` xattr (uploading shows as queued)."""
    if rec is None:
        return "local"
    if rec.state == DrainState.UPLOADING:
        return "queued"
    return rec.state.name.lower()
