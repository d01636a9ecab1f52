"""Prediction mismatches in the simulator: every miss is explained, and a view bug is caught.

The classifier's own cases are in tests/libs/routing/test_fidelity.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.routing.policy import Policy
from kvmesh_tools.clustersim import SimConfig, parts, simulate_policies
from kvmesh_tools.traffic.generator import GeneratorConfig, generate

pytestmark = pytest.mark.timeout(180)
TRACES = Path("/work/shared/traces/claude-code")


def _trace(sessions: int = 12, seed: int = 5):
    return generate(GeneratorConfig(sessions=sessions, seed=seed, turns_median=5, system_tokens=2048,
                                    first_user_tokens=400, growth_median=300, growth_p99=2000, output_median=64,
                                    output_p99=256, think_median_s=0.2, think_p99_s=2.0, max_context_tokens=8000,
                                    subagent_group_prob=0.3, group_max=6, subagent_system_tokens=1024,
                                    subagent_task_tokens=200, subagent_turns_median=3))


def _cfg(**kw) -> SimConfig:
    base = dict(decode_workers=2, prefill_workers=0, kv_capacity_tokens=12000, offload_capacity_tokens=0,
                start_window_s=1.0, seed=3)
    base.update(kw)
    return SimConfig(**base)


def _mm(rep: dict, policy: str) -> dict:
    return rep["results"][policy]["mismatches"]


def test_simulated_mismatches_are_explained() -> None:
    rep = simulate_policies(_trace(), _cfg(), ["precise", "llmd", "dynamo", "session"], jobs=1, records=True)
    for p in ("precise", "llmd", "dynamo"):
        assert _mm(rep, p)["view_bug"] == 0 and _mm(rep, p)["no_index"] == 0
        recs = rep["records"][p]
        wrong = [r for r in recs if not r["error"] and r["predicted_cached"] != r["actual_cached"]]
        assert len(wrong) == _mm(rep, p)["requests"]
        assert all(r["mismatch"] for r in wrong)
    # A GPU this small evicts prefixes a request was routed for before it is scheduled.
    assert _mm(rep, "dynamo")["evicted"] > 0
    # llm-d's speculative entries claim a finished request's blocks for their whole TTL, after the
    # engine has evicted them; precise's give way to the index once the request is over (on main
    # before that rule, precise had 24 such mispredictions here and llmd 29).
    assert _mm(rep, "llmd")["speculative"] > _mm(rep, "precise")["speculative"]
    # session does not read the index: its predictions are its own.
    assert _mm(rep, "session")["no_index"] == _mm(rep, "session")["requests"] > 0


def test_a_split_is_predicted_and_classified_as_the_live_router_does() -> None:
    """A P/D split's prediction is its decode endpoint's cache once the prefill endpoint's KV has
    arrived, compared with what that endpoint reused (``RouterService._final``); the simulator
    once compared the decode endpoint's cache before the transfer with the prefill's reuse, and
    classed nearly every split a miss."""
    from kvmesh.routing.fidelity import split_predicted_blocks

    trace = _trace()
    bs = trace.block_size
    rep = simulate_policies(trace, _cfg(prefill_workers=1, offload_capacity_tokens=400_000,
                                        kv_capacity_tokens=20000, split_threshold_tokens=512),
                            ["precise"], jobs=1, records=True)
    m = rep["results"]["precise"]
    recs = rep["records"]["precise"]
    splits = [r for r in recs if r["split"] and not r["error"]]
    assert m["split_requests"] == len(splits) > 0
    by_uid = {j.uid: j for j in _trace().requests()}
    for r in splits:
        full = split_predicted_blocks(by_uid[r["uid"]].input_tokens, bs, 0) * bs
        assert r["predicted_cached"] >= full            # every reusable block, once transferred
        assert (r["mismatch"] == "") == (r["predicted_cached"] == r["actual_cached"])
        assert r["mismatch"] in ("", "split")
    # The store carries every split's KV here: the decode endpoint reuses what was predicted.
    assert sum(r["predicted_cached"] == r["actual_cached"] for r in splits) == len(splits)
    assert m["mismatches"]["split"] == 0 and m["mismatches"]["view_bug"] == 0


def test_an_index_behind_the_engine_is_lag(monkeypatch: pytest.MonkeyPatch) -> None:
    publish = parts.SimWorker.publish
    calls = [0]

    def late(self: parts.SimWorker) -> None:   # apply KV events to the index one call in three
        calls[0] += 1
        if calls[0] % 3 == 0:
            publish(self)

    monkeypatch.setattr(parts.SimWorker, "publish", late)
    rep = simulate_policies(_trace(), _cfg(kv_capacity_tokens=20000), ["dynamo"], jobs=1)
    assert _mm(rep, "dynamo")["lag"] > 0 and _mm(rep, "dynamo")["view_bug"] == 0


def test_an_over_reporting_view_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    decision = Policy._decision

    def over(self, req, win, reason, table, fallback=""):   # the view claims two blocks it does not have
        d = decision(self, req, win, reason, table, fallback)
        d.predicted_cached_tokens_gpu += 2 * req.block_size
        return d

    monkeypatch.setattr(Policy, "_decision", over)
    rep = simulate_policies(_trace(), _cfg(kv_capacity_tokens=20000), ["precise", "dynamo"], jobs=1)
    for p in ("precise", "dynamo"):
        assert _mm(rep, p)["view_bug"] > 0


@pytest.mark.timeout(900)
@pytest.mark.skipif(not TRACES.is_dir(), reason="the shared real traces are not on this machine")
def test_no_view_bug_on_real_traces() -> None:
    from kvmesh_tools.traffic.readers import load_trace

    trace = load_trace([str(TRACES)], "weka", limit=2)
    for cap in (0, 4_000_000):
        rep = simulate_policies(trace, SimConfig(decode_workers=2, prefill_workers=1, kv_capacity_tokens=200_000,
                                                 offload_capacity_tokens=cap, seed=0),
                                ["precise", "llmd", "dynamo"], jobs=1)
        for p in ("precise", "llmd", "dynamo"):
            assert _mm(rep, p)["view_bug"] == 0, (cap, p, _mm(rep, p))


MOONCAKE = Path("/work/shared/traces/mooncake")


@pytest.mark.skipif(not MOONCAKE.is_dir(), reason="the shared real traces are not on this machine")
def test_no_view_bug_when_an_engine_holds_two_copies_of_a_block() -> None:
    """Mooncake's requests share prefixes across sessions and arrive together, so an engine often
    computes blocks it still holds again (a fully cached prompt's last block, a prefix restored
    from the store, prefills of one prefix side by side) and holds two copies. vLLM reports each
    copy's store and eviction; an index that dropped the block at the first eviction disagreed with the
    engine (2 / 1 / 1 view bugs here for precise / llmd / dynamo before the index counted copies)."""
    from kvmesh_tools.traffic.readers import load_trace

    trace = load_trace([str(MOONCAKE)], "mooncake", limit=600)
    rep = simulate_policies(trace, SimConfig(decode_workers=2, prefill_workers=1, kv_capacity_tokens=200_000,
                                             offload_capacity_tokens=4_000_000, seed=0),
                            ["precise", "llmd", "dynamo"], jobs=1)
    for p in ("precise", "llmd", "dynamo"):
        assert _mm(rep, p)["view_bug"] == 0, (p, _mm(rep, p))
