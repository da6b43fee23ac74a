"""The real users of the mount: torch.save / torch.load, DataLoader workers,
torch.distributed.checkpoint, safetensors and numpy.memmap. Every byte is compared."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from typing import Any

import pytest

from .conftest import Mount, fsync_dir

pytestmark = pytest.mark.integration

HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_NUMPY = importlib.util.find_spec("numpy") is not None
HAVE_SAFETENSORS = importlib.util.find_spec("safetensors") is not None


def model_state(seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(1000, 64, generator=g),
        "layer.0.weight": torch.randn(256, 64, generator=g),
        "layer.0.bias": torch.randn(256, generator=g),
        "head.weight": torch.randn(10, 256, generator=g).to(torch.bfloat16),
        "step": torch.tensor(1234, dtype=torch.int64),
    }


def assert_state_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    import torch

    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


@pytest.mark.torch
@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed (pip install torch==2.13.0)")
def test_torch_save_atomic_rename_and_load(mounted: Mount) -> None:
    import torch

    state = model_state(seed=1)
    final = mounted.path / "ckpt.pt"
    for round_ in range(3):  # the second and third rounds replace an existing checkpoint
        tmp = mounted.path / f".ckpt.pt.tmp{round_}"
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(mounted.path)
    assert sorted(os.listdir(mounted.path)) == ["ckpt.pt"]
    assert_state_equal(torch.load(final, weights_only=True), state)
    assert mounted.unmount() == 0
    mounted.start()
    assert_state_equal(torch.load(final, weights_only=True), state)


class _SampleFiles:
    """A map-style dataset of sample files on the mount (picklable for worker processes)."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, idx: int) -> tuple[int, bytes]:
        with open(self.paths[idx], "rb") as f:
            return idx, f.read()


@pytest.mark.torch
@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed (pip install torch==2.13.0)")
def test_dataloader_two_workers(mounted: Mount) -> None:
    import random

    import torch
    from torch.utils.data import DataLoader

    rng = random.Random(42)
    data_dir = mounted.path / "samples"
    data_dir.mkdir()
    expected: dict[int, str] = {}
    paths = []
    for i in range(96):
        blob = rng.randbytes(rng.randrange(1, 300_000))
        path = data_dir / f"sample-{i:04d}.bin"
        path.write_bytes(blob)
        expected[i] = hashlib.sha256(blob).hexdigest()
        paths.append(str(path))
    dataset: Any = _SampleFiles(paths)  # a map-style Dataset by protocol
    loader: Any = DataLoader(dataset, batch_size=8, shuffle=True, num_workers=2,
                        collate_fn=lambda batch: batch,
                        generator=torch.Generator().manual_seed(0))
    seen: dict[int, str] = {}
    for epoch in range(2):
        for batch in loader:
            for idx, blob in batch:
                digest = hashlib.sha256(blob).hexdigest()
                assert digest == expected[idx], f"epoch {epoch} sample {idx}"
                seen[idx] = digest
    assert seen == expected


@pytest.mark.torch
@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed (pip install torch==2.13.0)")
def test_distributed_checkpoint_single_process(mounted: Mount) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    state = {k: v for k, v in model_state(seed=2).items() if v.dim() > 0}
    ckpt = mounted.path / "dcp" / "step-100"
    # A one-rank gloo group, as `torchrun --nproc-per-node 1` would give.
    dist.init_process_group("gloo", init_method=f"file://{mounted.path.parent / 'pg-store'}",
                            rank=0, world_size=1)
    try:
        dcp.save(state, checkpoint_id=str(ckpt))
        assert (ckpt / ".metadata").exists()
        loaded = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(loaded, checkpoint_id=str(ckpt))
    finally:
        dist.destroy_process_group()
    assert_state_equal(loaded, state)


@pytest.mark.torch
@pytest.mark.skipif(not (HAVE_TORCH and HAVE_SAFETENSORS),
                    reason="needs torch (pip install torch==2.13.0) and safetensors")
def test_safetensors_save_and_safe_open(mounted: Mount) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    state = {k: v for k, v in model_state(seed=3).items() if v.dim() > 0}
    path = mounted.path / "model.safetensors"
    save_file(state, str(path), metadata={"format": "pt"})
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        loaded = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    assert_state_equal(loaded, state)


@pytest.mark.skipif(not HAVE_NUMPY, reason="numpy is not installed")
def test_numpy_memmap_write_and_read(mounted: Mount) -> None:
    import numpy as np

    path = mounted.path / "array.f32"
    shape = (512, 1024)
    rng = np.random.default_rng(7)
    expected = rng.standard_normal(shape, dtype=np.float32)
    mm = np.memmap(path, dtype=np.float32, mode="w+", shape=shape)
    mm[:] = expected
    mm[100, :] = 1.5  # a second write to pages already dirty
    expected[100, :] = 1.5
    mm.flush()
    del mm
    assert path.stat().st_size == expected.nbytes
    assert path.read_bytes() == expected.tobytes()
    ro = np.memmap(path, dtype=np.float32, mode="r", shape=shape)
    assert np.array_equal(ro, expected)
    del ro
    assert mounted.unmount() == 0
    mounted.start()
    assert path.read_bytes() == expected.tobytes()
