"""Fixtures of tests/reliability: the integration suite's real mounts, reused.

`mount_factory` / `mounted` / `image` / `workdir` are those of
tests/integration/conftest.py (a `zonefs-py mount -f` subprocess, always
unmounted, fsck'ed after the test), re-exported through `mounts.py`. Tests
that mount carry the `integration` marker.
"""

from __future__ import annotations

from mounts import (  # noqa: F401 - fixtures and the skip-without-FUSE hook
    image,
    mount_factory,
    mounted,
    pytest_collection_modifyitems,
    template_image,
    workdir,
)
