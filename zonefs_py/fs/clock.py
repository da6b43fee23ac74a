"""The clock that stamps file times: the kernel's own (CLOCK_REALTIME_COARSE).

The kernel stamps the times it keeps (ext4's, and FUSE's with the writeback
cache, `current_time()`) from the coarse real-time clock, which advances once
per timer tick. The engine stamps creates, unlinks, renames, truncates and
attribute changes from the same clock, so its times and the kernel's agree to
the tick. That is also what saves a round trip: a write(2) right after a
create finds mtime and ctime already equal to `current_time()`, so the kernel
has no times to send back (no SETATTR when the file is closed; DESIGN 4.3).
Caveat: two changes within one tick carry the same time, as on ext4.
"""

from __future__ import annotations

import time

#: Linux's CLOCK_REALTIME_COARSE (<linux/time.h>); the time module does not name it.
CLOCK_REALTIME_COARSE = 5


def _coarse_clock() -> int:
    try:
        time.clock_gettime_ns(CLOCK_REALTIME_COARSE)
    except OSError:  # not Linux: the fine clock
        return time.CLOCK_REALTIME
    return CLOCK_REALTIME_COARSE


_COARSE = _coarse_clock()


def now_ns() -> int:
    """Return the time to stamp a file change with, in nanoseconds since the epoch."""
    return time.clock_gettime_ns(_COARSE)
