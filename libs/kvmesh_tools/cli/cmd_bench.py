"""``kvmesh bench NAME --json PATH``: the benchmarks that check speed and memory targets.

Each benchmark is a module in ``kvmesh_tools.bench`` whose ``register(subparsers)``
adds it, listed by name in ``kvmesh_tools.cli.registry.BENCHES``.
``kvmesh bench all --json-dir DIR`` runs each with its defaults.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from kvmesh_tools.cli.registry import BENCHES, add_all

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run benchmarks (writes JSON)")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    add_all(BENCHES, bsub)
    pall = bsub.add_parser("all", help="run every benchmark with its defaults")
    pall.add_argument("--json-dir", default="out/bench")
    pall.set_defaults(func=lambda a: _run_all(a, bsub))
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def _run_all(args: argparse.Namespace, bsub: argparse._SubParsersAction) -> int:
    out = Path(args.json_dir)
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for name, parser in bsub.choices.items():
        if name == "all":
            continue
        sub_args = parser.parse_args(["--json", str(out / f"{name}.json")])
        log.info("running benchmark", extra={"bench": name})
        try:
            rc = sub_args.func(sub_args)
        except Exception:  # noqa: BLE001 - one failing bench must not hide the others
            log.exception("benchmark failed", extra={"bench": name})
            rc = 1
        if rc:
            failed.append(name)
    if failed:
        sys.stderr.write(f"failed benchmarks: {', '.join(failed)}\n")
    return 1 if failed else 0
