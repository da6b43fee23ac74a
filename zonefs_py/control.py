"""The control interface: virtual `trusted.zonefs.*` xattrs on the mount root.

A mounted zonefs-py answers these extended attributes on its root directory;
they are not stored anywhere:

  * ``trusted.zonefs.status`` (read, root): compact JSON of `fs.status()` plus
    a ``"daemon"`` object (pid, uid, failsafe reason, log file, metrics
    endpoint). `zonefs-py stat` reads it with getxattr(2).
  * ``user.zonefs.status`` (read): the same document for the user who
    mounted (the daemon's uid) and root; anyone else gets EPERM. This is how
    `zonefs-py stat` works for a user on their own mount.
  * ``trusted.zonefs.ctl`` (write): a command, one ASCII word:
      - ``sync``        make everything acknowledged so far durable (`fs.sync()`).
      - ``checkpoint``  write a journal checkpoint now (`fs.checkpoint()`).
      - ``failsafe``    switch the mount to read-only failsafe (for drills and
                        tests; a remount clears it).
      - ``drain-pause`` / ``drain-resume``  stop / restart uploads to the object
                        store (resume also retries at once after an error).
      - ``tenant-add INO MIN MAX [ACTIVE [WKBS WSHARE RSHARE]]`` /
        ``tenant-set INO MIN MAX [ACTIVE [WKBS WSHARE RSHARE]]`` / ``tenant-remove INO``
                        declare directory inode INO a tenant with MIN reserved, at
                        most MAX zones and at most ACTIVE active zones (0: no cap;
                        ``-`` keeps a value in tenant-set; ACTIVE left out: 0 /
                        kept), a write cap of WKBS kB/s or WSHARE percent of the
                        device's write bandwidth (not both; giving either in
                        tenant-set replaces the cap, 0 clears it) and a read share
                        of RSHARE percent (fs/data/tenantqos.py; left out: none /
                        kept), change or remove it (fs/tenants.py); durable when
                        the setxattr returns. `zonefs-py tenant` writes these.
    Reading it gives ENODATA; unknown commands give EINVAL.
  * ``user.zonefs.tenant`` on any directory (issue 45): the tenant commands for
    that directory, for root and for the users and groups root named with the
    mount option ``tenant_admins=`` (`TenantDelegates`); anyone else gets EPERM.
    Write ``add MIN MAX [ACTIVE]``, ``set MIN MAX [ACTIVE]`` (``-`` keeps a
    value) or ``remove``; durable when the setxattr returns. Read it for JSON:
    ``tenant`` (the directory's figures, as in the status, or null),
    ``may_change`` (whether the caller may run the commands) and ``last_error``
    (the daemon's reason for the caller's last refused command, kept per uid).
    The kernel lets a user set a ``user.`` xattr only on a directory it may
    write (the mount has default_permissions): so a delegate declares and
    changes only directories it can write. `zonefs-py tenant` uses it when not
    run as root.

Why xattrs: no extra socket, no daemon lookup by pid file, works through
the mount point alone, and the kernel already limits the ``trusted.``
namespace to CAP_SYS_ADMIN (non-root getxattr sees ENODATA, setxattr EPERM).
We also check ``ctx.uid == 0`` ourselves, so an unprivileged caller in a user
namespace cannot reach it either. Commands stay root-only even on a user's
own mount (docs/DESIGN.md, "Operating it"), the tenant commands but for the
delegates root named (a daemon not run by root refuses ``tenant_admins=``);
``user.zonefs.status`` and ``user.zonefs.tenant`` cannot be removed, and
``user.zonefs.tenant`` is never stored (a file's own xattr of that name
cannot be set).

Caveats: neither name is listed by listxattr (so `cp -a` / `getfattr -d` do not
copy them); the status JSON must fit the kernel's 64 KiB xattr limit, so
`fs.status()` must stay a summary (E2BIG otherwise).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from zonefs_py import errors
from zonefs_py.fs.api import XATTR_SIZE_MAX, Ctx, FileSystemAPI

STATUS_XATTR = b"trusted.zonefs.status"
USER_STATUS_XATTR = b"user.zonefs.status"
CTL_XATTR = b"trusted.zonefs.ctl"
CONTROL_NAMES = frozenset({STATUS_XATTR, USER_STATUS_XATTR, CTL_XATTR})
COMMANDS = ("sync", "checkpoint", "failsafe", "drain-pause", "drain-resume", "tenant-add",
            "tenant-set", "tenant-remove")
#: Set by the daemon once it serves: log file, mount point, uid, metrics endpoint.
DAEMON_INFO: dict[str, Any] = {}


#: Tenant commands on the directory itself, for root and its delegates (issue 45).
TENANT_XATTR = b"user.zonefs.tenant"
#: uid -> the reason its last tenant command through TENANT_XATTR was refused.
LAST_TENANT_ERROR: dict[int, str] = {}
#: Refusals kept at most (the oldest goes first).
LAST_TENANT_ERRORS_MAX = 256


@dataclass(frozen=True)
class TenantDelegates:
    """Who besides root may run tenant commands (mount option ``tenant_admins=``)."""

    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()

    def allows(self, ctx: Ctx) -> bool:
        """Whether the caller is root, a listed user, or in a listed group (its
        supplementary groups read from /proc, `zonefs_py.caller`)."""
        if ctx.uid == 0 or ctx.uid in self.uids:
            return True
        if not self.gids:
            return False
        groups, _cap = ctx.credentials()
        return ctx.gid in self.gids or not self.gids.isdisjoint(groups)

    def status(self) -> dict[str, list[int]]:
        return {"uids": sorted(self.uids), "gids": sorted(self.gids)}


def is_control_name(name: bytes) -> bool:
    """True for the names this module answers on the root inode."""
    return name in CONTROL_NAMES


def _require_root(ctx: Ctx) -> None:
    if ctx.uid != 0:
        raise errors.NotPermitted("the zonefs-py control xattrs are for root only")


def status_document(fs: FileSystemAPI, failsafe_reason: str | None,
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return the status JSON object: the engine's figures plus the daemon's own, plus
    `extra` (the FUSE adapter's: the request census)."""
    doc: dict[str, Any] = dict(fs.status())
    daemon = dict(doc.get("daemon", {})) if isinstance(doc.get("daemon"), dict) else {}
    daemon.update(DAEMON_INFO)
    daemon.update({"pid": os.getpid(), "failsafe": failsafe_reason})
    doc["daemon"] = daemon
    if extra:
        doc.update(extra)
    return doc


