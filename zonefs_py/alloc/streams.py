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
            parent = state.inodes.get(d.parent)
            if parent is not None and parent.entries:
                for n, child in parent.entries.items():
                    if child == ino:
                        ckpt_path = bool(_CKPT_WORD.search(n))
                        break
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
