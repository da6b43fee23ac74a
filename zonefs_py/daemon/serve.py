"""Serving a mount: device lock, load (recovery), FUSE init, the request loop, shutdown.

`serve_reporting(cfg, report)` is the daemon's whole life after forking (or
in the foreground with `-f`):

  1. take the device lock (`DeviceLock`) and start the state record
     (`RunState`), open the device, enter `ZoneFS.mount` (which runs crash
     recovery, with the cycle collector off, then frozen: `gcpolicy`; and
     owns the engine's task group: chunk pipeline, read-ahead, seals, the
     io_uring reaper), `pyfuse3.init` (the mount(2) call); the device and the
     mount are entered on one AsyncExitStack;
  2. serve: `pyfuse3.main` plus the engine's `serve_background`, a signal
     watcher, the readiness task, the memory trimmer and the cycle
     collector's collect-then-freeze step (`gcpolicy.GcFreezer`) and the
     FALLOCATE / COPY_FILE_RANGE requests (`fuseext.serving`), in one
     trio nursery. The readiness task
     waits for INIT and a STATFS to be answered, tunes the connection, and
     only then calls `report(None)`: `zonefs-py mount` exits 0 only once the
     filesystem serves. A failure before that unmounts, closes the
     filesystem and is reported as one line (traceback in the log);
  3. on `fusermount3 -u` / `umount` (the session ends) or SIGTERM / SIGINT
     (we call `pyfuse3.terminate`), or a lazy unmount that leaves requests
     unanswered: a stop (`stopping.Stopper`), which cancels requests still
     running `stop_grace` seconds later (a handler that never returns no
     longer keeps the daemon alive); unmount, then `fs.close()` (buffered data
     written, journal checkpointed, device flushed; at most
     `stopping.CLOSE_DEADLINE_S`), then the engine's task
     group is cancelled and waited for (leaving `ZoneFS.mount`) and the device
     closed; remove the state record and release (and remove) the lock, exit 0.
     A bug raised by an engine task cancels the whole serve and leaves the
     daemon with it (exit non-zero; the next mount recovers).

Under systemd (`$NOTIFY_SOCKET`, daemon/sdnotify.py) the daemon says
STATUS= while loading, READY=1 at the moment `report(None)` is called,
WATCHDOG=1 and a fresh STATUS= while serving, STOPPING=1 when step 3
begins.

A `kill -9` skips step 3; the next mount's recovery runs. Any
fatal error is written to the log and to the state record, where
`zonefs-py stat` finds it.

TEST HOOK: the environment variable ZONEFS_PY_MOUNT_TEST_FAIL=init|tune makes
the daemon fail on purpose once the kernel mount exists (`init`: before
INIT is answered; `tune`: after the connection was tuned, just before
reporting ready). Tests use it to check that `mount` exits non-zero and the
log holds the traceback; it has no other use. ZONEFS_PY_MOUNT_TEST_FAIL=hang
makes a GETXATTR of `HANG_XATTR` and a FALLOCATE of `HANG_LENGTH` bytes never
return (until cancelled): tests of a stop with a request stuck
(tests/integration/test_stop_stuck.py).

Caveats:
  * After `umount` returns the daemon still runs `fs.close()`; a script that
    wants to reopen the device (fsck) must wait for the daemon to exit (the
    device lock is released last).
  * An exception from the engine's background task puts the mount in
    read-only failsafe instead of ending the daemon.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
import time
from contextlib import AsyncExitStack
from typing import Any

import trio

from zonefs_py import control, errors, fuseext
from zonefs_py.daemon.daemonize import Reporter, logs_to_journal
from zonefs_py.daemon.gcpolicy import GcFreezer
from zonefs_py.daemon.gcpolicy import loading as gc_loading
from zonefs_py.daemon.memtrim import MemoryTrimmer
from zonefs_py.daemon.options import MountConfig, MountError
from zonefs_py.daemon.runstate import DeviceLock, LockHeld, RunState, sweep_stale
from zonefs_py.daemon.sdnotify import Notifier
from zonefs_py.daemon.stopping import CLOSE_DEADLINE_S, Stopper, watch_unmount
from zonefs_py.daemon.tuning import run_write_gate, setup_write_gate, tune_after_init, wait_serving
from zonefs_py.dataplane import wiring as dataplane_wiring
from zonefs_py.progress import progress_printer

log = logging.getLogger("zonefs_py.daemon")

TEST_HOOK_ENV = "ZONEFS_PY_MOUNT_TEST_FAIL"
#: TEST HOOK (=hang): the extended attribute whose GETXATTR never returns.
HANG_XATTR = b"user.zonefs_test.hang"
#: TEST HOOK (=hang): the length of a FALLOCATE that never returns.
HANG_LENGTH = 12345

#: glibc mallopt() parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Allocations below this come from the heap, not a fresh mmap.
MALLOC_MMAP_THRESHOLD = 8 << 20
#: Free memory kept at the top of the heap before it is given back to the kernel.
MALLOC_TRIM_THRESHOLD = 128 << 20


def keep_buffers_warm() -> bool:
    """Make glibc reuse freed 1 MiB request buffers instead of unmapping them.

    pyfuse3 copies every WRITE into a new bytes object, and glibc serves
    blocks of 128 KiB and more (until its dynamic threshold grows) from
    fresh mmaps that are unmapped on free: every request then faults in
    256 new pages. On the 2-vCPU VM we measured, a no-op pyfuse3 server
    that allocates a new 1 MiB object per read drops from ~3 GB/s to
    ~0.6 GB/s. Serving them from the heap and keeping up to
    MALLOC_TRIM_THRESHOLD of freed memory reuses warm pages. It also keeps
    the heap from fragmenting: after a 2 GiB sequential write through the
    mount the daemon's RSS was 150-204 MB with these settings, 344 MB (peak
    445 MB) with glibc's defaults. What a burst leaves free is given back
    once it is over (`memtrim.MemoryTrimmer`, issue 19). Best effort: False
    where the C library has no mallopt (not glibc).
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)
                and mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD))


