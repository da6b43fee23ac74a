"""Who sent a FUSE request, beyond what its header says: supplementary groups and
CAP_FSETID, read from /proc when a rule needs them.

A FUSE request header carries the caller's fsuid, fsgid and thread id, not its
supplementary groups or capabilities. The kill-priv rule (DESIGN 4.1a) needs both
for a file with a set-ID bit: setgid stays when the writer is in the file's group,
and nothing is cleared for a writer holding CAP_FSETID. `proc_credentials` reads
them from /proc/<tid>/status; the adapter hands it to the engine inside `Ctx`
(`Ctx.credentials`), so the read happens only for requests on set-ID files.

Caveat: the caller may be gone by the time we read (its request was answered
after it died, or the kernel sent the request on its own: pid 0); then only the
header is known: the groups are the fsgid alone and uid 0 holds CAP_FSETID.
A thread id reused by another process in between would be read as the caller:
the window is one request, and the fallback is no more lenient than the header.
"""

from __future__ import annotations

#: Capability number of CAP_FSETID (linux/capability.h).
CAP_FSETID = 4


def proc_credentials(pid: int, uid: int, gid: int) -> tuple[tuple[int, ...], bool]:
    """Return (supplementary groups with `gid`, holds CAP_FSETID) of thread `pid`."""
    fallback = (gid,), uid == 0
    if pid <= 0:
        return fallback
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read()
    except OSError:
        return fallback
    groups: tuple[int, ...] | None = None
    cap_eff: int | None = None
    for line in text.splitlines():
        if line.startswith(b"Groups:"):
            groups = tuple(int(g) for g in line[7:].split())
        elif line.startswith(b"CapEff:"):
            cap_eff = int(line[7:].strip(), 16)
    if groups is None or cap_eff is None:
        return fallback
    return (gid, *groups), bool(cap_eff >> CAP_FSETID & 1)
