"""``kvmesh simulate``: several routing policies over a trace on a simulated cluster, in virtual time."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, TypeVar

from kvmesh.config import ConfigError, add_dataclass_args, load_config
from kvmesh_tools.cli.trace_args import TraceArgs

log = logging.getLogger(__name__)

DEFAULT_POLICIES = "precise,approx,session,least_load,round_robin"

DEFAULT_REGIMES = "none,4M,32M"
_SUFFIX = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}
T = TypeVar("T")



@dataclass
class SimulateRun(TraceArgs):
    """What one run reads (``--trace`` is required) and writes; the simulated cluster is
    ``SimConfig`` (same env prefix)."""

    ENV_PREFIX: ClassVar[str] = "KVMESH_SIM_"

    policy: str = field(default=DEFAULT_POLICIES, metadata={"help": "routing policies to compare, comma-separated"})
    json: str = field(default="", metadata={"help": "write the report here ('' = do not)", "metavar": "OUT"})
    plots: str = field(default="", metadata={"help": "PNG plots directory ('' = next to --json)", "metavar": "DIR"})
    jobs: int = field(default=0, metadata={"help": "parallel policy processes (0 = one per CPU)"})
    no_table: bool = field(default=False, metadata={"help": "do not print the table"})
    regimes: str = field(default="", metadata={
        "help": "run every policy once per offload store size, same traces, e.g. none,4M,32M "
                "('' = one run with --offload-capacity-tokens)", "metavar": "SIZES"})
    seeds: str = field(default="", metadata={
        "help": "run everything once per seed (e.g. 0-3 or 0,5,9) and print, per regime and policy, the mean hit "
                "rate, the median TTFT percentiles and on how many seeds it had the best of each (the JSON keeps "
                "every run; no plots); '' = one run with --seed", "metavar": "SEEDS"})


def store_size(name: str) -> int:
    """``4M`` -> 4_000_000: one ``--regimes`` entry, an offload store size in tokens (``none`` is 0)."""
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
    return cap


def parse_regimes(text: str, size: Callable[[str], T] = store_size) -> list[tuple[str, T]]:
    """``none,4M,32M`` -> [("none", 0), ("4M", 4_000_000), ("32M", 32_000_000)] (offload store tokens);
    ``size`` reads each entry (``kvmesh bench simulate`` also reads shares of the fleet's GPU)."""
    out = [(name, size(name)) for name in (t.strip() for t in text.split(",")) if name]
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
    add_dataclass_args(p, SimulateRun)
    add_dataclass_args(p, SimConfig)   # incl. the nested router scoring flags
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from kvmesh.routing.pd_split import survival_problem
    from kvmesh.routing.registry import available_policies
    from kvmesh_tools.clustersim.config import SimConfig
    from kvmesh_tools.clustersim.report import render_table, write_plots
    from kvmesh_tools.clustersim.run import simulate_policies, simulate_regimes
    from kvmesh_tools.clustersim.seeds import parse_seeds, simulate_seeds
    from kvmesh_tools.traffic.readers import TraceFormatError, load_trace

    try:
        run = load_config(SimulateRun, args)
        cfg = load_config(SimConfig, args)
    except ConfigError as exc:
        print(f"error: {exc}")
        return 2
    if not run.trace:
        print(f"error: --trace (or env {SimulateRun.ENV_PREFIX}TRACE) is required")
        return 2
    policies = [p.strip() for p in run.policy.split(",") if p.strip()]
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
    if problem := survival_problem(cfg.split_survival_floor, cfg.split_survival_decay):
        print(f"error: {problem}")
        return 2
    try:
        regimes = parse_regimes(run.regimes) if run.regimes else None
        seeds = parse_seeds(run.seeds) if run.seeds else None
        trace = load_trace(run.trace, run.format, limit=run.limit_sessions or None)
        if seeds is not None:
            return _write_seeds(run, simulate_seeds(trace, cfg, policies, seeds, regimes, jobs=run.jobs or None))
        if regimes is not None:
            report = simulate_regimes(trace, cfg, policies, regimes, jobs=run.jobs or None)
        else:
            report = simulate_policies(trace, cfg, policies, jobs=run.jobs or None)
    except (TraceFormatError, ValueError) as exc:
        print(f"error: {exc}")
        return 2
    plots_dir = run.plots or (str(Path(run.json).with_suffix("")) + "_plots" if run.json else None)
    # One report per regime (a plain run is one regime).
    parts = ([(f"{r['regime']}_", r["report"]) for r in report["regimes"]] if regimes is not None
             else [("", report)])
    if plots_dir:
        for prefix, rep in parts:
            rep["plots"] = [str(p) for p in write_plots(rep, plots_dir, prefix=f"{prefix}simulate")]
    _write_json(run, report)
    if not run.no_table:
        for prefix, rep in parts:
            title = "kvmesh simulate"
            if prefix:
                title = _regime_title(prefix[:-1], rep["config"]["offload_capacity_tokens"])
            render_table(rep, title=title)
        if run.json:
            print(f"report: {run.json}")
        for _, rep in parts:
            for p in rep.get("plots", []):
                print(f"plot: {p}")
        if regimes is not None:
            print(f"wall: {report['wall_s']} s")
    return 0


def _write_seeds(run: SimulateRun, report: dict) -> int:
    """``--seeds``: the JSON with every run, and a table per regime of what held across the seeds."""
    from kvmesh_tools.clustersim.report import render_seeds_table

    _write_json(run, report)
    if not run.no_table:
        for agg in report["aggregate"]:
            render_seeds_table(agg, title=_regime_title(agg["regime"], agg["offload_capacity_tokens"]))
        if run.json:
            print(f"report: {run.json}")
        print(f"wall: {report['wall_s']} s")
    return 0


def _write_json(run: SimulateRun, report: dict) -> None:
    if run.json:
        Path(run.json).parent.mkdir(parents=True, exist_ok=True)
        Path(run.json).write_text(json.dumps(report, indent=1, sort_keys=False))


def _regime_title(name: str, cap: int) -> str:
    return f"kvmesh simulate  regime {name} ({'no offload' if not cap else f'{cap:,}-token store'})"
