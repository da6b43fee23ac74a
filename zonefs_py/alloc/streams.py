"""Which lifetime stream a new file's data goes to (docs/DESIGN.md "Streams").

Rules, first match wins, decided when the file is created:

1. The nearest directory (the parent, then its ancestors) carrying the xattr
   `user.zonefs.stream` names the stream (`checkpoint`, `dataset`, `log`,
   `scratch` or `default`). New subdirectories inherit it by this lookup.
2. The file name:
   * `.pt .pth .ckpt .safetensors .distcp .bin` in a checkpoint-looking path
     (a path component containing `ckpt` or `checkpoint`, or the name itself)
     -> checkpoint; temp names inside such a path also -> checkpoint, since
     checkpointers write a temp file and rename it into place;
   * `.tar .parquet .arrow .npy .npz .tfrecord .tfrecords .idx .rec`, and
     shard patterns (`shard-00001`, `part-00000`, `train-00012-of-00100`)
     -> dataset;
   * `*.log`, `*.log.N`, TensorBoard `events.out.tfevents.*` -> log;
   * temp names (`*.tmp`, `*.temp`, `*.swp`, `~*`, `tmp*`, `.#*`) -> scratch.
3. Otherwise default.
"""

from __future__ import annotations

import re

from zonefs_py.format.constants import Stream
from zonefs_py.model.state import State

STREAM_XATTR = b"user.zonefs.stream"
STREAM_NAMES = {
    b"default": Stream.DEFAULT,
    b"checkpoint": Stream.CHECKPOINT,
    b"dataset": Stream.DATASET,
    b"log": Stream.LOG,
    b"scratch": Stream.SCRATCH,
}
_CKPT_EXT = (b".pt", b".pth", b".ckpt", b".safetensors", b".distcp", b".bin")
_DATA_EXT = (b".tar", b".parquet", b".arrow", b".npy", b".npz", b".tfrecord", b".tfrecords",
             b".idx", b".rec")
_SHARD = re.compile(rb"(shard|part|train|val|test|valid)[-_.]?\d{3,}", re.IGNORECASE)
_LOG = re.compile(rb"(\.log(\.\d+)?$)|(^events\.out\.tfevents\.)")
_TEMP = re.compile(rb"(\.(tmp|temp|swp|part)$)|(^~)|(^tmp)|(^\.#)|(\.tmp\.)", re.IGNORECASE)
_CKPT_WORD = re.compile(rb"ckpt|checkpoint", re.IGNORECASE)
#: Ancestors examined for stream xattrs and checkpoint-looking names.
MAX_DEPTH = 64


def parse_stream_name(value: bytes) -> int:
    """Return the stream id for an xattr value; raise ValueError for an unknown name."""
    try:
        return STREAM_NAMES[value.strip().lower()]
    except KeyError:
        names = ", ".join(n.decode() for n in STREAM_NAMES)
        raise ValueError(f"unknown stream {value!r} (one of: {names})") from None


def classify(state: State, parent_ino: int, name: bytes) -> int:
    """Return the stream for a new file `name` in directory `parent_ino`."""
    ckpt_path = False
    ino = parent_ino
    for _ in range(MAX_DEPTH):
        d = state.inodes.get(ino)
        if d is None:
            break
        if d.xattrs and STREAM_XATTR in d.xattrs:
            try:
                return parse_stream_name(d.xattrs[STREAM_XATTR])
            except ValueError:
                pass
        if not ckpt_path and d.parent:
            n = _name_of(state, d.parent, ino)
            if n is not None:
                ckpt_path = bool(_CKPT_WORD.search(n))
        if ino == d.parent or not d.parent:
            break
        ino = d.parent
    lower = name.lower()
    if _LOG.search(lower):
        return Stream.LOG
    if ckpt_path or (_CKPT_WORD.search(lower)
                     and (lower.endswith(_CKPT_EXT) or _TEMP.search(lower))):
        return Stream.CHECKPOINT
    if lower.endswith(_DATA_EXT) or _SHARD.search(lower):
        return Stream.DATASET
    if _TEMP.search(lower):
        return Stream.SCRATCH
    return Stream.DEFAULT


def classify_stream(state: State, inode: object) -> int:
    """Fallback for files whose stream was not decided at creation."""
    return Stream.DEFAULT


#: Directory names `_name_of` remembers at most (then it starts over).
_NAME_HINTS_MAX = 4096


def _name_of(state: State, parent_ino: int, ino: int) -> bytes | None:
    """A name of directory `ino` in `parent_ino` (its parent), or None. Found by
    scanning the parent's names once, then remembered in `State.name_hints`
    until a name op names the directory (a lazy directory's scan reads the
    index, and format 4's went over every sibling per create)."""
    hints = state.name_hints
    hit = hints.get(ino)
    if hit is not None and hit[0] == parent_ino:
        return hit[1]
    parent = state.inodes.get(parent_ino)
    if parent is None or not parent.entries:
        return None
    for n, child in parent.entries.items():
        if child == ino:
            if len(hints) >= _NAME_HINTS_MAX:
                hints.clear()
            hints[ino] = (parent_ino, n)
            return n
    return None
