"""`zonefs-py mount`: mount a zonefs-py filesystem (and the mount(8) helper).

    zonefs-py mount DEVICE MOUNTPOINT [-f] [-o opt,...] [--log-level L] [--log-file P]
    zonefs-py mount --install-helper [DIR]

By default the command daemonizes and returns once the filesystem serves
(exit 0: INIT answered, connection tuned, a statfs answered) or with the
daemon's one-line error (exit 1); the daemon then logs to its log file
(`zonefs_py.daemon.daemonize.default_log_file`). `-f` stays in the
foreground and logs to stderr. The heavy lifting is in `zonefs_py.daemon`.

`mount -t fuse.zonefs-py DEVICE MOUNTPOINT -o ...` and fstab lines such as

    /srv/zns.img  /mnt/zns  fuse.zonefs-py  defaults,noauto,commit=5  0 0

work once the helper is installed: util-linux mount(8) runs
`/sbin/mount.fuse.zonefs-py DEVICE MOUNTPOINT -o OPTIONS` for the type
`fuse.zonefs-py` (its helper search path is /sbin, /sbin/fs.d, /sbin/fs).
`--install-helper` writes that file, bound to this Python interpreter.
`helper_main` is what the helper runs: it drops mount(8)-only options and
calls the same code as `zonefs-py mount`.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

from zonefs_py.daemon import DAEMON_OPTIONS, MountConfig, MountError, run_mount

HELPER_NAME = "mount.fuse.zonefs-py"
DEFAULT_HELPER_DIR = "/sbin"

OPTIONS_HELP = textwrap.dedent("""\
    mount options (-o, comma separated, may repeat):
      FUSE:   ro, allow_other, allow_root, fsname=NAME (default: DEVICE),
              subtype=NAME (default: zonefs-py), noatime/relatime/..., nodev, nosuid, noexec;
              default_permissions is always on (the kernel checks modes).
      engine: commit=S (journal commit interval, default 5),
              checkpoint_mb=N (journal MiB between checkpoints at least, default 64),
              io_threads=N (device calls in flight, default 16),
              cleaner_rate=MB/s (0 disables background cleaning, default 64),
              cleaner_policy=cost-benefit|greedy,
              io_uring=on|off (file reads without worker threads, default on),
              sqpoll_ms=N (io_uring submission polling of reads up to 128 KiB,
                idle time in ms, 0 off, default 2),
              read_latency_ms=MS (read QoS: file-data appends are slowed only while the
                engine's p90 read latency is above MS, 0 off, default 2),
              device_write_mb=N (the device write bandwidth, MB/s, that tenants'
                --write-share and --read-share are shares of; 0, the default: the
                peak append rate seen since mount),
              prefetch_mb=N (device reads kept in flight ahead of a file read
                sequentially, MiB, 0 off, default 8),
              cache_mb=N (memory for the checksums of full zones, read from the
                zones' summary blocks on demand, MiB, default 256),
              inode_cache=N (format 5: inodes kept in memory besides those in use,
                ~1 KiB each, the rest read from the namespace index on use; 0 loads
                every inode at mount; default 131072),
              inline_max=N (files of at most N bytes keep them in the metadata, no
                data block; 0 off, at most 2048, default 512),
              zone_append=auto|on|off (NVMe Zone Append through /dev/ngXnY when the
                device has it, default auto; off: writes at the write pointer; on an
                emulator image only "on" turns on its out-of-order append model),
              format=4|5 (a read-write mount converts a format 2-4 image to format 5,
                the namespace index, when its meta area has room, else keeps it and logs
                why; format=5 fails the mount instead, format=4 keeps format 4).
      daemon: {daemon}
      ignored (fstab): rw, defaults, auto, noauto, _netdev, user, users, nofail, x-*, comment=*.
      mount(8) helper only: log_file=PATH.
    """).replace("{daemon}", "\n          ".join(f"{k}={v}" for k, v in DAEMON_OPTIONS.items()))


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `mount` subcommand."""
    p = subparsers.add_parser(
        "mount", help="mount a zonefs-py filesystem",
        description="Mount the zonefs-py filesystem on DEVICE (a zoned block device or an "
                    "emulator image) at MOUNTPOINT. Unmount with `fusermount3 -u MOUNTPOINT`, "
                    "`umount MOUNTPOINT` or SIGTERM to the daemon.",
        epilog=OPTIONS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("device", nargs="?", metavar="DEVICE")
    p.add_argument("mountpoint", nargs="?", metavar="MOUNTPOINT")
    p.add_argument("-f", "--foreground", action="store_true",
                   help="do not daemonize; log to stderr")
    p.add_argument("-o", dest="options", action="append", default=[], metavar="OPT[,OPT...]",
                   help="mount options (see below)")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper)
    p.add_argument("--log-file", metavar="PATH",
                   help="log here (default: stderr with -f, else "
                        "/var/log/zonefs-py/DEVICE-NAME.log for root, "
                        "~/.local/state/zonefs-py/DEVICE-NAME.log for others)")
    p.add_argument("--install-helper", nargs="?", const=DEFAULT_HELPER_DIR, metavar="DIR",
                   help=f"install {HELPER_NAME} into DIR (default {DEFAULT_HELPER_DIR}) so that "
                        "mount -t fuse.zonefs-py and fstab work, then exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Entry point of `zonefs-py mount`."""
    if args.install_helper:
        return install_helper(args.install_helper)
    if not args.device or not args.mountpoint:
        print("zonefs-py mount: DEVICE and MOUNTPOINT are required", file=sys.stderr)
        return 2
    try:
        cfg = MountConfig.build(args.device, args.mountpoint, args.options,
                                foreground=args.foreground, log_level=args.log_level,
                                log_file=os.path.abspath(args.log_file) if args.log_file
                                else None)
    except MountError as exc:
        print(f"zonefs-py: {exc}", file=sys.stderr)
        return 1
    return run_mount(cfg)


def helper_script() -> str:
    """The text of /sbin/mount.fuse.zonefs-py, bound to the running interpreter."""
    import zonefs_py

    package_root = os.path.dirname(os.path.dirname(os.path.abspath(zonefs_py.__file__)))
    return (f"#!{sys.executable}\n"
            "# mount(8) helper for fuse.zonefs-py, from `zonefs-py mount --install-helper`.\n"
            "import sys\n"
            f"sys.path.insert(0, {package_root!r})\n"
            "from zonefs_py.cli.mount import helper_main\n"
            "sys.exit(helper_main(sys.argv[1:]))\n")


def install_helper(directory: str) -> int:
    """Write the mount(8) helper into `directory`; return an exit status."""
    path = os.path.join(directory, HELPER_NAME)
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            f.write(helper_script())
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
    except OSError as exc:
        print(f"zonefs-py: cannot install {path}: {exc.strerror}", file=sys.stderr)
        return 1
    print(f"installed {path}")
    return 0


def helper_main(argv: list[str]) -> int:
    """Run as mount(8)'s helper: `mount.fuse.zonefs-py DEVICE MOUNTPOINT [-o OPTS] [-snfvrw]`.

    mount(8) passes `-o` with the fstab options, `-t fuse.zonefs-py`, and may
    pass -s (sloppy), -n (no mtab), -f (fake), -v (verbose), -r/-w. Options
    meaningless to the daemon are dropped by `MountConfig.build`.
    """
    p = argparse.ArgumentParser(prog=HELPER_NAME, add_help=True)
    p.add_argument("device")
    p.add_argument("mountpoint")
    p.add_argument("-o", dest="options", action="append", default=[])
    p.add_argument("-t", dest="fstype")
    for flag in ("-s", "-n", "-v", "-f", "-w"):
        p.add_argument(flag, action="store_true")
    p.add_argument("-r", action="store_true", dest="read_only")
    args = p.parse_args(argv)
    if args.f:  # "fake": do everything but the mount
        return 0
    options = list(args.options) + (["ro"] if args.read_only else [])
    log_file = None
    rest = []
    for opt_string in options:
        kept = []
        for item in opt_string.split(","):
            if item.startswith("log_file="):
                log_file = item.partition("=")[2]
            else:
                kept.append(item)
        rest.append(",".join(kept))
    try:
        cfg = MountConfig.build(args.device, args.mountpoint, rest, foreground=False,
                                log_file=log_file)
    except MountError as exc:
        print(f"{HELPER_NAME}: {exc}", file=sys.stderr)
        return 32  # mount(8): "mount failure"
    status = run_mount(cfg)
    return 0 if status == 0 else 32
