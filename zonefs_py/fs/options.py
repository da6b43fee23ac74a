"""Mount-time options of the engine (the filesystem's own `-o` options).

`zonefs-py mount -o` parses `name=value` pairs into `FsOptions` with
`FsOptions.from_mount_options`; unknown names are left for FUSE.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from zonefs_py.format.constants import DISK_VERSION, INDEX_DISK_VERSION, INLINE_MAX_BYTES


def _flag(value: str) -> bool:
    if value in ("1", "on", "yes", "true"):
        return True
    if value in ("0", "off", "no", "false"):
        return False
    raise ValueError(value)


#: FsOptions.convert_format: convert to format 5 where the meta area has room.
AUTO_FORMAT = None


@dataclass(slots=True)
class FsOptions:
    """Engine options of one mount (the `-o` options the engine reads; daemon/options.py parses
    them). Each field documents its unit and default.
    """

    #: Seconds between background journal commits (like ext4's commit=).
    commit_interval_s: float = 5.0
    #: Mount read-only: no device writes at all (recovery must not need to write).
    read_only: bool = False
    #: Journal bytes since the last checkpoint that trigger a new checkpoint.
    checkpoint_journal_bytes: int = 64 << 20
    #: Most file-data reads in flight in worker threads at once (writes get a quarter,
    #: metadata commits 2, the cleaner 1, each from a budget of its own).
    max_device_threads: int = 16
    #: Cleaner rate limit, MB/s (token bucket); 0 disables background cleaning.
    cleaner_rate_mb_s: float = 64.0
    #: Cleaner victim policy: "cost-benefit" or "greedy".
    cleaner_policy: str = "cost-benefit"
    #: Read file data through an io_uring polled by the event loop instead of
    #: worker threads (falls back to threads when io_uring is unavailable).
    io_uring: bool = True
    #: With io_uring: a kernel thread polls submissions, sleeping after this many
    #: ms without reads; 0 submits from the event loop (see device/aread.py).
    sqpoll_ms: int = 2
    #: The read fast path (fs/data/readpath.py): a read of one mapped piece is one C call
    #: submitting it with its checksums, verified in C at completion; False: every
    #: read takes the general path (for A/B comparison and tests).
    fast_read: bool = True
    #: READs of settled files answered in C by the data plane's dispatcher, without
    #: the trio thread (zonefs_py/dataplane, DESIGN 4.10); False: every request goes
    #: through pyfuse3 as before (`-o c_reads=off`).
    c_reads: bool = True
    #: The dispatcher takes the sequential WRITEs of files the engine arms (issue 44,
    #: dataplane/cwrites.py); needs c_reads (its dispatcher). `-o c_writes=off`:
    #: every WRITE through pyfuse3 as before.
    c_writes: bool = True
    #: Read QoS: p90 latency (ms) reads may see in the engine before file-data appends
    #: are slowed down (fs/data/qos.py); 0 disables the controller.
    read_latency_ms: float = 2.0
    #: The device's write bandwidth (MB/s) that tenants' --write-share and --read-share
    #: are shares of (fs/data/tenantqos.py); 0: the peak append rate seen since mount.
    device_write_mb: float = 0.0
    #: Sequential read-ahead in the engine: MiB of device reads kept in flight ahead
    #: of a file read sequentially (fs/data/prefetch.py); 0 disables it.
    prefetch_mb: int = 8
    #: MiB of memory for the checksums of sealed zones read from their summaries
    #: (fs/data/zonesums.py; at 4 KiB blocks, 1 MiB of cache covers ~1 GiB of data).
    cache_mb: int = 256
    #: Format 5: inodes kept in memory at most beyond those the kernel or a handle
    #: holds or that changed since the last checkpoint (model/lazy.py; ~1 KiB each);
    #: the others are read from the namespace index when used. 0 loads the whole
    #: namespace at mount, as format 4 does.
    inode_cache: int = 131072
    #: Files of at most this many bytes keep their bytes in the metadata (fs/inline.py;
    #: at most 2048 and half a block; 0 disables it).
    inline_max_bytes: int = 512
    #: The caller keeps written files' mtime/ctime and sets them itself (SETATTR after
    #: the data, as the FUSE writeback cache does): writes then leave the times alone.
    #: Not a mount option: the daemon sets it with the writeback cache.
    kernel_write_times: bool = False
    #: Appends as true zone appends (NVMe Zone Append; device/zappend.py): "auto"
    #: when the device has it (not the emulator's test model: only "on" there), "on"
    #: to require it, "off" for writes at the write pointer.
    zone_append: str = "auto"
    #: Drain to an object store (zonefs_py/drain): S3 endpoint URL, region, profile and
    #: shared-credentials file; empty fields are left to boto3's standard resolution.
    drain_endpoint: str = ""
    drain_region: str = ""
    drain_profile: str = ""
    drain_credentials: str = ""
    #: Upload rate limit, MB/s (0: none); parts in flight; part size, MiB.
    drain_rate_mb_s: float = 0.0
    drain_parts: int = 4
    drain_part_mb: int = 16
    #: Files uploaded (or moved) at once, each with up to `drain_parts` parts in flight.
    drain_parallel: int = 2
    #: Drain rate, MB/s, while foreground reads are served (reads first; 0: none).
    drain_rate_reads_mb_s: float = 32.0
    #: Seconds a queued file waits before its upload starts (a rename into place
    #: right after the fsync+close then names the object).
    drain_delay_s: float = 1.0
    #: On-disk format a read-write mount converts a format 2-4 image to
    #: (DESIGN.md 3.14, "Conversion"): 4 keeps it at format 4 (versions 2 and 3
    #: are still brought to 4; the default of this API, for tools such as fsck
    #: --repair); 5 converts it to format 5 (the namespace index) or refuses the
    #: mount when it cannot; None (AUTO_FORMAT, the mount command's default):
    #: converts to 5 when the image's meta area can hold the index with room to
    #: grow, else keeps format 4 and logs why. No effect on a format 5 image:
    #: there is no conversion back.
    convert_format: int | None = 4

    _MOUNT_NAMES: ClassVar[dict[str, tuple[str, Callable[[str], object]]]] = {
        "commit": ("commit_interval_s", float),
        "checkpoint_mb": ("checkpoint_journal_bytes", lambda v: int(v) << 20),
        "io_threads": ("max_device_threads", int),
        "cleaner_rate": ("cleaner_rate_mb_s", float),
        "cleaner_policy": ("cleaner_policy", str),
        "io_uring": ("io_uring", _flag),
        "sqpoll_ms": ("sqpoll_ms", int),
        "fast_read": ("fast_read", _flag),
        "c_reads": ("c_reads", _flag),
        "c_writes": ("c_writes", _flag),
        "read_latency_ms": ("read_latency_ms", float),
        "device_write_mb": ("device_write_mb", float),
        "prefetch_mb": ("prefetch_mb", int),
        "cache_mb": ("cache_mb", int),
        "inode_cache": ("inode_cache", int),
        "inline_max": ("inline_max_bytes", int),
        "zone_append": ("zone_append", lambda v: {"1": "on", "0": "off"}.get(v, v)),
        "drain_endpoint": ("drain_endpoint", str),
        "drain_region": ("drain_region", str),
        "drain_profile": ("drain_profile", str),
        "drain_credentials": ("drain_credentials", str),
        "drain_rate": ("drain_rate_mb_s", float),
        "drain_parts": ("drain_parts", int),
        "drain_parallel": ("drain_parallel", int),
        "drain_rate_reads": ("drain_rate_reads_mb_s", float),
        "drain_part_mb": ("drain_part_mb", int),
        "drain_delay": ("drain_delay_s", float),
        "format": ("convert_format", int),
    }
    #: Options that were removed, with what replaced them.
    _RETIRED: ClassVar[dict[str, str]] = {
        "qos_write_mb": "mount option qos_write_mb was replaced by read_latency_ms=MS "
                        "(writers are slowed only while reads miss that latency target)",
    }

    @classmethod
    def from_mount_options(
            cls, opts: dict[str, str | None]) -> tuple[FsOptions, dict[str, str | None]]:
        """Split -o options into ours (parsed) and the rest (for FUSE).

        Raises ValueError with a one-line message for a bad value.
        """
        result = cls(convert_format=AUTO_FORMAT)
        rest: dict[str, str | None] = {}
        for name, value in opts.items():
            if name == "ro":
                result.read_only = True
                rest[name] = value
                continue
            if name in cls._RETIRED:
                raise ValueError(cls._RETIRED[name])
            spec = cls._MOUNT_NAMES.get(name)
            if spec is None:
                rest[name] = value
                continue
            field_name, conv = spec
            if value is None:
                raise ValueError(f"mount option {name} needs a value ({name}=...)")
            try:
                setattr(result, field_name, conv(value))
            except ValueError:
                raise ValueError(f"bad value for mount option {name}: {value!r}") from None
        if result.cleaner_policy not in ("cost-benefit", "greedy"):
            raise ValueError("cleaner_policy must be cost-benefit or greedy")
        if result.zone_append not in ("auto", "on", "off"):
            raise ValueError("zone_append must be auto, on or off")
        if not 0 <= result.inline_max_bytes <= INLINE_MAX_BYTES:
            raise ValueError(f"inline_max must be 0 (off) .. {INLINE_MAX_BYTES} bytes")
        if result.prefetch_mb < 0:
            raise ValueError("prefetch_mb must be 0 (off) or a number of MiB")
        if result.cache_mb < 1:
            raise ValueError("cache_mb must be at least 1 (MiB of checksums kept in memory)")
        if result.inode_cache < 0:
            raise ValueError("inode_cache must be 0 (load every inode at mount) or a "
                             "number of inodes")
        if not result.read_latency_ms >= 0:
            raise ValueError("read_latency_ms must be 0 (off) or a positive number of ms")
        if not result.device_write_mb >= 0:
            raise ValueError("device_write_mb must be 0 (measured) or a number of MB/s")
        if not 5 <= result.drain_part_mb <= 5120 or not 1 <= result.drain_parts <= 64 \
                or not 1 <= result.drain_parallel <= 64:
            raise ValueError("drain_part_mb must be 5..5120 (S3's part sizes), "
                             "drain_parts and drain_parallel 1..64")
        if result.convert_format not in (AUTO_FORMAT, DISK_VERSION, INDEX_DISK_VERSION):
            raise ValueError(f"format={result.convert_format}: 4 keeps a format 4 image as it "
                             f"is, 5 converts it to format {INDEX_DISK_VERSION} (the default "
                             f"does so when its meta area has room)")
        if not result.drain_rate_reads_mb_s >= 0 or not result.drain_rate_mb_s >= 0:
            raise ValueError("drain_rate and drain_rate_reads must be 0 (no limit) or MB/s")
        return result, rest

    def replace(self, **changes: object) -> FsOptions:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
