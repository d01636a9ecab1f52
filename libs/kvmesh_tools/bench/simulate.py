"""``kvmesh bench simulate --json PATH``: how far the cluster simulator scales.

A platform team sizing a 544-GPU class fleet asks the simulator about thousands
of concurrent agent sessions on hundreds of workers. This benchmark generates
that workload (seeded, the published Claude Code statistics, fewer turns per
session to keep it to minutes), runs it through ``simulate`` on the large
cluster, and as the same-run baseline the same load per worker on the issue's
8 + 2 workers (proportionally fewer sessions): the wall time per request on the
large cluster over the baseline's says what the size of the cluster costs,
apart from the machine's speed.
"""

from __future__ import annotations

import argparse
import logging
import resource
import time
from typing import Any

from kvmesh_tools.bench.common import write_json

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="cluster simulator at fleet scale (sessions x workers)")
    p.add_argument("--json", default=None)
    p.add_argument("--sessions", type=int, default=1000, help="generated agent sessions")
    p.add_argument("--turns-median", type=int, default=8, help="median main-agent turns per session")
    p.add_argument("--start-window-s", type=float, default=600.0, help="sessions start within this window")
    p.add_argument("--decode-workers", type=int, default=512)
    p.add_argument("--prefill-workers", type=int, default=32)
    p.add_argument("--baseline-decode-workers", type=int, default=8)
    p.add_argument("--baseline-prefill-workers", type=int, default=2)
    p.add_argument("--policy", default="precise")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def peak_concurrent_sessions(records: list[dict[str, Any]]) -> int:
    """Most sessions active at once, a session being active from its first request's release
    to its last request's first token."""
    span: dict[str, list[float]] = {}
    for r in records:
        session = r["uid"].split("/", 1)[0]
        start, end = r["release_s"], r["release_s"] + (r["ttft_s"] or 0.0)
        s = span.setdefault(session, [start, end])
        s[0], s[1] = min(s[0], start), max(s[1], end)
    edges = sorted([(a, 1) for a, _ in span.values()] + [(b, -1) for _, b in span.values()])
    live = peak = 0
    for _, d in edges:
        live += d
        peak = max(peak, live)
    return peak


def _one(trace, decode: int, prefill: int, args: argparse.Namespace) -> dict[str, Any]:
    from kvmesh_tools.clustersim.config import SimConfig
    from kvmesh_tools.clustersim.run import simulate_policies

    cfg = SimConfig(decode_workers=decode, prefill_workers=prefill, start_window_s=args.start_window_s,
                    seed=args.seed)
    t0 = time.perf_counter()
    rep = simulate_policies(trace, cfg, [args.policy], jobs=1, records=True)
    wall = time.perf_counter() - t0
    m = rep["results"][args.policy]
    out = {k: m[k] for k in ("requests", "errors", "prefix_hit_rate", "ttft_p50_s", "ttft_p90_s",
                             "load_imbalance", "virtual_time_s", "steps", "offload_blocks_stored",
                             "offload_evictions")}
    out.update(workers=decode + prefill, decode_workers=decode, prefill_workers=prefill, wall_s=round(wall, 2),
               ms_per_request=round(1000 * wall / max(1, m["requests"]), 3),
               virtual_s_per_wall_s=round(m["virtual_time_s"] / wall, 1) if wall > 0 else 0.0,
               peak_concurrent_sessions=peak_concurrent_sessions(rep["records"][args.policy]))
    log.info("simulated", extra={k: out[k] for k in ("workers", "requests", "wall_s", "peak_concurrent_sessions")})
    return out


def run(args: argparse.Namespace) -> int:
    from kvmesh_tools.traffic.generator import GeneratorConfig, generate

    def trace_of(sessions: int):
        return generate(GeneratorConfig(sessions=sessions, turns_median=args.turns_median, seed=args.seed))

    share = (args.baseline_decode_workers + args.baseline_prefill_workers) / (args.decode_workers
                                                                            + args.prefill_workers)
    base_sessions = max(1, round(args.sessions * share))
    # The baseline first, on a small heap (after the large run, its garbage would be in the
    # measurement); it is short, so the median of three runs.
    base_trace = trace_of(base_sessions)
    bases = sorted((_one(base_trace, args.baseline_decode_workers, args.baseline_prefill_workers, args)
                    for _ in range(3)), key=lambda r: r["ms_per_request"])
    base = bases[1]
    base.update(sessions=base_sessions, ms_per_request_runs=[b["ms_per_request"] for b in bases])
    t0 = time.perf_counter()
    trace = trace_of(args.sessions)
    gen_s = time.perf_counter() - t0
    large = _one(trace, args.decode_workers, args.prefill_workers, args)
    # Peak resident memory of this process: the large run dominates it.
    large["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    out = write_json(args.json, {
        "bench": "simulate", "policy": args.policy, "sessions": args.sessions, "seed": args.seed,
        "generate_s": round(gen_s, 2), "large": large, "baseline": base,
        "wall_s": large["wall_s"],
        "ms_per_request_ratio_vs_baseline": round(large["ms_per_request"] / base["ms_per_request"], 2)
        if base["ms_per_request"] else None,
    })
    print({k: out[k] for k in ("sessions", "wall_s", "ms_per_request_ratio_vs_baseline")}
          | {"workers": large["workers"], "requests": large["requests"],
             "peak_concurrent_sessions": large["peak_concurrent_sessions"], "peak_rss_mb": large["peak_rss_mb"]})
    return 0
