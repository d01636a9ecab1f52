"""``kvmesh bench router --tls compare``: a routing decision with its indexer hop in plaintext vs mutual TLS.

Why it exists: the in-process router bench has no network hop, but mTLS costs exactly there:
every precise decision asks the indexer for the prompt's block chain (about 3,000 keys at
200k tokens). Two real ``kvmesh serve indexer`` processes, one plaintext and one mTLS (a
throwaway CA; this process presents a router identity), are given the same blocks: 16
endpoints' unrelated contexts and the session's first turn, written as speculative entries as
a router does. Each turn of the growing 100k->200k-token session is then routed against both,
alternating which goes first: incremental chain hashing, the gRPC Lookup, scoring and
recording the pick; the pick is written back to both as the router's speculative entry (not
timed). ``--rounds`` repeats the session on fresh cores; the result is each mode's p50/p99 per
round and the median over rounds of the p99 and p50 ratios (TLS / plaintext).

With ``--auth both`` the TLS side is the whole zero-trust path of issue #20: besides mutual TLS,
each decision authenticates its API key (looked up among ``--auth-keys`` keys, as a router with
``--auth keys`` does), derives the tenant's HMAC salt and hashes the salted chain (the indexer
holds the salted blocks); the plaintext side has neither. ``tls_over_plain_p99`` is then
"mTLS + keys on" over "both off".
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from kvmesh.api_keys import ApiKeys, TenantSalts, add_key, key_from_headers
from kvmesh.hashing import BlockHasher, ExtraKeys
from kvmesh.routing.hash_cache import HashCacheConfig
from kvmesh.routing.router import RouterCore, RouterCoreConfig
from kvmesh.routing.types import EndpointView, Matches, RouteRequest, TierMatch
from kvmesh.rpc.channel import aio_channel
from kvmesh.rpc.tls import TlsConfig, plaintext
from kvmesh_api.indexer.v1 import indexer_pb2, indexer_pb2_grpc
from kvmesh_tools.bench.common import median, percentile
from kvmesh_tools.stack.certs import CertAuthority
from kvmesh_tools.testing.ports import free_port
from kvmesh_tools.testing.procs import ServiceProcess

MODEL = "bench-model"
TTL_S = 300.0          # the indexer's longest speculative TTL: entries outlive a round
MAX_KEYS = 65_536      # per PutSpeculative
MODES = ("plain", "tls")


def _core(args: argparse.Namespace) -> RouterCore:
    cfg = RouterCoreConfig(policy="precise", block_size=args.block_size,
                           hash_cache=HashCacheConfig(enabled=True, verify=args.verify))
    core = RouterCore(cfg, BlockHasher("sha256_cbor", args.block_size))
    for i in range(args.endpoints):
        core.set_endpoint(EndpointView(f"e{i:02d}", f"127.0.0.1:{9000 + i}", MODEL))
    return core


def _matches(resp: indexer_pb2.LookupResponse) -> Matches:
    out = Matches()
    for m in resp.matches:
        tm = TierMatch(speculative=m.speculative_blocks)
        for t in m.tiers:
            tm.gpu = max(tm.gpu, t.blocks)
        out.per_endpoint[m.endpoint_id] = tm
    return out


async def _put(stub: Any, eid: str, keys: list[int]) -> None:
    for i in range(0, len(keys), MAX_KEYS):
        await stub.PutSpeculative(indexer_pb2.PutSpeculativeRequest(
            model=MODEL, endpoint_id=eid, keys=keys[i:i + MAX_KEYS], ttl_s=TTL_S), timeout=30)


class _Auth:
    """A router's API-key check and tenant salt: the key among ``n`` others, then HMAC."""

    def __init__(self, n: int, folder: Path) -> None:
        path = folder / "api-keys"
        mine = ""
        for i in range(n):
            k = add_key(path, f"tenant-{i}")
            mine = k if i == n // 2 else mine
        self.keys = ApiKeys(path)
        self.salts = TenantSalts(os.urandom(32))
        self.headers = {"authorization": f"Bearer {mine}", "content-type": "application/json"}

    def extra(self) -> ExtraKeys:
        principal = self.keys.lookup(key_from_headers(self.headers.get))
        assert principal is not None
        return ExtraKeys(cache_salt=self.salts.salt(principal.tenant))


