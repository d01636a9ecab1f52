"""``kvmesh serve SERVICE [ARGS...]``: run one service in the foreground.

Services register under the ``kvmesh.services`` entry-point group
(pyproject.toml), so this command finds them without importing any service
module by name. This is the one kind that is not a ``kvmesh.registry`` table
(``kvmesh_tools.cli.registry`` holds the commands): a table here would name
service modules from the tools package, which the layer rules forbid
(tests/test_layout_rules.py).
"""

from __future__ import annotations

import argparse
from importlib.metadata import entry_points


def available_services() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group="kvmesh.services")}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run one service (router, indexer, prefill, decode, offload)",
                       add_help=False)
    p.add_argument("service", nargs="?", help="service name")
    p.add_argument("args", nargs=argparse.REMAINDER, help="service flags (see `kvmesh serve SERVICE --help`)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    services = available_services()
    if not args.service or args.service not in services:
        names = ", ".join(sorted(services)) or "(none installed)"
        print(f"usage: kvmesh serve SERVICE [flags]; services: {names}")
        return 2
    fn = services[args.service].load()
    return int(fn(args.args) or 0)
