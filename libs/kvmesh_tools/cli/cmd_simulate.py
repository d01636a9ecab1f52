"""``kvmesh simulate``: several routing policies over a trace on a simulated cluster, in virtual time."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from kvmesh.config import ConfigError, add_dataclass_args, load_config

log = logging.getLogger(__name__)

DEFAULT_POLICIES = "precise,approx,session,least_load,round_robin"
ENV_PREFIX = "KVMESH_SIM_"


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
    add_dataclass_args(p, SimConfig, env_prefix=ENV_PREFIX)   # incl. the nested router scoring flags
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from kvmesh.routing.registry import available_policies
    from kvmesh_tools.clustersim.config import SimConfig
    from kvmesh_tools.clustersim.report import render_table, write_plots
    from kvmesh_tools.clustersim.run import simulate_policies
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
        trace = load_trace(args.trace, args.format, limit=args.limit_sessions)
        report = simulate_policies(trace, cfg, policies, jobs=args.jobs)
    except (TraceFormatError, ValueError) as exc:
        print(f"error: {exc}")
        return 2
    plots_dir = args.plots or (str(Path(args.json_out).with_suffix("")) + "_plots" if args.json_out else None)
    if plots_dir:
        report["plots"] = [str(p) for p in write_plots(report, plots_dir)]
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=1, sort_keys=False))
    if not args.no_table:
        render_table(report)
        if args.json_out:
            print(f"report: {args.json_out}")
        for p in report.get("plots", []):
            print(f"plot: {p}")
    return 0
