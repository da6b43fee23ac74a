"""`zonefs-py tenant add|set|remove DIR`, `zonefs-py tenant list MOUNTPOINT [--json]`.

* `tenant add DIR [--min-zones N] [--max-zones N] [--active-zones N]` declares
  directory DIR of a mounted zonefs-py a tenant: its data goes only to zones it
  owns, N zones are kept empty for it, it owns at most N zones (its ENOSPC when
  full, while the others still write), and it holds at most N partly written
  zones at once (its share of the device's active-zone budget). DIR must hold
  no file data yet (declare, then copy data in); tenants do not nest.
* `--write-mbps X` / `--write-share PCT` (add and set): cap its file-data
  writes at X MB/s, or at PCT% of the device's write bandwidth, while another
  tenant (or undeclared data) is busy; alone it runs at full speed. One replaces
  the other; 0 clears the cap. `--read-share PCT`: while it reads, everyone
  else's writes together get at most (100-PCT)% of the device's write
  bandwidth; 0 clears it (fs/data/tenantqos.py).
* `tenant set DIR [--min-zones N] [--max-zones N] [--active-zones N] [...]` changes
  what is given.
* `tenant remove DIR`: its zones become shared; its data stays where it is.
* `tenant list MOUNTPOINT [--json]`: the declared tenants and their figures
  (zones owned, reserved and cap, bytes stored, bytes written by users and
  by the cleaner, write amplification, resets and wear of its zones, write and
  read rate, write cap and read share, time throttled).

add/set/remove go, for root, through the control xattr `trusted.zonefs.ctl` of
the mount root (control.py); for the users and groups root allowed with the
mount option `tenant_admins=`, through `user.zonefs.tenant` of DIR itself (they
must be able to write DIR); anyone else is refused (EPERM, with the daemon's
reason). Both return once the change is durable. `--max-zones 0` means no cap.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from typing import Any

from zonefs_py.cli.stat import read_status

CTL_XATTR = "trusted.zonefs.ctl"
#: The tenant commands on a directory itself, for root's delegates (control.py).
TENANT_XATTR = "user.zonefs.tenant"

#: What an errno of a tenant command means, beyond the daemon's own message.
_MEANING = {
    errno.EEXIST: "it is a tenant already (use `zonefs-py tenant set`)",
    errno.ENOTEMPTY: "it holds file data in shared zones: declare tenants on directories "
                     "without file data, then copy the data in",
    errno.EINVAL: "the root, a directory inside or holding another tenant, --max-zones "
                  "below --min-zones, or a bad bandwidth policy",
    errno.ENOSPC: "the reservations do not fit the free zones",
    errno.ENOENT: "it is not a tenant",
    errno.ENOTDIR: "not a directory",
    errno.EPERM: "tenant commands are for root and the users and groups root allows "
                 "(mount option tenant_admins=)",
    errno.EACCES: "you may not write that directory",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `tenant` subcommand and its actions."""
    p = subparsers.add_parser("tenant", help="declare directories as tenants owning zones",
                              description="Declare directories of a mounted zonefs-py as "
                              "tenants: each one's data in zones of its own, with zones "
                              "reserved for it and a cap (docs/DESIGN.md 3.9a).")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, text in (("add", "declare DIR a tenant"), ("set", "change a tenant's policy")):
        q = sub.add_parser(name, help=text)
        q.add_argument("dir", metavar="DIR")
        q.add_argument("--min-zones", type=int, default=None, metavar="N",
                       help="zones kept empty for it (default 0)")
        q.add_argument("--max-zones", type=int, default=None, metavar="N",
                       help="zones it may own at most (default 0: no cap); leave one "
                       "for each stream it writes (checkpoints, datasets, logs, others)")
        q.add_argument("--active-zones", type=int, default=None, metavar="N",
                       help="active (open) zones it may hold at once: its share of the "
                       "device's active-zone budget (default 0: none of its own)")
        cap = q.add_mutually_exclusive_group()
        cap.add_argument("--write-mbps", type=float, default=None, metavar="X",
                         help="cap its writes at X MB/s while others are busy (0: no cap; "
                         "replaces a --write-share)")
        cap.add_argument("--write-share", type=int, default=None, metavar="PCT",
                         help="cap its writes at PCT%% of the device's write bandwidth "
                         "while others are busy (0: no cap; replaces a --write-mbps)")
        q.add_argument("--read-share", type=int, default=None, metavar="PCT",
                       help="while it reads, other writers together get at most "
                       "(100-PCT)%% of the device's write bandwidth (0: none)")
        q.set_defaults(func=run_change)
    q = sub.add_parser("remove", help="remove a tenant (its data stays)")
    q.add_argument("dir", metavar="DIR")
    q.set_defaults(func=run_change)
    q = sub.add_parser("list", help="list the declared tenants of a mount")
    q.add_argument("mountpoint", metavar="MOUNTPOINT")
    q.add_argument("--json", action="store_true", help="print the raw JSON object")
    q.set_defaults(func=run_list)


