"""`zonefs-py`: the one command-line tool. Each subcommand lives in its own module.

A subcommand module defines `register(subparsers)` that adds its parser and sets
`func` to a callable taking the parsed arguments and returning an exit status.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: Subcommand modules, in the order `--help` lists them.
SUBCOMMANDS = ("emu", "mkfs", "fsck", "mount", "stat", "tenant", "drain", "unit")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zonefs-py",
        description="A log-structured FUSE filesystem for zoned block devices.",
    )
    from zonefs_py import __version__

    parser.add_argument("--version", action="version", version=f"zonefs-py {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"zonefs_py.cli.{name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 16 if args.command is None else 2
    status: int = args.func(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
