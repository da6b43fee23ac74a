"""The contenders: what zonefs-py is measured against, and zonefs-py itself.

A contender is set up fresh for each repetition (`with contender.mounted(...)`),
gives workloads a directory (`root`) or, for the physical limit, byte ranges of
the backing file (`fio_target`), and can make caches cold (`make_cold`). Every
backing file lives under the scratch directory on /work's disk, never tmpfs.

Caveats:
- `ext4`'s loop device runs with `--direct-io=on` (checked), so ext4's reads
  reach the disk rather than the host page cache of the backing file;
  `ext4plain` is the same on a buffered loop device, kept in the report.
- zonefs-py is remounted by `make_cold` (it may cache in its own process);
  the other FUSE contenders keep nothing of their own, so dropping the kernel
  caches is enough for them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .util import BenchError, drop_caches, fuse_unmount, process_cpu_s, run, wait_for_mount

BENCH_DIR = Path(__file__).resolve().parent.parent
REPO_DIR = BENCH_DIR.parent
MiB = 1 << 20


class Contender:
    """Base class: a directory to run workloads in, set up and torn down per repetition."""

    #: Short key used in the JSON and for ratios ("ceiling", "peer", "ext4", ...).
    key = ""
    #: Human label for the report.
    label = ""
    #: False for the raw backing file (no files, no torch, no metadata).
    is_filesystem = True
    #: Workloads this contender cannot run, with the reason.
    unsupported: dict[str, str] = {}
    #: External programs it runs to set up and tear down (bench/lib/tools.py).
    tools: tuple[str, ...] = ()

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir / self.key
        self.root = self.work_dir / "mnt"

    def unavailable_reason(self) -> str | None:
        """Return why this contender cannot run on this machine, or None."""
        return None

    @contextmanager
    def mounted(self, size_bytes: int) -> Iterator[None]:
        """Create a fresh backing store of `size_bytes`, mount it, always tear down."""
        raise NotImplementedError
        yield  # pragma: no cover

    def make_cold(self) -> bool:
        """Empty every cache between the workload and the disk; False if caches stay warm."""
        return drop_caches()

    def fio_target(self, name: str, size_bytes: int) -> dict[str, str]:
        """Return fio options that place the file `name` of `size_bytes` on this contender."""
        return {"filename": str(self.root / name), "size": str(size_bytes),
                "fallocate": "none"}

    def fio_direct_writes(self) -> bool:
        """Return True when sequential writes should bypass the page cache (physical only)."""
        return False

    def fs_stats(self) -> dict[str, object] | None:
        """Return the filesystem's own counters (zonefs-py: write amplification), if any."""
        return None

    def census(self) -> dict[str, int] | None:
        """FUSE requests by opcode since the mount (issue 29's census), or None when
        this contender has no FUSE server that counts them."""
        return None

    def daemon_cpu_s(self) -> float | None:
        """Return the CPU seconds its FUSE servers spent serving so far, or None (no server).

        Counted from each server's mount being ready to its unmount, summed over the
        servers of this contender (a cold read remounts zonefs-py): mount-time
        recovery and the shutdown flush are left out.
        """
        return None

    def _reset_dir(self) -> None:
        if self.work_dir.exists():
            shutil.rmtree(self.work_dir)
        self.root.mkdir(parents=True)


