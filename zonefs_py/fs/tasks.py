"""The background tasks of one mount, owned by one nursery (`MountTasks`).

Every task the engine starts on its own (a streaming write's chunk, a
read-ahead segment, a zone seal or finish, the io_uring reaper) is started
through the mount's `MountTasks`, which every engine object that needs one
receives in its constructor. `ZoneFS.mount` runs it: the nursery opens before
the engine loads and, at the end, the clean close (flush, commit,
checkpoint) runs first, then the nursery is cancelled and waited for. So no
task outlives its mount, and a task that raises a bug reaches the nursery
(then the caller of `ZoneFS.mount`: the daemon's failsafe and exit) instead of
being swallowed.

Nothing runs unowned when the nursery is not open (an engine from
`ZoneFS.load`, which owns no tasks; or a RELEASE after the mount's close):
the users check `is_open` and do the work another way (a chunk is written
inline, a seal waits for `ZoneSealer.wait_idle`, read-ahead and the io_uring
reader are off); `start_soon` itself raises `NoTaskGroup`.

Caveats:
  * Tasks must not swallow `trio.Cancelled`: cancellation at unmount is how
    they end. Those that must leave state consistent when cancelled (a chunk
    that was never written) do so in `finally`/`except Cancelled: ...; raise`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from zonefs_py import errors


class NoTaskGroup(errors.ZoneFSError):
    """A background task was started while its mount's nursery was not open."""


class MountTasks:
    """Start the mount's background tasks in its one nursery (module docstring).

    Has the `start_soon` of a `trio.Nursery`, so the lower layers (the io_uring
    reader) take either.
    """

    def __init__(self) -> None:
        self._nursery: trio.Nursery | None = None

    @property
    def is_open(self) -> bool:
        """True while the nursery runs (between `run()`'s entry and exit)."""
        return self._nursery is not None

    @asynccontextmanager
    async def run(self) -> AsyncIterator[MountTasks]:
        """Own a nursery for this mount's tasks; at the exit cancel and wait for them.

        A lone exception (of the body or of one task) leaves unwrapped, as it would
        without the nursery; several leave as their exception group.
        """
        if self._nursery is not None:
            raise RuntimeError("MountTasks.run() entered twice")
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                try:
                    yield self
                finally:
                    self._nursery = None
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any,
                   name: str | None = None) -> None:
        """Start `fn(*args)` in the mount's nursery. Raises NoTaskGroup when it is not
        open (no await: callers rely on this for their atomicity)."""
        nursery = self._nursery
        if nursery is None:
            raise NoTaskGroup(f"background task {name or fn!r} started with no mount "
                              f"running (use `async with ZoneFS.mount(...)`)")
        nursery.start_soon(fn, *args, name=name)