def get(fs: FileSystemAPI, name: bytes, ctx: Ctx, failsafe_reason: str | None,
        extra: dict[str, Any] | None = None) -> bytes:
    """Answer getxattr of a control name. Raises NotPermitted, NoAttribute, ValueTooLarge."""
    if name == USER_STATUS_XATTR:
        if ctx.uid not in (0, os.getuid()):
            raise errors.NotPermitted("the status of this mount is for root and the user "
                                      "who mounted it")
    else:
        _require_root(ctx)
    if name not in (STATUS_XATTR, USER_STATUS_XATTR):
        raise errors.NoAttribute(name.decode(errors="replace"))
    blob = json.dumps(status_document(fs, failsafe_reason, extra), separators=(",", ":"),
                      sort_keys=True, default=str).encode()
    if len(blob) > XATTR_SIZE_MAX:
        raise errors.ValueTooLarge(f"status is {len(blob)} bytes, over the xattr limit")
    return blob


async def command(fs: FileSystemAPI, name: bytes, value: bytes, ctx: Ctx) -> None:
    """Run a command written to `trusted.zonefs.ctl`. Raises NotPermitted, InvalidArgument,
    NotSupported and whatever the engine raises for the command."""
    _require_root(ctx)
    if name != CTL_XATTR:
        raise errors.NotPermitted(f"{name.decode(errors='replace')} is read-only")
    word = value.strip(b"\0 \n").decode("ascii", errors="replace")
    if word.startswith("tenant-"):
        try:
            await tenant_command(fs, word.split())
        except errors.ZoneFSError as exc:
            # The errno alone says little ("Invalid argument"): `zonefs-py tenant`
            # shows this from the status document's daemon object.
            DAEMON_INFO["last_control_error"] = str(exc)
            raise
        DAEMON_INFO.pop("last_control_error", None)
    elif word == "sync":
        await fs.sync()
    elif word == "checkpoint":
        await fs.checkpoint()
    elif word == "failsafe":
        fs.enter_failsafe("requested through trusted.zonefs.ctl")
    elif word in ("drain-pause", "drain-resume"):
        drain = getattr(fs, "drain", None)
        if drain is None:
            raise errors.NotSupported("this filesystem has no drain")
        drain.pause(word == "drain-pause")
    else:
        raise errors.InvalidArgument(f"unknown control command {word!r}; known: {COMMANDS}")


