"""``kvmesh bench simulate --json PATH``: how far the cluster simulator scales.

A platform team sizing a 544-GPU class fleet asks the simulator about thousands
of concurrent agent sessions on hundreds of workers. This benchmark generates
that workload (seeded, the published Claude Code statistics, fewer turns per
session to keep it to minutes), runs it through ``simulate`` on the large
cluster, and as the same-run baseline the same load per worker on the issue's
8 + 2 workers (proportionally fewer sessions): the wall time per request on the
large cluster over the baseline's says what the size of the cluster costs,
apart from the machine's speed.

It also answers how close each policy comes to the best any routing could do at
that scale: with ``--policy precise,session,llmd,dynamo`` every policy runs on the
large cluster, and the JSON gives ``ceiling_pooled`` (one LRU of the fleet's GPU +
store capacity) and each policy's share of it. The fleet's GPU capacity is set from
the trace (``--gpu-fit``: the fleet's GPU holds this fraction of the working set,
every distinct block of the trace), so that the working set does not fit and the
policies are compared where cache is scarce; the ``capacity`` block says whether it fits.

Without an offload store the fleet's prefill workers sit idle (the store carries a split's
KV), so ``--regimes`` runs the same fleet once per store size, as ``kvmesh simulate
--regimes`` does for traces; a size may be a share of the fleet's decode GPU tokens
(``0.1x``), since those follow from the generated trace.
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
    p.add_argument("--policy", default="precise",
                   help="policies, comma-separated: each runs on the large cluster; the first also sets the baseline")
    p.add_argument("--kv-capacity-tokens", type=int, default=0,
                   help="GPU KV capacity per worker (tokens; 0 = from --gpu-fit)")
    p.add_argument("--gpu-fit", type=float, default=0.5,
                   help="with --kv-capacity-tokens 0: the large cluster's decode GPUs hold this fraction of the "
                        "trace's working set (its distinct blocks)")
    p.add_argument("--offload-capacity-tokens", type=int, default=0, help="shared offload store (tokens; 0 = none)")
    p.add_argument("--regimes", type=regime_specs, default=None, metavar="SIZES",
                   help="run every policy on the large cluster once per offload store size, e.g. none,0.1x: "
                        "tokens (none, 4M, 32000000) or, ending in x, a share of the fleet's decode GPU tokens; "
                        "the JSON's top level is the first regime, 'regimes' has each "
                        "(default: one run with --offload-capacity-tokens)")
    p.add_argument("--jobs", type=int, default=1, help="policies simulated in parallel on the large cluster")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cold-first", default="true", choices=("true", "false"),
                   help="precise places new sessions on endpoints left without a request first "
                        "(ScoringConfig.cold_first)")
    p.add_argument("--split-read-index", default="true", choices=("true", "false"),
                   help="a policy that predicts no cached tokens (session) has its P/D split decided from the "
                        "index for the decode worker it chose (SplitConfig.read_index; false: every long prompt "
                        "splits)")
    p.set_defaults(func=run)


def regime_specs(text: str) -> list[tuple[str, int | float]]:
    """``none,4M,0.1x`` -> [("none", 0), ("4M", 4_000_000), ("0.1x", 0.1)]: a store size in tokens
    (as ``kvmesh simulate --regimes`` reads it), or a float share of the fleet's GPU tokens."""
    from kvmesh_tools.cli.cmd_simulate import parse_regimes, store_size

    def size_or_share(name: str) -> int | float:
        if not name.lower().endswith("x"):
            return store_size(name)
        try:
            share = float(name[:-1])
        except ValueError:
            raise ValueError(f"--regimes: {name!r} is not a share of the GPU tokens (0.1x)") from None
        if not 0.0 <= share <= 1000.0:
            raise ValueError(f"--regimes: {name!r} must be a share between 0x and 1000x")
        return share

    try:
        return parse_regimes(text, size_or_share)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--regimes: ")) from None


