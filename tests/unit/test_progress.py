"""Progress bars: drawn on a terminal only (tqdm), from any thread, closed when done."""

from __future__ import annotations

import io
import threading
import time

import pytest

from zonefs_py import progress


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_silent_without_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    assert progress.progress_printer("resetting zones", "zones") is None
    bar = progress.FileProgress("fetching", ["/nonexistent"])
    calls = []
    bar.run("/nonexistent", calls.append, 1)
    bar.close()
    assert calls == [1]
    assert err.getvalue() == ""


def test_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    err = Tty()
    monkeypatch.setattr("sys.stderr", err)
    show = progress.progress_printer("replaying the log", "B")
    assert show is not None
    workers = [threading.Thread(target=show, args=(n << 20, 8 << 20)) for n in range(1, 8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    show(8 << 20, 8 << 20)
    out = err.getvalue()
    assert "replaying the log: 100%|" in out, out
    assert "8.00M/8.00M" in out
    assert out.endswith("\n")  # closed: the line is ended


def test_file_progress_advances_per_file(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    err = Tty()
    monkeypatch.setattr("sys.stderr", err)
    paths = []
    for i, size in enumerate((3000, 1000)):
        p = tmp_path / f"f{i}"
        p.write_bytes(b"x" * size)
        paths.append(str(p))
    bar = progress.FileProgress("fetching", paths)
    bar.run(paths[0], time.sleep, 0.6)
    assert bar.bar.n == 3000
    with pytest.raises(OSError, match="gone"):
        bar.run(paths[1], _fail)
    bar.close()
    assert "fetching:" in err.getvalue()
    assert "f0" in err.getvalue()  # the file being fetched is named


def _fail() -> None:
    raise OSError("gone")
