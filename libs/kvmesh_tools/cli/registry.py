"""The ``kvmesh`` subcommands and the ``kvmesh bench`` benchmarks by name: their two tables.

Why it exists: the command line is built from these tables, in the one
registry shape kvmesh uses for every pluggable kind (``kvmesh.registry``).
Each name maps to ``(module, "register")``: that module's
``register(subparsers)`` adds the subparser of that name. Adding a command or
a benchmark is its module plus one line here.

The services that ``kvmesh serve`` runs are not listed here: they register
under the ``kvmesh.services`` entry-point group (pyproject.toml), because tools
must never import a service's code by name (tests/test_layout_rules.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvmesh.registry import LazyRegistry

Register = Callable[[argparse._SubParsersAction], None]

COMMANDS: LazyRegistry[Register] = LazyRegistry("kvmesh command", {
    "analyze": ("kvmesh_tools.cli.cmd_analyze", "register"),
    "bench": ("kvmesh_tools.cli.cmd_bench", "register"),
    "certs": ("kvmesh_tools.cli.cmd_certs", "register"),
    "demo": ("kvmesh_tools.cli.cmd_demo", "register"),
    "fuzz": ("kvmesh_tools.cli.cmd_fuzz", "register"),
    "hash": ("kvmesh_tools.cli.cmd_hash", "register"),
    "model": ("kvmesh_tools.cli.cmd_model", "register"),
    "replay": ("kvmesh_tools.cli.cmd_replay", "register"),
    "serve": ("kvmesh_tools.cli.cmd_serve", "register"),
    "simulate": ("kvmesh_tools.cli.cmd_simulate", "register"),
    "soak": ("kvmesh_tools.cli.cmd_soak", "register"),
    "up": ("kvmesh_tools.cli.cmd_up", "register"),
})

BENCHES: LazyRegistry[Register] = LazyRegistry("benchmark", {
    "detokenize": ("kvmesh_tools.bench.detokenize", "register"),
    "events": ("kvmesh_tools.bench.events", "register"),
    "hashing": ("kvmesh_tools.bench.hashing", "register"),
    "hedge": ("kvmesh_tools.bench.hedge", "register"),
    "indexer": ("kvmesh_tools.bench.indexer", "register"),
    "offload": ("kvmesh_tools.bench.offload", "register"),
    "offload-policy": ("kvmesh_tools.bench.offload_policy", "register"),
    "router": ("kvmesh_tools.bench.router", "register"),
    "simulate": ("kvmesh_tools.bench.simulate", "register"),
    "tokenize": ("kvmesh_tools.bench.tokenize", "register"),
    "worker": ("kvmesh_tools.bench.worker", "register"),
})


def add_all(registry: LazyRegistry[Register], sub: argparse._SubParsersAction) -> None:
    """Add every entry's subparser to ``sub``, in name order."""
    for name in registry:
        registry.load(name)(sub)
