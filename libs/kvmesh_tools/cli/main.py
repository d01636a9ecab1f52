"""The single ``kvmesh`` command.

Each subcommand lives in its own module ``kvmesh_tools.cli.cmd_<name>`` exposing
``register(subparsers)``, listed by name in ``kvmesh_tools.cli.registry.COMMANDS``.
"""

from __future__ import annotations

import argparse
import sys

import kvmesh
from kvmesh.logs import setup_logging
from kvmesh_tools.cli.registry import COMMANDS, add_all


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh", description="kvmesh: KV-cache-aware serving for agent traffic")
    parser.add_argument("--version", action="version", version=f"kvmesh {kvmesh.__version__}")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (env KVMESH_LOG_LEVEL)")
    parser.add_argument("--log-format", default=None, choices=["json", "text"], help="env KVMESH_LOG_FORMAT")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_all(COMMANDS, sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(level=args.log_level, fmt=args.log_format)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    rc = args.func(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