def serve_reporting(cfg: MountConfig, report: Reporter | None) -> int:
    """Run the daemon; turn a failure into one line (reported, or printed on stderr).

    The traceback of any failure goes to the log and its one-line reason to
    the state record; returns the daemon's exit status.
    """
    if not keep_buffers_warm():
        log.debug("mallopt unavailable: request buffers use the C library's defaults")
    state = RunState(cfg.device, cfg.mountpoint, cfg.log_file)
    state.fields["journal"] = logs_to_journal(cfg.log_file)
    notifier = Notifier()  # systemd's NOTIFY_SOCKET, if set (daemon/sdnotify.py)
    # trio's signal receiver (serve) restores this handler when it closes: a SIGTERM
    # after that (systemd stopping a unit whose umount came first) finds the
    # shutdown done and must not turn the exit into a death by signal.
    signal.signal(signal.SIGTERM, _signal_after_shutdown)
    try:
        status = trio.run(serve, cfg, report or (lambda _err: None), state, notifier)
        if _SHUTDOWN_DONE:
            # Nothing is left to protect: ignore SIGTERM for the rest of the exit.
            # (A Python handler would be reset to the default by the interpreter's
            # own teardown, and a SIGTERM then, e.g. systemd's after `umount`,
            # turned a clean exit into a death by signal: -15.)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except KeyboardInterrupt:
        state.update(state="stopped", last_error="interrupted")
        notifier.status("stopped: interrupted")
        return 130
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, then exits 1
        exc = _unwrap(exc)
        expected = isinstance(exc, MountError | LockHeld | errors.ZoneFSError | OSError)
        if isinstance(exc, MountError | LockHeld):
            msg = str(exc)
        elif expected:
            msg = f"{cfg.device}: {exc}"
        else:
            msg = f"internal error: {type(exc).__name__}: {exc}"
        if report is not None or cfg.log_file or not expected:
            # Into the log file (a bug's traceback also to stderr in the foreground);
            # an expected failure in the foreground without a log file is just one line.
            log.error("mount failed: %s", msg, exc_info=None if expected else exc)
        state.update(state="failed", last_error=msg)
        notifier.status(f"failed: {msg}")
        if report is not None:
            report(msg)
        else:
            print(f"zonefs-py: {msg}", file=sys.stderr)
        return 1
    state.update(state="stopped" if status == 0 else "failed")  # no-op once removed (clean)
    notifier.status("stopped" if status == 0 else "stopped: closing the filesystem failed")
    notifier.close()
    return status


#: Set once `serve` let go of the device lock (all durable that could be): from then
#: on a SIGTERM no longer matters.
_SHUTDOWN_DONE: list[bool] = []


