"""``kvmesh demo`` (``make demo``): the whole product in a few minutes on a laptop.

Brings up the local stack once per policy (fresh worker caches and offload store
each time, so no policy inherits another's warm cache), replays the same
burst-heavy generated agent workload through the router, and prints hit rate,
TTFT and throughput side by side, with plots. Everything is torn down on exit,
including after Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

DEMO_POLICIES = "precise,approx,round_robin"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="bring up the stack and compare routing policies on agent traffic")
    p.add_argument("--policies", default=DEMO_POLICIES, help=f"comma-separated (default {DEMO_POLICIES})")
    # 8 sessions of up to 64k tokens (+ sub-agents) against 4 x 64k tokens of GPU KV and a
    # store of ~64k tokens: caches are under pressure, so where a prefix really is (after
    # evictions) matters, not only where it was sent.
    p.add_argument("--sessions", type=int, default=8, help="generated agent sessions")
    p.add_argument("--seed", type=int, default=7, help="workload seed")
    p.add_argument("--time-scale", type=float, default=10.0, help="sim workers and think times run this much faster")
    p.add_argument("--concurrency", type=int, default=32, help="max requests in flight")
    p.add_argument("--decode-workers", type=int, default=4)
    p.add_argument("--prefill-workers", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per worker (64 tokens each)")
    p.add_argument("--offload-ram-bytes", type=int, default=32 << 20,
                   help="offload store RAM (sim KV is 512 B/token: 32 MiB holds ~1024 blocks)")
    p.add_argument("--split", action="store_true",
                   help="enable the P/D split (a split's hit is what its prefill worker found cached; "
                        "the decode worker's restore of the rest is reported as transferred tokens)")
    p.add_argument("--redis", default="auto", choices=["auto", "on", "off"], help="indexer on Redis")
    p.add_argument("--tls", default="on", choices=["on", "off"],
                   help="mutual TLS between the services (default on: a throwaway CA under the logs folder)")
    p.add_argument("--out", default="out/demo", help="report, plots and logs go here")
    p.set_defaults(func=_run)


def demo_workload(sessions: int, seed: int) -> Any:
    """The demo's traffic: long agent prompts, so a cache hit shows in TTFT (traffic.shapes)."""
    from kvmesh_tools.traffic.shapes import long_agent_sessions

    return long_agent_sessions(sessions, seed)


def _console():
    import sys

    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=200)


def _causes(mm: dict[str, int]) -> str:
    """``12 (evicted 9, lag 3)``: mispredicted requests and their causes (kvmesh.routing.fidelity)."""
    parts = [f"{k.replace('_', ' ')} {v}" for k, v in mm.items() if k != "requests" and v]
    return f"{mm.get('requests', 0)}" + (f" ({', '.join(parts)})" if parts else "")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _table(rows: dict[str, dict[str, Any]]) -> None:
    """One row per policy. TTFT is what the client saw; its parts the stack reports are beside it:
    the engine's own TTFT (its queue, restores and prefill: what a cache hit shortens) and the
    router's decision (what precise pays for its index lookup)."""
    from rich.table import Table

    t = Table(title="kvmesh demo: same agent workload, one fresh stack per policy")
    for col in ("policy", "hit rate", "gpu", "offload", "TTFT p50 s", "TTFT p90 s", "engine TTFT p50 s",
                "engine TTFT p90 s", "decision p50 ms", "lookup p50 ms", "out tok/s", "pred==actual",
                "mispredicted (causes)", "errors"):
        t.add_column(col, justify="right" if col != "policy" else "left")
    for pol, m in rows.items():
        pva = m["predicted_vs_actual"]["exact_share"]
        eng, dec, look = m.get("engine_ttft_s") or {}, m.get("decision_ms") or {}, m.get("lookup_ms") or {}
        t.add_row(pol, f"{m['hit_rate']:.3f}", f"{m['gpu_hit_rate']:.3f}", f"{m['offload_hit_rate']:.3f}",
                  _s(m["ttft_s"]["p50"]), _s(m["ttft_s"]["p90"]), _s(eng.get("p50")), _s(eng.get("p90")),
                  _ms(dec.get("p50")), _ms(look.get("p50")), f"{m['output_tok_per_s']}",
                  "-" if pva is None else f"{pva:.2f}", _causes(m.get("mismatches") or {}), str(m["errors"]))
    con = _console()
    con.print(t)
    con.print("TTFT = the router's decision (index lookup included) + the hops client -> router -> engine and back "
              "+ the engine's TTFT (queue, restores, prefill: what a cache hit shortens). "
              "Per-request figures: demo-records.jsonl.")
    con.print("Moved turns (sent away from their session's previous endpoint: how many, their hit rate, and the "
              "share of all prompt tokens that endpoint was predicted to hold beyond the new one): "
              + "; ".join(f"{pol} {m['moved_requests']}, hit {m['moved_hit_rate']:.3f}, gave up "
                          f"{m['moved_given_up_share']:.3f}" for pol, m in rows.items()))