def store_tokens(spec: int | float, gpu_tokens: int) -> int:
    """A regime's store size in tokens: an int is one, a float is that share of ``gpu_tokens``."""
    return spec if isinstance(spec, int) else int(spec * gpu_tokens)


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


def working_set_tokens(trace) -> int:
    """Tokens of KV the trace ever asks for: its distinct blocks (what never recomputing would hold)."""
    seen: set[int] = set()
    for r in trace.requests():
        seen.update(r.keys)
    return len(seen) * trace.block_size


def _cfg(decode: int, prefill: int, args: argparse.Namespace, kv_tokens: int, store: int):
    from kvmesh_tools.clustersim.config import SimConfig

    cfg = SimConfig(decode_workers=decode, prefill_workers=prefill, start_window_s=args.start_window_s,
                    seed=args.seed, kv_capacity_tokens=kv_tokens, offload_capacity_tokens=store,
                    split_read_index=args.split_read_index == "true")
    cfg.scoring.cold_first = args.cold_first == "true"
    return cfg


def _row(m: dict[str, Any], records: list[dict[str, Any]], decode: int, prefill: int, wall: float) -> dict[str, Any]:
    out = {k: m[k] for k in ("requests", "errors", "prefix_hit_rate", "share_of_ceiling_pooled", "ttft_p50_s",
                             "ttft_p90_s", "ttft_p99_s", "load_imbalance", "virtual_time_s", "steps",
                             "moved_requests", "moved_prompt_share", "moved_hit_rate", "moved_given_up_share",
                             "split_requests", "split_lost_share", "offload_blocks_stored", "offload_evictions")}
    out.update(workers=decode + prefill, decode_workers=decode, prefill_workers=prefill, wall_s=round(wall, 2),
               ms_per_request=round(1000 * wall / max(1, m["requests"]), 3),
               virtual_s_per_wall_s=round(m["virtual_time_s"] / wall, 1) if wall > 0 else 0.0,
               peak_concurrent_sessions=peak_concurrent_sessions(records))
    return out


def _one(trace, decode: int, prefill: int, args: argparse.Namespace, policy: str, kv_tokens: int,
         store: int) -> dict[str, Any]:
    from kvmesh_tools.clustersim.run import simulate_policies

    t0 = time.perf_counter()
    rep = simulate_policies(trace, _cfg(decode, prefill, args, kv_tokens, store), [policy], jobs=1, records=True)
    out = _row(rep["results"][policy], rep["records"][policy], decode, prefill, time.perf_counter() - t0)
    log.info("simulated", extra={k: out[k] for k in ("workers", "requests", "wall_s", "peak_concurrent_sessions")})
    return out


def _large(trace, args: argparse.Namespace, policies: list[str], kv_tokens: int, store: int,
           capacity: dict[str, Any]) -> dict[str, Any]:
    """Every policy on the large cluster with one store (one report: one ceiling), wall time per policy."""
    from kvmesh_tools.clustersim.run import simulate_policies

    d, p = args.decode_workers, args.prefill_workers
    rep = simulate_policies(trace, _cfg(d, p, args, kv_tokens, store), policies, jobs=args.jobs, records=True)
    rows = {}
    for pol in policies:
        m = rep["results"][pol]
        rows[pol] = _row(m, rep["records"][pol], d, p, m["wall_s"])
    pooled = capacity["gpu_tokens"] + store
    capacity = capacity | {"offload_capacity_tokens": store, "pooled_tokens": pooled,
                           "pooled_fits_working_set": pooled >= capacity["working_set_tokens"]}
    return {"capacity": capacity, "ceiling_infinite": rep["ceiling_infinite"], "ceiling_pooled": rep["ceiling_pooled"],
            "results": rows}


