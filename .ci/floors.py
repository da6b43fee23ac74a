#!/usr/bin/env python3
"""Print a pip constraints file pinning every install_requires of setup.py to its floor.

    python3 .ci/floors.py > floors.txt    # cffi==1.15.1, trio==0.23, ...

.ci/run installs with it into a second virtualenv and runs the smoke set
there, so the lowest versions setup.py promises are the ones tested. Reads
setup.py's literal `install_requires` list with `ast` (no import, no build).
A requirement without a `>=` floor is an error: every dependency has one.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path


def floors(setup_py: Path) -> list[str]:
    """Return `name==floor` for each install_requires entry of `setup_py`."""
    tree = ast.parse(setup_py.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            reqs = ast.literal_eval(node.value)
            break
    else:
        raise SystemExit(f"{setup_py}: no install_requires")
    out = []
    for req in reqs:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][^,;\s]*)\s*(,.*)?", req)
        if not m:
            raise SystemExit(f"{setup_py}: {req!r} has no >= floor")
        out.append(f"{m.group(1)}=={m.group(2)}")
    return out


if __name__ == "__main__":
    here = Path(__file__).resolve().parents[1]
    print("\n".join(floors(here / "setup.py")))
    sys.exit(0)
