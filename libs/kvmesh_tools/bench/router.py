"""``kvmesh bench router``: time one routing decision on a 100k→200k-token agent session.

Set-up: everything in-process — the routing core, an embedded memory index
holding 16 endpoints' blocks (one of them the session's), token ids given.
Each turn appends ~600 tokens. A decision is timed from "token ids in" to
"decision out": block hashing, index lookup, scoring, and recording the pick.
The same turn is routed twice in the same run: once with incremental hashing
(the hash cache) and once by a second core that re-hashes the whole prompt
(the baseline). Tokenizing the turn's full text with the model's tokenizer is
timed separately, on a sample of turns.

``--auth both`` also routes each turn as the router does with API keys on: the key is
read from the headers and looked up among ``--auth-keys`` others (``kvmesh.api_keys``),
its tenant's secret salt is derived, and the salted chain is hashed, looked up and
scored, on a third core whose index holds the salted blocks; ``auth_on_over_off_p99`` is
the same-run ratio of the two routes' p99 (and ``..._p50`` of the medians).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from kvmesh.api_keys import ApiKeys, TenantSalts, add_key, key_from_headers
from kvmesh.hashing import BlockHasher, ExtraKeys
from kvmesh.index.base import Tier
from kvmesh.index.memory import MemoryIndex
from kvmesh.routing.hash_cache import HashCacheConfig
from kvmesh.routing.index_adapter import matches_from_lookup
from kvmesh.routing.router import RouterCore, RouterCoreConfig
from kvmesh.routing.types import EndpointView, RouteRequest
from kvmesh_api.common.v1 import common_pb2
from kvmesh_tools.bench.common import median, percentile, write_json

log = logging.getLogger(__name__)
MODEL = "bench-model"


def _core(block_size: int, endpoints: int, incremental: bool, verify: str) -> RouterCore:
    cfg = RouterCoreConfig(policy="precise", block_size=block_size,
                           hash_cache=HashCacheConfig(enabled=incremental, verify=verify))
    core = RouterCore(cfg, BlockHasher("sha256_cbor", block_size))
    for i in range(endpoints):
        core.set_endpoint(EndpointView(f"e{i:02d}", f"127.0.0.1:{9000 + i}", MODEL))
    return core


def _route(core: RouterCore, index: MemoryIndex, tokens: list[int], rid: str, session: str, now: float,
           scope: Any = None):
    """Route one turn; ``scope`` (timed with it) authenticates the request and gives its salt."""
    c0 = time.thread_time()
    t0 = time.perf_counter()
    extra = ExtraKeys(cache_salt=scope()) if scope is not None else None
    chain = core.chain(tokens, extra, session)
    t1 = time.perf_counter()
    res = index.lookup(MODEL, chain.keys)
    t2 = time.perf_counter()
    req = RouteRequest(rid, MODEL, chain.keys, len(tokens), core.block_size, session)
    d = core.decide(req, matches_from_lookup(res), now)
    core.on_routed(req, d, now)
    t3 = time.perf_counter()
    cpu = time.thread_time() - c0
    return req, d, (t3 - t0), (t1 - t0), (t2 - t1), (t3 - t2), cpu


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    bs = args.block_size
    index = MemoryIndex()
    incr = _core(bs, args.endpoints, True, args.verify)
    full = _core(bs, args.endpoints, False, args.verify)
    # The gRPC front door hands the routing core the request's protobuf field, not a list.
    grpc_core = _core(bs, args.endpoints, True, args.verify)
    vocab = 32000
    # Other endpoints hold unrelated contexts (so lookups see a realistic, populated index).
    noise_hasher = BlockHasher("sha256_cbor", bs)
    for i in range(args.endpoints):
        other = [rng.randrange(vocab) for _ in range(args.noise_tokens)]
        index.add(MODEL, f"e{i:02d}", Tier.GPU, noise_hasher.block_keys(other))
    tokens = [rng.randrange(vocab) for _ in range(args.start_tokens)]
    # The session's first turn was served before: its blocks are on one endpoint.
    index.add(MODEL, "e07", Tier.GPU, noise_hasher.block_keys(tokens))
    incr.chain(tokens, None, "agent")
    grpc_core.chain(tokens, None, "agent")
    grpc_ms: list[float] = []
    auth = _AuthPath(args, tokens, noise_hasher, index, bs) if args.auth == "both" else None
    auth_ms: list[float] = []
    off_ms: list[float] = []
    auth_cpu_ms: list[float] = []
    off_cpu_ms: list[float] = []

    route_ms: list[float] = []
    cpu_ms: list[float] = []
    hash_ms: list[float] = []
    lookup_ms: list[float] = []
    score_ms: list[float] = []
    full_ms: list[float] = []
    mismatches = 0
    turn = 0
    now = 0.0
    while len(tokens) + args.turn_tokens <= args.end_tokens:
        turn += 1
        now += 5.0
        tokens = tokens + [rng.randrange(vocab) for _ in range(args.turn_tokens)]
        if auth is not None and turn % 2:
            # Alternate which of the two goes first, so neither always runs on a warmer cache.
            auth_ms.append(auth.route(tokens, turn, now) * 1e3)
            auth_cpu_ms.append(auth.cpu * 1e3)
        req, d, total, th, tl, ts, cpu = _route(incr, index, tokens, f"t{turn}", "agent", now)
        if auth is not None:
            off_ms.append(total * 1e3)
            off_cpu_ms.append(cpu * 1e3)
            if not turn % 2:
                auth_ms.append(auth.route(tokens, turn, now) * 1e3)
                auth_cpu_ms.append(auth.cpu * 1e3)
        route_ms.append(total * 1e3)
        cpu_ms.append(cpu * 1e3)
        hash_ms.append(th * 1e3)
        lookup_ms.append(tl * 1e3)
        score_ms.append(ts * 1e3)
        if turn % args.full_every == 0:
            freq, fd, ftotal, *_ = _route(full, index, tokens, f"f{turn}", "agent", now)
            full_ms.append(ftotal * 1e3)
            if freq.keys != req.keys or fd.endpoint_id != d.endpoint_id:
                mismatches += 1
            full.on_finished(freq, fd, now)
        field = common_pb2.TokenIds(ids=tokens).ids   # what gRPC parsing produced (not timed)
        greq, gd, gtotal, *_ = _route(grpc_core, index, field, f"g{turn}", "agent", now)
        grpc_ms.append(gtotal * 1e3)
        if greq.keys != req.keys:
            mismatches += 1
        grpc_core.on_finished(greq, gd, now)
        # The engine now holds the prompt: its events reach the index (not timed).
        index.add(MODEL, d.endpoint_id, Tier.GPU, req.keys)
        incr.on_finished(req, d, now)

    tok_ms = _tokenize_times(args, rng)
    r50 = percentile(route_ms, 50)
    f50 = percentile(full_ms, 50)
    extra: dict[str, Any] = {}
    if auth is not None:
        on99, off99 = percentile(auth_ms, 99), percentile(off_ms, 99)
        extra = {"auth_keys": args.auth_keys, "route_auth_on_p50_ms": percentile(auth_ms, 50),
                 "route_auth_on_p99_ms": on99, "route_auth_off_p50_ms": percentile(off_ms, 50),
                 "route_auth_off_p99_ms": off99,
                 "auth_on_over_off_p50": percentile(auth_ms, 50) / percentile(off_ms, 50),
                 "auth_on_over_off_p99": on99 / off99,
                 # CPU time of the deciding thread: the same comparison without this machine's preemption.
                 "auth_on_over_off_cpu_p99": percentile(auth_cpu_ms, 99) / percentile(off_cpu_ms, 99),
                 "auth_on_over_off_cpu_p50": percentile(auth_cpu_ms, 50) / percentile(off_cpu_ms, 50),
                 "auth_decisions_differ": auth.differ}
    return {
        "bench": "router",
        "endpoints": args.endpoints,
        "block_size": bs,
        "turns": turn,
        "start_tokens": args.start_tokens,
        "end_tokens": len(tokens),
        "turn_tokens": args.turn_tokens,
        "hash_cache_verify": args.verify,
        "route_p50_ms": r50,
        "route_p99_ms": percentile(route_ms, 99),
        "route_mean_ms": sum(route_ms) / len(route_ms),
        # CPU time of the deciding thread: the same work without the time the OS gave other
        # processes (this machine is shared; wall-clock tails include preemption).
        "route_cpu_p50_ms": percentile(cpu_ms, 50),
        "route_cpu_p99_ms": percentile(cpu_ms, 99),
        "load_avg_1m": os.getloadavg()[0],
        "route_hash_p50_ms": percentile(hash_ms, 50),
        "route_lookup_p50_ms": percentile(lookup_ms, 50),
        "route_score_p50_ms": percentile(score_ms, 50),
        "route_grpc_field_p50_ms": percentile(grpc_ms, 50),
        "route_grpc_field_p99_ms": percentile(grpc_ms, 99),
        "route_full_hash_p50_ms": f50,
        "route_full_hash_samples": len(full_ms),
        "full_over_incremental_p50": f50 / r50 if r50 else float("nan"),
        "incremental_vs_full_disagreements": mismatches,
        "tokenize_p50_ms": median(tok_ms),
        "tokenize_samples": len(tok_ms),
        **extra,
        "targets": {"route_p99_ms_le_2": percentile(route_ms, 99) <= 2.0,
                    "full_hash_ge_10x": bool(r50) and f50 >= 10 * r50,
                    **({"auth_p99_growth_le_10pct": extra["auth_on_over_off_p99"] <= 1.10} if extra else {})},
    }


class _AuthPath:
    """The routing core of a router with API keys on: authenticate, salt, then route."""

    def __init__(self, args: argparse.Namespace, first_turn: list[int], hasher: BlockHasher, index: MemoryIndex,
                 block_size: int) -> None:
        self._dir = tempfile.TemporaryDirectory()
        keys = Path(self._dir.name) / "keys"
        mine = ""
        for i in range(args.auth_keys):
            k = add_key(keys, f"tenant-{i}")
            mine = k if i == args.auth_keys // 2 else mine
        self.keys = ApiKeys(keys)
        self.salts = TenantSalts(os.urandom(32))
        self.headers = {"authorization": f"Bearer {mine}", "content-type": "application/json"}
        self.core = _core(block_size, args.endpoints, True, args.verify)
        self.index = index
        salt = self.salts.salt(self.keys.lookup(mine).tenant)
        # The session's first turn, salted as this tenant, was served before (as in the keys-off run).
        index.add(MODEL, "e07", Tier.GPU, hasher.block_keys(first_turn, ExtraKeys(cache_salt=salt)))
        self.core.chain(first_turn, ExtraKeys(cache_salt=salt), "agent")
        self.cpu = 0.0
        self.differ = 0

    def scope(self) -> str:
        principal = self.keys.lookup(key_from_headers(self.headers.get))
        assert principal is not None
        return self.salts.salt(principal.tenant)

    def route(self, tokens: list[int], turn: int, now: float) -> float:
        req, d, total, _h, _l, _s, self.cpu = _route(self.core, self.index, tokens, f"a{turn}", "agent", now,
                                                     self.scope)
        if d.endpoint_id != "e07":     # the session's blocks are there, salted or not
            self.differ += 1
        self.index.add(MODEL, d.endpoint_id, Tier.GPU, req.keys)
        self.core.on_finished(req, d, now)
        return total


def _tokenize_times(args: argparse.Namespace, rng: random.Random) -> list[float]:
    """Tokenize a text of the session's size (start and end of the range) with the tiny model's tokenizer."""
    if args.tokenize_samples <= 0:
        return []
    from kvmesh.tokenization import load_tokenizer
    from kvmesh.tokenization.tiny_model import write_tiny_model

    with tempfile.TemporaryDirectory() as d:
        tok = load_tokenizer(write_tiny_model(f"{d}/tiny"))
        words = ["agent", "tool", "call", "result", "def", "return", "file", "path", "error", "the", "a", "of",
                 "{", "}", "(", ")", "import", "class", "self", "value", "0", "1", "2", "\n"]
        text = " ".join(rng.choice(words) for _ in range(args.end_tokens))
        out = []
        for i in range(args.tokenize_samples):
            frac = args.start_tokens / args.end_tokens + (1 - args.start_tokens / args.end_tokens) * i / max(
                1, args.tokenize_samples - 1)
            sample = text[: int(len(text) * frac)]
            t0 = time.perf_counter()
            tok.encode(sample)
            out.append((time.perf_counter() - t0) * 1e3)
        return out


def _main(args: argparse.Namespace) -> int:
    if args.tls == "compare":
        from kvmesh_tools.bench import router_tls

        result = router_tls.run(args)
        write_json(args.json, result)
        keys = ("route_p99_ms_plain", "route_p99_ms_tls", "tls_over_plain_p99", "tls_over_plain_p50")
        print({k: round(result[k], 3) for k in keys}, result["targets"])
        return 0
    if args.http == "only":
        from kvmesh_tools.bench import router_http

        result = {"bench": "router", **router_http.run(args)}
        result["targets"] = router_http.targets(result)
        write_json(args.json, result)
        keys = ("http_decision_p50_ms", "http_decision_full_tokenize_p50_ms", "http_full_over_incremental_p50",
                "http_tokens_last")
        print({k: round(result[k], 3) for k in keys}, result["targets"])
        return 0
    result = run(args)
    if args.http == "on":
        from kvmesh_tools.bench import router_http

        result.update(router_http.run(args))
        result["targets"].update(router_http.targets(result))
    write_json(args.json, result)
    keys = ("route_p50_ms", "route_p99_ms", "route_full_hash_p50_ms", "tokenize_p50_ms", "full_over_incremental_p50",
            *(("route_auth_on_p99_ms", "route_auth_off_p99_ms", "auth_on_over_off_p99", "auth_on_over_off_p50",
               "auth_on_over_off_cpu_p99") if args.auth == "both"
              else ()))
    if args.http == "on":
        keys += ("http_decision_p50_ms", "http_full_over_incremental_p50")
    print({k: round(result[k], 3) for k in keys}, result["targets"])
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="routing decision latency on a growing 100k-200k token agent session")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--endpoints", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--start-tokens", type=int, default=100_000)
    p.add_argument("--end-tokens", type=int, default=200_000)
    p.add_argument("--turn-tokens", type=int, default=600)
    p.add_argument("--noise-tokens", type=int, default=50_000, help="unrelated context held by each endpoint")
    p.add_argument("--full-every", type=int, default=4, help="also route with full re-hashing every Nth turn")
    p.add_argument("--tokenize-samples", type=int, default=8)
    p.add_argument("--verify", choices=["sampled", "full"], default="sampled",
                   help="hash-cache prefix check (see kvmesh.routing.hash_cache)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--auth", choices=["off", "both"], default="off",
                   help="both: also route every turn with the API-key scope and tenant salt (same run, ratio)")
    p.add_argument("--auth-keys", type=int, default=1000, help="keys in the keys file the request is looked up in")
    p.add_argument("--tls", choices=["off", "compare"], default="off",
                   help="compare: route over a real indexer hop, plaintext vs mutual TLS in the same run "
                        "(kvmesh_tools.bench.router_tls; with --auth both the TLS side also checks an API key and "
                        "salts the chain: mTLS + keys vs neither); off: the in-process decision alone")
    # A round's p99 over ~166 turns is its second-slowest turn, so one round's ratio swings
    # 0.3-1.2 on a shared 2-core machine; the median over 15 rounds (~6 s each) is stable.
    p.add_argument("--rounds", type=int, default=15, help="--tls compare: sessions replayed (median of ratios)")
    from kvmesh_tools.bench import router_http

    router_http.register_args(p)
    p.set_defaults(func=_main)