async def _round(args: argparse.Namespace, stubs: dict[str, Any], seed: int,
                 auth: _Auth | None = None) -> dict[str, list[float]]:
    rng = random.Random(seed)
    hasher = BlockHasher("sha256_cbor", args.block_size)
    vocab = 32000
    for i in range(args.endpoints):
        keys = hasher.block_keys([rng.randrange(vocab) for _ in range(args.noise_tokens)])
        for stub in stubs.values():
            await _put(stub, f"e{i:02d}", keys)
    tokens = [rng.randrange(vocab) for _ in range(args.start_tokens)]
    # The TLS side with auth on: its requests are salted with the tenant's secret salt.
    scope = {"plain": lambda: None, "tls": auth.extra if auth is not None else (lambda: None)}
    first = hasher.block_keys(tokens)
    for m, stub in stubs.items():
        await _put(stub, "e07", hasher.block_keys(tokens, scope[m]()))
    cores = {m: _core(args) for m in stubs}
    for m, core in cores.items():
        core.chain(tokens, scope[m](), "agent")
    for stub in stubs.values():   # warm the channels: handshakes are not what is measured
        for _ in range(5):
            await stub.Lookup(indexer_pb2.LookupRequest(model=MODEL, chain=indexer_pb2.BlockChain(keys=first[:64])),
                              timeout=10)
    times: dict[str, list[float]] = {m: [] for m in stubs}
    picks: dict[str, list[str]] = {m: [] for m in stubs}
    turn, now = 0, 0.0
    while len(tokens) + args.turn_tokens <= args.end_tokens:
        turn += 1
        now += 5.0
        tokens = tokens + [rng.randrange(vocab) for _ in range(args.turn_tokens)]
        order = MODES if turn % 2 else MODES[::-1]
        for m in order:
            core, stub = cores[m], stubs[m]
            t0 = time.perf_counter()
            chain = core.chain(tokens, scope[m](), "agent")
            resp = await stub.Lookup(indexer_pb2.LookupRequest(
                model=MODEL, chain=indexer_pb2.BlockChain(keys=chain.keys), include_speculative=True), timeout=10)
            req = RouteRequest(f"{m}{turn}", MODEL, chain.keys, len(tokens), core.block_size, "agent")
            d = core.decide(req, _matches(resp), now)
            core.on_routed(req, d, now)
            times[m].append((time.perf_counter() - t0) * 1e3)
            picks[m].append(d.endpoint_id)
            await _put(stub, d.endpoint_id, list(req.keys))
            core.on_finished(req, d, now)
    # Both sides must route the session alike (salted or not, its blocks are on the same endpoint).
    times["differ"] = [float(a != b) for a, b in zip(picks["plain"], picks["tls"], strict=True)]
    return times


def _indexer(name: str, log_dir: Path, flags: list[str], probe_tls: TlsConfig) -> ServiceProcess:
    def fresh() -> tuple[list[str], str]:
        port = free_port()
        return (["--host", "127.0.0.1", "--port", str(port), "--models", f"{MODEL}@64@sha256_cbor",
                 "--default-model", MODEL, *flags], f"127.0.0.1:{port}")
    sp = ServiceProcess.on_fresh_ports("indexer", fresh, log_path=log_dir / f"{name}.log",
                                       env={"KVMESH_LOG_FORMAT": "text"}, tls=probe_tls)
    return sp.start(timeout_s=90)


async def _run(args: argparse.Namespace, addresses: dict[str, str], tls: dict[str, TlsConfig],
               auth: _Auth | None = None) -> list[dict]:
    chans = {m: aio_channel(addresses[m], tls=tls[m], traced=False) for m in MODES}
    stubs = {m: indexer_pb2_grpc.IndexerStub(ch) for m, ch in chans.items()}
    rounds = []
    try:
        for r in range(args.rounds):
            t = await _round(args, stubs, args.seed + r, auth)
            rounds.append({f"{m}_{k}": percentile(t[m], q) for m in MODES for k, q in (("p50_ms", 50),
                                                                                     ("p99_ms", 99))})
            rounds[-1]["turns"] = len(t["plain"])
            rounds[-1]["decisions_differ"] = int(sum(t["differ"]))
    finally:
        for ch in chans.values():
            await ch.close()
    return rounds


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.block_size != 64:
        raise SystemExit("--tls compare runs its indexers at block size 64")
    with tempfile.TemporaryDirectory(prefix="kvmesh-router-tls-bench-") as tmp:
        ca = CertAuthority(Path(tmp) / "certs")
        client = ca.issue("router", "bench").tls_config()
        procs = {"plain": _indexer("indexer-plain", Path(tmp), ["--tls", "off"], plaintext()),
                 "tls": _indexer("indexer-tls", Path(tmp), ca.issue("indexer", "indexer").flags(), client)}
        auth = _Auth(args.auth_keys, Path(tmp)) if args.auth == "both" else None
        try:
            rounds = asyncio.run(_run(args, {m: p.grpc_address for m, p in procs.items()},
                                      {"plain": plaintext(), "tls": client}, auth))
        finally:
            for p in procs.values():
                p.stop()
    p99 = [r["tls_p99_ms"] / r["plain_p99_ms"] for r in rounds]
    p50 = [r["tls_p50_ms"] / r["plain_p50_ms"] for r in rounds]
    ratio = median(p99)
    return {
        "bench": "router", "mode": "tls-auth-compare" if args.auth == "both" else "tls-compare",
        "auth": args.auth, "auth_keys": args.auth_keys if args.auth == "both" else 0, "endpoints": args.endpoints, "block_size": args.block_size,
        "start_tokens": args.start_tokens, "end_tokens": args.end_tokens, "turn_tokens": args.turn_tokens,
        "rounds": rounds,
        "route_p99_ms_plain": median([r["plain_p99_ms"] for r in rounds]),
        "route_p99_ms_tls": median([r["tls_p99_ms"] for r in rounds]),
        "route_p50_ms_plain": median([r["plain_p50_ms"] for r in rounds]),
        "route_p50_ms_tls": median([r["tls_p50_ms"] for r in rounds]),
        "tls_over_plain_p99": ratio, "tls_over_plain_p99_rounds": p99,
        "tls_over_plain_p50": median(p50),
        "load_avg_1m": os.getloadavg()[0],
        "targets": {"tls_over_plain_p99_le_1.10": ratio <= 1.10},
    }