def run(args: argparse.Namespace) -> int:
    from kvmesh_tools.traffic.generator import GeneratorConfig, generate

    policies = [p for p in args.policy.split(",") if p]

    def trace_of(sessions: int):
        return generate(GeneratorConfig(sessions=sessions, turns_median=args.turns_median, seed=args.seed))

    share = (args.baseline_decode_workers + args.baseline_prefill_workers) / (args.decode_workers
                                                                            + args.prefill_workers)
    base_sessions = max(1, round(args.sessions * share))
    t0 = time.perf_counter()
    trace = trace_of(args.sessions)
    gen_s = time.perf_counter() - t0
    working_set = working_set_tokens(trace)
    # A worker must hold the longest request (prompt + output) or it fails; that floor wins over the fit.
    longest = max((r.input_tokens + r.output_tokens for r in trace.requests()), default=0)
    floor = -(-(longest + 1) // trace.block_size) * trace.block_size
    kv_tokens = args.kv_capacity_tokens or max(floor, int(args.gpu_fit * working_set / args.decode_workers))
    gpu_total = kv_tokens * args.decode_workers
    regimes = [(n, store_tokens(v, gpu_total)) for n, v in args.regimes] if args.regimes \
        else [("run", max(0, args.offload_capacity_tokens))]
    capacity = {"working_set_tokens": working_set, "kv_capacity_tokens_per_worker": kv_tokens,
                "longest_request_tokens": longest, "gpu_tokens": gpu_total,
                "gpu_fits_working_set": gpu_total >= working_set}
    # The baseline first, on a small heap (after the large run, its garbage would be in the
    # measurement); it is short, so the median of three runs. Same capacity per worker, the
    # first regime's store.
    base_trace = trace_of(base_sessions)
    bases = sorted((_one(base_trace, args.baseline_decode_workers, args.baseline_prefill_workers, args, policies[0],
                         kv_tokens, regimes[0][1]) for _ in range(3)), key=lambda r: r["ms_per_request"])
    base = bases[1]
    base.update(sessions=base_sessions, ms_per_request_runs=[b["ms_per_request"] for b in bases])
    fleets = []
    for name, store in regimes:
        fleets.append({"regime": name, "offload_capacity_tokens": store}
                      | _large(trace, args, policies, kv_tokens, store, capacity))
    fleet = fleets[0]
    large = dict(fleet["results"][policies[0]])
    # Peak resident memory of this process (with --jobs 1 the large runs dominate it).
    large["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    doc = {
        "bench": "simulate", "policy": policies[0], "policies": policies, "sessions": args.sessions, "seed": args.seed,
        "cold_first": args.cold_first == "true", "split_read_index": args.split_read_index == "true",
        "generate_s": round(gen_s, 2), "large": large, "baseline": base,
        "capacity": fleet["capacity"],
        "ceiling_infinite": fleet["ceiling_infinite"], "ceiling_pooled": fleet["ceiling_pooled"],
        "results": fleet["results"],
        "wall_s": large["wall_s"],
        "ms_per_request_ratio_vs_baseline": round(large["ms_per_request"] / base["ms_per_request"], 2)
        if base["ms_per_request"] else None,
    }
    if args.regimes:
        doc["regimes"] = fleets
    out = write_json(args.json, doc)
    print({k: out[k] for k in ("sessions", "wall_s", "ms_per_request_ratio_vs_baseline")}
          | {"workers": large["workers"], "requests": large["requests"],
             "peak_concurrent_sessions": large["peak_concurrent_sessions"], "peak_rss_mb": large["peak_rss_mb"]})
    for f in fleets:
        cap = f["capacity"]
        store = f"{cap['offload_capacity_tokens']:,}-token store" if cap["offload_capacity_tokens"] else "no store"
        label = f"regime {f['regime']} " if args.regimes else ""
        print(f"{label}({store}): ceiling_pooled {f['ceiling_pooled']}, fits {cap['pooled_fits_working_set']}")
        for pol, r in f["results"].items():
            print(f"{pol:>10}  hit {r['prefix_hit_rate']:.4f}  of pooled {r['share_of_ceiling_pooled']:.4f}  "
                  f"TTFT p50 {r['ttft_p50_s']:.2f}  p90 {r['ttft_p90_s']:.2f}  p99 {r['ttft_p99_s']:.2f}  "
                  f"imbalance {r['load_imbalance']:.2f}")
    return 0
