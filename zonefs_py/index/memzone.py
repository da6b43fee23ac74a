"""An in-memory `ZoneAppender` for tests: zones, write pointers, resets, power cuts.

Caveats: every append is durable at once (no volatile cache, so `flush` only
counts); a power cut makes appends fail from then on, it loses nothing.
"""

from __future__ import annotations

import errno


class MemoryZoneDevice:
    """`nr_zones` zones of `zone_size_bytes`, zone k at byte offset k * zone_size_bytes.

    `cut_power_after(n)` lets n more appends succeed, then every append raises
    OSError(EIO) until `restore_power()`. Reads past a zone's write pointer
    return zeros, as a zoned drive does.
    """

    def __init__(self, nr_zones: int, zone_size_bytes: int) -> None:
        self.nr_zones = nr_zones
        self._zone_size_bytes = zone_size_bytes
        self._zones = [bytearray() for _ in range(nr_zones)]
        self.appends = 0
        self.reads = 0
        self.resets = 0
        self.flushes = 0
        self._appends_left: int | None = None

    @property
    def zone_size_bytes(self) -> int:
        return self._zone_size_bytes

    def cut_power_after(self, appends: int) -> None:
        """Let `appends` more appends succeed, then fail all others."""
        self._appends_left = appends

    def restore_power(self) -> None:
        self._appends_left = None

    def append(self, zone_idx: int, data: bytes) -> int:
        if self._appends_left is not None:
            if self._appends_left <= 0:
                raise OSError(errno.EIO, f"power cut (append to zone {zone_idx})")
            self._appends_left -= 1
        zone = self._zones[zone_idx]
        if len(zone) + len(data) > self._zone_size_bytes:
            raise OSError(errno.ENOSPC, f"zone {zone_idx} full")
        offset = zone_idx * self._zone_size_bytes + len(zone)
        zone += data
        self.appends += 1
        return offset

    def read(self, offset_bytes: int, length_bytes: int) -> bytes:
        self.reads += 1
        out = bytearray()
        while length_bytes > 0:
            zone_idx, within = divmod(offset_bytes, self._zone_size_bytes)
            take = min(length_bytes, self._zone_size_bytes - within)
            chunk = self._zones[zone_idx][within:within + take]
            out += chunk + bytes(take - len(chunk))
            offset_bytes += take
            length_bytes -= take
        return bytes(out)

    def reset_zone(self, zone_idx: int) -> None:
        self._zones[zone_idx] = bytearray()
        self.resets += 1

    def write_pointer(self, zone_idx: int) -> int:
        return zone_idx * self._zone_size_bytes + len(self._zones[zone_idx])

    def flush(self) -> None:
        self.flushes += 1