def _signal_after_shutdown(signum: int, _frame: object) -> None:
    """SIGTERM outside trio's receiver: after the shutdown, let the exit finish; before
    the receiver opened (the first instants), die of it as without a handler."""
    if _SHUTDOWN_DONE:
        log.info("%s received after the shutdown: exiting anyway", signal.Signals(signum).name)
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _unwrap(exc: BaseException) -> BaseException:
    """The one exception inside (nested) single-member exception groups from trio nurseries."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _test_hook(point: str) -> None:
    """TEST HOOK (module docstring): fail on purpose at `point` when asked to."""
    if os.environ.get(TEST_HOOK_ENV) == point:
        raise RuntimeError(f"injected failure ({TEST_HOOK_ENV}={point})")


def _arm_hang_hook(ops: Any) -> None:
    """TEST HOOK (module docstring): a GETXATTR of HANG_XATTR (a pyfuse3 request)
    and a FALLOCATE of HANG_LENGTH bytes (a fuseext one) never return."""
    getxattr, fallocate = ops.getxattr, ops.fallocate

    async def hanging_getxattr(inode: int, name: bytes, ctx: Any) -> bytes:
        if name == HANG_XATTR:
            log.info("TEST HOOK: GETXATTR %s never returns", name.decode())
            await trio.sleep_forever()
        return bytes(await getxattr(inode, name, ctx))

    async def hanging_fallocate(ino: int, fh: int, mode: int, offset: int,
                                length: int) -> int:
        if length == HANG_LENGTH:
            log.info("TEST HOOK: FALLOCATE of %d bytes never returns", length)
            await trio.sleep_forever()
        return int(await fallocate(ino, fh, mode, offset, length))

    ops.getxattr = hanging_getxattr
    fuseext.install(hanging_fallocate, ops.copy_file_range)


async def serve(cfg: MountConfig, report: Reporter, state: RunState,
                notifier: Notifier | None = None) -> int:
    """Lock, open, recover, mount and serve until unmounted; return the exit status.

    Setup failures raise (MountError, LockHeld, a ZoneFSError, OSError,
    RuntimeError); `report(None)` is called once the mount serves (and
    systemd told READY=1). A clean exit removes the state record; the lock
    file is removed whenever the lock is let go (daemon/runstate.py, "Tidy").
    """
    notifier = notifier or Notifier({})
    import pyfuse3

    from zonefs_py.device import open_device
    from zonefs_py.fs.filesystem import ZoneFS
    from zonefs_py.fuse_ops import Operations, set_c_write_absorber

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        sweep_stale()
        lock = DeviceLock(cfg.device)
        lock.acquire()
        state.claim(lock)
        clean = False
        try:
            notifier.status(f"loading {cfg.device} (recovery replays the metadata log if the "
                            "last unmount was not clean)")
            # Exits in reverse: the engine's tasks are cancelled and waited for
            # (after its clean close, in _serve_mounted), then the device closes.
            async with AsyncExitStack() as stack:
                device = open_device(cfg.device, read_only=cfg.fs_options.read_only,
                                     zone_append=cfg.fs_options.zone_append)
                stack.callback(device.close)
                log.info("loading %s (recovery runs if the last unmount was not clean)",
                         cfg.device)
                # On a terminal (the caller's, until ready) the replay shows progress.
                with gc_loading():
                    fs = await stack.enter_async_context(ZoneFS.mount(
                        device, cfg.fs_options, progress=progress_printer(
                            "mount: replaying the metadata log", "B")))
                ops = Operations(fs, writeback_cache=cfg.writeback_cache,
                                 attr_timeout_s=cfg.attr_timeout_s,
                                 entry_timeout_s=cfg.attr_timeout_s,
                                 negative_timeout_s=cfg.attr_timeout_s,
                                 stuck_request_s=cfg.stuck_request_s,
                                 tenant_admins=control.TenantDelegates(
                                     cfg.tenant_admin_uids, cfg.tenant_admin_gids))
                if os.environ.get(TEST_HOOK_ENV) == "hang":
                    _arm_hang_hook(ops)
                control.DAEMON_INFO.update(log_file=cfg.log_file, mountpoint=cfg.mountpoint,
                                           uid=os.getuid(), started=time.time(),
                                           journal=logs_to_journal(cfg.log_file),
                                           tenant_admins=ops.tenant_admins.status())
                c_reads = dataplane_wiring.arm_before_init(fs, cfg.fs_options.c_reads)
                try:
                    pyfuse3.init(ops, cfg.mountpoint, cfg.fuse_options)
                except RuntimeError:
                    await fs.close()
                    raise MountError(f"{cfg.mountpoint}: the FUSE mount failed "
                                     "(libfuse's message is above)") from None
                if c_reads and dataplane_wiring.attach_after_init(fs):
                    streams = dataplane_wiring.attach_writes(fs, cfg.fs_options.c_writes)
                    if streams is not None:
                        set_c_write_absorber(streams.absorb)
                log.info("mounted %s on %s (options %s, writeback_cache=%s, max_tasks=%d, "
                         "min_tasks=%d)",
                         cfg.device, cfg.mountpoint, ",".join(sorted(cfg.fuse_options)),
                         cfg.writeback_cache, cfg.max_tasks, cfg.min_tasks)
                status = await _serve_mounted(cfg, fs, ops, signals, report, state, notifier)
                clean = status == 0
                return status
        finally:
            if clean:
                state.remove()
            lock.release(remove=True)
            _SHUTDOWN_DONE.append(True)  # still inside the signal receiver


async def _become_ready(cfg: MountConfig, report: Reporter, state: RunState,
                        failed: list[BaseException], notifier: Notifier, serving: trio.Event,
                        status_line: Any, ops: Any) -> None:
    """Wait until the mount serves, tune it and set up its write gate, then report
    ready (the caller of a daemonizing mount and systemd at the same moment); on
    failure end the loop."""
    import pyfuse3

    try:
        _test_hook("init")
        await wait_serving(cfg, ops.initialized)
        await tune_after_init(cfg)
        await setup_write_gate(cfg, ops)
        _test_hook("tune")
    except Exception as exc:  # noqa: BLE001 - re-raised by _serve_mounted after the unmount
        failed.append(exc)
        pyfuse3.terminate()
        return
    log.info("%s is serving", cfg.mountpoint)
    state.update(state="serving")
    # systemd first: whoever sees `mount` exit 0 finds READY=1 already sent.
    if notifier.enabled:
        try:
            line = status_line()
        except Exception:  # noqa: BLE001 - a status line must never fail the mount
            log.exception("building the systemd status line failed")
            line = f"serving {cfg.mountpoint}"
        notifier.send("READY=1", *([] if cfg.foreground else [f"MAINPID={os.getpid()}"]),
                      "STATUS=" + " ".join(line.split()))
    report(None)
    serving.set()


async def _serve_mounted(cfg: MountConfig, fs: Any, ops: Any, signals: Any,
                         report: Reporter, state: RunState, notifier: Notifier) -> int:
    """Run the FUSE loop, the engine's background work and the signal watcher; shut down."""
    import pyfuse3

    from zonefs_py.fuse_ops import set_c_write_absorber
    from zonefs_py.metrics import start_exporters
    from zonefs_py.statusview import serving_line

    status = 0
    failed: list[BaseException] = []
    serving = trio.Event()

    def status_doc() -> dict[str, Any]:
        return control.status_document(fs, ops.failsafe_reason, ops.status_extra())

    def status_line() -> str:
        return serving_line(status_doc())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(_run_background, fs, ops)
        nursery.start_soon(ops.invalidate_changed)
        nursery.start_soon(run_write_gate, cfg, ops, serving)  # ENOSPC from write(2)
        nursery.start_soon(ops.stuck_requests.run)  # logs requests unanswered too long
        if getattr(fs, "drain", None) is not None:  # uploads to an object store (drain/)
            from zonefs_py.drain.drainer import Drainer

            nursery.start_soon(Drainer(fs.drain).run)
        closing = trio.Event()  # set once the FUSE session is being closed
        stopper = Stopper(nursery, cfg.stop_grace_s, closing, pyfuse3.terminate)
        nursery.start_soon(_watch_signals, signals, stopper)
        nursery.start_soon(watch_unmount, cfg.resolved_mountpoint or cfg.mountpoint, stopper,
                           serving, lambda: _received() + _write_activity(fs))
        nursery.start_soon(_become_ready, cfg, report, state, failed, notifier, serving,
                           status_line, ops)
        nursery.start_soon(notifier.run, serving, status_line)
        nursery.start_soon(MemoryTrimmer(lambda: _write_activity(fs)).run)
        nursery.start_soon(GcFreezer().run)
        nursery.start_soon(dataplane_wiring.feed_qos, fs)
        nursery.start_soon(dataplane_wiring.absorb_writes, fs)
        await start_exporters(
            nursery, cfg.device, cfg.metrics_addr, cfg.metrics_textfile_dir,
            cfg.metrics_interval_s, status_doc)
        try:
            # pyfuse3 ends a task that finds more than min_tasks others waiting
            # for a request, and starts one whenever none waits: with min_tasks=1
            # a queue-depth-16 reader made it start and end a task per request or
            # so (Nursery.start_soon and the idle tasks' lock hand-offs in py-spy).
            # FALLOCATE and COPY_FILE_RANGE requests (fuseext) run in a nursery of
            # their own, inside the stop's cancel scope with pyfuse3's loop: a stop
            # cancels whatever still runs after the grace, while the session is open
            # (an answer after pyfuse3.close would use a freed session).
            with stopper.loop_scope:
                async with trio.open_nursery() as requests:
                    with fuseext.serving(requests):
                        await pyfuse3.main(min_tasks=cfg.min_tasks, max_tasks=cfg.max_tasks)
                    # The session ended: requests still running get the grace.
                    stopper.stop("the FUSE session ended", terminate=False)
            stopper.loop_ended()
        except (OSError, BaseExceptionGroup) as exc:
            # An unmount racing requests still in flight (e.g. RELEASEDIR of many
            # descriptors closed just before fusermount3 -u) aborts the session with
            # ECONNABORTED instead of ENODEV: it ended all the same. (pyfuse3's
            # request tasks may report it wrapped in an exception group.)
            if not _session_aborted(exc):
                raise
            log.info("FUSE session aborted by the unmount (%s)", exc)
        finally:
            # Unmount first so no request can arrive, then make everything durable.
            with trio.CancelScope(shield=True):
                if serving.is_set():
                    notifier.send("STOPPING=1", f"STATUS=unmounting {cfg.mountpoint}: writing "
                                  "buffered data, checkpoint, device flush")
                    state.update(state="stopping")
                closing.set()
                # After a lazy unmount nothing is left to unmount (libfuse would try).
                pyfuse3.close(unmount=not stopper.detached)
                # The dispatcher has stopped: the WRITEs it took go to the engine now.
                set_c_write_absorber(None)
                dataplane_wiring.close_writes(fs)
                log.info("unmounted %s; closing the filesystem", cfg.mountpoint)
                try:
                    with trio.move_on_after(CLOSE_DEADLINE_S) as close_scope:
                        await fs.close()
                    if close_scope.cancelled_caught:
                        log.error("closing the filesystem took over %g s: given up; the next "
                                  "mount will recover", CLOSE_DEADLINE_S)
                        state.update(last_error="closing the filesystem did not finish")
                        status = 1
                except Exception as exc:  # noqa: BLE001 - report, exit non-zero, recover later
                    log.exception("closing the filesystem failed; the next mount will recover")
                    state.update(last_error=f"closing the filesystem failed: {exc}")
                    status = 1
                nursery.cancel_scope.cancel()
                stopper.finished()
    if failed:
        raise failed[0]
    if status == 0:
        log.info("clean shutdown of %s", cfg.device)
    return status


