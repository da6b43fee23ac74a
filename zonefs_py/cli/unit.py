"""`zonefs-py systemd-unit DEVICE MOUNTPOINT [-o OPTS] [--write DIR]`: a service unit.

Prints (or writes into DIR, e.g. /etc/systemd/system) a `Type=notify` unit
named `zonefs-py-<escaped mount point>.service` that runs `zonefs-py mount
-f DEVICE MOUNTPOINT` with this interpreter and checkout, as the mount(8)
helper is bound (`cli/mount.py`). The daemon tells systemd READY=1 once the
filesystem serves, pings the watchdog, logs to the journal and shuts down
cleanly on the SIGTERM that `systemctl stop` sends (daemon/sdnotify.py,
daemon/serve.py). A device under /dev binds the unit to its device unit;
`drain_*` options order it after network-online.target (the `_netdev` of
a mount unit). `systemd/zonefs-py@.service` in the checkout is the same as
a template for block devices (instance: `systemd-escape -p DEVICE`).

Caveats: the unit names the paths as given (a /dev/disk/by-id/ path is
steadier than /dev/nvme0n2); other services that need the files order
themselves `After=` and `Requires=` this unit (a FUSE mount made by a
service is not a mount unit that `RequiresMountsFor=` could wait for).
"""

from __future__ import annotations

import argparse
import os
import string
import sys

from zonefs_py.daemon.options import parse_option_strings

#: The daemon starts within this (recovery of a large log can take minutes).
START_TIMEOUT = "15min"
#: A clean stop writes a checkpoint and flushes the device.
STOP_TIMEOUT = "10min"
#: The watchdog pings come from the trio loop; a pass that holds the loop for
#: seconds (encoding a checkpoint of millions of files) must not look hung.
WATCHDOG = "2min"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `systemd-unit` subcommand."""
    p = subparsers.add_parser(
        "systemd-unit", help="print or write a systemd service unit for a mount",
        description="Print a systemd service (Type=notify) that mounts DEVICE on MOUNTPOINT "
                    "with `zonefs-py mount -f`, or write it into DIR (--write).")
    p.add_argument("device", metavar="DEVICE")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("-o", dest="options", action="append", default=[], metavar="OPT[,OPT...]",
                   help="mount options, as for `zonefs-py mount`")
    p.add_argument("--write", metavar="DIR",
                   help="write the unit into DIR (e.g. /etc/systemd/system) instead of printing")
    p.set_defaults(func=run)


def escape_path(path: str) -> str:
    """`systemd-escape --path PATH`: '/mnt/zoned' -> 'mnt-zoned'."""
    parts = [p for p in os.path.normpath(path).split("/") if p]
    if not parts:
        return "-"
    allowed = set(string.ascii_letters + string.digits + ":_.")
    out = []
    for i, ch in enumerate("/".join(parts)):
        if ch == "/":
            out.append("-")
        elif ch in allowed and not (i == 0 and ch == "."):
            out.append(ch)
        else:
            out.append("".join(f"\\x{b:02x}" for b in ch.encode()))
    return "".join(out)


def unit_name(mountpoint: str) -> str:
    return f"zonefs-py-{escape_path(os.path.abspath(mountpoint))}.service"


def _quote(arg: str) -> str:
    """One word of an Exec= line (systemd.service(5) quoting; % and $ escaped)."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and not any(c in arg for c in " \t\"'\\;"):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def unit_text(device: str, mountpoint: str, options: list[str]) -> str:
    """The unit for DEVICE on MOUNTPOINT (absolute paths), run by this interpreter."""
    import zonefs_py

    device, mountpoint = os.path.abspath(device), os.path.abspath(mountpoint)
    opts = ",".join(o for o in options if o)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(zonefs_py.__file__)))
    cmd = [sys.executable, "-m", "zonefs_py.cli.main", "mount", "-f", device, mountpoint]
    if opts:
        cmd += ["-o", opts]
    drains = any(name.startswith("drain_") for name in parse_option_strings(options))
    unit = [f"# zonefs-py on {mountpoint}, from `zonefs-py systemd-unit`.",
            f"# Install: zonefs-py systemd-unit ... --write /etc/systemd/system; "
            f"systemctl daemon-reload; systemctl enable --now {unit_name(mountpoint)}",
            "[Unit]",
            f"Description=zonefs-py filesystem {device} on {mountpoint}"]
    if device.startswith("/dev/"):
        dev_unit = escape_path(device) + ".device"
        unit += [f"BindsTo={dev_unit}", f"After={dev_unit}"]
    if drains:  # uploads to an object store: the network first (fstab's _netdev)
        unit += ["Wants=network-online.target", "After=network-online.target"]
    unit += ["",
             "[Service]",
             "Type=notify",
             "NotifyAccess=main",
             f"Environment=PYTHONPATH={_quote(package_root)}",
             "ExecStart=" + " ".join(_quote(a) for a in cmd),
             "# systemctl stop: SIGTERM to the daemon, which unmounts, writes what is",
             "# buffered, checkpoints and flushes before it exits.",
             "KillMode=mixed",
             f"TimeoutStartSec={START_TIMEOUT}",
             f"TimeoutStopSec={STOP_TIMEOUT}",
             f"WatchdogSec={WATCHDOG}",
             "# A daemon that died leaves a dead FUSE connection on the mount point:",
             "# detach it so that the restart can mount again.",
             f"ExecStopPost=-/usr/bin/fusermount3 -u -z {_quote(mountpoint)}",
             "Restart=on-failure",
             "RestartSec=5",
             "",
             "[Install]",
             "WantedBy=multi-user.target",
             ""]
    return "\n".join(unit)


def run(args: argparse.Namespace) -> int:
    """Entry point of `zonefs-py systemd-unit`."""
    text = unit_text(args.device, args.mountpoint, args.options)
    if not args.write:
        print(text, end="")
        return 0
    path = os.path.join(args.write, unit_name(args.mountpoint))
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        print(f"zonefs-py systemd-unit: cannot write {path}: {exc.strerror}", file=sys.stderr)
        return 1
    print(f"wrote {path}; now: systemctl daemon-reload && systemctl enable --now "
          f"{os.path.basename(path)}", file=sys.stderr)
    return 0
