#!/usr/bin/env python3
"""Soak: 8 writers and 8 readers on a mount for N minutes; the daemon must stay flat.

    python3 tests/reliability/soak.py --minutes 30 [--dir D]

Writers (checkpoint, dataset, small files; round robin over the 8 threads)
write self-verifying files (a 48-byte header: magic, length, blake2b of the
body), each as NAME.tmp, fsync'ed and renamed into place; checkpoints are
replaced with temp + fsync + rename; old files are deleted so the live data
stays bounded. Readers read random
files whole and verify them (a name vanishing under them is fine; anything
else is an error). Figures: daemon RSS and open fds at the start (after a
warm-up) and at the end, zones by condition, errors, bytes moved. At the end
everything is deleted and synced; live bytes must come back to about zero.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import struct
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torture"))
from torture_lib import Daemon, make_image, run_cli  # noqa: E402

MAGIC = b"ZFSSOAK1"
HEADER = struct.Struct("<8sQ32s")


def make_content(rng: random.Random, size: int) -> bytes:
    body = rng.randbytes(max(0, size - HEADER.size))
    return HEADER.pack(MAGIC, len(body), hashlib.blake2b(body, digest_size=32).digest()) + body


def verify_content(data: bytes) -> str | None:
    if len(data) < HEADER.size:
        return f"short file ({len(data)} bytes)"
    magic, length, digest = HEADER.unpack_from(data)
    body = data[HEADER.size:]
    if magic != MAGIC or length != len(body):
        return f"bad header (len {len(body)} vs {length})"
    if hashlib.blake2b(body, digest_size=32).digest() != digest:
        return "body does not match its digest"
    return None


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


#: How long the idle RSS is watched: the daemon trims freed memory after 2 s without
#: writes (zonefs_py/daemon/memtrim.py), looking once a second.
IDLE_WATCH_S = 10.0


def idle_rss_kib(pid: int) -> int:
    """The daemon's RSS once the writers stopped: the lowest over IDLE_WATCH_S. While
    writes run the daemon keeps freed request buffers warm (up to 128 MiB free at the
    top of each glibc arena, `serve.keep_buffers_warm`), and how much of that is
    resident depends on how the threads met the arenas; once idle it trims that, so
    what is left is memory in use, which a leak would grow."""
    low = rss_kib(pid)
    deadline = time.monotonic() + IDLE_WATCH_S
    while time.monotonic() < deadline:
        time.sleep(0.5)
        low = min(low, rss_kib(pid))
    return low


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def status(mnt: Path) -> dict[str, object]:
    proc = run_cli("stat", "--json", str(mnt))
    return dict(json.loads(proc.stdout)) if proc.returncode == 0 else {}


@dataclass
class Figures:
    errors: list[str] = field(default_factory=list)
    bytes_written: int = 0
    bytes_read: int = 0
    files_written: int = 0
    files_verified: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def error(self, msg: str) -> None:
        with self.lock:
            if len(self.errors) < 50:
                self.errors.append(msg)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_whole(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        for pos in range(0, len(data), 1 << 20):
            os.write(fd, data[pos:pos + (1 << 20)])
        os.fsync(fd)
    finally:
        os.close(fd)


def writer(idx: int, root: Path, stop: threading.Event, fig: Figures) -> None:
    rng = random.Random(idx)
    kind = ("ckpt", "data", "small")[idx % 3]
    d = root / f"{kind}{idx}"
    d.mkdir(exist_ok=True)
    n = 0
    try:
        while not stop.is_set():
            n += 1
            if kind == "ckpt":
                data = make_content(rng, rng.randrange(1, 8) << 20)
                write_whole(d / "latest.pt.tmp", data)
                os.rename(d / "latest.pt.tmp", d / "latest.pt")
                fsync_dir(d)
            elif kind == "data":
                data = make_content(rng, rng.randrange(1, 4) << 20)
                write_whole(d / f"shard-{n:06d}.tmp", data)  # readers skip *.tmp
                os.rename(d / f"shard-{n:06d}.tmp", d / f"shard-{n:06d}")
                old = d / f"shard-{n - 8:06d}"
                if n > 8:
                    os.unlink(old)
            else:
                data = make_content(rng, rng.randrange(1, 64) << 10)
                write_whole(d / f"s-{n:07d}.tmp", data)
                os.rename(d / f"s-{n:07d}.tmp", d / f"s-{n:07d}")
                if n > 200:
                    os.unlink(d / f"s-{n - 200:07d}")
            with fig.lock:
                fig.bytes_written += len(data)
                fig.files_written += 1
    except OSError as exc:
        fig.error(f"writer {idx} ({kind}): {exc!r}")


def reader(idx: int, root: Path, stop: threading.Event, fig: Figures) -> None:
    rng = random.Random(1000 + idx)
    while not stop.is_set():
        try:
            dirs = [p for p in root.iterdir() if p.is_dir()]
            if not dirs:
                time.sleep(0.05)
                continue
            d = rng.choice(dirs)
            names = [n for n in os.listdir(d) if not n.endswith(".tmp")]
            if not names:
                continue
            path = d / rng.choice(names)
            data = path.read_bytes()
        except FileNotFoundError:
            continue  # renamed or deleted under us
        except OSError as exc:
            fig.error(f"reader {idx}: {exc!r}")
            return
        why = verify_content(data)
        if why:
            fig.error(f"reader {idx}: {path}: {why}")
            return
        with fig.lock:
            fig.bytes_read += len(data)
            fig.files_verified += 1


def zones_summary(st: dict[str, object]) -> dict[str, object]:
    return {"zones_by_condition": st.get("zones_by_condition"),
            "data_zones_by_condition": st.get("data_zones_by_condition"),
            "space": {k: v for k, v in (st.get("space") or {}).items()  # type: ignore[union-attr]
                      if k in ("live_bytes", "dead_bytes", "free_bytes", "dead_zones")}}


def run_soak(mnt: Path, pid: int, seconds: float, *, warmup_s: float = 10.0) -> dict[str, object]:
    """Run the soak on a mounted filesystem served by daemon `pid`; return the figures."""
    root = mnt / "soak"
    root.mkdir(exist_ok=True)
    initial = zones_summary(status(mnt))
    fig = Figures()
    stop = threading.Event()
    threads = [threading.Thread(target=writer, args=(i, root, stop, fig), daemon=True)
               for i in range(8)]
    threads += [threading.Thread(target=reader, args=(i, root, stop, fig), daemon=True)
                for i in range(8)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    time.sleep(min(warmup_s, seconds / 4))
    start = {"rss_kib": rss_kib(pid), "fds": fd_count(pid), **zones_summary(status(mnt))}
    samples = []
    while time.monotonic() - t0 < seconds and not fig.errors:
        time.sleep(min(30.0, max(1.0, seconds / 20)))
        samples.append(rss_kib(pid))
    end = {"rss_kib": rss_kib(pid), "fds": fd_count(pid), **zones_summary(status(mnt))}
    stop.set()
    hung = []
    for t in threads:
        t.join(120)
        if t.is_alive():
            hung.append(t.name)
    end["idle_rss_kib"] = idle_rss_kib(pid)
    shutil.rmtree(root)
    fsync_dir(mnt)
    os.setxattr(mnt, "trusted.zonefs.ctl", b"sync")
    # Dead zones are reset once their release is durable; give the background work
    # (commit interval 5 s, cleaner) a bounded time to get there.
    deadline = time.monotonic() + 30
    while True:
        after = {"fds": fd_count(pid), **zones_summary(status(mnt))}
        waiting = set(after["space"].get("dead_zones") or {})  # type: ignore[union-attr]
        # Write heads keep their dead bytes until they fill; anything else must go.
        if waiting <= {"write_head"} or time.monotonic() > deadline:
            break
        time.sleep(1)
    return {"seconds": round(time.monotonic() - t0), "errors": fig.errors, "hung": hung,
            "bytes_written": fig.bytes_written, "bytes_read": fig.bytes_read,
            "files_written": fig.files_written, "files_verified": fig.files_verified,
            "initial": initial, "start": start, "end": end, "after_delete_all": after,
            "rss_samples_kib": samples}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--size", default="2G")
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="zonefs-soak-", dir="/var/tmp"))
    workdir.mkdir(parents=True, exist_ok=True)
    image, mnt = workdir / "soak.img", workdir / "mnt"
    mnt.mkdir(exist_ok=True)
    make_image(image, size=args.size)
    daemon = Daemon(image, mnt, workdir / "daemon.log", None, [])
    try:
        figures = run_soak(mnt, daemon.proc.pid, args.minutes * 60)
    finally:
        rc = daemon.unmount()
    fsck = run_cli("fsck", str(image))
    figures["unmount_rc"], figures["fsck_rc"] = rc, fsck.returncode
    print(json.dumps(figures, indent=1))
    ok = not figures["errors"] and not figures["hung"] and rc == 0 and fsck.returncode == 0
    if ok and args.dir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
