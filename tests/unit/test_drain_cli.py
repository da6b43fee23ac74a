"""`zonefs-py drain status --wait`: waits until nothing is queued or uploading, draws a
progress bar only on a terminal, gives up (exit 1) on a credentials error. The mount's
status is faked (a sequence of drain sections); the real mount is in
tests/integration/test_drain_s3.py."""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from zonefs_py.cli import drain as cli

MiB = 1 << 20


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def statuses(*drains: dict[str, Any]) -> Iterator[dict[str, Any]]:
    last: dict[str, Any] = {}
    for d in drains:
        last = {"drain": d}
        yield last
    while True:
        yield last


def fake_mount(monkeypatch: pytest.MonkeyPatch, *drains: dict[str, Any]) -> None:
    it = statuses(*drains)
    monkeypatch.setattr(cli, "read_status", lambda _mnt: next(it))
    monkeypatch.setattr(cli, "WAIT_POLL_S", 0.0)


BUSY = {"queue_files": 1, "queue_bytes": 64 * MiB, "uploading_files": 1,
        "uploading": "/ck/a.pt", "uploading_bytes": 64 * MiB, "bytes_uploaded": 0}
HALF = {**BUSY, "queue_files": 0, "queue_bytes": 0, "bytes_uploaded": 64 * MiB}
DONE = {"queue_files": 0, "queue_bytes": 0, "uploading_files": 0, "uploading": None,
        "uploading_bytes": 0, "bytes_uploaded": 128 * MiB}


def test_wait_is_silent_without_a_terminal(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    fake_mount(monkeypatch, BUSY, HALF, DONE)
    assert cli.wait_drained("/mnt") is True
    assert capsys.readouterr().err == ""


def test_wait_draws_progress_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_mount(monkeypatch, BUSY, HALF, DONE)
    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert cli.wait_drained("/mnt") is True
    out = tty.getvalue()
    assert "drain" in out
    assert "100%" in out  # 128 MiB of 128 MiB at the end


def test_wait_gives_up_on_a_credentials_error(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    fake_mount(monkeypatch, BUSY, {**BUSY, "auth_error": "403 InvalidAccessKeyId"})
    assert cli.wait_drained("/mnt") is False
    assert "refuses the credentials" in capsys.readouterr().err