def _run(args: argparse.Namespace) -> int:
    from kvmesh.routing.registry import available_policies
    from kvmesh_tools.replay.client import ReplayConfig, run_replay
    from kvmesh_tools.replay.plots import write_replay_plots
    from kvmesh_tools.stack.launcher import LocalStack, StackConfig
    from kvmesh_tools.stack.stop_signals import stop_on_signals
    from kvmesh_tools.traffic.analyze import analyze

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in available_policies()]
    if bad or not policies:
        print(f"error: unknown policy {', '.join(bad) or '(none)'}; choose from {', '.join(available_policies())}")
        return 2
    stop_on_signals()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = demo_workload(args.sessions, args.seed)
    shape = analyze(trace, pooled_capacity_tokens=args.decode_workers * args.num_blocks * 64)
    print(f"workload: {shape['sessions']} sessions, {shape['requests']} requests "
          f"({shape['subagent_requests']} from sub-agents, bursts p50 {shape['subagent_bursts']['sizes'].get('p50')}"
          f" / max {shape['subagent_bursts']['sizes'].get('max')}), ceiling_infinite {shape['ceiling_infinite']}",
          flush=True)
    results: dict[str, dict[str, Any]] = {}
    records: dict[str, list[dict[str, Any]]] = {}
    t0 = time.monotonic()
    try:
        for pol in policies:
            cfg = StackConfig(decode_workers=args.decode_workers, prefill_workers=args.prefill_workers,
                              redis=args.redis, num_blocks=args.num_blocks, time_scale=args.time_scale,
                              offload_ram_bytes=args.offload_ram_bytes, split=args.split,
                              policy=pol, log_dir=str(out / "logs" / pol), tls=args.tls)
            print(f"[{pol}] starting a fresh stack ...", flush=True)
            with LocalStack(cfg) as stack:
                rc = ReplayConfig(target=stack.router_address, api_key=stack.api_key, time_scale=args.time_scale,
                                  concurrency=args.concurrency, vocab_size=cfg.vocab_size, start_window_s=5.0,
                                  seed=args.seed, progress=True, tls=stack.client_tls())
                res = asyncio.run(run_replay(trace, rc, label=pol))
            results[pol] = res.metrics
            records[pol] = res.records
    except KeyboardInterrupt:
        print("\ninterrupted; the stack was torn down")
        return 130
    except (RuntimeError, TimeoutError, ValueError) as exc:
        print(f"error: {exc} (service logs under {out / 'logs'})")
        return 1
    plots = write_replay_plots(records, out / "plots", prefix="demo")
    report = {"workload": shape, "results": results, "plots": [str(p) for p in plots],
              "wall_s": round(time.monotonic() - t0, 1)}
    (out / "demo.json").write_text(json.dumps(report, indent=1))
    with (out / "demo-records.jsonl").open("w") as f:
        for pol, recs in records.items():
            for r in recs:
                f.write(json.dumps({"policy": pol, **r}) + "\n")
    _table(results)
    print(f"report: {out / 'demo.json'}")
    for p in plots:
        print(f"plot: {p}")
    return 0 if all(m["ok"] for m in results.values()) else 1
