"""fsck --repair: fix what can be fixed without guessing, then write a fresh checkpoint."""

from __future__ import annotations

from collections import Counter

from zonefs_py import errors
from zonefs_py.device.base import ZonedDevice
from zonefs_py.fs.api import ROOT_INO
from zonefs_py.journal.recovery import recover


def repair_filesystem(dev: ZonedDevice) -> list[str]:
    """Fix what can be fixed without guessing; return one line per repair.

    * a log damaged in the middle: keep everything before the damage, drop the
      rest (said plainly: changes after the damage are lost);
    * orphans, dangling entries and wrong link counts (INV-11);
    then write a fresh checkpoint and reset every meta zone it does not occupy.
    Data blocks with bad checksums are reported, never "fixed".
    """
    import trio

    from zonefs_py.format.constants import OpType
    from zonefs_py.fs.filesystem import ZoneFS
    from zonefs_py.fs.options import FsOptions
    from zonefs_py.fs.tasks import MountTasks

    fixed: list[str] = []

    async def run() -> None:
        try:
            rec = recover(dev)
        except errors.CorruptionError:
            rec = recover(dev, salvage=True)
            fixed.append(f"metadata log cut at the damaged record ({rec.salvaged}); "
                         "changes recorded after it are lost")
            rec.scan.append_zone = None
            rec.log.cur_zone = None
            rec.log.next_seq += 1 << 32
        fs = ZoneFS(dev, rec, FsOptions(commit_interval_s=3600), MountTasks())  # no tasks
        state = fs.state
        ops = []
        refs: Counter[int] = Counter()
        subdirs: Counter[int] = Counter()
        for d in list(state.inodes.values()):
            for name, child in list((d.entries or {}).items()):
                c = state.inodes.get(child)
                if c is None:
                    ops.append((OpType.DIRENT_DEL, d.ino, name))
                    fixed.append(f"removed entry {name!r} of directory {d.ino} "
                                 f"(inode {child} is missing)")
                    continue
                refs[child] += 1
                if c.is_dir:
                    subdirs[d.ino] += 1
        fs.txn(ops)
        ops = []
        for inode in list(state.inodes.values()):
            want = (2 + subdirs[inode.ino]) if inode.is_dir else refs[inode.ino]
            if inode.ino == ROOT_INO:
                want = 2 + subdirs[inode.ino]
            elif refs[inode.ino] == 0:
                want = 0
            if inode.nlink != want:
                ops.append(inode.op(nlink=want))
                fixed.append(f"inode {inode.ino}: link count {inode.nlink} -> {want}")
        fs.txn(ops)
        await fs.after_recovery()
        await fs.journal.checkpoint()
        # Reset everything but the new checkpoint's zones (from the one holding
        # its BEGIN on, and the one the log appends to): the damaged tail and
        # any zone the salvage left out of the chain. Resetting all but the
        # current zone reset the start of a checkpoint that spanned zones, and
        # a crash before the checkpoint of `close` then left no mountable image.
        mlog = fs.journal.log
        first_seq = mlog.zone_first_seq.get(fs.journal.sb.checkpoint_zone, 0)
        keep = {z for z, seq in mlog.zone_first_seq.items() if seq >= first_seq}
        keep.add(fs.journal.sb.checkpoint_zone)
        if mlog.cur_zone is not None:
            keep.add(mlog.cur_zone)
        if fs.journal.index is not None:  # format 5: the index's pages
            keep.update(fs.journal.index.store.live)
        others = [z for z in mlog.zones if z not in keep]
        await trio.to_thread.run_sync(mlog.reset_zones, others)
        await fs.close()

    trio.run(run)
    return fixed
