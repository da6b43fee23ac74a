"""The request census's figures and the stuck-request report (issue 42).

The census itself is in C (native/zonefs_census.h, read through
`zonefs_py.fuseext`): every FUSE request counted when received and when
answered, by opcode, and every request in flight remembered with its inode
and arrival time. This module turns it into the status document's part
(`census_status`) and runs `StuckRequestReport`, which logs each request that
has waited longer than the threshold (mount option `stuck_request_s`, default
30 s) once, with its opcode, inode and age.

Caveats:
  * The report runs on the trio thread: a handler that blocks that thread
    (instead of awaiting) stops every request and the report with them; the
    status xattr, also served there, is then unanswered too.
  * The GETXATTR that asks for the status is itself in flight while the
    document is built: `requests_in_flight` is at least 1 in it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

from zonefs_py import fuseext

log = logging.getLogger(__name__)

#: Default of the `stuck_request_s` mount option.
STUCK_REQUEST_S = 30.0
#: Stuck requests listed in the status document (the count says how many in all).
STATUS_ROWS = 16

WaitingFn = Callable[[float], tuple[list[dict[str, Any]], int]]


class StuckRequestReport:
    """Log each FUSE request waiting longer than `threshold_s`, once; count them.

    `run()` checks every `interval_s` (a quarter of the threshold, at most 5 s)
    until `stop()`; `check()` is one pass (tests call it directly).
    """

    def __init__(self, threshold_s: float = STUCK_REQUEST_S,
                 waiting: WaitingFn = fuseext.waiting) -> None:
        if threshold_s <= 0:
            raise ValueError(f"stuck request threshold must be positive: {threshold_s}")
        self.threshold_s = threshold_s
        self.interval_s = max(0.05, min(5.0, threshold_s / 4))
        self._waiting = waiting
        #: Ids of the stuck requests already logged that are still in flight.
        self._logged: set[int] = set()
        #: Stuck requests logged since the mount.
        self.reported_total = 0
        self._stopped = trio.Event()

    def check(self) -> list[dict[str, Any]]:
        """Log the requests that became stuck since the last pass; return all stuck."""
        rows, total = self._waiting(self.threshold_s)
        for row in rows:
            if row["id"] not in self._logged:
                self.reported_total += 1
                log.warning("FUSE request waiting for %.1f s (over %g s): %s of inode %d "
                            "(request #%d); %d waiting that long in all", row["age_s"],
                            self.threshold_s, row["opcode"], row["inode"], row["id"], total)
        self._logged = {row["id"] for row in rows}
        return rows

    async def run(self) -> None:
        """Check every `interval_s` until `stop()`."""
        while not self._stopped.is_set():
            with trio.move_on_after(self.interval_s):
                await self._stopped.wait()
            if not self._stopped.is_set():
                self.check()

    def stop(self) -> None:
        self._stopped.set()

    def status(self) -> dict[str, Any]:
        """The `stuck_requests` part of the status document."""
        rows, total = self._waiting(self.threshold_s)
        return {"threshold_s": self.threshold_s, "waiting": rows[:STATUS_ROWS],
                "waiting_total": total, "reported_total": self.reported_total}


def census_status(report: StuckRequestReport) -> dict[str, Any]:
    """The census's part of the status document: received (`requests`, by opcode, as
    before), answered, in flight, failures the C guard answered, stuck requests."""
    return {
        "requests": fuseext.census(),
        "requests_answered": fuseext.census_answered(),
        "requests_in_flight": fuseext.in_flight(),
        "requests_failed_in_dispatch": fuseext.dispatch_failures(),
        "stuck_requests": report.status(),
    }
