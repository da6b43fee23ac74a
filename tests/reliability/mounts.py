"""Real-mount helpers of the integration suite, importable by name from tests/reliability.

(Tests import these from here rather than from `conftest`, a module name that
several test directories share.)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Fixtures, helpers, and the skip-without-FUSE hook (for runs of this directory alone).
from integration.conftest import (  # noqa: E402,F401 - re-exported
    Mount,
    image,
    make_image,
    mount_factory,
    mounted,
    pytest_collection_modifyitems,
    template_image,
    workdir,
    zonefs,
)
