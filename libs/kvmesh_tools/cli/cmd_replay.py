"""``kvmesh replay``: drive a running kvmesh stack with a trace (closed loop, real time)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kvmesh.config import ConfigError, add_dataclass_args, load_config
from kvmesh_tools.cli.trace_args import TraceArgs


@dataclass
class ReplayRun(TraceArgs):
    """What one run reads and writes; how it drives the router is ``ReplayConfig`` (same env prefix)."""

    ENV_PREFIX: ClassVar[str] = "KVMESH_REPLAY_"

    generate_sessions: int = field(default=8, metadata={
        "help": "without --trace: sessions of the generated agent workload replayed instead"})
    json: str = field(default="out/replay.json", metadata={"help": "report path", "metavar": "OUT"})
    plots: str = field(default="", metadata={"help": "PNG directory ('' = next to --json)", "metavar": "DIR"})


def register(sub: argparse._SubParsersAction) -> None:
    from kvmesh_tools.replay.client import ReplayConfig

    p = sub.add_parser("replay", help="replay a trace against a running router (gRPC or OpenAI HTTP)")
    add_dataclass_args(p, ReplayRun)
    add_dataclass_args(p, ReplayConfig)
    p.set_defaults(func=_run)


def report_config(cfg: Any) -> dict[str, Any]:
    """The run's settings as the report keeps them: nested settings (TLS) as objects, and the API
    key only as whether one was given (a report is shared; the key is a credential)."""
    out = dataclasses.asdict(cfg)
    out["api_key"] = "(set)" if cfg.api_key else ""
    return out


def _run(args: argparse.Namespace) -> int:
    from kvmesh_tools.replay.client import ReplayConfig, run_replay
    from kvmesh_tools.replay.plots import write_replay_plots
    from kvmesh_tools.traffic.generator import GeneratorConfig, generate
    from kvmesh_tools.traffic.readers import TraceFormatError, load_trace

    try:
        run = load_config(ReplayRun, args)
        cfg = load_config(ReplayConfig, args)
    except ConfigError as exc:
        print(f"error: {exc}")
        return 2
    try:
        if run.trace:
            trace = load_trace(run.trace, run.format, limit=run.limit_sessions or None)
        else:
            trace = generate(GeneratorConfig(sessions=run.generate_sessions, seed=cfg.seed, turns_median=6,
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
    out = Path(run.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    plots = write_replay_plots({cfg.policy or "router": res.records}, run.plots or str(out.with_suffix("")) + "_plots")
    report = {"config": report_config(cfg), "metrics": res.metrics,
              "plots": [str(p) for p in plots], "records": res.records}
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(res.metrics, indent=1))
    print(f"report: {out}")
    for p in plots:
        print(f"plot: {p}")
    return 1 if res.metrics["ok"] == 0 else 0
