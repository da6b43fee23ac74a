"""Crash torture of a mounted zonefs-py: workload, SIGKILL or power cut, fsck, verify.

One *cycle*: mount the image (`zonefs-py mount -f`, the daemon in a
subprocess), verify every file against the model, run a mixed workload from
threads of this process for a random time, then end the daemon at a random
moment in one of three ways:

  * ``kill``: SIGKILL. The emulator's acknowledged writes stay in the image
    file, but its zone table holds only the last *flushed* write pointers, so
    unflushed appends are lost on reopen (like a drive dropping its cache).
  * ``drop`` / ``tear``: SIGUSR1 through the emulator's TEST HOOK
    (`ZONEFS_PY_EMU_TEST_HOOK=powercut=MODE,seed=N`, see
    zonefs_py/device/emu_hook.py): the daemon's own emulator runs
    `simulate_power_cut` (unflushed data dropped, or a random prefix of each
    zone's unflushed appends kept) and then SIGKILLs itself.
  * ``cut``: the daemon's emulator dies right after its N-th write once the
    workload starts (TEST HOOK `cut_after_writes=N,arm=sigusr2`, N random
    below 300, armed by SIGUSR2 after the verification): power is lost at an exact
    write boundary while the daemon keeps running on a dead device (its
    answers are EIO/EROFS), then SIGKILL.

Then `fsck` of the crashed image (read-only recovery, data checksums) must be
clean, and the next mount must show, for every path:
  * fsync'ed bytes exactly (a file's fsync makes it and every earlier
    namespace change durable: DESIGN.md 3.6);
  * checkpoint paths (`latest.pt`, `step_N.pt`, only ever written by
    temp + fsync + rename) exactly one complete version that was renamed
    there (or absent if no rename to it was acknowledged);
  * anything else: one of the states the workload went through since the
    last durable point, where a file not fsync'ed may hold any subset of
    the written bytes (others read as zeros) but never a byte that was never
    written at that offset, and never less than the fsync'ed prefix.

Model: per path a list of acceptable contents (None: absent); the first is
the durable base. An operation appends its outcome *before* it is issued; an
acknowledged fsync collapses the list to the current content.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from crashlib import fsck_findings  # noqa: E402 - shared with the other crash tests
from integration.conftest import fusermount_u  # noqa: E402 - retries while EBUSY

REPO = Path(__file__).resolve().parents[2]
ZONEFS = [sys.executable, "-m", "zonefs_py.cli.main"]
MOUNT_DEADLINE_S = 60.0
JOIN_DEADLINE_S = 60.0
MODES = ("kill", "drop", "tear", "cut")
#: errno values a workload thread sees once the daemon is gone.
DEAD_ERRNOS = {errno.ENOTCONN, errno.ECONNABORTED, errno.EIO, errno.ENODEV}
#: ... and what it may answer while alive on a device that lost power ("cut").
CUT_ERRNOS = DEAD_ERRNOS | {errno.EROFS}


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e.pop("ZONEFS_PY_EMU_TEST_HOOK", None)
    e.update(extra or {})
    return e


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ZONEFS, *args], env=_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)


class TortureFailure(AssertionError):
    """A violated guarantee; the message names the seed and cycle."""


# -- the model -------------------------------------------------------------------------------

def _lcp(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    x = np.frombuffer(a[:n], np.uint8) != np.frombuffer(b[:n], np.uint8)
    return int(np.argmax(x))


@dataclass(slots=True)
class PathModel:
    versions: list[bytes | None]
    atomic: bool = False

    def add(self, content: bytes | None) -> None:
        if content is not self.versions[-1]:
            self.versions.append(content)

    def collapse(self, content: bytes | None) -> None:
        self.versions = [content]

    def check(self, actual: bytes | None) -> str | None:
        """Return why `actual` is not acceptable, or None."""
        if actual is None:
            return None if None in self.versions else "missing (a durable version exists)"
        if any(v is not None and v == actual for v in self.versions):
            return None
        if self.atomic:
            return (f"{len(actual)} bytes equal to none of the {len(self.versions)} "
                    "complete versions (torn or mixed checkpoint)")
        cands = [v for v in self.versions if v is not None]
        if not cands:
            return "exists but was never created or is durably deleted"
        base = self.versions[0]
        protected = 0 if base is None else min(
            0 if v is None else _lcp(base, v) for v in self.versions)
        if len(actual) < protected or (base is not None and actual[:protected] != base[:protected]):
            return f"fsync'ed prefix of {protected} bytes not intact (len {len(actual)})"
        if len(actual) > max(len(v) for v in cands):
            return f"longer ({len(actual)}) than any written version"
        a = np.frombuffer(actual, np.uint8)
        ok = a == 0
        for v in cands:
            n = min(len(v), len(a))
            ok[:n] |= a[:n] == np.frombuffer(v, np.uint8, count=n)
        if not ok.all():
            bad = int(np.argmax(~ok))
            return f"byte at {bad} was never written there (0x{actual[bad]:02x})"
        return None


@dataclass
class Model:
    paths: dict[str, PathModel] = field(default_factory=dict)

    def get(self, rel: str, atomic: bool = False) -> PathModel:
        pm = self.paths.get(rel)
        if pm is None:
            pm = self.paths[rel] = PathModel([None], atomic)
        return pm


# -- workers ---------------------------------------------------------------------------------

def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes, *, fsync: bool, chunk: int = 1 << 20) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for pos in range(0, len(data), chunk):
            os.write(fd, data[pos:pos + chunk])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


class Worker(threading.Thread):
    """One workload kind in its own directory; stops at the first OSError or on `stop`."""

    kind = "base"

    def __init__(self, root: Path, model: Model, rng: random.Random, stop: threading.Event):
        super().__init__(name=f"torture-{self.kind}", daemon=True)
        self.root = root
        self.dir = root / self.kind
        self.model = model
        self.rng = rng
        self.stop_event = stop
        self.error: BaseException | None = None
        self.ops = 0

    def run(self) -> None:
        try:
            self.dir.mkdir(exist_ok=True)
            fsync_path(self.root)
            while not self.stop_event.is_set():
                self.step()
                self.ops += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the runner
            self.error = exc

    def rel(self, path: Path) -> str:
        return str(path.relative_to(self.root))

    def cur(self, path: Path) -> bytes | None:
        return self.model.get(self.rel(path)).versions[-1]

    def step(self) -> None:
        raise NotImplementedError


class CheckpointWorker(Worker):
    """torch.save-style: temp + fsync + rename + fsync(dir); keep the last two steps."""

    kind = "ckpt"

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.step_no = 0

    def save(self, name: str) -> None:
        data = self.rng.randbytes(self.rng.choice([16 << 10, 300 << 10, 1 << 20, 3 << 20]))
        tmp, dst = self.dir / (name + ".tmp"), self.dir / name
        mt, md = self.model.get(self.rel(tmp)), self.model.get(self.rel(dst), atomic=True)
        mt.add(b"")
        mt.add(data)
        write_file(tmp, data, fsync=True)
        mt.collapse(data)
        md.add(data)
        mt.add(None)
        os.rename(tmp, dst)
        fsync_path(self.dir)
        md.collapse(data)
        mt.collapse(None)

    def step(self) -> None:
        if self.rng.random() < 0.5:
            self.save("latest.pt")
            return
        self.step_no += 1
        self.save(f"step_{self.step_no}.pt")
        for old in sorted(self.dir.glob("step_*.pt")):
            if int(old.stem.split("_")[1]) <= self.step_no - 2:
                m = self.model.get(self.rel(old), atomic=True)
                m.add(None)
                os.unlink(old)
                fsync_path(self.dir)
                m.collapse(None)


class DatasetWorker(Worker):
    """Dataset shards written in 1 MiB writes, fsync'ed, sometimes deleted."""

    kind = "data"

    def step(self) -> None:
        path = self.dir / f"shard_{self.rng.randrange(8):02d}.bin"
        m = self.model.get(self.rel(path))
        if m.versions[-1] is not None and self.rng.random() < 0.2:
            m.add(None)
            os.unlink(path)
            if self.rng.random() < 0.5:
                fsync_path(self.dir)
                m.collapse(None)
            return
        data = self.rng.randbytes(self.rng.randrange(1, 64) * (64 << 10) + self.rng.randrange(4096))
        m.add(b"")  # O_CREAT|O_TRUNC first: empty, then the data
        m.add(data)
        sync = self.rng.random() < 0.8
        write_file(path, data, fsync=sync)
        if sync:
            m.collapse(data)