def mount_root(path: str) -> str:
    """The mount point holding `path` (walking up)."""
    cur = os.path.realpath(path)
    while not os.path.ismount(cur):
        parent = os.path.dirname(cur)
        if parent == cur:
            break
        cur = parent
    return cur


def run_change(args: argparse.Namespace) -> int:
    """`tenant add|set|remove DIR`: one control command, durable when it returns."""
    prog = f"zonefs-py tenant {args.action}"
    for flag in ("min_zones", "max_zones", "active_zones", "write_mbps", "write_share",
                 "read_share"):
        value = getattr(args, flag, None)
        if value is not None and value < 0:
            print(f"{prog}: --{flag.replace('_', '-')} cannot be negative", file=sys.stderr)
            return 2
        if flag.endswith("_share") and value is not None and value > 100:
            print(f"{prog}: --{flag.replace('_', '-')} is a percentage: at most 100",
                  file=sys.stderr)
            return 2
    bandwidth = bandwidth_words(args)
    if bandwidth is None:
        print(f"{prog}: --write-mbps is at least 0.001 (1 kB/s), or 0 for no cap",
              file=sys.stderr)
        return 2
    try:
        st = os.stat(args.dir)
    except OSError as exc:
        print(f"{prog}: {args.dir}: {exc.strerror}", file=sys.stderr)
        return 1
    root = mount_root(args.dir)
    if os.geteuid() != 0:
        return _run_delegated(prog, args, bandwidth)
    if args.action == "add":
        word = (f"tenant-add {st.st_ino} {args.min_zones or 0} {args.max_zones or 0} "
                f"{args.active_zones or 0}")
        if bandwidth:
            word += " " + " ".join("0" if w == "-" else w for w in bandwidth)
    elif args.action == "set":
        def keep(v: int | None) -> str:
            return "-" if v is None else str(v)
        word = (f"tenant-set {st.st_ino} {keep(args.min_zones)} {keep(args.max_zones)} "
                f"{keep(args.active_zones)}")
        if bandwidth:
            word += " " + " ".join(bandwidth)
    else:
        word = f"tenant-remove {st.st_ino}"
    try:
        os.setxattr(root, CTL_XATTR, word.encode())
    except OSError as exc:
        why = _daemon_reason(root) or _MEANING.get(exc.errno or 0, "")
        if exc.errno in (errno.ENODATA, errno.EOPNOTSUPP, errno.ENOTSUP):
            why = f"{root} is not a zonefs-py mount"
        print(f"{prog}: {args.dir}: {exc.strerror}" + (f": {why}" if why else ""),
              file=sys.stderr)
        return 1
    return 0


def bandwidth_words(args: argparse.Namespace) -> list[str] | None:
    """The control command's WKBS WSHARE RSHARE words (`-`: not given), [] when no
    bandwidth option was given, None for a write cap below 1 kB/s (not 0)."""
    mbps = getattr(args, "write_mbps", None)
    share = getattr(args, "write_share", None)
    reads = getattr(args, "read_share", None)
    if mbps is None and share is None and reads is None:
        return []
    kbs = None if mbps is None else round(mbps * 1000)
    if mbps is not None and mbps > 0 and kbs == 0:
        return None
    return ["-" if v is None else str(v) for v in (kbs, share, reads)]


