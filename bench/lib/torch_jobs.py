"""Workloads that need CPU torch: checkpoint save/load and DataLoader epochs.

torch is imported lazily; without it every workload here raises
SkipWorkload("torch not installed"), and the report says so.

Caveats:
- The state dict is built once per run (random float32 tensors of 64 MiB) and
  reused for every contender, so its creation is never timed.
- DataLoader workers are forked (Linux default) and open shard files lazily,
  one fd per worker.
- Samples are raw bytes turned into uint8 tensors: the epoch measures storage
  and loader overhead, not decoding.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .contenders import Contender
from .workloads import Config, MiB, SkipWorkload

_STATE_DICT: dict[str, Any] | None = None
_STATE_DICT_BYTES = 0


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise SkipWorkload(f"torch not installed ({exc})") from None
    return torch


def torch_available() -> str | None:
    """Return torch's version, or None when it cannot be imported."""
    try:
        return str(_torch().__version__)
    except SkipWorkload:
        return None


def _state_dict(total_bytes: int) -> dict[str, Any]:
    global _STATE_DICT, _STATE_DICT_BYTES
    if _STATE_DICT is None or total_bytes != _STATE_DICT_BYTES:
        torch = _torch()
        gen = torch.Generator().manual_seed(6)
        tensor_bytes = min(64 * MiB, total_bytes)
        _STATE_DICT = {
            f"layer{idx:03d}.weight": torch.rand(tensor_bytes // 4, generator=gen)
            for idx in range(max(1, total_bytes // tensor_bytes))
        }
        _STATE_DICT_BYTES = total_bytes
    return _STATE_DICT


def _require_fs(contender: Contender) -> None:
    if not contender.is_filesystem:
        raise SkipWorkload("no filesystem: raw backing file")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save(contender: Contender, cfg: Config) -> dict[str, object]:
    """torch.save the state dict to a temp file, fsync, rename over the checkpoint, fsync dir."""
    _require_fs(contender)
    torch = _torch()
    state = _state_dict(cfg.torch_bytes)
    final = contender.root / "ckpt.pt"
    tmp = contender.root / "ckpt.pt.tmp"
    start = time.perf_counter()
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, final)
    _fsync_dir(contender.root)
    seconds = time.perf_counter() - start
    size = final.stat().st_size
    return {"MiB/s": size / MiB / seconds, "seconds": seconds, "_io_bytes": size}


def dcp_save(contender: Contender, cfg: Config) -> dict[str, object]:
    """torch.distributed.checkpoint save of 2 ranks (gloo on 127.0.0.1), each writing
    half of the checkpoint's bytes to its own file, fsynced (dcp_rank.py); timed from
    a barrier after both ranks built their tensors to the directory's fsync after a
    barrier at the end. Torch's import and the ranks' start are not timed."""
    _require_fs(contender)
    _torch()
    world = 2
    directory = contender.root / "dcp"
    if directory.exists():
        shutil.rmtree(directory)
    with socket.socket() as s:  # a free port for the process group's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).with_name("dcp_rank.py")
    # -P: bench/lib not first on the rank's path (its profile.py is not the stdlib's).
    procs = [subprocess.Popen([sys.executable, "-P", str(script), str(r), str(world), str(port),
                               str(directory), str(cfg.torch_bytes)],
                              stdout=subprocess.PIPE, text=True) for r in range(world)]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=600)
            if p.returncode:
                raise RuntimeError(f"dcp_save: a rank exited with {p.returncode}")
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    result = json.loads(outs[0].strip().splitlines()[-1])
    seconds, size = float(result["seconds"]), int(result["bytes"])
    return {"MiB/s": size / MiB / seconds, "seconds": seconds, "_io_bytes": size}


def torch_load(contender: Contender, cfg: Config) -> dict[str, object]:
    """torch.load the checkpoint written by torch_save, from cold caches."""
    _require_fs(contender)
    torch = _torch()
    final = contender.root / "ckpt.pt"
    if not final.exists():
        raise SkipWorkload("no checkpoint: torch_save did not run")
    figures: dict[str, object] = {}
    if not contender.make_cold():
        figures["_warning"] = "caches could not be dropped (not root?)"
    start = time.perf_counter()
    state = torch.load(final, map_location="cpu", weights_only=True)
    seconds = time.perf_counter() - start
    if len(state) != len(_state_dict(cfg.torch_bytes)):
        raise SkipWorkload("checkpoint read back with the wrong number of tensors")
    figures.update({"MiB/s": final.stat().st_size / MiB / seconds, "seconds": seconds,
                    "_io_bytes": final.stat().st_size})
    return figures


class ShardDataset:
    """Samples of equal size stored back to back in shard files."""

    def __init__(self, shard_paths: list[Path], per_shard: int, sample_bytes: int) -> None:
        self.shard_paths = shard_paths
        self.per_shard = per_shard
        self.sample_bytes = sample_bytes
        self._fds: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.shard_paths) * self.per_shard

    def __getitem__(self, idx: int) -> Any:
        shard, slot = divmod(idx, self.per_shard)
        fd = self._fds.get(shard)
        if fd is None:
            fd = self._fds[shard] = os.open(self.shard_paths[shard], os.O_RDONLY)
        data = os.pread(fd, self.sample_bytes, slot * self.sample_bytes)
        return _torch().frombuffer(bytearray(data), dtype=_torch().uint8)


class FileDataset:
    """One file per sample."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, idx: int) -> Any:
        with open(self.paths[idx], "rb") as f:
            data = f.read()
        return _torch().frombuffer(bytearray(data), dtype=_torch().uint8)


def _epoch(contender: Contender, dataset: Any, cfg: Config) -> dict[str, object]:
    torch = _torch()
    figures: dict[str, object] = {}
    if not contender.make_cold():
        figures["_warning"] = "caches could not be dropped (not root?)"
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=32, shuffle=True, num_workers=2,
        generator=torch.Generator().manual_seed(6))
    seen = 0
    start = time.perf_counter()
    for batch in loader:
        seen += int(batch.shape[0])
    seconds = time.perf_counter() - start
    figures.update({"samples/s": seen / seconds,
                    "MiB/s": seen * cfg.sample_bytes / MiB / seconds,
                    "_io_bytes": seen * cfg.sample_bytes, "_io_requests": seen})
    return figures


def dataloader_shards(contender: Contender, cfg: Config) -> dict[str, object]:
    """Write the samples into shard files, then time one shuffled DataLoader epoch."""
    _require_fs(contender)
    _torch()
    base = contender.root / "shards"
    base.mkdir(exist_ok=True)
    per_shard = cfg.samples // cfg.shards
    rng = random.Random(6)
    paths = []
    for shard in range(cfg.shards):
        path = base / f"shard-{shard:05d}.bin"
        with open(path, "wb") as f:
            f.write(rng.randbytes(per_shard * cfg.sample_bytes))
        paths.append(path)
    return _epoch(contender, ShardDataset(paths, per_shard, cfg.sample_bytes), cfg)


def dataloader_files(contender: Contender, cfg: Config) -> dict[str, object]:
    """Write each sample as its own file (1,000 per directory), then time one epoch."""
    _require_fs(contender)
    _torch()
    base = contender.root / "samples"
    rng = random.Random(6)
    paths = []
    for idx in range(cfg.samples):
        path = base / f"d{idx // 1000:03d}" / f"s{idx:06d}.bin"
        if idx % 1000 == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(cfg.sample_bytes))
        paths.append(path)
    return _epoch(contender, FileDataset(paths), cfg)
