"""Re-run the device contract tests (tests/unit/test_device_contract.py) on null_blk.

The tests are imported unchanged; this directory's conftest provides a
`zdev_factory` that makes real zoned null_blk devices, so every contract test
here runs against the kernel. Where the two disagree, the kernel is right.
"""

from __future__ import annotations

import pytest

contract = pytest.importorskip(
    "tests.unit.test_device_contract",
    reason="tests/unit/test_device_contract.py is not there yet (emulator engineer's file)")

# Tests and the module's own fixtures (e.g. `dev`), as a star import would
# bring them, plus private helpers fixtures may be named by.
globals().update({name: getattr(contract, name) for name in dir(contract)
                  if not name.startswith("__") and name not in ("pytest", "pytestmark")})

_marks = getattr(contract, "pytestmark", [])
pytestmark = [*(_marks if isinstance(_marks, list) else [_marks]), pytest.mark.guest]
