"""The single ``kvmesh`` command.

Each subcommand lives in its own module ``kvmesh_tools.cli.cmd_<name>`` exposing
``register(subparsers)``, listed by name in ``kvmesh_tools.cli.registry.COMMANDS``.
A command line naming a command builds that command's parser only: every service the
tests and the launcher start is a ``kvmesh serve`` process, and importing the other
commands' modules (benchmarks, the stack launcher) took a third of its start-up.
"""

from __future__ import annotations

import argparse
import sys

import kvmesh
from kvmesh.logs import setup_logging
from kvmesh_tools.cli.registry import COMMANDS, add_all


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or with ``only`` (a command's name) just that command under it."""
    parser = argparse.ArgumentParser(prog="kvmesh", description="kvmesh: KV-cache-aware serving for agent traffic")
    parser.add_argument("--version", action="version", version=f"kvmesh {kvmesh.__version__}")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (env KVMESH_LOG_LEVEL)")
    parser.add_argument("--log-format", default=None, choices=["json", "text"], help="env KVMESH_LOG_FORMAT")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    if only is None:
        add_all(COMMANDS, sub)
    else:
        COMMANDS.load(only)(sub)
    return parser


def _command_in(argv: list[str]) -> str | None:
    """The command ``argv`` names: its first word that is not an option or an option's value."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word in ("--log-level", "--log-format"):   # the top-level options that take a value
            i += 2
            continue
        if not word.startswith("-"):
            return word if word in COMMANDS else None
        i += 1
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(_command_in(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    setup_logging(level=args.log_level, fmt=args.log_format)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    rc = args.func(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
