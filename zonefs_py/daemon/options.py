"""Mount options: split `-o` strings into engine, daemon and FUSE options (`MountConfig`).

Pure parsing and validation, no I/O beyond checking that the device exists
and the mount point is a directory (or a stale FUSE mount, which gets its
own message). Every problem is a `MountError` with a one-line reason.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from zonefs_py.fs.options import FsOptions

#: FUSE/VFS options passed to libfuse unchanged (libfuse 3 `fuse_mount_opts` and mount flags).
FUSE_PASSTHROUGH = frozenset({
    "allow_other", "allow_root", "ro", "default_permissions",
    "dev", "nodev", "suid", "nosuid", "exec", "noexec", "sync", "async", "dirsync",
    "atime", "noatime", "diratime", "nodiratime", "relatime", "norelatime",
    "strictatime", "nostrictatime", "lazytime", "nolazytime",
})
#: FUSE options that take a value and are passed through.
FUSE_VALUED = frozenset({"fsname", "subtype"})
#: mount(8) / fstab options that mean nothing to the daemon and are dropped.
IGNORED = frozenset({
    "rw", "defaults", "auto", "noauto", "_netdev", "user", "users", "nouser", "owner",
    "group", "nofail", "loop", "silent", "loud",
})
#: Options of the daemon itself, with their help text.
DAEMON_OPTIONS = {
    "writeback_cache": "on|off: kernel writeback cache (default on; see DESIGN.md 4.3)",
    "max_tasks": "N: most FUSE requests handled at once (default 64)",
    "min_tasks": "N: FUSE request tasks kept waiting while idle (default 16, at most "
                 "max_tasks; fewer makes pyfuse3 start a task for most requests under load)",
    "attr_timeout": "S: seconds the kernel caches attributes and entries (default 3600)",
    "readahead_kb": "N: kernel readahead window of the mount in KiB (default 4096; 0 keeps "
                    "the kernel's 128)",
    "max_background": "N: FUSE background requests (async reads, writeback) in flight "
                      "(default 64; the kernel's 12 lets O_DIRECT readers starve writeback; "
                      "0 keeps it)",
    "metrics": "[HOST:]PORT: serve Prometheus /metrics over HTTP (default off; HOST "
               "defaults to 127.0.0.1)",
    "metrics_textfile": "DIR: rewrite DIR/zonefs_<device>.prom (node_exporter textfile "
                        "collector) atomically every metrics_interval seconds (default off)",
    "metrics_interval": "S: seconds between textfile rewrites (default 15)",
    "stuck_request_s": "S: a FUSE request unanswered this long is logged once and listed "
                       "by `zonefs-py stat` (default 30)",
    "tenant_admins": "USER[:@GROUP...]: users and groups (names or numbers, @ before a "
                     "group) who may run `zonefs-py tenant add|set|remove` on directories "
                     "they can write (a mount by root only; default: root alone)",
    "stop_grace": "S: seconds requests in flight may take to finish once the daemon stops "
                  "(SIGTERM, or an unmount with requests stuck); then they are cancelled "
                  "and their callers get an error (default 10)",
}
DEFAULT_SUBTYPE = "zonefs-py"


class MountError(Exception):
    """A one-line reason why the mount could not be set up."""


def parse_option_strings(option_strings: Iterable[str]) -> dict[str, str | None]:
    """Parse repeated `-o a,b=c` strings into an ordered name -> value dict."""
    opts: dict[str, str | None] = {}
    for option_string in option_strings:
        for item in option_string.split(","):
            item = item.strip()
            if not item:
                continue
            name, sep, value = item.partition("=")
            opts[name] = value if sep else None
    return opts


def is_ignored(name: str) -> bool:
    """True for fstab/mount(8) options that the daemon drops."""
    return name in IGNORED or name.startswith(("x-", "comment"))


def parse_host_port(value: str) -> tuple[str, int]:
    """Parse `metrics=`'s `[HOST:]PORT` (HOST defaults to 127.0.0.1); raise ValueError."""
    host, sep, port_s = value.rpartition(":")
    host = host.strip("[]") if sep else "127.0.0.1"
    port = int(port_s)
    if not 0 < port < 65536 or not host:
        raise ValueError(value)
    return host, port


