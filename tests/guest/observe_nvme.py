#!/usr/bin/env python3
"""Print how the kernel's nvme driver answers on QEMU's zoned NVMe namespace (guest, root).

The same requests as observe_kernel.py asks of null_blk, on the namespace of
tests/guest/run's second controller (serial zonefs-contract, nsid 1: 16 x 4 MiB
zones, capacity 3 MiB, max open 2, max active 3, lbs 4096; ZNS has no
conventional zones), through raw ioctls and O_DIRECT (observe_kernel's
helpers), and zone appends through zonefs-py's passthrough handle. Output is
a Markdown table for docs/kernel-zoned-behaviour.md.

usage (from the checkout root, on the host; run attaches the namespaces):
  tests/guest/run -- .venv/bin/python tests/guest/observe_nvme.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.guest.conftest import nvme_namespace  # noqa: E402
from tests.guest.observe_kernel import (  # noqa: E402
    BLKCLOSEZONE,
    BLKFINISHZONE,
    BLKOPENZONE,
    BLKRESETZONE,
    MB,
    mgmt,
    obs,
    pr,
    pw,
    report,
    sysfs,
)


def main() -> None:
    from zonefs_py.device import native
    from zonefs_py.device.zappend import open_handle

    dev = nvme_namespace("zonefs-contract", 1)
    if dev is None:
        sys.exit("observe_nvme: the zonefs-contract namespace is not attached")
    name = os.path.basename(dev)
    zsz = 4 * MB
    print(f"{dev}: sysfs: {sysfs(name)}")
    print("| request | result |\n|---|---|")
    fd = os.open(dev, os.O_RDWR | os.O_DIRECT | os.O_EXCL)
    mgmt(fd, BLKRESETZONE, 0, zsz, 16)
    z, zs = 2, 2 * zsz
    obs("report seq zone 2 (start, cap, wp-rel, cond)", lambda: report(fd, z, zsz))
    obs("write 4K at WP of EMPTY zone -> state", lambda: (pw(fd, zs, 4096),
                                                         report(fd, z, zsz))[1])
    obs("write 4K ahead of WP (wp+4K)", lambda: pw(fd, zs + 8192, 4096))
    obs("write 4K behind WP (zone start)", lambda: pw(fd, zs, 4096))
    obs("write 512 B at WP (lbs 4096)", lambda: pw(fd, zs + 4096, 512))
    obs("read 8K from zone start (4K written, 4K past WP)",
        lambda: pr(fd, zs, 8192)[4094:4098])
    obs("read 4K past capacity (cap..size)", lambda: pr(fd, zs + 3 * MB, 4096)[:4])
    obs("write up to capacity -> state", lambda: (pw(fd, zs + 4096, 3 * MB - 4096),
                                                  report(fd, z, zsz))[1])
    obs("write 4K to FULL zone", lambda: pw(fd, zs + 3 * MB, 4096))
    mgmt(fd, BLKRESETZONE, z, zsz)
    obs("write crossing capacity (wp=cap-4K, 8K) -> state", lambda: (
        pw(fd, zs, 3 * MB - 4096), pw(fd, zs + 3 * MB - 4096, 8192)))
    obs("  -> state", lambda: report(fd, z, zsz))
    mgmt(fd, BLKRESETZONE, z, zsz)
    obs("reset EMPTY zone -> state", lambda: (mgmt(fd, BLKRESETZONE, z, zsz),
                                              report(fd, z, zsz))[1])
    obs("finish EMPTY zone -> state", lambda: (mgmt(fd, BLKFINISHZONE, z, zsz),
                                               report(fd, z, zsz))[1])
    obs("finish FULL zone", lambda: mgmt(fd, BLKFINISHZONE, z, zsz))
    obs("open FULL zone", lambda: mgmt(fd, BLKOPENZONE, z, zsz))
    obs("close FULL zone", lambda: mgmt(fd, BLKCLOSEZONE, z, zsz))
    mgmt(fd, BLKRESETZONE, z, zsz)
    obs("close EMPTY zone", lambda: mgmt(fd, BLKCLOSEZONE, z, zsz))
    obs("open EMPTY zone, close it (wp=start) -> state", lambda: (
        mgmt(fd, BLKOPENZONE, z, zsz), mgmt(fd, BLKCLOSEZONE, z, zsz),
        report(fd, z, zsz))[2])
    obs("write 4K, finish IMP_OPEN zone -> state", lambda: (
        mgmt(fd, BLKRESETZONE, z, zsz), pw(fd, zs, 4096), mgmt(fd, BLKFINISHZONE, z, zsz),
        report(fd, z, zsz))[3])
    mgmt(fd, BLKRESETZONE, 0, zsz, 16)
    obs("explicit open 3rd zone (max_open 2)", lambda: (
        mgmt(fd, BLKOPENZONE, 2, zsz), mgmt(fd, BLKOPENZONE, 3, zsz),
        mgmt(fd, BLKOPENZONE, 4, zsz)))
    obs("write to 3rd EMPTY zone with 2 EXP_OPEN", lambda: pw(fd, 4 * zsz, 4096))
    mgmt(fd, BLKRESETZONE, 0, zsz, 16)

    def states() -> list[str]:
        return [f"{i}:{report(fd, i, zsz)[3]}" for i in range(2, 8)]

    obs("write zones 2,3,4 (max_open 2) -> states", lambda: (
        pw(fd, 2 * zsz, 4096), pw(fd, 3 * zsz, 4096), pw(fd, 4 * zsz, 4096), states())[3])
    obs("explicit open 6th zone (3 active)", lambda: mgmt(fd, BLKOPENZONE, 5, zsz))
    obs("write to EMPTY zone (3 active)", lambda: pw(fd, 5 * zsz, 4096))
    obs("finish EMPTY zone at active limit -> states", lambda: (
        mgmt(fd, BLKFINISHZONE, 5, zsz), states())[1])
    obs("finish CLOSED zone 2 -> states", lambda: (mgmt(fd, BLKFINISHZONE, 2, zsz),
                                                   states())[1])
    mgmt(fd, BLKRESETZONE, 0, zsz, 16)
    geo = native.block_geometry(fd, dev)
    handle, why = open_handle(dev, 4096, geo.zone_append_max_bytes)
    if handle is None:
        print(f"no zone append: {why}")
        return
    obs("zone append 4K x 3 to EMPTY zone 2 -> landed (rel)", lambda: [
        r - zs if isinstance(r, int) else r for r in handle.run([(zs, bytes(4096))] * 3)])
    obs("  -> state", lambda: report(fd, z, zsz))
    obs("zone append 256K (> zone_append_max_bytes; zonefs-py refuses it)",
        lambda: handle.run([(zs, bytes(256 << 10))]))
    pw(fd, zs + 3 * 4096, 3 * MB - 4 * 4096)
    obs("zone append 8K with 4K left", lambda: handle.run([(zs, bytes(8192))]))
    obs("zone append 4K with 4K left, then 4K to FULL", lambda: handle.run(
        [(zs, bytes(4096))]) + handle.run([(zs, bytes(4096))]))
    obs("zone append 4K at a zone start that is not one (zs+4K)",
        lambda: handle.run([(3 * zsz + 4096, bytes(4096))]))
    obs("zone append to 3rd EMPTY zone with 2 EXP_OPEN", lambda: (
        mgmt(fd, BLKOPENZONE, 4, zsz), mgmt(fd, BLKOPENZONE, 5, zsz),
        handle.run([(6 * zsz, bytes(4096))]))[2])
    os.close(fd)


if __name__ == "__main__":
    main()
