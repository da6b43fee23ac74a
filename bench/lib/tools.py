"""The external programs the benchmark starts, and the Debian packages that provide them.

Workloads (`suite.Workload.tools`) and contenders (`Contender.tools`) name the
programs they run; `bench/run` checks the ones its selection needs before it
measures anything, so a missing program is one message naming it and its
package, not a traceback half way through a run.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable

#: Program -> the Debian 12 package that provides it.
PACKAGES: dict[str, str] = {
    "fio": "fio",
    "fusermount3": "fuse3",
    "rsync": "rsync",
    "mkfs.ext4": "e2fsprogs",
    "losetup": "mount",
    "mount": "mount",
    "umount": "mount",
    "tar": "tar",
    "cp": "coreutils",
    "du": "coreutils",
    "stat": "coreutils",
    "rm": "coreutils",
    "mkdir": "coreutils",
    "find": "findutils",
    "xargs": "findutils",
}


def missing_tools(tools: Iterable[str]) -> list[str]:
    """Return the programs of `tools` not found on PATH, sorted, each once."""
    return sorted({tool for tool in tools if shutil.which(tool) is None})


def missing_message(missing: list[str], prog: str = "bench/run") -> str:
    """Say which programs are missing, which packages provide them, how to install."""
    lines = [f"{prog}: missing {tool} (Debian package {PACKAGES.get(tool, '?')})"
             for tool in missing]
    packages = sorted({PACKAGES[tool] for tool in missing if tool in PACKAGES})
    if packages:
        lines.append(f"{prog}: install them (as root): apt-get install {' '.join(packages)}")
    return "\n".join(lines)