class PhysicalLimit(Contender):
    """fio with O_DIRECT on a preallocated backing file on the scratch disk."""

    key = "physical"
    label = "physical limit (fio O_DIRECT on backing file)"
    is_filesystem = False
    unsupported = {w: "no filesystem: raw backing file" for w in (
        "torch_save", "dcp_save", "torch_load", "dataloader_shards", "dataloader_files",
        "meta_create", "meta_stat", "meta_unlink")}

    def __init__(self, work_dir: Path) -> None:
        super().__init__(work_dir)
        self.backing = self.work_dir / "backing.img"
        self._offsets: dict[str, int] = {}
        self._next_offset = 0

    @contextmanager
    def mounted(self, size_bytes: int) -> Iterator[None]:
        self._reset_dir()
        with open(self.backing, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, size_bytes)
        self._offsets.clear()
        self._next_offset = 0
        self._size_bytes = size_bytes
        try:
            yield
        finally:
            self.backing.unlink(missing_ok=True)

    def fio_target(self, name: str, size_bytes: int) -> dict[str, str]:
        if name not in self._offsets:
            if self._next_offset + size_bytes > self._size_bytes:
                raise BenchError(f"physical backing file too small for {name}")
            self._offsets[name] = self._next_offset
            self._next_offset += -(-size_bytes // MiB) * MiB
        return {"filename": str(self.backing), "offset": str(self._offsets[name]),
                "size": str(size_bytes), "direct": "1"}

    def fio_direct_writes(self) -> bool:
        return True


class FuseServer:
    """A FUSE filesystem served by a foreground subprocess, logged to a file."""

    def __init__(self, cmd: list[str], mountpoint: Path, log_path: Path,
                 cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
        self.cmd = cmd
        self.env = env
        self.mountpoint = mountpoint
        self.log_path = log_path
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self._cpu_at_ready = 0.0

    def cpu_served_s(self) -> float:
        """CPU seconds of the server since its mount was ready (0 when not running)."""
        if self.proc is None:
            return 0.0
        now = process_cpu_s(self.proc.pid)
        return 0.0 if now is None else now - self._cpu_at_ready

    def start(self) -> None:
        """Start the server and wait for the mount; raise BenchError if it fails."""
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.cwd, env=self.env,
                                         start_new_session=True)
        try:
            wait_for_mount(self.mountpoint, self.proc, self.log_path)
        except BaseException:
            self.stop()
            raise
        self._cpu_at_ready = process_cpu_s(self.proc.pid) or 0.0

    def stop(self) -> float:
        """Unmount and reap the server (idempotent); return its CPU seconds served."""
        served = self.cpu_served_s()
        fuse_unmount(self.mountpoint, self.proc)
        self.proc = None
        return served


class _Served(Contender):
    """A contender served by FuseServer processes: their CPU is counted."""

    tools = ("fusermount3",)

    def __init__(self, work_dir: Path) -> None:
        super().__init__(work_dir)
        self._server: FuseServer | None = None
        self._cpu_retired = 0.0

    def _start(self, server: FuseServer) -> None:
        server.start()
        self._server = server

    def _stop(self) -> None:
        if self._server is not None:
            self._cpu_retired += self._server.stop()
        self._server = None

    def daemon_cpu_s(self) -> float | None:
        live = self._server.cpu_served_s() if self._server is not None else 0.0
        return self._cpu_retired + live

    def daemon_pid(self) -> int | None:
        """Return the pid of the running FUSE server process, if any."""
        if self._server is None or self._server.proc is None:
            return None
        return self._server.proc.pid


class NoopCeiling(_Served):
    """The no-op pyfuse3 filesystem (bench/noopfs.py): accepts writes, reads zeros."""

    key = "ceiling"
    label = "Python FUSE ceiling (no-op pyfuse3)"
    unsupported = {"torch_load": "no-op FS returns zeros, not the checkpoint"}

    @contextmanager
    def mounted(self, size_bytes: int) -> Iterator[None]:
        self._reset_dir()
        self._census_file = self.work_dir / "census.json"
        self._start(FuseServer([sys.executable, str(BENCH_DIR / "noopfs.py"), str(self.root),
                                "--census", str(self._census_file)],
                               self.root, self.work_dir / "noopfs.log"))
        try:
            yield
        finally:
            self._stop()


    def census(self) -> dict[str, int] | None:
        """Ask the server (SIGUSR1) to write its counts, and read them."""
        pid = self.daemon_pid()
        if pid is None:
            return None
        path = self._census_file
        before = path.stat().st_mtime_ns if path.exists() else 0
        os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if path.exists() and path.stat().st_mtime_ns != before:
                return {k: int(v) for k, v in json.loads(path.read_text()).items()}
            time.sleep(0.005)
        raise BenchError("the no-op server did not write its request census")


class Ext4Loop(Contender):
    """ext4 on a loop device (direct I/O) over a sparse backing file.

    The direct-I/O loop is the like-for-like kernel peer of zonefs-py, whose
    emulator reads and writes its image with O_DIRECT: each page is cached once
    (by ext4), not a second time in the backing file's page cache. Whether the
    kernel took the direct I/O is checked (/sys/block/loopN/loop/dio) and
    recorded in `dio_active`; `Ext4PlainLoop` is the buffered loop beside it.
    """

    key = "ext4"
    label = "ext4 on direct-I/O loop device"
    tools = ("losetup", "mkfs.ext4", "mount", "umount")
    #: losetup --direct-io=on (off: the plain loop, which caches every page twice).
    direct_io = True

    def unavailable_reason(self) -> str | None:
        for tool in self.tools:
            if shutil.which(tool) is None:
                return f"{tool} not installed"
        if os.geteuid() != 0:
            return "needs root for losetup and mount"
        return None

    @contextmanager
    def mounted(self, size_bytes: int) -> Iterator[None]:
        self._reset_dir()
        with self.ext4_at(self.work_dir / "backing.img", self.root, size_bytes,
                          direct_io=self.direct_io):
            yield

    @staticmethod
    @contextmanager
    def ext4_at(backing: Path, mountpoint: Path, size_bytes: int,
                direct_io: bool = True) -> Iterator[None]:
        """Make ext4 on a loop device over `backing` and mount it; always detach."""
        with open(backing, "wb") as f:
            f.truncate(size_bytes)
        loop_dev = run(["losetup", "--find", "--show",
                        f"--direct-io={'on' if direct_io else 'off'}", str(backing)]).strip()
        try:
            dio = Path(f"/sys/block/{Path(loop_dev).name}/loop/dio")
            if direct_io and dio.exists() and dio.read_text().strip() != "1":
                raise BenchError(f"{loop_dev}: the kernel did not take --direct-io=on "
                                 f"(loop/dio is {dio.read_text().strip()})")
            # Initialise inode tables now so lazy init does not run during the workloads.
            run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0",
                 loop_dev])
            mountpoint.mkdir(parents=True, exist_ok=True)
            run(["mount", loop_dev, str(mountpoint)])
            try:
                yield
            finally:
                run(["umount", str(mountpoint)], check=False)
                if os.path.ismount(mountpoint):
                    run(["umount", "-l", str(mountpoint)], check=False)
        finally:
            run(["losetup", "-d", loop_dev], check=False)
            backing.unlink(missing_ok=True)


