"""Against a live local stack: a short replay, and the simulator agreeing with the services.

The agreement test sends one workload through the live stack (router, indexer,
sim workers time-scaled, offload store) and through ``kvmesh simulate`` with the
same cluster shape. Requests never overlap (sessions are far apart, think times
long), and round robin routes independently of timing, so every per-request
cached-token count, by tier, must be identical: the simulator's engine and
offload store behave as the services do.
"""

from __future__ import annotations

import asyncio

import pytest

from kvmesh_tools.clustersim import SimConfig, simulate_policies
from kvmesh_tools.replay.client import ReplayConfig, run_replay
from kvmesh_tools.traffic.model import Agent, Request, Session, Trace

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def _workload() -> Trace:
    """Two sessions, 60 recorded seconds apart; growing contexts that overflow a 64-block GPU cache."""
    sessions = []
    for s in range(2):
        sid = f"s{s}"
        items: list[Request | Agent] = []
        ids: list[int] = []
        n_in = 0
        for turn in range(5):
            n_in += 600 if turn else 1000
            ids = ids + list(range(1000 * s + len(ids), 1000 * s + n_in // 64))
            items.append(Request(uid=f"{sid}/main/{turn}", session=sid, agent="main", t=turn * 8.0,
                                 input_tokens=n_in, output_tokens=4, hash_ids=list(ids), namespace="live",
                                 block_size=64, think_time=6.0 if turn else 0.0, api_time=1.0))
        sessions.append(Session(session_id=sid, root=Agent("main", 0.0, items), block_size=64, start=60.0 * s))
    return Trace(sessions=sessions, fmt="native", block_size=64)


def test_replay_against_live_stack_and_simulator_agrees(live_stack_rr) -> None:
    tr = _workload()
    res = asyncio.run(run_replay(tr, ReplayConfig(target=live_stack_rr.router_address, api_key=live_stack_rr.api_key,
                                                  time_scale=20.0, concurrency=1, vocab_size=32000, progress=False,
                                                  tls=live_stack_rr.client_tls())))
    m = res.metrics
    assert m["errors"] == 0 and m["ok"] == 10
    assert m["ttft_s"]["p50"] is not None and m["e2e_s"]["p50"] >= m["ttft_s"]["p50"]
    assert m["output_tokens"] == 40 and m["hit_rate"] > 0.2
    assert set(m["endpoints"]) == {"decode-0", "decode-1"}
    # the router's prediction is reported for every request
    assert m["predicted_vs_actual"]["requests"] == 10
    # ... and every miss is classified by the router: round robin does not read the index.
    wrong = [r for r in res.records if r["predicted"] != r["cached"]]
    assert m["mismatches"]["requests"] == len(wrong) == m["mismatches"]["no_index"]
    assert all(r["mismatch"] == "no_index" for r in wrong)
    # Where the TTFT went: the router's decision (no index lookup for round robin) and the
    # engine's own TTFT, which is part of what the client saw.
    assert all(r["decision_ms"] > 0 and r["lookup_ms"] == 0 for r in res.records)
    assert all(0 < r["engine_ttft_s"] <= r["ttft_s"] for r in res.records)
    assert m["engine_ttft_s"]["p50"] <= m["ttft_s"]["p50"] and m["decision_ms"]["p50"] > 0

    sim = simulate_policies(_workload(), SimConfig(
        decode_workers=2, prefill_workers=0, kv_capacity_tokens=64 * 64, offload_capacity_tokens=10_000_000,
        kv_bytes_per_token=512, seed=0, start_window_s=None), ["round_robin"], jobs=1, records=True)
    sm = sim["results"]["round_robin"]
    assert sm["requests"] == 10
    assert sm["cached_tokens_offload"] > 0 and sm["cached_tokens_gpu"] > 0
    live = {r["uid"]: (r["endpoint"], r["cached_gpu"], r["cached_offload"]) for r in res.records}
    simulated = {r["uid"]: (r["endpoint"], r["cached_gpu"], r["cached_offload"])
                 for r in sim["records"]["round_robin"]}
    assert simulated == live


def test_replay_http_api(live_stack_rr) -> None:
    tr = _workload()
    tr.sessions = tr.sessions[:1]
    res = asyncio.run(run_replay(tr, ReplayConfig(target=live_stack_rr.http_address, api="http",
                                                  api_key=live_stack_rr.api_key, time_scale=40.0,
                                                  concurrency=2, vocab_size=32000, salt="http", progress=False)))
    assert res.metrics["errors"] == 0, res.records
    assert res.metrics["ok"] == 5 and res.metrics["output_tokens"] == 20
    assert res.metrics["prompt_tokens"] == sum(r.input_tokens for r in tr.requests())
    # The HTTP front door carries the class too (under "kvmesh"), so the summary counts it.
    assert res.metrics["mismatches"]["requests"] == sum(1 for r in res.records if r["mismatch"])
    # The decision's time comes under "kvmesh" too; the engine's TTFT only over gRPC.
    assert all(r["decision_ms"] > 0 and r["engine_ttft_s"] is None for r in res.records)


def test_precise_decides_live_as_in_the_simulator(live_stack_precise) -> None:
    """The placement cost's terms (displaced KV against each worker's capacity without vLLM's
    null block, the sessions' working set) decide the same way in the live router and in the
    simulator: the same endpoint and the same cached tokens for every request.

    Two sessions whose contexts (up to 3,400 tokens) do not both fit one worker's 64 blocks.
    The live router's clock is real time, the simulator's is recorded time (20x): the
    simulator's speculative entries live 20x longer in recorded seconds, as the router's do.
    """
    tr = _workload()
    res = asyncio.run(run_replay(tr, ReplayConfig(target=live_stack_precise.router_address,
                                                  api_key=live_stack_precise.api_key, time_scale=20.0, concurrency=1,
                                                  vocab_size=32000, progress=False,
                                                  tls=live_stack_precise.client_tls())))
    assert res.metrics["errors"] == 0 and res.metrics["ok"] == 10
    sim = simulate_policies(_workload(), SimConfig(
        decode_workers=2, prefill_workers=0, kv_capacity_tokens=64 * 64, offload_capacity_tokens=10_000_000,
        kv_bytes_per_token=512, seed=0, start_window_s=None, speculative_ttl_s=2.0 * 20.0), ["precise"], jobs=1,
        records=True)
    assert sim["results"]["precise"]["requests"] == 10
    live = {r["uid"]: (r["endpoint"], r["cached_gpu"], r["cached_offload"]) for r in res.records}
    simulated = {r["uid"]: (r["endpoint"], r["cached_gpu"], r["cached_offload"]) for r in sim["records"]["precise"]}
    assert simulated == live
    # precise pays for its index lookup, inside its decision.
    assert all(0 < r["lookup_ms"] <= r["decision_ms"] for r in res.records)
    # Both sessions are placed where their contexts fit: on different workers.
    assert {live["s0/main/0"][0], live["s1/main/0"][0]} == {"decode-0", "decode-1"}
