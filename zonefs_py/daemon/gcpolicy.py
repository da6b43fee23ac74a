"""Python's cycle collector and a namespace of millions of objects (issue 15).

A recovered namespace of 1,000,000 files is ~3.3M objects the cycle collector
tracks (inodes, their extents, names). CPython's full collection walks all of
them: measured 1.26 s on the 2-vCPU VM, on the trio thread, so every request
waits for it. It runs whenever the objects that survived since the last full
collection exceed a quarter of those that survived it: during a mount's load
(6.27 s with the collector on, 5.17 s with it off), and while a namespace
grows, about every quarter more files, each time longer (~1 s near 1M files).

Nothing in the model needs the collector: its objects form no reference
cycles, so reference counting frees them (unlinking 2,000 files, syncing and
checkpointing leaves 0 unreachable objects: tests/unit/test_gcpolicy.py).
So the daemon

  * loads with the collector off (`loading()`), then freezes what the load
    built (`gc.freeze()`: later collections skip those objects, reference
    counting still frees them);
  * every `INTERVAL_S` (`GcFreezer.run`): a full collection, which walks only
    what was allocated since the last freeze (milliseconds: ~15k objects at
    1,000 creates/s), then freezes the survivors. Collecting first means the
    garbage cycles of that interval (trio's, exceptions') are freed, not
    frozen.

Caveat: an object that is frozen and later dropped as part of a reference
cycle is never reclaimed (reference counting cannot, and the collector no
longer looks). None is known in the engine; trio's short-lived cycles die
within an interval.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator

import trio

log = logging.getLogger(__name__)

#: Seconds between two collect-then-freeze steps while the daemon runs.
INTERVAL_S = 5.0


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Run a load with the cycle collector off, then freeze what it built."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
    gc.freeze()
    log.debug("loaded: %d objects frozen out of the cycle collector's walks",
              gc.get_freeze_count())


class GcFreezer:
    """Collect what is new, then freeze the survivors, every `interval_s`."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.steps = 0
        #: Longest step so far (seconds on the trio thread).
        self.longest_s = 0.0

    def step(self) -> int:
        """One full collection of the unfrozen objects and a freeze; returns
        the number of unreachable objects the collection found."""
        start = time.perf_counter()
        found = gc.collect()
        gc.freeze()
        took = time.perf_counter() - start
        self.steps += 1
        self.longest_s = max(self.longest_s, took)
        if took > 0.05:
            log.info("cycle collection of what is new took %.0f ms (%d objects frozen)",
                     took * 1e3, gc.get_freeze_count())
        return found

    async def run(self) -> None:
        while True:
            await trio.sleep(self.interval_s)
            self.step()