def _run_delegated(prog: str, args: argparse.Namespace, bandwidth: list[str]) -> int:
    """A user who is not root: the command on `user.zonefs.tenant` of DIR itself."""
    def keep(v: int | None, default: str) -> str:
        return default if v is None else str(v)

    if args.action == "remove":
        word = "remove"
    else:
        default = "0" if args.action == "add" else "-"
        word = (f"{args.action} {keep(args.min_zones, default)} "
                f"{keep(args.max_zones, default)} {keep(args.active_zones, default)}")
        if bandwidth:
            word += " " + " ".join(default if w == "-" else w for w in bandwidth)
    try:
        os.setxattr(args.dir, TENANT_XATTR, word.encode())
    except OSError as exc:
        why = _delegate_reason(args.dir) or _MEANING.get(exc.errno or 0, "")
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOTSUP):
            why = f"{args.dir} is not on a zonefs-py mount"
        print(f"{prog}: {args.dir}: {exc.strerror}" + (f": {why}" if why else ""),
              file=sys.stderr)
        return 1
    return 0


def _delegate_reason(directory: str) -> str | None:
    """The daemon's message for this user's last refused tenant command."""
    try:
        doc = json.loads(os.getxattr(directory, TENANT_XATTR))
    except (OSError, ValueError):
        return None
    reason = doc.get("last_error") if isinstance(doc, dict) else None
    return str(reason) if reason else None


def _daemon_reason(root: str) -> str | None:
    """The daemon's message for the last refused control command, if it gives one."""
    try:
        doc = read_status(root)
    except RuntimeError:
        return None
    reason = doc.get("daemon", {}).get("last_control_error")
    return str(reason) if reason else None


def declared(doc: dict[str, Any]) -> dict[str, Any]:
    """The declared tenants of a status document (path -> figures)."""
    return {path: t for path, t in sorted(doc.get("tenants", {}).items())
            if isinstance(t, dict) and t.get("declared")}


def render_list(tenants: dict[str, Any]) -> str:
    """One line per tenant (a header first); empty: a sentence saying so."""
    if not tenants:
        return "no declared tenants\n"
    head = ("tenant", "zones", "reserved", "max", "active", "stored MiB", "users MiB",
            "cleaner MiB", "WA", "wear max/mean", "write MB/s", "read MB/s", "write cap",
            "read share", "throttled s")
    rows = [head]
    for path, t in tenants.items():
        wear = t.get("wear", {})
        wa = t.get("write_amplification")
        rows.append((path or "/", str(t.get("zones_owned", 0)), str(t.get("zones_reserved", 0)),
                     str(t.get("zones_max") or "-"),
                     f"{t.get('active_zones', 0)}/{t.get('active_zones_max') or '-'}",
                     f"{t.get('bytes_stored', 0) / 2**20:.1f}",
                     f"{t.get('device_bytes_written_users', 0) / 2**20:.1f}",
                     f"{t.get('device_bytes_written_cleaner', 0) / 2**20:.1f}",
                     "-" if wa is None else f"{wa:.2f}",
                     f"{wear.get('max', 0)}/{wear.get('mean', 0)}",
                     f"{t.get('write_bytes_per_s', 0) / 1e6:.1f}",
                     f"{t.get('read_bytes_per_s', 0) / 1e6:.1f}",
                     _write_cap_text(t),
                     f"{t['read_share_pct']}%" if t.get("read_share_pct") else "-",
                     f"{t.get('throttled_seconds', 0):.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                   + "\n" for r in rows)


def _write_cap_text(t: dict[str, Any]) -> str:
    if t.get("write_cap_mb_s"):
        return f"{t['write_cap_mb_s']:g} MB/s"
    if t.get("write_share_pct"):
        cap = t.get("write_cap_bytes_per_s")
        return f"{t['write_share_pct']}%" + (f" ({cap / 1e6:.0f} MB/s)" if cap else "")
    return "-"


def run_list(args: argparse.Namespace) -> int:
    """`tenant list MOUNTPOINT [--json]`."""
    try:
        doc = read_status(args.mountpoint)
    except RuntimeError as exc:
        print(f"zonefs-py tenant list: {exc}", file=sys.stderr)
        return 1
    tenants = declared(doc)
    if args.json:
        print(json.dumps(tenants, indent=2, sort_keys=True))
    else:
        print(render_list(tenants), end="")
    return 0
