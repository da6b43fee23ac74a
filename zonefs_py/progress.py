"""A progress line on stderr for long device scans (only when stderr is a terminal)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable


def progress_printer(what: str) -> Callable[[int, int], None] | None:
    """Return a callback(done, total) that redraws one line at most 5 times a second."""
    if not sys.stderr.isatty():
        return None
    last = [0.0]

    def show(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] < 0.2 and done < total:
            return
        last[0] = now
        pct = 100.0 * done / total if total else 100.0
        end = "\n" if done >= total else ""
        print(f"\r{what}: {done}/{total} ({pct:.0f}%)", end=end, file=sys.stderr, flush=True)

    return show
