"""The seam between `BlockZonedDevice` and the ways it appends.

`blockdev.py` writes at the cached write pointer itself (`WritePointerAppender`);
`zappend.py` issues NVMe Zone Append. Both see the device through
`AppendTarget` and a zone through `ZoneState`, declared here so that neither
module imports the other (tests/unit/test_layers.py forbids cycles).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol

from zonefs_py.device.base import DeviceInfo, ZoneType


@dataclass(slots=True)
class ZoneState:
    """Cached state of one zone; fields change only under `lock`."""

    start: int
    size: int
    capacity: int
    type: ZoneType
    wp: int
    data_end: int  # end of bytes really written (wp, except after finish)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def sequential(self) -> bool:
        return self.type is not ZoneType.CONVENTIONAL


class AppendTarget(Protocol):
    """What an appender needs of the device it appends to."""

    @property
    def info(self) -> DeviceInfo: ...

    def zone_state(self, zone_idx: int) -> ZoneState:
        """Return the cached state of a zone. Raises OSError(EINVAL)."""
        ...

    def refresh_after_error_locked(self, st: ZoneState, zone_idx: int) -> None:
        """Reload a sequential zone's write pointer after a failed write (caller holds
        `st.lock`)."""
        ...

    def check_fits_locked(self, st: ZoneState, zone_idx: int, offset_bytes: int,
                          length_bytes: int) -> None:
        """Raise OSError unless the bytes fit in the zone (caller holds `st.lock`)."""
        ...
