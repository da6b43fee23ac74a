"""Power cuts and the volatile cache of the emulator (test hooks), and its table write.

Test hooks (not for user paths): `volatile_cache=True` with
`simulate_power_cut()`, `faults` (`emu_faults.FaultInjector`) including
`cut_after_writes`. After a power cut the object is dead: every call raises
OSError(EIO, "simulated power loss"), `close()` only releases it, and the
image, reopened, shows the cut state.

The zone table copy is written here (`_write_table_locked`): a flush writes
the next copy, and the "torn_table" fault of a flush tears it.
"""

from __future__ import annotations

import fcntl
import random
from typing import Literal

from zonefs_py.device.base import ZoneCond
from zonefs_py.device.emu_base import EmuBase, _power_loss
from zonefs_py.device.emu_format import ENTRY_BYTES, TABLE_ENTRIES_AT, TableEntry, encode_table

PowerCutMode = Literal["drop", "tear"]


class EmuPowerCut(EmuBase):
    """The emulator's table write, power cuts and volatile-cache overlay."""

    def _write_table_locked(self, entries: list[TableEntry], *, torn: bool = False) -> None:
        """Write the next table copy and fdatasync; caller holds `_table_lock`."""
        seq = self._seq + 1
        tbytes = self._geo.table_copy_bytes
        buf = encode_table(self._geo, seq, entries)
        offset = self._geo.table_offset + (seq % 2) * tbytes
        if torn:
            # Test hook: the copy's last meaningful 512-byte sector never reaches
            # the media, so the slot keeps old bytes there and fails its checksum.
            used = TABLE_ENTRIES_AT + ENTRY_BYTES * self._geo.nr_zones
            cut = (used - 1) // 512 * 512
            old = self._io.pread(offset, tbytes)
            self._io.pwrite(offset, buf[:cut] + old[cut:])
            self._io.fdatasync()
            self.power_cut_now()
            raise _power_loss()
        self._io.pwrite(offset, buf)
        self._io.fdatasync()
        self._seq = seq
        self._durable = entries

    def _apply_overlay(self, offset_bytes: int, data: bytes) -> bytes:
        bs = self._geo.block_size
        out: bytearray | None = None
        with self._state_lock:
            for pos in range(offset_bytes, offset_bytes + len(data), bs):
                block = self._overlay.get(pos)
                if block is not None:
                    out = out if out is not None else bytearray(data)
                    out[pos - offset_bytes : pos - offset_bytes + bs] = block
        return data if out is None else bytes(out)

    def _write_back_overlay_locked(self, blocks: dict[int, bytes]) -> None:
        for pos in sorted(blocks):
            self._io.pwrite(self._data_offset + pos, blocks[pos])
        blocks.clear()

    def simulate_power_cut(self, mode: PowerCutMode = "drop",
                           rng: random.Random | None = None) -> None:
        """Cut power now: unflushed writes are lost ("drop") or torn ("tear").

        "tear" keeps, per sequential zone, a random block-aligned prefix of
        the appends since the last flush (zoned devices persist in order), and
        each unflushed conventional block with probability 1/2. The device is
        dead afterwards; reopen the image to see the result. Raises ValueError
        for an unknown mode, OSError(EIO) if the device is already dead.
        """
        if mode not in ("drop", "tear"):
            raise ValueError(f"unknown power cut mode {mode!r}")
        self._check_alive()
        rng = rng or random.Random(0)
        with self._table_lock:
            with self._state_lock:
                if mode == "tear":
                    kept = {pos: blk for pos, blk in sorted(self._overlay.items())
                            if rng.random() < 0.5}
                    self._write_back_overlay_locked(kept)
                    entries = self._torn_entries_locked(rng)
                else:
                    entries = self._durable
                self._overlay.clear()
            if entries != self._durable:
                self._io.fdatasync()
                self._write_table_locked(entries)
            self.power_cut_now()

    def _torn_entries_locked(self, rng: random.Random) -> list[TableEntry]:
        bs = self._geo.block_size
        entries = list(self._durable)
        for idx in range(self._geo.nr_conventional, self._geo.nr_zones):
            old = entries[idx]
            live_end = self._zones.data_end[idx]
            if old.cond in (ZoneCond.FULL, ZoneCond.READONLY, ZoneCond.OFFLINE):
                continue
            if live_end <= old.data_end_rel_bytes or self._zones.wp_rel[idx] < old.wp_rel_bytes:
                continue
            keep = rng.randint(0, (live_end - old.data_end_rel_bytes) // bs) * bs
            end = old.data_end_rel_bytes + keep
            entries[idx] = TableEntry(end, end, ZoneCond.CLOSED if end else ZoneCond.EMPTY,
                                      old.reset_count)
        return entries

    def power_cut_now(self) -> None:
        """Mark the device dead and drop the image lock (the image stays as it is; test hook)."""
        self._dead = True
        self._overlay.clear()
        if self._io.fd >= 0 and not self._read_only:
            fcntl.flock(self._io.fd, fcntl.LOCK_UN)

    def _count_write_locked(self) -> None:
        faults = self.faults
        faults.writes_seen += 1
        if faults.cut_after is not None and faults.writes_seen >= faults.cut_after:
            self.power_cut_now()
