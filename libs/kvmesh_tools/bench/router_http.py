"""``kvmesh bench router --http on|only``: the router's whole decision for a 200k-token agent turn, over HTTP.

The in-process bench (``kvmesh_tools.bench.router``) times hashing, lookup and scoring from token
ids. An agent sends a chat body instead: ~800 KB of JSON that the router reads, parses, renders
with the chat template, tokenizes, hashes, looks up in the indexer and scores. This runs the
real stack (``kvmesh up``'s launcher: indexer, sim decode workers, a router with API keys on,
no TLS) and sends, over HTTP, a conversation that starts near ``--http-start-tokens`` and grows by
1-5k tokens a turn. The router reports each request's ``decision_ms`` (request in -> decision
out, in ``kvmesh.decision_ms`` of the answer; the target is p50 <= 25 ms).

Same-run baseline: each turn is sent twice, in alternating order: as the agent's session (its
previous turn is cached: incremental render-then-tokenize) and under a fresh session id, which
the router tokenizes in full (its hashing still resumes from the shared prefix, so the ratio is
the tokenization's share). ``http_full_over_incremental_p50`` is their ratio.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import tempfile
import time
from typing import Any

from kvmesh_tools.bench.common import median, percentile

MODEL = "bench-model"


def _outcomes(metrics_url: str, headers: dict[str, str]) -> dict[str, float]:
    import httpx

    out: dict[str, float] = {}
    for m in re.finditer(r'^kvmesh_router_tokenize_cache_total\{outcome="(\w+)"\} (\S+)$',
                         httpx.get(metrics_url, headers=headers, timeout=10).text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from kvmesh_tools.bench.tokenize import _message
    from kvmesh_tools.stack.launcher import LocalStack, StackConfig

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as d:
        cfg = StackConfig(decode_workers=args.http_workers, prefill_workers=0, model=MODEL, tls="off", split=False,
                          num_blocks=16384, max_model_len=1 << 20, time_scale=args.http_time_scale, log_dir=d,
                          redis=args.http_redis)
        with LocalStack(cfg) as stack, httpx.Client(base_url=stack.http_address, timeout=600,
                                                           headers=stack.auth_headers()) as client:
            messages = [{"role": "system", "content": _message(rng, 2000)},
                        {"role": "user", "content": _message(rng, args.http_start_tokens)}]
            incr_ms: list[float] = []
            full_ms: list[float] = []
            wall_ms: list[float] = []
            tokens: list[int] = []
            differ = 0

            pipeline_ms: list[float] = []
            tokenize_ms: list[float] = []
            hash_ms: list[float] = []
            lookup_ms: list[float] = []

            def send(session: str) -> tuple[float, float, int, float, float, float, float]:
                body = {"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0}
                t0 = time.perf_counter()
                r = client.post("/v1/chat/completions", json=body, headers={"x-session-id": session})
                wall = (time.perf_counter() - t0) * 1e3
                r.raise_for_status()
                doc = r.json()
                k = doc["kvmesh"]
                return (k["decision_ms"], wall, doc["usage"]["prompt_tokens"], k["routing_overhead_ms"],
                        k["tokenize_ms"], k["hash_ms"], k["lookup_ms"])

            send("agent")   # the session's first turn: nothing cached yet (not timed)
            before = _outcomes(stack.metrics_address, stack.metrics_headers())
            for turn in range(1, args.http_turns + 1):
                messages += [{"role": "assistant", "content": _message(rng, 300)},
                             {"role": "user", "content": _message(rng, rng.randint(args.min_turn_tokens,
                                                                                   args.max_turn_tokens) - 300)}]
                order = ("agent", f"full-{turn}") if turn % 2 else (f"full-{turn}", "agent")
                got = {s: send(s) for s in order}
                inc, full = got["agent"], got[f"full-{turn}"]
                incr_ms.append(inc[0])
                pipeline_ms.append(inc[3])
                tokenize_ms.append(inc[4])
                hash_ms.append(inc[5])
                lookup_ms.append(inc[6])
                wall_ms.append(inc[1])
                full_ms.append(full[0])
                tokens.append(inc[2])
                differ += inc[2] != full[2]
            outcomes = {k: v - before.get(k, 0.0) for k, v in _outcomes(stack.metrics_address, stack.metrics_headers()).items()}
            redis_used = stack.redis is not None
    p50, f50 = median(incr_ms), median(full_ms)
    return {
        "http_turns": len(incr_ms),
        "http_index": "redis" if redis_used else "embedded",
        "http_tokens_first": tokens[0] if tokens else 0,
        "http_tokens_last": tokens[-1] if tokens else 0,
        "http_decision_p50_ms": p50,
        "http_decision_p99_ms": percentile(incr_ms, 99),
        # From the parsed request on (render, tokenize, hash, lookup, score): the rest of
        # decision_ms is reading and parsing the body.
        "http_pipeline_p50_ms": median(pipeline_ms),
        "http_render_tokenize_p50_ms": median(tokenize_ms),   # of the pipeline: render + tokenize
        "http_hash_p50_ms": median(hash_ms),                  # of the pipeline: block hashing
        "http_lookup_p50_ms": median(lookup_ms),              # of the pipeline: the indexer lookup (gRPC, Redis)
        "http_decision_full_tokenize_p50_ms": f50,
        "http_full_over_incremental_p50": f50 / p50 if p50 else float("nan"),
        "http_request_wall_p50_ms": median(wall_ms),
        "http_prompt_length_differences": differ,
        "http_tokenize_outcomes": outcomes,
        "http_load_avg_1m": os.getloadavg()[0],
    }


def targets(result: dict[str, Any]) -> dict[str, bool]:
    return {"http_decision_p50_le_25ms": result["http_decision_p50_ms"] <= 25.0,
            "http_same_prompt_both_ways": result["http_prompt_length_differences"] == 0}


def register_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--http", choices=["off", "on", "only"], default="off",
                   help="on: also time the whole decision over HTTP on a real local stack (parse, render, "
                        "tokenize, hash, lookup, score; kvmesh_tools.bench.router_http); only: just that")
    p.add_argument("--http-start-tokens", type=int, default=200_000, help="--http: about the first turn's size")
    p.add_argument("--http-turns", type=int, default=20, help="--http: turns timed after the first")
    p.add_argument("--min-turn-tokens", type=int, default=1_000, help="--http: least growth per turn")
    p.add_argument("--max-turn-tokens", type=int, default=5_000, help="--http: most growth per turn")
    p.add_argument("--http-workers", type=int, default=2, help="--http: sim decode workers")
    p.add_argument("--http-redis", choices=["auto", "on", "off"], default="auto",
                   help="--http: the indexer's backend, Redis (auto: when installed) or its embedded index (off)")
    p.add_argument("--http-time-scale", type=float, default=50.0, help="--http: sim workers' speed-up over an H100")