class Ext4PlainLoop(Ext4Loop):
    """ext4 on a plain (buffered) loop device: the backing file's page cache holds a
    second copy of every page (slower writes, reads that swing with memory)."""

    key = "ext4plain"
    label = "ext4 on plain loop device"
    direct_io = False


class PassthroughPeer(_Served, Ext4Loop):
    """bench/passthroughfs.py over ext4 on a loop device: the afternoon Python FS."""

    key = "peer"
    label = "Python FUSE peer (pyfuse3 passthrough over ext4/loop)"
    tools = _Served.tools + Ext4Loop.tools

    @contextmanager
    def mounted(self, size_bytes: int) -> Iterator[None]:
        self._reset_dir()
        source = self.work_dir / "source"
        with self.ext4_at(self.work_dir / "backing.img", source, size_bytes):
            self._start(FuseServer(
                [sys.executable, str(BENCH_DIR / "passthroughfs.py"), str(source),
                 str(self.root)],
                self.root, self.work_dir / "passthroughfs.log"))
            try:
                yield
            finally:
                self._stop()


class ZonefsPy(_Served):
    """zonefs-py mounted on the file-backed zoned emulator (or a real zoned device)."""

    key = "zonefs"
    label = "zonefs-py (emulated zoned device)"

    def __init__(self, work_dir: Path, zoned_dev: str | None = None,
                 zone_size: str = "64M", mount_opts: str | None = None,
                 variant: str | None = None, repo: Path | None = None) -> None:
        #: The checkout whose zonefs-py this contender runs (an A/B twin may run
        #: another one: `--zonefs-b-repo`, e.g. a worktree of the previous release).
        self.repo = repo or REPO_DIR
        if variant:
            # An A/B twin with other mount options, measured right after zonefs-py.
            self.key = f"zonefs-{variant}"
            what = [f"-o {mount_opts}"] if mount_opts else []
            if repo is not None:
                what.append(f"code of {repo}")
            self.label = f"zonefs-py {', '.join(what)} (A/B)"
        super().__init__(work_dir)
        self.zoned_dev = zoned_dev
        self.zone_size = zone_size
        self.mount_opts = mount_opts
        if zoned_dev and not variant:
            self.label = f"zonefs-py ({zoned_dev})"
        self.image = Path(zoned_dev) if zoned_dev else self.work_dir / "zoned.img"

    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "zonefs_py.cli.main", *args]

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.repo),
                                                          env.get("PYTHONPATH")]))
        return env

    def unavailable_reason(self) -> str | None:
        try:
            for sub in ("emu", "mkfs", "mount", "stat"):
                run(self._cli(sub, "--help"), timeout_s=60, env=self._env(), cwd=self.repo)
        except BenchError as exc:
            return _short_reason(str(exc))
        return None

    def _new_server(self) -> FuseServer:
        cmd = self._cli("mount", str(self.image), str(self.root), "-f")
        if self.mount_opts:
            cmd += ["-o", self.mount_opts]
        return FuseServer(cmd, self.root, self.work_dir / "zonefs-py.log", cwd=self.repo,
                          env=self._env())

    @contextmanager
    def mounted(self, size_bytes: int) -> Iterator[None]:
        self._reset_dir()
        env = self._env()
        if not self.zoned_dev:
            run(self._cli("emu", "create", str(self.image), "--size", f"{size_bytes // MiB}M",
                          "--zone-size", self.zone_size), env=env, cwd=self.repo)
        run(self._cli("mkfs", str(self.image), "--force"), env=env, cwd=self.repo)
        self._start(self._new_server())
        try:
            yield
        finally:
            self._stop()
            if not self.zoned_dev:
                self.image.unlink(missing_ok=True)

    def make_cold(self) -> bool:
        """Remount (empties zonefs-py's own caches) and drop the kernel caches."""
        dropped, _ = self.remount()
        return dropped

    def remount(self) -> tuple[bool, float]:
        """Unmount, drop caches, mount again; return (caches dropped, seconds to mount)."""
        self._stop()
        dropped = drop_caches()
        start = time.perf_counter()
        self._start(self._new_server())
        return dropped, time.perf_counter() - start

    def census(self) -> dict[str, int] | None:
        """The daemon's request census (status document), less the probe's own GETXATTR."""
        try:
            doc = json.loads(os.getxattr(self.root, "trusted.zonefs.status"))
        except (OSError, json.JSONDecodeError):
            return None
        counts = {k: int(v) for k, v in doc.get("requests", {}).items()}
        # The status probes (this one included: counted before it is answered; os.getxattr
        # may ask twice, for the size first) are GETXATTRs of the status name: left out.
        probes = counts.pop("GETXATTR:trusted.zonefs.status", 0)
        if "GETXATTR" in counts:
            counts["GETXATTR"] -= probes
        return counts

    def fs_stats(self) -> dict[str, object] | None:
        try:
            out = run(self._cli("stat", str(self.root), "--json"), timeout_s=120,
                      env=self._env(), cwd=self.repo)
            data = json.loads(out)
        except (BenchError, json.JSONDecodeError) as exc:
            return {"error": str(exc)[:300]}
        return data if isinstance(data, dict) else {"error": "stat --json: not an object"}


def _short_reason(message: str) -> str:
    """Keep the informative end of a failed command's message (e.g. the exception line)."""
    return message.split(" / ")[-1].strip()[:200]


def all_contenders(work_dir: Path, zoned_dev: str | None = None,
                   zonefs_mount_opts: str | None = None,
                   zonefs_b_mount_opts: str | None = None,
                   zonefs_b_repo: Path | None = None) -> list[Contender]:
    """Return the contenders in report order: references first, zonefs-py last (then its
    A/B twin `zonefs-b` when `zonefs_b_mount_opts` or `zonefs_b_repo` is given)."""
    contenders: list[Contender] = [
        PhysicalLimit(work_dir), NoopCeiling(work_dir), PassthroughPeer(work_dir),
        Ext4Loop(work_dir), Ext4PlainLoop(work_dir),
        ZonefsPy(work_dir, zoned_dev, mount_opts=zonefs_mount_opts)]
    if zonefs_b_mount_opts is not None or zonefs_b_repo is not None:
        contenders.append(ZonefsPy(work_dir, zoned_dev, mount_opts=zonefs_b_mount_opts,
                                   variant="b", repo=zonefs_b_repo))
    return contenders
