"""TEST HOOK: arm an emulator opened by a separate process (the mount daemon).

`open_device` reads `ZONEFS_PY_EMU_TEST_HOOK` for emulator images and, when it
is set, opens the image as asked and installs the hook (see `EnvTestHook`).
Crash-torture runs (tests/torture) set it; users never should.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from zonefs_py.device.emulated import EmulatedZonedDevice

#: Environment variable read by `open_device` for emulator images. TEST HOOK: ignored unless set.
ENV_HOOK = "ZONEFS_PY_EMU_TEST_HOOK"


@dataclass(slots=True)
class EnvTestHook:
    """What `ZONEFS_PY_EMU_TEST_HOOK` asks of an emulator opened by a daemon (TEST HOOK).

    The value is comma-separated `key=value` items:
      * ``powercut=drop|tear``: open with `volatile_cache=True`; on SIGUSR1 a
        thread runs `simulate_power_cut(mode, Random(seed))` and then the
        process SIGKILLs itself, so a test can cut power of a running daemon
        (a plain SIGKILL loses no write the emulator acknowledged).
      * ``seed=N``: seed of the tear (default 0).
      * ``cut_after_writes=N``: the device dies after N mutating calls, counted
        from open, or (with ``arm=sigusr2``) from when the process gets SIGUSR2,
        so that a test can let mount and recovery finish first.
    Crash-torture runs (tests/torture) set it; users never should.
    """

    powercut: str | None = None
    seed: int = 0
    cut_after_writes: int | None = None
    arm_on_sigusr2: bool = False

    @classmethod
    def from_env(cls) -> EnvTestHook | None:
        """Parse the variable; None when unset or empty. Raises ValueError for a bad value."""
        import os

        spec = os.environ.get(ENV_HOOK, "").strip()
        if not spec:
            return None
        hook = cls()
        for item in spec.split(","):
            key, _, value = item.strip().partition("=")
            if key == "powercut" and value in ("drop", "tear"):
                hook.powercut = value
            elif key == "seed":
                hook.seed = int(value)
            elif key == "cut_after_writes":
                hook.cut_after_writes = int(value)
            elif key == "arm" and value == "sigusr2":
                hook.arm_on_sigusr2 = True
            else:
                raise ValueError(f"{ENV_HOOK}: bad item {item!r}")
        return hook

    @property
    def volatile_cache(self) -> bool:
        return self.powercut is not None

    def install(self, dev: EmulatedZonedDevice) -> None:
        """Arm the hooks on a freshly opened device (SIGUSR1 only from the main thread)."""
        import logging
        import os
        import random
        import signal

        main = threading.current_thread() is threading.main_thread()
        count = self.cut_after_writes
        if count is not None and self.arm_on_sigusr2 and main:

            def arm(_signum: int, _frame: object) -> None:
                threading.Thread(target=dev.faults.cut_after_writes, args=(count,),
                                 name="emu-arm-cut", daemon=True).start()

            signal.signal(signal.SIGUSR2, arm)
        elif count is not None:
            dev.faults.cut_after_writes(count)
        if self.powercut is None or not main:
            return
        mode = self.powercut
        rng = random.Random(self.seed)

        def cut_and_die() -> None:
            try:
                dev.simulate_power_cut(mode, rng)  # type: ignore[arg-type]
                logging.getLogger(__name__).warning("TEST HOOK: power cut (%s)", mode)
            finally:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_sigusr1(_signum: int, _frame: object) -> None:
            threading.Thread(target=cut_and_die, name="emu-power-cut", daemon=True).start()

        signal.signal(signal.SIGUSR1, on_sigusr1)