class LogWorker(Worker):
    """An append-only log, fsync'ed every few lines, truncated when large."""

    kind = "log"

    def step(self) -> None:
        path = self.dir / "train.log"
        m = self.model.get(self.rel(path))
        cur = m.versions[-1] or b""
        if len(cur) > (2 << 20):
            m.add(b"")
            os.truncate(path, 0)
            return
        line = (f"step {self.ops} loss {self.rng.random():.6f} ".encode()
                + self.rng.randbytes(self.rng.randrange(0, 9000)).hex().encode() + b"\n")
        new = cur + line
        m.add(new)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
            if self.rng.random() < 0.3:
                os.fsync(fd)
                m.collapse(new)
        finally:
            os.close(fd)


class ChurnWorker(Worker):
    """Small files: create, overwrite, unlink, rename across directories, truncate."""

    kind = "churn"

    def pick(self) -> Path:
        return self.dir / f"d{self.rng.randrange(4)}" / f"f{self.rng.randrange(16)}"

    def step(self) -> None:
        for i in range(4):
            (self.dir / f"d{i}").mkdir(exist_ok=True)
        r = self.rng.random()
        path = self.pick()
        m = self.model.get(self.rel(path))
        cur = m.versions[-1]
        if r < 0.4 or cur is None:
            data = self.rng.randbytes(self.rng.randrange(1, 40000))
            m.add(b"")  # O_CREAT|O_TRUNC first: empty, then the data
            m.add(data)
            sync = self.rng.random() < 0.5
            write_file(path, data, fsync=sync)
            if sync:
                m.collapse(data)
        elif r < 0.6:
            m.add(None)
            os.unlink(path)
            if self.rng.random() < 0.3:
                fsync_path(path.parent)
                m.collapse(None)
        elif r < 0.8:
            dst = self.pick()
            if dst == path:
                return
            md = self.model.get(self.rel(dst))
            md.add(cur)
            m.add(None)
            os.rename(path, dst)
            if self.rng.random() < 0.3:
                # fsync(dir) makes the rename durable; the content only if it was fsync'ed.
                fsync_path(dst.parent)
                m.collapse(None)  # dst keeps its list: its content may not be fsync'ed
        else:
            size = self.rng.randrange(0, 2 * len(cur) + 1)
            new = cur[:size] + bytes(max(0, size - len(cur)))
            m.add(new)
            os.truncate(path, size)
            if self.rng.random() < 0.5:
                fsync_path(path)
                m.collapse(new)


