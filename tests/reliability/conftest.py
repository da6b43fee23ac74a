"""Fixtures of tests/reliability: the integration suite's real mounts, reused.

`mount_factory` / `mounted` / `image` / `workdir` are those of
tests/integration/conftest.py (a `zonefs-py mount -f` subprocess, always
unmounted, fsck'ed after the test). Tests that mount carry the `integration`
marker and skip, saying why, where FUSE is missing.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from integration.conftest import (  # noqa: E402,F401 - fixtures re-exported
    Mount,
    image,
    make_image,
    mount_factory,
    mounted,
    template_image,
    workdir,
    zonefs,
)
from integration.conftest import _why_unavailable as why_no_fuse  # noqa: E402,F401
