"""Progress bars on stderr for long device work, only when stderr is a terminal (tqdm).

`progress_printer(what, unit)` returns a `callback(done, total)` or None
when stderr is not a terminal (then callers do no progress work at all):
mkfs's zone resets, fsck's log replay and data check, the log replay at
mount (shown on the caller's terminal, which the daemon keeps until it is
ready). `FileProgress` follows `zonefs-py fetch` of evicted files, file by
file, weighted by their sizes.

Why tqdm: it is small, pure Python, has no dependencies of its own and
redraws at most every `mininterval`, from any thread (the recovery replay
reports from a worker thread); rich would pull in pygments and
markdown-it for a bar. NO_COLOR and TERM=dumb need nothing: tqdm draws no
colours, and `ascii=True` is used on a dumb terminal.

Caveat: a fetch restores each file in one request to the daemon (a
setxattr); the bar moves when a file is complete and otherwise shows the
file being fetched and the time spent.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from collections.abc import Callable
from typing import Any

#: Seconds between redraws at most.
REDRAW_S = 0.2


def on_terminal() -> bool:
    """True if progress should be drawn (stderr is a terminal)."""
    return sys.stderr.isatty()


def _bar(what: str, total: int, unit: str) -> Any:
    from tqdm import tqdm

    # A terminal that reports a 0x0 size (script(1), some serial consoles) makes
    # tqdm draw nothing (its bar "does not fit"): take shutil's fallback size then.
    size = shutil.get_terminal_size((80, 24))
    return tqdm(total=total, desc=what, unit=unit, unit_scale=unit == "B", unit_divisor=1024,
                file=sys.stderr, leave=True, mininterval=REDRAW_S,
                ncols=min(size.columns or 80, 100), nrows=size.lines or 24,
                ascii=os.environ.get("TERM") == "dumb")


def progress_printer(what: str, unit: str = "it") -> Callable[[int, int], None] | None:
    """Return a callback(done, total) drawing a bar for `what`, or None off a terminal.

    `unit="B"` shows bytes scaled (KiB, MiB...). Thread-safe; the bar is
    closed (its line ended) once done reaches total.
    """
    if not on_terminal():
        return None
    lock = threading.Lock()
    bar: Any = None

    def show(done: int, total: int) -> None:
        nonlocal bar
        with lock:
            if bar is None:
                bar = _bar(what, total, unit)
            elif bar.disable:
                return
            if total != bar.total:
                bar.total = total
            bar.update(max(0, done - bar.n))
            if done >= total:
                bar.close()

    return show


class FileProgress:
    """A bar over the bytes of some files, advanced as each one completes (fetch)."""

    def __init__(self, what: str, paths: list[str]) -> None:
        self.bar: Any = None
        if not paths or not on_terminal():
            return
        sizes = []
        for path in paths:
            try:
                sizes.append(os.stat(path).st_size)
            except OSError:
                sizes.append(0)
        self.bar = _bar(what, sum(sizes), "B")
        self.sizes = dict(zip(paths, sizes, strict=True))

    def run(self, path: str, fn: Callable[..., object], *args: object) -> None:
        """Call `fn(*args)` for `path`, redrawing the elapsed time until it returns.

        `fn` runs in a thread; what it raises is raised here.
        """
        if self.bar is None:
            fn(*args)
            return
        self.bar.set_postfix_str(os.path.basename(path), refresh=True)
        failed: list[BaseException] = []

        def call() -> None:
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                failed.append(exc)

        worker = threading.Thread(target=call, daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(REDRAW_S * 2.5)
            self.bar.refresh()
        self.bar.update(self.sizes.get(path, 0))
        if failed:
            raise failed[0]

    def close(self) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str("", refresh=False)
            self.bar.close()
