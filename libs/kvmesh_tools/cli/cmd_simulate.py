"""``kvmesh simulate``: several routing policies over a trace on a simulated cluster, in virtual time."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from kvmesh.config import ConfigError, add_dataclass_args, load_config

log = logging.getLogger(__name__)

DEFAULT_POLICIES = "precise,approx,session,least_load,round_robin"
DEFAULT_REGIMES = "none,4M,32M"
ENV_PREFIX = "KVMESH_SIM_"
_SUFFIX = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}


def parse_regimes(text: str) -> list[tuple[str, int]]:
    """``none,4M,32M`` -> [("none", 0), ("4M", 4_000_000), ("32M", 32_000_000)] (offload store tokens)."""
    out: list[tuple[str, int]] = []
    for name in (t.strip() for t in text.split(",")):
        if not name:
            continue
        low = name.lower()
        try:
            if low in ("none", "0"):
                cap = 0
            elif low[-1] in _SUFFIX:
                cap = int(float(low[:-1]) * _SUFFIX[low[-1]])
            else:
                cap = int(low)
        except ValueError:
            raise ValueError(f"--regimes: {name!r} is not a store size (none, 512k, 4M, 32000000)") from None
        if cap < 0:
            raise ValueError(f"--regimes: {name!r} is negative")
        out.append((name, cap))
    if not out:
        raise ValueError("--regimes: no regime given")
    if len({n for n, _ in out}) != len(out):
        raise ValueError("--regimes: a regime is named twice")
    return out


def register(sub: argparse._SubParsersAction) -> None:
    from kvmesh_tools.clustersim.config import SimConfig

    p = sub.add_parser("simulate", help="simulate routing policies on a cluster in virtual time",
                       description="Replay a trace through the real router, index, block manager, latency "
                                   "model and offload tier in virtual time; compare policies side by side.")
    p.add_argument("--trace", nargs="+", required=True, metavar="PATH", help="trace files or directories")
    p.add_argument("--format", default="weka", choices=["weka", "claude-code", "mooncake", "native"])
    p.add_argument("--policy", default=DEFAULT_POLICIES, help=f"comma-separated (default {DEFAULT_POLICIES})")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write the report here")
    p.add_argument("--plots", default=None, metavar="DIR", help="PNG plots directory (default: next to --json)")
    p.add_argument("--limit-sessions", type=int, default=None, help="use only the first N sessions")
    p.add_argument("--jobs", type=int, default=None, help="parallel policy processes (default: CPUs)")
    p.add_argument("--no-table", action="store_true", help="do not print the table")
    p.add_argument("--regimes", nargs="?", const=DEFAULT_REGIMES, default=None, metavar="SIZES",
                   help="run every policy once per offload store size, same traces (bare: "
                        f"{DEFAULT_REGIMES}; 'none' = no store); replaces --offload-capacity-tokens")
    add_dataclass_args(p, SimConfig, env_prefix=ENV_PREFIX)   # incl. the nested router scoring flags
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from kvmesh.routing.policy import available_policies
    from kvmesh_tools.clustersim.config import SimConfig
    from kvmesh_tools.clustersim.report import render_table, write_plots
    from kvmesh_tools.clustersim.run import simulate_policies, simulate_regimes
    from kvmesh_tools.traffic.readers import TraceFormatError, load_trace

    try:
        cfg = load_config(SimConfig, args, env_prefix=ENV_PREFIX)
    except ConfigError as exc:
        print(f"error: {exc}")
        return 2
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    known = available_policies()
    bad = [p for p in policies if p not in known]
    if not policies or bad:
        print(f"error: unknown policy {', '.join(bad) or '(none)'}; choose from {', '.join(known)}")
        return 2
    for name in ("decode_workers", "kv_capacity_tokens"):
        if getattr(cfg, name) <= 0:
            print(f"error: --{name.replace('_', '-')} must be > 0")
            return 2
    if cfg.prefill_workers < 0 or cfg.offload_capacity_tokens < 0:
        print("error: --prefill-workers and --offload-capacity-tokens must be >= 0")
        return 2
    try:
        regimes = parse_regimes(args.regimes) if args.regimes is not None else None
        trace = load_trace(args.trace, args.format, limit=args.limit_sessions)
        if regimes is not None:
            report = simulate_regimes(trace, cfg, policies, regimes, jobs=args.jobs)
        else:
            report = simulate_policies(trace, cfg, policies, jobs=args.jobs)
    except (TraceFormatError, ValueError) as exc:
        print(f"error: {exc}")
        return 2
    plots_dir = args.plots or (str(Path(args.json_out).with_suffix("")) + "_plots" if args.json_out else None)
    # One report per regime (a plain run is one regime).
    parts = ([(f"{r['regime']}_", r["report"]) for r in report["regimes"]] if regimes is not None
             else [("", report)])
    if plots_dir:
        for prefix, rep in parts:
            rep["plots"] = [str(p) for p in write_plots(rep, plots_dir, prefix=f"{prefix}simulate")]
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=1, sort_keys=False))
    if not args.no_table:
        for prefix, rep in parts:
            title = "kvmesh simulate"
            if prefix:
                cap = rep["config"]["offload_capacity_tokens"]
                title += f"  regime {prefix[:-1]} ({'no offload' if not cap else f'{cap:,}-token store'})"
            render_table(rep, title=title)
        if args.json_out:
            print(f"report: {args.json_out}")
        for _, rep in parts:
            for p in rep.get("plots", []):
                print(f"plot: {p}")
        if regimes is not None:
            print(f"wall: {report['wall_s']} s")
    return 0
