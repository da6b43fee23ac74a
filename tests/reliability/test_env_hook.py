"""The emulator's TEST HOOK for daemons (ZONEFS_PY_EMU_TEST_HOOK, emu_hook.EnvTestHook)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from zonefs_py.device.emu_hook import ENV_HOOK, EnvTestHook
from zonefs_py.device.emulated import EmulatedZonedDevice

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import os, signal, sys, time
from zonefs_py.device import open_device
dev = open_device(sys.argv[1])
dev.append(1, b"F" * 4096)
dev.flush()                      # durable
dev.append(1, b"U" * 4096 * 8)   # acknowledged, never flushed
os.kill(os.getpid(), signal.SIGUSR1)
time.sleep(30)                   # the hook's thread cuts power and SIGKILLs us
sys.exit(3)
"""


def test_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_HOOK, raising=False)
    assert EnvTestHook.from_env() is None
    monkeypatch.setenv(ENV_HOOK, "powercut=tear,seed=7")
    hook = EnvTestHook.from_env()
    assert hook is not None
    assert (hook.powercut, hook.seed, hook.volatile_cache) == ("tear", 7, True)
    monkeypatch.setenv(ENV_HOOK, "cut_after_writes=5")
    hook = EnvTestHook.from_env()
    assert hook is not None
    assert (hook.cut_after_writes, hook.volatile_cache) == (5, False)
    monkeypatch.setenv(ENV_HOOK, "cut_after_writes=9,arm=sigusr2")
    hook = EnvTestHook.from_env()
    assert hook is not None
    assert (hook.cut_after_writes, hook.arm_on_sigusr2) == (9, True)
    monkeypatch.setenv(ENV_HOOK, "powercut=melt")
    with pytest.raises(ValueError, match="bad item"):
        EnvTestHook.from_env()


@pytest.mark.parametrize("mode", ["drop", "tear"])
def test_sigusr1_cuts_power_of_the_process(tmp_path: Path, mode: str) -> None:
    image = tmp_path / "dev.img"
    EmulatedZonedDevice.create(image, size_bytes=8 << 20, zone_size_bytes=1 << 20).close()
    env = dict(os.environ, PYTHONPATH=str(REPO), **{ENV_HOOK: f"powercut={mode},seed=3"})
    proc = subprocess.run([sys.executable, "-c", CHILD, str(image)], env=env, timeout=60,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    with EmulatedZonedDevice.open(image, read_only=True) as dev:
        zone = dev.report_zones(1, 1)[0]
        assert 4096 <= zone.written_bytes <= 9 * 4096  # the flushed block always survives
        if mode == "drop":
            assert zone.written_bytes == 4096
        assert dev.read(zone.start_bytes, 4096) == b"F" * 4096
