"""The in-memory metadata model: State, Inode, ExtentMap; changed only by `State.apply(op)`."""
