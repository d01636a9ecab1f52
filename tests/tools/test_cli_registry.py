"""The ``kvmesh`` commands and ``kvmesh bench`` benchmarks come from one table each.

Each entry's ``register`` must add exactly the subparser of its name, and the
command line must offer exactly the table's names (nothing found by scanning).
"""

from __future__ import annotations

import argparse

import pytest

from kvmesh_tools.cli.main import build_parser
from kvmesh_tools.cli.registry import BENCHES, COMMANDS


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub


@pytest.mark.parametrize(("table", "name"), [(t, n) for t in (COMMANDS, BENCHES) for n in t.names()])
def test_every_entry_registers_its_own_name(table, name: str) -> None:  # noqa: ANN001
    sub = argparse.ArgumentParser().add_subparsers()
    table.load(name)(sub)
    assert list(sub.choices) == [name]


def test_the_command_line_offers_exactly_the_tables() -> None:
    parser = build_parser()
    assert list(_subparsers(parser).choices) == COMMANDS.names()
    bench = _subparsers(_subparsers(parser).choices["bench"])
    assert list(bench.choices) == [*BENCHES.names(), "all"]


def test_unknown_command_names_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown kvmesh command 'frobnicate'; choose one of analyze, bench"):
        COMMANDS.load("frobnicate")


def test_a_command_line_naming_a_command_builds_only_that_command() -> None:
    from kvmesh_tools.cli.main import _command_in

    assert _command_in(["--log-level", "DEBUG", "--log-format", "text", "serve", "router", "--port", "1"]) == "serve"
    assert _command_in(["hash", "--help"]) == "hash"
    assert _command_in(["--version"]) is None and _command_in(["frobnicate"]) is None and _command_in([]) is None
    parser = build_parser("serve")
    assert list(_subparsers(parser).choices) == ["serve"]
    args = parser.parse_args(["--log-level", "DEBUG", "serve", "router", "--port", "1"])
    assert (args.command, args.service, args.args, args.log_level) == ("serve", "router", ["--port", "1"], "DEBUG")
