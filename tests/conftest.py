"""Fixtures for every test: a test fails on an unexpected WARNING or ERROR log record.

Every record of level WARNING or above from a `zonefs_py` logger, logged while
a test runs (setup, call and teardown, any thread), must be declared by the
test, or the test fails at teardown with the records listed. Declare them

* with the `expect_log` fixture: `expect_log("zonefs_py.fs", "WARNING", "regex")`;
* or with the marker, also as a module's `pytestmark`:
  `@pytest.mark.expect_log("zonefs_py.fs", "ERROR", "regex")`.

A declaration matches records of that logger or its children, of exactly that
level, whose message `re.search`es the pattern. It allows, it does not demand:
a test that must see a record asserts so itself (caplog).

With ZONEFS_LOGCHECK_DUMP=path set, every unexpected record is also appended
to that file (test id, level, logger, message), to list them for a whole run.

Daemons in subprocesses log to their own files; tests/integration/conftest.py
feeds the daemon's log into the same check (`request.getfixturevalue(
"_fail_on_unexpected_log").add_daemon_log(path)`; not imported: pytest loads
this file as `conftest`, an import would make a second copy).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT_LOGGER = "zonefs_py"

#: A daemon log line (daemon/daemonize.py's format): time, level, logger[pid]: message.
_DAEMON_LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (?P<level>[A-Z]+) (?P<name>[\w.]+)\[\d+\]: "
    r"(?P<msg>.*)$")


@dataclass(frozen=True)
class Expected:
    logger: str
    level: str
    pattern: re.Pattern[str]

    def matches(self, name: str, level: str, message: str) -> bool:
        return ((name == self.logger or name.startswith(self.logger + "."))
                and level == self.level and self.pattern.search(message) is not None)


@dataclass
class LogCheck:
    """The WARNING+ records a test logged and the ones it declared."""

    expected: list[Expected] = field(default_factory=list)
    #: (logger, level, message, where) of every WARNING+ record seen.
    seen: list[tuple[str, str, str, str]] = field(default_factory=list)

    def expect(self, logger: str, level: str, pattern: str) -> None:
        level = level.upper()
        if level not in ("WARNING", "ERROR", "CRITICAL"):
            raise ValueError(f"expect_log level {level!r}: WARNING, ERROR or CRITICAL")
        self.expected.append(Expected(logger, level, re.compile(pattern, re.S)))

    def add(self, name: str, level: str, message: str, where: str) -> None:
        self.seen.append((name, level, message, where))

    def add_daemon_log(self, path: Path) -> None:
        """Add the WARNING+ records of a daemon's log file (continuation lines join theirs)."""
        if not path.exists():
            return
        current: list[str] | None = None
        for line in path.read_text(errors="replace").splitlines():
            m = _DAEMON_LINE.match(line)
            if m is None:
                if current is not None:
                    current[2] += "\n" + line  # a traceback under its record
                continue
            if current is not None:
                self.add(*current)  # type: ignore[arg-type]
                current = None
            if (m["level"] in ("WARNING", "ERROR", "CRITICAL")
                    and (m["name"] == ROOT_LOGGER or m["name"].startswith(ROOT_LOGGER + "."))):
                current = [m["name"], m["level"], m["msg"], str(path)]
        if current is not None:
            self.add(*current)  # type: ignore[arg-type]

    def unexpected(self) -> list[tuple[str, str, str, str]]:
        return [rec for rec in self.seen
                if not any(e.matches(rec[0], rec[1], rec[2]) for e in self.expected)]


class _Collector(logging.Handler):
    def __init__(self, check: LogCheck) -> None:
        super().__init__(logging.WARNING)
        self.check = check

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string is itself worth failing on
            message = f"{record.msg!r} % {record.args!r}"
        if record.exc_info and record.exc_info[1] is not None:
            message += f"\n{type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
        self.check.add(record.name, record.levelname, message, "in-process")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "expect_log(logger, level, pattern): the test may log this record "
        "(tests/conftest.py); without it an unexpected WARNING/ERROR fails the test")


@pytest.fixture(autouse=True)
def _fail_on_unexpected_log(request: pytest.FixtureRequest) -> Iterator[LogCheck]:
    check = LogCheck()
    for mark in request.node.iter_markers("expect_log"):
        check.expect(*mark.args, **mark.kwargs)
    logger = logging.getLogger(ROOT_LOGGER)
    handler = _Collector(check)
    old_level = logger.level
    if logger.getEffectiveLevel() > logging.WARNING:
        logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield check
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    bad = check.unexpected()
    dump = os.environ.get("ZONEFS_LOGCHECK_DUMP")
    if bad and dump:  # a list of every test's unexpected records, for a whole-suite run
        with open(dump, "a") as f:
            for name, level, msg, _where in bad:
                f.write(f"{request.node.nodeid}\t{level}\t{name}\t{msg[:300]!r}\n")
    if bad:
        lines = "\n".join(f"  {level} {name} ({where}): {msg}" for name, level, msg, where in bad)
        pytest.fail("unexpected log records (declare expected ones with expect_log, "
                    f"tests/conftest.py):\n{lines}", pytrace=False)


@pytest.fixture
def expect_log(_fail_on_unexpected_log: LogCheck) -> Callable[[str, str, str], None]:
    """Return `expect(logger, level, pattern)`: this test may log such a record."""
    return _fail_on_unexpected_log.expect