def _write_activity(fs: Any) -> int:
    """Bytes written by users, appended as data and copied by the cleaner (a moving sum)."""
    from zonefs_py.format.constants import C_CLEANER_BYTES, C_DATA_BYTES, C_USER_BYTES

    counters = fs.state.counters
    return sum(counters.get(c, 0) for c in (C_USER_BYTES, C_DATA_BYTES, C_CLEANER_BYTES))


def _session_aborted(exc: BaseException) -> bool:
    """True if `exc` is ECONNABORTED from /dev/fuse, alone or only it in a group."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_session_aborted(e) for e in exc.exceptions)
    return isinstance(exc, OSError) and exc.errno == errno.ECONNABORTED


async def _run_background(fs: Any, ops: Any) -> None:
    """Run the engine's periodic work; a crash there puts the mount in failsafe."""
    try:
        await fs.serve_background()
    except Exception as exc:  # noqa: BLE001 - the failsafe boundary for background work
        ops.failsafe(f"background task failed: {type(exc).__name__}: {exc}", exc)


def _received() -> int:
    """FUSE requests received since the mount (the census; 0 when it is not armed)."""
    return sum(n for name, n in fuseext.census().items()
               if ":" not in name and name != "forgotten_inodes")


async def _watch_signals(signals: Any, stopper: Stopper) -> None:
    """SIGTERM / SIGINT stop the FUSE loop (`Stopper`: then the clean shutdown runs);
    SIGHUP is ignored.

    Once the session is being closed (`closing`: after an unmount, or a first
    SIGTERM) a signal is only logged: the shutdown is under way, and
    `pyfuse3.terminate()` on a closed session crashed the daemon (SIGSEGV,
    seen with systemd's SIGTERM after `umount` of an fstab mount).
    """
    async for signum in signals:
        name = signal.Signals(signum).name
        if signum == signal.SIGHUP:
            log.info("SIGHUP ignored (the daemon has no terminal)")
        elif stopper.closing.is_set() or stopper.reason is not None:
            log.info("%s received while stopping: the clean shutdown goes on", name)
        else:
            log.info("%s received: unmounting", name)
            stopper.stop(name)