WORKERS = (CheckpointWorker, DatasetWorker, LogWorker, ChurnWorker)


# -- the daemon and one cycle ---------------------------------------------------------------

class Daemon:
    def __init__(self, image: Path, mnt: Path, log: Path, hook: str | None,
                 options: list[str]) -> None:
        self.image, self.mnt, self.log = image, mnt, log
        cmd = [*ZONEFS, "mount", "-f", str(image), str(mnt), "--log-file", str(log)]
        for opt in options:
            cmd += ["-o", opt]
        extra = {"ZONEFS_PY_EMU_TEST_HOOK": hook} if hook else {}
        self.proc = subprocess.Popen(cmd, env=_env(extra), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + MOUNT_DEADLINE_S
        while not os.path.ismount(mnt):
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                self.close()
                raise TortureFailure(f"mount failed ({self.proc.returncode}): {err.strip()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TortureFailure(f"not mounted after {MOUNT_DEADLINE_S}s (hang)")
            time.sleep(0.01)

    def close(self) -> None:
        """Close our end of the daemon's stderr pipe (a leaked pipe is a ResourceWarning
        that fails whichever later test the garbage collector runs in)."""
        if self.proc.stderr:
            self.proc.stderr.close()

    def kill(self) -> None:
        """SIGKILL the daemon (if still running), reap it, close the pipe."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        self.close()

    def end(self, mode: str) -> None:
        """End the daemon: SIGKILL, or a power cut through the TEST HOOK (then it kills itself).

        The dead mount stays until `lazy_unmount`: workers still running must
        see ENOTCONN, not the empty directory under the mount point.
        """
        self.proc.send_signal(signal.SIGUSR1 if mode in ("drop", "tear") else signal.SIGKILL)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
            raise TortureFailure(f"daemon did not die after {mode} (hang)") from None
        finally:
            self.close()

    def lazy_unmount(self) -> None:
        # Unconditional: a dead connection makes stat() fail, so ismount() says False.
        subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], timeout=60,
                       capture_output=True, check=False)

    def unmount(self) -> int:
        fusermount_u(self.mnt, check=True)
        try:
            return self.proc.wait(timeout=120)
        finally:
            self.close()


def fsck_image(image: Path) -> list[str]:
    """check_filesystem on the (unmounted) image, read-only; return its findings."""
    return fsck_findings(image, check_data=True)


def read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def verify(mnt: Path, model: Model) -> list[str]:
    """Compare the mount with the model; adopt what is there as the new durable state."""
    problems = []
    seen: set[str] = set()
    for dirpath, _dirs, files in os.walk(mnt):
        for name in files:
            rel = str((Path(dirpath) / name).relative_to(mnt))
            seen.add(rel)
            if rel not in model.paths:
                problems.append(f"{rel}: a file the workload never created")
    for rel, pm in sorted(model.paths.items()):
        actual = read_or_none(mnt / rel)
        why = pm.check(actual)
        if why:
            problems.append(f"{rel}: {why}")
        pm.collapse(actual)
    return problems


@dataclass
class Stats:
    cycles: int = 0
    modes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MODES, 0))
    ops: int = 0
    seconds: float = 0.0


def make_image(image: Path, size: str = "1G", zone_size: str = "16M") -> None:
    for args in (("emu", "create", str(image), "--size", size, "--zone-size", zone_size,
                  "--force"), ("mkfs", str(image), "--force")):
        proc = run_cli(*args)
        if proc.returncode:
            raise TortureFailure(f"zonefs-py {' '.join(args)}: {proc.stderr.strip()}")


def _keep_evidence(workdir: Path, image: Path, log: Path, seed: int, cycle: int) -> str:
    """Copy the image (as the failing mount left it: recovered, and maybe already
    checkpointed by that mount), the daemon log, and with ZONEFS_TORTURE_KEEP_CRASH=1
    the image as the crash left it, out of `workdir` (which a test removes);
    return where they went, for the failure message."""
    dest = Path(f"/var/tmp/zonefs-torture-failed-{seed}-{cycle}-{os.getpid()}")
    try:
        dest.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "--sparse=always", str(image), str(dest / "image.img")],
                       check=True, timeout=300)
        if log.exists():
            shutil.copy(log, dest / "daemon.log")
        crash = workdir / "after-crash.img"
        if crash.exists():
            shutil.copy(crash, dest / "after-crash.img")
    except (OSError, subprocess.SubprocessError) as exc:
        return f"evidence not kept: {exc}"
    return f"image and daemon log kept in {dest}"


def run_torture(workdir: Path, *, seed: int, cycles: int, size: str = "1G",
                progress: bool = False, time_limit_s: float | None = None) -> Stats:
    """Run `cycles` crash cycles on a fresh image in `workdir`; raise TortureFailure."""
    rng = random.Random(seed)
    image, mnt, log = workdir / "torture.img", workdir / "mnt", workdir / "daemon.log"
    mnt.mkdir(exist_ok=True)
    make_image(image, size=size)
    model = Model()
    stats = Stats()
    start = time.monotonic()
    daemon: Daemon | None = None
    try:
        for cycle in range(cycles):
            if time_limit_s is not None and time.monotonic() - start > time_limit_s:
                break
            mode = rng.choice(MODES)
            options = [rng.choice(["commit=5", "commit=0.2"]),
                       rng.choice(["checkpoint_mb=64", "checkpoint_mb=1"]),
                       rng.choice(["zone_append=on", "zone_append=off"])]
            hook = {"kill": None,
                    "cut": f"cut_after_writes={rng.randrange(1, 300)},arm=sigusr2"}.get(
                mode, f"powercut={mode},seed={rng.randrange(1 << 30)}")
            where = f"seed {seed} cycle {cycle} ({mode}, {' '.join(options)})"
            daemon = Daemon(image, mnt, log, hook, options)
            problems = verify(mnt, model)
            if problems:
                kept = _keep_evidence(workdir, image, log, seed, cycle)
                raise TortureFailure(f"{where}: after the previous crash ({kept}):\n  "
                                     + "\n  ".join(problems[:20]))
            if mode == "cut":  # count the N writes from now on, not from mount and recovery
                daemon.proc.send_signal(signal.SIGUSR2)
            stop = threading.Event()
            workers = [cls(mnt, model, random.Random(rng.random()), stop) for cls in WORKERS]
            for w in workers:
                w.start()
            time.sleep(rng.uniform(0.05, 1.5))
            early = [w for w in workers if (w.error is not None or not w.is_alive()) and not (
                mode == "cut" and isinstance(w.error, OSError) and w.error.errno in CUT_ERRNOS)]
            daemon.end(mode)
            stop.set()
            for w in workers:
                w.join(JOIN_DEADLINE_S)
                if w.is_alive():
                    raise TortureFailure(f"{where}: {w.kind} worker hung after the crash")
            daemon.lazy_unmount()
            for w in early:
                raise TortureFailure(f"{where}: {w.kind} failed before the crash: {w.error!r}")
            for w in workers:
                if (w.error is not None and not (isinstance(w.error, OSError)
                                                 and w.error.errno in CUT_ERRNOS)):
                    raise TortureFailure(f"{where}: {w.kind}: unexpected {w.error!r}")
                stats.ops += w.ops
            daemon = None
            findings = fsck_image(image)
            if findings:
                shutil.copy(image, workdir / "failed.img")
                raise TortureFailure(f"{where}: fsck after the crash:\n  " + "\n  ".join(findings))
            if os.environ.get("ZONEFS_TORTURE_KEEP_CRASH"):
                # The image as the crash left it, before the next mount's recovery
                # writes to it: what a failure found by that mount needs.
                subprocess.run(["cp", "--sparse=always", str(image),
                                str(workdir / "after-crash.img")], check=True, timeout=300)
            stats.cycles += 1
            stats.modes[mode] += 1
            if progress:
                print(f"cycle {cycle}: {mode:4s} ops={sum(w.ops for w in workers):4d} "
                      f"files={sum(v.versions[-1] is not None for v in model.paths.values())} "
                      f"ok ({time.monotonic() - start:.0f}s)", flush=True)
        daemon = Daemon(image, mnt, log, None, [])
        problems = verify(mnt, model)
        if problems:
            raise TortureFailure(f"seed {seed} final mount:\n  " + "\n  ".join(problems[:20]))
        rc = daemon.unmount()
        daemon = None
        if rc != 0:
            raise TortureFailure(f"seed {seed}: clean unmount exited {rc}")
        proc = run_cli("fsck", str(image))
        if proc.returncode != 0:
            raise TortureFailure(f"seed {seed}: final fsck:\n{proc.stdout}{proc.stderr}")
    finally:
        if daemon is not None:
            daemon.kill()
            daemon.lazy_unmount()
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], timeout=60, check=False)
    stats.seconds = time.monotonic() - start
    return stats
