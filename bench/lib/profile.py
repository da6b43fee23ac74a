"""`bench/run --profile`: a py-spy flame graph of each FUSE server per workload.

Every change to the request path is judged by where the daemon's time goes:
with `--profile DIR` the suite records zonefs-py and the no-op ceiling with
py-spy (`pip install py-spy`; it needs root or ptrace rights) for the whole
of each workload and writes `DIR/<workload>-<contender>[-N].svg`. A workload
that remounts (cold reads) gets one graph per server process: a thread
follows the contender's daemon pid and starts a new recording when it
changes. Sampling costs the daemon a little (py-spy reads its memory from
outside, `--nonblocking`: the daemon is never paused), so figures of a
profiled run are not compared with an unprofiled one.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

#: Samples per second.
RATE_HZ = 250
#: How often the daemon's pid is checked (a remount starts a new recording).
POLL_S = 0.1


def py_spy() -> str | None:
    """The py-spy executable (beside this interpreter, as pip installs it, or on PATH)."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


@contextmanager
def _recorders(target_of: Callable[[], int | None],
               command: Callable[[int, int], tuple[list[str], Path]]) -> Iterator[list[Path]]:
    """Start a recorder, `command(target, n)` -> (argv, output file), for every new
    target (a process or thread id) `target_of()` names while the block runs (a
    remount starts another); at the end stop each with SIGINT (py-spy and perf
    both write their output then) and fill the yielded list with the outputs
    that exist."""
    stop = threading.Event()
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    written: list[Path] = []

    def follow() -> None:
        seen: int | None = None
        while True:
            target = target_of()
            if target is not None and target != seen:
                seen = target
                argv, out = command(target, len(procs))
                procs.append((subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL), out))
            if stop.wait(POLL_S):
                return

    watcher = threading.Thread(target=follow, daemon=True)
    watcher.start()
    try:
        yield written
    finally:
        stop.set()
        watcher.join()
        for proc, out in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if out.exists():
                written.append(out)


def _numbered(stem: Path, suffix: str, n: int) -> Path:
    return stem.with_name(stem.name + (f"-{n}" if n else "") + suffix)


@contextmanager
def recording(pid_of: Callable[[], int | None], out_stem: Path) -> Iterator[list[Path]]:
    """Record every server process `pid_of()` names while the block runs; yield the
    list of SVG files written (filled in when the block ends)."""
    exe = py_spy()
    if exe is None:
        yield []
        return

    def command(pid: int, n: int) -> tuple[list[str], Path]:
        out = _numbered(out_stem, ".svg", n)
        return ([exe, "record", "-p", str(pid), "-r", str(RATE_HZ), "--nonblocking",
                 "-f", "flamegraph", "-o", str(out)], out)

    with _recorders(pid_of, command) as written:
        yield written


# -- perf: the data plane's dispatcher thread (C, where py-spy sees nothing) ------------
#: The dispatcher thread's name (native/zonefs_dispatch.c, pthread_setname_np).
DISPATCH_THREAD = "zonefs-dispatch"
#: perf's sampling rate.
PERF_HZ = 999


def perf() -> str | None:
    """The perf executable (Debian: linux-perf), or None."""
    return shutil.which("perf")


def dispatcher_tid(pid: int) -> int | None:
    """The thread id of zonefs-py's request dispatcher in process `pid`, or None."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            if (task / "comm").read_text().strip() == DISPATCH_THREAD:
                return int(task.name)
        except OSError:
            continue
    return None


@contextmanager
def perf_recording(pid_of: Callable[[], int | None], out_stem: Path) -> Iterator[list[Path]]:
    """`perf record -g` of the dispatcher thread of every server process `pid_of()`
    names while the block runs; yield the list of reports written when it ends
    (`<stem>-dispatch[-N].txt`: `perf report --stdio`, self time by symbol, and the
    top call chains). Nothing when perf is missing or the thread does not run."""
    exe = perf()
    reports: list[Path] = []
    if exe is None:
        yield reports
        return

    def tid_of() -> int | None:
        pid = pid_of()
        return dispatcher_tid(pid) if pid is not None else None

    def command(tid: int, n: int) -> tuple[list[str], Path]:
        data = _numbered(out_stem.with_name(out_stem.name + "-dispatch"), ".perf.data", n)
        return ([exe, "record", "-q", "-g", "-F", str(PERF_HZ), "-t", str(tid),
                 "-o", str(data)], data)

    try:
        with _recorders(tid_of, command) as written:
            yield reports
    finally:
        for data in written:
            txt = data.with_suffix("").with_suffix(".txt")
            with open(txt, "w") as out:
                subprocess.run([exe, "report", "-i", str(data), "--stdio", "--no-children",
                                "--sort", "dso,sym", "--percent-limit", "0.5"],
                               stdout=out, stderr=subprocess.DEVNULL, timeout=300, check=False)
            reports.append(txt)
