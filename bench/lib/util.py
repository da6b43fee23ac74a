"""Small helpers shared by the benchmark modules: commands, caches, mounts, machine.

Everything here is synchronous and runs in the `bench/run` process; FUSE
servers always live in their own subprocesses.
"""

from __future__ import annotations

import mmap
import os
import platform
import shutil
import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

#: Seconds to wait for a FUSE mount to appear or a server to exit.
MOUNT_TIMEOUT_S = 60.0


class BenchError(RuntimeError):
    """A step of the benchmark failed; the message says which and why."""


def run(cmd: Sequence[str], *, timeout_s: float = 3600.0, check: bool = True,
        env: dict[str, str] | None = None, cwd: str | Path | None = None) -> str:
    """Run a command and return its stdout; raise BenchError with its stderr on failure."""
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout_s,
                              env=env, cwd=cwd)
    except FileNotFoundError as exc:
        raise BenchError(f"{cmd[0]}: not found") from exc
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"{' '.join(cmd)}: timed out after {timeout_s:.0f}s") from exc
    if check and proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-3:]
        raise BenchError(f"{' '.join(cmd)}: exit {proc.returncode}: {' / '.join(tail)}")
    return proc.stdout


def first_touch_us_per_mib(mib: int) -> float:
    """Fault in `mib` MiB of fresh anonymous memory (one write per page), give it
    back, and return the microseconds per MiB the faults took."""
    with mmap.mmap(-1, mib << 20) as m:
        t0 = time.perf_counter()
        for off in range(0, mib << 20, mmap.PAGESIZE):
            m[off] = 1
        return (time.perf_counter() - t0) * 1e6 / mib


def prewarm_memory(gib: float) -> None:
    """Fault in `gib` GiB of fresh memory and give it back.

    On a VM whose balloon reports free pages to the host (free page reporting),
    a page the kernel hands out for the first time in a while also faults in
    the host (0.8-1 ms per MiB at first touch on the 2-core VM, against 20 us
    for a page already touched); a buffered writer's new page-cache folios are such
    pages, and which contender gets host-backed ones depends on what ran
    before. Touching memory right before a workload hands it pages the host
    still backs: what a machine without free page reporting would see.
    """
    if gib > 0:
        first_touch_us_per_mib(int(gib * 1024))


def drop_caches() -> bool:
    """Write back dirty pages and drop the page, dentry and inode caches.

    Returns False (caches left warm) when /proc/sys/vm/drop_caches is not
    writable, e.g. when not running as root.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def wait_for_mount(mountpoint: Path, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    """Wait until `mountpoint` is a mount point; raise BenchError if the server dies first."""
    deadline = time.monotonic() + MOUNT_TIMEOUT_S
    while not os.path.ismount(mountpoint):
        if proc.poll() is not None:
            raise BenchError(f"mount exited with {proc.returncode}: {log_tail(log_path)}")
        if time.monotonic() > deadline:
            proc.kill()
            raise BenchError(f"mount did not appear in {MOUNT_TIMEOUT_S:.0f}s: "
                             f"{log_tail(log_path)}")
        time.sleep(0.05)


def fuse_unmount(mountpoint: Path, proc: subprocess.Popen[bytes] | None) -> None:
    """Unmount a FUSE mount and reap its server; escalate to lazy unmount and kill."""
    if os.path.ismount(mountpoint):
        result = subprocess.run(["fusermount3", "-u", str(mountpoint)], capture_output=True)
        if result.returncode != 0:
            subprocess.run(["fusermount3", "-uz", str(mountpoint)], capture_output=True)
    if proc is None:
        return
    try:
        proc.wait(timeout=MOUNT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def process_cpu_s(pid: int) -> float | None:
    """Return the user + system CPU seconds of process `pid` (all its threads), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # Fields 14 and 15 of proc(5) (utime, stime); [0] here is field 3 (state).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def log_tail(path: Path, lines: int = 3) -> str:
    """Return the last lines of a log file joined by ' / ' (empty if unreadable)."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " / ".join(text[-lines:])


def summarize(values: Sequence[float]) -> dict[str, float | int | list[float]]:
    """Return median, min, max, the count and the raw values of repeated measurements."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "values": list(values),
    }


def _meminfo_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(cmd: Sequence[str]) -> str:
    try:
        return run(cmd, timeout_s=30).strip().splitlines()[0]
    except (BenchError, IndexError):
        return "unavailable"


def machine_info(work_dir: Path, repo_dir: Path) -> dict[str, object]:
    """Describe the machine, software and backing store the run used."""
    try:
        fs_line = run(["df", "-T", str(work_dir)]).splitlines()[-1].split()
        backing = {"device": fs_line[0], "fstype": fs_line[1]}
    except (BenchError, IndexError):
        backing = {"device": "unknown", "fstype": "unknown"}
    try:
        commit = run(["git", "-C", str(repo_dir), "rev-parse", "--short", "HEAD"]).strip()
    except BenchError:
        commit = "unknown"
    return {
        "host": platform.node(),
        "cores": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_bytes": _meminfo_bytes(),
        "kernel": platform.release(),
        "os": _version(["sh", "-c", ". /etc/os-release && echo $PRETTY_NAME"]),
        "python": platform.python_version(),
        "fio": _version(["fio", "--version"]),
        "backing_store": {"dir": str(work_dir), **backing},
        "git_commit": commit,
        "free_disk_bytes": shutil.disk_usage(work_dir).free,
    }
