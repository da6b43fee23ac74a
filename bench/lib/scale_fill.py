"""Fill a zonefs-py image through the engine API (no FUSE), for bench/scale.

`python -m lib.scale_fill IMAGE --ckpt-files N --ckpt-gib G --dataset-files M
--dataset-kib K [--zone-append auto|on|off]` (run from bench/) loads the
filesystem in-process, writes N checkpoint-sized files of G GiB of zeros
(64 MiB writes, fsync each) under /ckpt, then M dataset files of K KiB of
zeros in directories of 1000 under /data (fsync per directory), closes it
cleanly and prints one JSON line of figures (times, bytes of data, and the bytes
the metadata log took: journal plus checkpoints). Zeros because the emulator's
data-discarding mode reads every discarded block back as zeros: the
checksums computed here still verify on read (docs/SPEC.md, "Data-discarding
mode").

Caveat: this bypasses FUSE, so its write rate is the engine's, not a mount's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import trio

from zonefs_py.device import open_device
from zonefs_py.fs.api import ROOT_INO, Ctx
from zonefs_py.fs.filesystem import ZoneFS
from zonefs_py.fs.options import FsOptions

MiB = 1 << 20
WRITE_BYTES = 64 * MiB
CTX = Ctx()


async def _new_file(fs: ZoneFS, parent: int, name: bytes) -> int:
    fh, attr = await fs.create(parent, name, 0o644, os.O_WRONLY, CTX)
    fs.forget([(attr.ino, 1)])
    return fh


async def fill(image: str, ckpt_files: int, ckpt_gib: float, dataset_files: int,
               dataset_kib: int, zone_append: str = "auto",
               random_data: bool = False) -> dict[str, float]:
    """Write the files; return figures (seconds, bytes)."""
    dev = open_device(image, zone_append=zone_append)
    zeros = bytes(WRITE_BYTES)
    # Random bytes: slices of a pool at block offsets, so no two writes' checksums
    # repeat within zlib's window (zeros make every checksum equal, and the
    # compressed metadata far smaller than real data's).
    pool = os.urandom(2 * WRITE_BYTES) if random_data else b""
    rng = random.Random(1)

    def payload(n: int) -> bytes | memoryview:
        if not pool:
            return zeros[:n]
        at = rng.randrange(0, WRITE_BYTES // 4096) * 4096
        return memoryview(pool)[at:at + n]

    figures: dict[str, float] = {}
    try:
        async with ZoneFS.mount(dev, FsOptions(zone_append=zone_append)) as fs:
            try:
                start = time.perf_counter()
                ckpt = (await fs.mkdir(ROOT_INO, b"ckpt", 0o755, CTX)).ino
                ckpt_bytes = int(ckpt_gib * 1024) * MiB
                for idx in range(ckpt_files):
                    fh = await _new_file(fs, ckpt, f"c{idx:05d}".encode())
                    for off in range(0, ckpt_bytes, WRITE_BYTES):
                        await fs.write(fh, off, payload(min(WRITE_BYTES, ckpt_bytes - off)))
                    await fs.fsync(fh, False)
                    await fs.release(fh)
                figures["ckpt_fill_s"] = time.perf_counter() - start
                figures["ckpt_bytes"] = ckpt_files * ckpt_bytes
                start = time.perf_counter()
                data = (await fs.mkdir(ROOT_INO, b"data", 0o755, CTX)).ino
                parent = data
                for idx in range(dataset_files):
                    if idx % 1000 == 0:
                        parent = (await fs.mkdir(data, f"d{idx // 1000:05d}".encode(), 0o755,
                                                 CTX)).ino
                    fh = await _new_file(fs, parent, f"f{idx:08d}".encode())
                    small = payload(dataset_kib * 1024)
                    await fs.write(fh, 0, small)
                    if idx % 1000 == 999 or idx == dataset_files - 1:
                        await fs.fsync(fh, False)
                    await fs.release(fh)
                figures["dataset_fill_s"] = time.perf_counter() - start
                figures["dataset_bytes"] = dataset_files * dataset_kib * 1024
            finally:
                start = time.perf_counter()
                await fs.close()
                figures["close_s"] = time.perf_counter() - start
                # What the fill cost the metadata log: journal and checkpoints (the
                # checkpoint trigger decides how much of it is rewritten checkpoints).
                figures["meta_bytes_written"] = fs.journal.log.bytes_written
                figures["checkpoints"] = fs.journal.checkpoints_written
    finally:
        dev.close()
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("image")
    parser.add_argument("--ckpt-files", type=int, default=0)
    parser.add_argument("--ckpt-gib", type=float, default=2.0)
    parser.add_argument("--dataset-files", type=int, default=0)
    parser.add_argument("--dataset-kib", type=int, default=128)
    parser.add_argument("--zone-append", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--random", action="store_true",
                        help="random bytes instead of zeros: the metadata written is "
                             "then that of real data, but the data-discarding emulator "
                             "stores every non-zero block, so the image takes the disk "
                             "space of the data (only for fills that fit on the disk)")
    args = parser.parse_args()
    figures = trio.run(fill, args.image, args.ckpt_files, args.ckpt_gib, args.dataset_files,
                       args.dataset_kib, args.zone_append, args.random)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
