"""``kvmesh replay``: drive a running kvmesh stack with a trace (closed loop, real time)."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from kvmesh.config import ConfigError, add_dataclass_args, load_config


def register(sub: argparse._SubParsersAction) -> None:
    from kvmesh_tools.replay.client import ReplayConfig

    p = sub.add_parser("replay", help="replay a trace against a running router (gRPC or OpenAI HTTP)")
    p.add_argument("--trace", nargs="+", default=None, metavar="PATH",
                   help="trace files or directories (default: a generated agent workload)")
    p.add_argument("--format", default="weka", choices=["weka", "claude-code", "mooncake", "native"])
    p.add_argument("--limit-sessions", type=int, default=None, help="use only the first N sessions")
    p.add_argument("--generate-sessions", type=int, default=8, help="sessions of the generated workload")
    p.add_argument("--json", dest="json_out", default="out/replay.json", metavar="OUT", help="report path")
    p.add_argument("--plots", default=None, metavar="DIR", help="PNG directory (default: next to --json)")
    add_dataclass_args(p, ReplayConfig)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from kvmesh_tools.replay.client import ReplayConfig, run_replay
    from kvmesh_tools.replay.plots import write_replay_plots
    from kvmesh_tools.traffic.generator import GeneratorConfig, generate
    from kvmesh_tools.traffic.readers import TraceFormatError, load_trace

    try:
        cfg = load_config(ReplayConfig, args, env_prefix="KVMESH_REPLAY_")
    except ConfigError as exc:
        print(f"error: {exc}")
        return 2
    try:
        if args.trace:
            trace = load_trace(args.trace, args.format, limit=args.limit_sessions)
        else:
            trace = generate(GeneratorConfig(sessions=args.generate_sessions, seed=cfg.seed, turns_median=6,
                                             system_tokens=2048, first_user_tokens=300, growth_median=120,
                                             growth_p99=1500, output_median=24, output_p99=128,
                                             think_median_s=1.0, think_p99_s=20.0, max_context_tokens=12000,
                                             subagent_group_prob=0.2, subagent_system_tokens=1024,
                                             subagent_task_tokens=200, subagent_turns_median=3))
        res = asyncio.run(run_replay(trace, cfg))
    except (TraceFormatError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}")
        return 2
    except KeyboardInterrupt:
        print("interrupted")
        return 130
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plots = write_replay_plots({cfg.policy or "router": res.records}, args.plots or str(out.with_suffix("")) + "_plots")
    report = {"config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}, "metrics": res.metrics,
              "plots": [str(p) for p in plots], "records": res.records}
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(res.metrics, indent=1))
    print(f"report: {out}")
    for p in plots:
        print(f"plot: {p}")
    return 1 if res.metrics["ok"] == 0 else 0
