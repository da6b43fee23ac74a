"""One rank of bench's dcp_save workload (torch_jobs.dcp_save runs WORLD of these).

    python bench/lib/dcp_rank.py RANK WORLD PORT DIR BYTES

Each rank builds its own tensors (BYTES / WORLD of float32, untimed), joins a gloo
process group on 127.0.0.1:PORT, waits at a barrier, then saves with
torch.distributed.checkpoint's FileSystemWriter (its default: every file fsynced)
into DIR, as a 2-rank data-parallel job's sharded save would: each rank writes its
own keys to its own file, rank 0 the metadata. The keys differ per rank, so the
planner deduplicates nothing and every rank writes its share. After a second
barrier, rank 0 fsyncs DIR and prints one JSON line: the save's seconds and the
bytes of DIR's files.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    rank, world, port = int(argv[0]), int(argv[1]), int(argv[2])
    directory, total = Path(argv[3]), int(argv[4])
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        gen = torch.Generator().manual_seed(100 + rank)
        mine = total // world
        tensor_bytes = min(64 << 20, mine)
        state = {f"rank{rank}.layer{i:03d}": torch.rand(tensor_bytes // 4, generator=gen)
                 for i in range(max(1, mine // tensor_bytes))}
        dist.barrier()
        start = time.perf_counter()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory)))
        dist.barrier()
        if rank == 0:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            seconds = time.perf_counter() - start
            size = sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
            print(json.dumps({"seconds": seconds, "bytes": size}), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