@dataclass(slots=True)
class MountConfig:
    """Everything the daemon needs, parsed and validated."""

    device: str
    mountpoint: str
    fs_options: FsOptions
    fuse_options: set[str]
    foreground: bool = False
    log_level: str = "INFO"
    log_file: str | None = None
    writeback_cache: bool = True
    max_tasks: int = 64
    min_tasks: int = 16
    attr_timeout_s: float = 3600.0
    readahead_kb: int = 4096
    max_background: int = 64
    metrics_addr: tuple[str, int] | None = None
    metrics_textfile_dir: str | None = None
    metrics_interval_s: float = 15.0
    stuck_request_s: float = 30.0
    stop_grace_s: float = 10.0
    #: Users and groups root allows to run tenant commands (`tenant_admins=`).
    tenant_admin_uids: frozenset[int] = frozenset()
    tenant_admin_gids: frozenset[int] = frozenset()
    #: The mount point with symlinks resolved, before the mount (the daemon must
    #: not stat its own mount from the trio thread: daemon/stopping.py).
    resolved_mountpoint: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, device: str, mountpoint: str, option_strings: Iterable[str],
              **kwargs: Any) -> MountConfig:
        """Validate paths and split `-o` options; raise MountError with a one-line reason."""
        device = os.path.abspath(device)
        mountpoint = os.path.abspath(mountpoint)
        if not os.path.exists(device):
            raise MountError(f"{device}: no such device or image")
        try:
            # statfs always reaches the filesystem (stat may be answered from the
            # kernel's cache), so a FUSE mount whose daemon died shows here.
            os.statvfs(mountpoint)
            is_dir = stat.S_ISDIR(os.stat(mountpoint).st_mode)
        except OSError as exc:
            if exc.errno == errno.ENOTCONN:
                raise MountError(f"{mountpoint}: stale FUSE mount (its daemon is gone); "
                                 f"run fusermount3 -u {mountpoint}") from None
            is_dir = False
        if not is_dir:
            raise MountError(f"{mountpoint}: mount point is not a directory")
        opts = parse_option_strings(option_strings)
        try:
            fs_options, rest = FsOptions.from_mount_options(opts)
        except ValueError as exc:
            raise MountError(str(exc)) from None
        cfg = cls(device=device, mountpoint=mountpoint, fs_options=fs_options,
                  fuse_options=set(), resolved_mountpoint=os.path.realpath(mountpoint),
                  **kwargs)
        fsname, subtype = device, DEFAULT_SUBTYPE
        for name, value in rest.items():
            if is_ignored(name):
                continue
            if name in DAEMON_OPTIONS:
                cfg._set_daemon_option(name, value)
            elif name in FUSE_PASSTHROUGH and value is None:
                cfg.fuse_options.add(name)
            elif name == "fsname" and value:
                fsname = value
            elif name == "subtype" and value:
                subtype = value
            else:
                raise MountError(f"unknown mount option {name!r}"
                                 + ("" if value is None else f" (={value})"))
        cfg.min_tasks = min(cfg.min_tasks, cfg.max_tasks)
        # With the writeback cache the kernel owns mtime/ctime of written files: a
        # WRITE arrives at writeback, after a utime the program did before close
        # (cp -p, tar, rsync), and must not stamp the time of its arrival.
        cfg.fs_options.kernel_write_times = cfg.writeback_cache
        if cfg.metrics_textfile_dir is not None:
            cfg.metrics_textfile_dir = os.path.abspath(cfg.metrics_textfile_dir)
            if not os.path.isdir(cfg.metrics_textfile_dir):
                raise MountError(f"metrics_textfile: {cfg.metrics_textfile_dir} is not a "
                                 "directory")
        if (cfg.tenant_admin_uids or cfg.tenant_admin_gids) and os.geteuid() != 0:
            raise MountError("tenant_admins: only root may let others run tenant commands "
                             "(mount as root)")
        cfg.fuse_options.add("default_permissions")  # always: the kernel checks modes
        cfg.fuse_options.add(f"fsname={fsname}")
        cfg.fuse_options.add(f"subtype={subtype}")
        return cfg

    def _set_daemon_option(self, name: str, value: str | None) -> None:
        if value is None:
            raise MountError(f"mount option {name} needs a value ({name}=...)")
        try:
            if name == "writeback_cache":
                if value not in ("on", "off", "1", "0"):
                    raise ValueError(value)
                self.writeback_cache = value in ("on", "1")
            elif name == "max_tasks":
                self.max_tasks = _int_at_least(value, 1)
            elif name == "min_tasks":
                self.min_tasks = _int_at_least(value, 1)
            elif name == "attr_timeout":
                self.attr_timeout_s = float(value)
                if self.attr_timeout_s < 0:
                    raise ValueError(value)
            elif name == "readahead_kb":
                self.readahead_kb = _int_at_least(value, 0, 65536)
            elif name == "max_background":
                self.max_background = _int_at_least(value, 0, 65535)
            elif name == "metrics":
                self.metrics_addr = parse_host_port(value)
            elif name == "metrics_textfile":
                self.metrics_textfile_dir = value
            elif name == "metrics_interval":
                self.metrics_interval_s = float(value)
                if not 0.1 <= self.metrics_interval_s <= 86400:
                    raise ValueError(value)
            elif name == "stuck_request_s":
                self.stuck_request_s = float(value)
                if not 0.1 <= self.stuck_request_s <= 86400:
                    raise ValueError(value)
            elif name == "tenant_admins":
                self.tenant_admin_uids, self.tenant_admin_gids = parse_tenant_admins(value)
            elif name == "stop_grace":
                self.stop_grace_s = float(value)
                if not 0 <= self.stop_grace_s <= 3600:
                    raise ValueError(value)
        except ValueError:
            raise MountError(f"bad value for mount option {name}: {value!r}") from None


def parse_tenant_admins(value: str) -> tuple[frozenset[int], frozenset[int]]:
    """Parse `tenant_admins=`'s `USER[:@GROUP...]` (names or numbers) into uids and gids;
    raise MountError naming an unknown user or group."""
    import grp
    import pwd

    uids: set[int] = set()
    gids: set[int] = set()
    for item in value.split(":"):
        group = item.startswith("@")
        name = item[1:] if group else item
        if not name:
            raise MountError(f"tenant_admins: empty entry in {value!r}")
        if name.isdigit():
            (gids if group else uids).add(int(name))
            continue
        try:
            if group:
                gids.add(grp.getgrnam(name).gr_gid)
            else:
                uids.add(pwd.getpwnam(name).pw_uid)
        except KeyError:
            raise MountError(f"tenant_admins: no such {'group' if group else 'user'} "
                             f"{name!r}") from None
    return frozenset(uids), frozenset(gids)


def _int_at_least(value: str, low: int, high: int | None = None) -> int:
    n = int(value)
    if n < low or (high is not None and n > high):
        raise ValueError(value)
    return n