async def tenant_command(fs: FileSystemAPI, words: list[str]) -> None:
    """Run `tenant-add|tenant-set INO MIN MAX [ACTIVE [WKBS WSHARE RSHARE]]` or
    `tenant-remove INO`, then make it durable. Raises InvalidArgument for a malformed
    command, and what fs/tenants.py raises."""
    admin = getattr(fs, "tenants", None)
    if admin is None:
        raise errors.NotSupported("this filesystem has no tenants")
    verb, args = words[0], words[1:]

    def number(text: str, keep: bool = False) -> int | None:
        if keep and text == "-":
            return None
        if not text.isdigit():
            raise errors.InvalidArgument(f"{verb}: {text!r} is not a number")
        return int(text)

    if verb in ("tenant-add", "tenant-set") and len(args) in (3, 4, 7):
        ino = number(args[0])
        assert ino is not None
        if verb == "tenant-add":
            lo, hi = number(args[1]), number(args[2])
            active = number(args[3]) if len(args) >= 4 else 0
            bw = [number(a) or 0 for a in args[4:7]] or [0, 0, 0]
            assert lo is not None
            assert hi is not None
            assert active is not None
            admin.declare(ino, lo, hi, active, write_cap_kbs=bw[0], write_share=bw[1],
                          read_share=bw[2])
        else:
            kept = [number(a, keep=True) for a in args[4:7]] or [None, None, None]
            admin.change(ino, number(args[1], keep=True), number(args[2], keep=True),
                         number(args[3], keep=True) if len(args) >= 4 else None,
                         write_cap_kbs=kept[0], write_share=kept[1], read_share=kept[2])
    elif verb == "tenant-remove" and len(args) == 1:
        ino = number(args[0])
        assert ino is not None
        admin.remove(ino)
    else:
        raise errors.InvalidArgument(f"malformed tenant command {' '.join(words)!r}")
    await fs.sync()


async def tenant_xattr_set(fs: FileSystemAPI, dir_ino: int, value: bytes, ctx: Ctx,
                           delegates: TenantDelegates) -> None:
    """Run a tenant command written to `user.zonefs.tenant` of directory `dir_ino`.
    Raises NotPermitted (not root nor a delegate), InvalidArgument, and what
    `tenant_command` raises; the reason is kept for the caller (`tenant_xattr_get`)."""
    words = value.strip(b"\0 \n").decode("ascii", errors="replace").split()
    try:
        if not delegates.allows(ctx):
            raise errors.NotPermitted(
                f"uid {ctx.uid} may not declare or change tenants: root may allow users "
                "and groups with the mount option tenant_admins=USER:@GROUP")
        if not words or words[0] not in ("add", "set", "remove"):
            raise errors.InvalidArgument(
                f"{TENANT_XATTR.decode()}: write 'add MIN MAX [ACTIVE [WKBS WSHARE "
                f"RSHARE]]', 'set ...' (the same, '-' keeps a value) or 'remove', not "
                f"{' '.join(words)!r}")
        await tenant_command(fs, [f"tenant-{words[0]}", str(dir_ino), *words[1:]])
    except errors.ZoneFSError as exc:
        LAST_TENANT_ERROR.pop(ctx.uid, None)
        LAST_TENANT_ERROR[ctx.uid] = str(exc)
        while len(LAST_TENANT_ERROR) > LAST_TENANT_ERRORS_MAX:
            del LAST_TENANT_ERROR[next(iter(LAST_TENANT_ERROR))]
        raise
    LAST_TENANT_ERROR.pop(ctx.uid, None)


def tenant_xattr_get(fs: FileSystemAPI, dir_ino: int, ctx: Ctx,
                     delegates: TenantDelegates) -> bytes:
    """Answer getxattr of `user.zonefs.tenant`: the directory's tenant figures (or
    null), whether the caller may change tenants, and its last refusal."""
    figures: dict[str, Any] | None = None
    admin = getattr(fs, "tenants", None)
    tid = admin.state.tenants.by_dir.get(dir_ino) if admin is not None else None
    if admin is not None and tid is not None:
        figures = next((f for f in admin.report().values() if f.get("tenant_id") == tid),
                       None)
    return json.dumps({"tenant": figures, "may_change": delegates.allows(ctx),
                       "last_error": LAST_TENANT_ERROR.get(ctx.uid)},
                      separators=(",", ":"), sort_keys=True, default=str).encode()
