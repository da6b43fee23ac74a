"""The drain's figures for `zonefs-py stat`, the metrics and the status xattr."""

from __future__ import annotations

import trio

from zonefs_py.drain.host import DrainHost
from zonefs_py.model.drain import DrainState
from zonefs_py.model.state import State


class DrainStatus:
    """The figures of a DrainManager (a base class of it) and their report."""

    host: DrainHost
    state: State
    paused: bool
    #: ino -> trio time at which its upload may start (insertion = queue order).
    queue: dict[int, float]
    #: ino -> time it was queued (for the lag in stat).
    queued_since: dict[int, float]
    #: Files the drainer is uploading or moving now.
    uploading: set[int]

    def __init__(self) -> None:
        self.bytes_drained = 0
        self.files_drained = 0
        self.bytes_restored = 0
        self.files_evicted = 0
        self.errors = 0
        self.last_error: str | None = None
        self.auth_error: str | None = None
        self.parts_sent = 0
        #: Bytes the store holds through finished parts (sent or found stored).
        self.bytes_uploaded = 0
        #: Parts a resumed upload found already stored (ListParts) and did not send.
        self.parts_reused = 0
        self.files_moved = 0

    def note_error(self, message: str) -> None:
        """Count a failed drain step and keep its message for `stat`."""
        self.errors += 1
        self.last_error = message

    def note_auth_error(self, message: str) -> bool:
        """Record that the store refused our credentials; True if it was not already
        (the caller logs the first one only)."""
        first = self.auth_error is None
        self.auth_error = message
        return first

    def clear_auth_error(self) -> None:
        """The store took a request (or `drain resume`): credentials are fine again."""
        self.auth_error = None

    def status(self) -> dict[str, object]:
        """The drain's figures and state, as `stat` and the metrics show them."""
        try:
            now = trio.current_time()
        except RuntimeError:  # outside trio (a tool reading figures): no lag
            now = min(self.queued_since.values(), default=0.0)
        counts = {s.name.lower(): 0 for s in DrainState}
        sizes = dict.fromkeys(counts, 0)
        for ino, rec in self.state.drain.items():
            name = rec.state.name.lower()
            counts[name] += 1
            inode = self.state.inodes.get(ino)
            sizes[name] += inode.size if inode is not None else 0
        queue_bytes = sum(self.state.inodes[i].size for i in self.queue
                          if i in self.state.inodes)
        oldest = min(self.queued_since.values(), default=None)
        return {
            "paused": self.paused,
            "queue_files": len(self.queue),
            "queue_bytes": queue_bytes,
            "lag_seconds": round(now - oldest, 3) if oldest is not None else 0.0,
            "uploading": self.host.path_of(min(self.uploading)) if self.uploading else None,
            "uploading_files": len(self.uploading),
            "uploading_bytes": sum(self.state.inodes[i].size for i in self.uploading
                                   if i in self.state.inodes),
            "bytes_uploaded": self.bytes_uploaded,
            "parts_sent": self.parts_sent,
            "parts_reused": self.parts_reused,
            "files_moved": self.files_moved,
            "bytes_drained": self.bytes_drained,
            "files_drained": self.files_drained,
            "bytes_restored": self.bytes_restored,
            "files_evicted": self.files_evicted,
            "files_by_state": counts,
            "bytes_by_state": sizes,
            "errors": self.errors,
            "last_error": self.last_error,
            "auth_error": self.auth_error,
        }
