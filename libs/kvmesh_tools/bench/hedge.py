"""``kvmesh bench hedge``: time to first token with and without hedging, one worker slowed.

Why it exists: hedging the first token (``--hedge-delay-s``, off by default) is only worth
its extra prefills if it cuts the tail a slow or stalled worker causes. This measures that on
real processes, in one run: ``--workers`` sim workers, the first of them slowed by an injected
delay (``--slow-s`` real seconds for every engine step that admits a request: a stall the load
reports do not show), and two routers over the same workers, one hedging and one not.
``--concurrency`` clients each send requests to both routers in turn (alternating which goes
first), so both see the same workers at the same moments. The result is each router's TTFT
percentiles, the hedges it sent and won, and the same-run ratios hedged / unhedged of p99 and
p50.
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

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh_tools.bench.common import percentile, write_json
from kvmesh_tools.testing.ports import free_port
from kvmesh_tools.testing.procs import ServiceProcess

MODEL = "bench-model"
BLOCK = 32
TIME_SCALE = 20.0
MODES = ("off", "hedge")


def _worker(i: int, log_dir: Path, slow_s: float) -> ServiceProcess:
    extra = ["--request-overhead-s", str(slow_s * TIME_SCALE)] if slow_s > 0 else []

    def fresh() -> tuple[list[str], str]:
        port = free_port()
        return (["--engine", "sim", "--endpoint-id", f"w{i}", "--model", MODEL, "--host", "127.0.0.1",
                 "--port", str(port), "--block-size", str(BLOCK), "--num-blocks", "8192",
                 "--time-scale", str(TIME_SCALE), "--grace-s", "1", "--kv-events-endpoint", "",
                 "--kv-events-replay-endpoint", "", *extra], f"127.0.0.1:{port}")
    return ServiceProcess.on_fresh_ports("decode", fresh, log_path=log_dir / f"w{i}.log",
                                         env={"KVMESH_LOG_FORMAT": "text"})


def _router(mode: str, log_dir: Path, endpoints: str, args: argparse.Namespace) -> ServiceProcess:
    """Its metrics port is picked with the gRPC port (again on a retry): read it with ``flag_port``."""
    hedge = (["--hedge-delay-s", str(args.hedge_delay_s), "--hedge-budget", str(args.hedge_budget),
              "--hedge-burst", str(args.hedge_burst)] if mode == "hedge" else [])

    def fresh() -> tuple[list[str], str]:
        port = free_port()
        return (["--host", "127.0.0.1", "--port", str(port), "--http-port", "0", "--model", MODEL,
                 "--block-size", str(BLOCK), "--endpoints", endpoints, "--policy", args.policy, "--auth", "off",
                 "--metrics-port", str(free_port()), "--grace-s", "1", *hedge], f"127.0.0.1:{port}")
    sp = ServiceProcess.on_fresh_ports("router", fresh, log_path=log_dir / f"router-{mode}.log",
                                       env={"KVMESH_LOG_FORMAT": "text"})
    return sp


async def _one(stub: Any, tokens: list[int], max_tokens: int) -> float:
    """TTFT of one request (seconds), read to its end."""
    req = router_pb2.GenerateRequest(model=MODEL, tokens=common_pb2.TokenIds(ids=tokens),
                                     sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    t0 = time.perf_counter()
    ttft = None
    async for msg in stub.Generate(req, timeout=120):
        if ttft is None and (msg.HasField("chunk") or msg.HasField("final")):
            ttft = time.perf_counter() - t0
    assert ttft is not None
    return ttft


async def _load(args: argparse.Namespace, addresses: dict[str, str]) -> tuple[dict[str, list[float]], dict[str, int]]:
    chans = {m: grpc.aio.insecure_channel(a) for m, a in addresses.items()}
    stubs = {m: router_pb2_grpc.RouterStub(ch) for m, ch in chans.items()}
    ttft: dict[str, list[float]] = {m: [] for m in MODES}
    errors = {m: 0 for m in MODES}
    per_client = max(1, args.requests // args.concurrency)

    async def client(c: int) -> None:
        rng = random.Random(args.seed * 1000 + c)
        for i in range(per_client):
            order = MODES if (i + c) % 2 == 0 else MODES[::-1]
            for m in order:
                tokens = [rng.randrange(1, 30000) for _ in range(args.prompt_tokens)]
                try:
                    ttft[m].append(await _one(stubs[m], tokens, args.max_tokens))
                except grpc.aio.AioRpcError:
                    errors[m] += 1
    try:
        await asyncio.gather(*(client(c) for c in range(args.concurrency)))
    finally:
        for ch in chans.values():
            await ch.close()
    return ttft, errors


def _hedges(port: int) -> dict[str, float]:
    out: dict[str, float] = {}
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kvmesh_router_hedges_total":
                out[s.labels["event"]] = s.value
    return out


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvmesh-hedge-bench-") as tmp:
        log_dir = Path(tmp)
        workers = [_worker(i, log_dir, args.slow_s if i == 0 else 0.0) for i in range(args.workers)]
        routers: dict[str, ServiceProcess] = {}
        try:
            for w in workers:
                w.start(wait=False)
            for w in workers:
                w.wait_ready(90)
            endpoints = ",".join(f"w{i}={w.grpc_address}" for i, w in enumerate(workers))
            routers = {m: _router(m, log_dir, endpoints, args) for m in MODES}
            for sp in routers.values():
                sp.start(timeout_s=90)
            time.sleep(1.0)   # a first load poll of every worker
            t0 = time.monotonic()
            ttft, errors = asyncio.run(_load(args, {m: sp.grpc_address for m, sp in routers.items()}))
            wall = time.monotonic() - t0
            hedges = _hedges(routers["hedge"].flag_port("--metrics-port"))
        finally:
            for sp in routers.values():
                sp.stop(grace_s=2)
            for w in workers:
                w.stop(grace_s=2)
    res: dict[str, Any] = {"bench": "hedge", "workers": args.workers, "slow_s": args.slow_s,
                           "policy": args.policy, "hedge_delay_s": args.hedge_delay_s,
                           "hedge_budget": args.hedge_budget, "hedge_burst": args.hedge_burst,
                           "concurrency": args.concurrency, "prompt_tokens": args.prompt_tokens,
                           "wall_s": round(wall, 1), "load_avg_1m": os.getloadavg()[0], "errors": errors,
                           "hedges": hedges}
    for m in MODES:
        for q in (50, 90, 99):
            res[f"ttft_p{q}_ms_{m}"] = round(percentile(ttft[m], q) * 1000, 1)
        res[f"requests_{m}"] = len(ttft[m])
    res["hedge_over_off_p99"] = round(res["ttft_p99_ms_hedge"] / res["ttft_p99_ms_off"], 3)
    res["hedge_over_off_p50"] = round(res["ttft_p50_ms_hedge"] / res["ttft_p50_ms_off"], 3)
    write_json(args.json, res)
    print(" ".join(f"{k}={v}" for k, v in res.items() if not isinstance(v, dict)))
    print(f"hedges={hedges} errors={errors}")
    return 1 if any(errors.values()) else 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("hedge", help="TTFT p99 with vs without first-token hedging, one sim worker slowed")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--slow-s", type=float, default=1.0,
                   help="real seconds the first worker adds to every engine step that admits a request")
    p.add_argument("--policy", default="round_robin",
                   help="both routers' policy (round_robin: load-blind, the slow worker gets its share)")
    p.add_argument("--hedge-delay-s", type=float, default=0.25)
    p.add_argument("--hedge-budget", type=float, default=0.5, help="the hedging router's --hedge-budget")
    p.add_argument("--hedge-burst", type=float, default=10.0)
    p.add_argument("--requests", type=int, default=120, help="requests per router")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=500)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(func=run)
