"""The in-memory metadata model: State, Inode, ExtentMap; changed only by `State.apply(op)`.

state.py (State, apply), inode.py (Inode), extents.py, prealloc.py, shared.py,
drain.py (per-file records) and snapshot.py (the checkpoint's listing).
"""
