"""The emulator's data-discarding mode.

Data-discarding mode (`create(..., discard_data=True)`, `emu create
--discard-data`): after mkfs declared where its data zones start
(`declare_data_zones`, recorded in the header), the all-zero blocks written to
those zones are not stored (their file ranges stay holes), while every block
holding anything else is (contiguous runs of them with one pwrite each), so
the filesystem's per-zone summary blocks read back exactly. Zone states, write
pointers and the superblock/metadata zones behave as always. It lets a
benchmark fill a multi-terabyte device with zeros on a small disk. Skipping a
zero block is right only where the file already reads zeros, so:
  * EMU-4: in a discarding zone, the file range from `_zeros_from[zone]` to the
    zone end is holes. A write or append starting below that mark first
    punches its zone's range from its start to the zone end (fallocate
    PUNCH_HOLE); the mark is unknown (the zone size) after open, so stale
    blocks of a generation the table forgot (power cut, torn flush, failed
    write) never resurface under skipped zeros.
  * reset punches the whole zone's range after the reset is durable (EMU-2),
    so its stored blocks give their space back and a crash in between leaves
    the zone reset (the next write punches again). The zone lock is held
    throughout; reads of the zone already see zeros (its data end is 0).
  * a file system that cannot punch holes fails `create(discard_data=True)`,
    and a punch later, with OSError(EOPNOTSUPP); writing zeros instead would
    allocate the very space the mode saves.
"""

from __future__ import annotations

import errno
import os

from zonefs_py.device.emu_format import DataDiscard, Geometry, encode_header
from zonefs_py.device.emu_io import Buffer, nonzero_runs, punch_hole
from zonefs_py.device.emu_powercut import EmuPowerCut


def _punch_unsupported(path: str, exc: OSError) -> OSError:
    return OSError(errno.EOPNOTSUPP,
                   f"{path}: the image's file system cannot punch holes "
                   f"(fallocate PUNCH_HOLE: {exc.strerror}), which the data-discarding "
                   "mode needs; put the image on ext4, xfs, btrfs or tmpfs")


def _probe_punch_hole(path: str, fd: int, geo: Geometry) -> None:
    """Punch the last zone of a new (all-holes) image; unlink it and raise if impossible."""
    try:
        punch_hole(fd, geo.image_bytes - geo.zone_size_bytes, geo.zone_size_bytes)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        os.unlink(path)
        raise _punch_unsupported(path, exc) from None


class EmuDiscard(EmuPowerCut):
    """The data-discarding mode of the emulator (module docstring)."""

    @property
    def discard(self) -> DataDiscard:
        """The data-discarding mode recorded in the header (`declare_data_zones`)."""
        return self._discard

    def declare_data_zones(self, first_zone: int) -> None:
        """Record that zones from `first_zone` on hold file data (mkfs calls it).

        Only an image created with `discard_data` acts on it: from then on the
        all-zero blocks written to those zones are not stored (the write
        pointer and zone state move as usual; they read back as zeros from
        the holes) while other blocks are, and the zones before it -- the
        superblock and metadata log -- keep every byte. Persisted in the
        header (fdatasync) before it returns; a no-op otherwise.

        Raises OSError: EINVAL for a zone out of range, EBADF when read-only.
        """
        if not self._discard.enabled:
            return
        self._check_writable()
        if not self._geo.nr_conventional <= first_zone < self._geo.nr_zones:
            raise OSError(errno.EINVAL, f"zone {first_zone} out of range")
        discard = DataDiscard(enabled=True, first_zone=first_zone)
        with self._table_lock:
            self._io.pwrite(0, encode_header(self._geo, discard))
            self._io.fdatasync()
            self._discard = discard

    def _claim_range_zl(self, zone_idx: int, rel: int, length: int) -> bool:
        """Prepare a write of zone-relative [rel, rel + length); return whether it discards.

        Keeps EMU-4 (module doc): a discarding write starting below the zone's
        zeros mark punches from `rel` to the zone end first. Caller holds the
        zone lock. Raises OSError from the punch (EOPNOTSUPP: `_punch_zone_zl`).
        """
        discards = self._discard.discards(zone_idx)
        if discards and rel < self._zeros_from[zone_idx]:
            self._punch_zone_zl(zone_idx, rel)
        self._zeros_from[zone_idx] = max(self._zeros_from[zone_idx], rel + length)
        return discards

    def _punch_zone_zl(self, zone_idx: int, rel: int) -> None:
        """Punch the zone's file range from `rel` to its end; caller holds the zone lock."""
        zsize = self._geo.zone_size_bytes
        try:
            self._io.punch_hole(self._data_offset + (zone_idx << self._zone_shift) + rel,
                                zsize - rel)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                raise _punch_unsupported(self._path, exc) from None
            raise
        self._zeros_from[zone_idx] = rel

    def _store(self, zone_idx: int, offset_bytes: int, data: Buffer, discards: bool) -> None:
        """Write `data` at device offset `offset_bytes`, all-zero blocks skipped if `discards`."""
        if not discards:
            self._io.pwrite(self._data_offset + offset_bytes, data)
            return
        view = memoryview(data).cast("B")
        for start, end in nonzero_runs(view, self._geo.block_size):
            self._io.pwrite(self._data_offset + offset_bytes + start, view[start:end])
