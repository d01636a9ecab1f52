"""``llmd`` reproduces llm-d's precise-prefix-cache profile on small clusters computed by hand."""

from __future__ import annotations

import pytest

from kvmesh.routing.load import LoadReport
from kvmesh.routing.policy import RouteContext
from kvmesh.routing.router import RouterCore, RouterCoreConfig
from kvmesh.routing.types import EndpointView, Matches, RouteRequest, TierMatch

BS = 16
pytestmark = pytest.mark.timeout(60)


def _core(reports: dict[str, LoadReport]) -> RouterCore:
    core = RouterCore(RouterCoreConfig(policy="llmd", block_size=BS))
    for ep, rep in reports.items():
        core.set_endpoint(EndpointView(ep, "", "m"))
        core.load.update(ep, rep)
    return core


def _req(rid: str, blocks: int = 100, session: str = "s1") -> RouteRequest:
    return RouteRequest(rid, "m", list(range(1, blocks + 1)), blocks * BS + 8, BS, session)


def _scores(core: RouterCore, req: RouteRequest, matches: Matches, now: float = 0.5) -> dict[str, float]:
    pol = core.policy("llmd")
    eps = core.decode_endpoints("m")
    ctx = RouteContext(endpoints=eps, load=core.load, now=now, matches=matches)
    return dict(zip(ctx.ids, pol.scores(req, ctx, pol.matched_blocks(req, ctx)).tolist(), strict=True))


def test_weighted_sum_of_prefix_kv_and_queue_scores():
    core = _core({"e0": LoadReport(waiting=4, kv_usage=0.5), "e1": LoadReport(waiting=0, kv_usage=0.25),
                  "e2": LoadReport(waiting=2, kv_usage=0.0)})
    m = Matches(per_endpoint={"e0": TierMatch(gpu=40), "e1": TierMatch(gpu=10)})
    # prefix: min-max over the endpoints that match (10..40): e0 1, e1 0; e2 matches nothing: 0.
    # queue: (4 - waiting) / 4: e0 0, e1 1, e2 0.5.  kv: 1 - usage: 0.5, 0.75, 1.
    assert _scores(core, _req("r"), m) == {"e0": 2 * 1 + 0.5 + 0, "e1": 2 * 0 + 0.75 + 1, "e2": 0 + 1 + 0.5}
    d = core.decide(_req("r"), m, now=0.5)
    assert d.endpoint_id == "e0" and d.policy == "llmd"
    assert d.predicted_cached_tokens_gpu == 40 * BS


def test_a_lone_match_scores_one_and_equal_queues_score_one():
    core = _core({"e0": LoadReport(waiting=3, kv_usage=0.5), "e1": LoadReport(waiting=3, kv_usage=0.5)})
    m = Matches(per_endpoint={"e1": TierMatch(gpu=1)})
    # One block is enough for the full prefix score when no other endpoint matches.
    assert _scores(core, _req("r"), m) == {"e0": 0 + 0.5 + 1, "e1": 2 + 0.5 + 1}
    assert core.decide(_req("r"), m, now=0.5).endpoint_id == "e1"


def test_load_outweighs_a_shorter_match():
    # e1 holds 39 of e0's 40 blocks, yet min-max gives it no prefix score: load decides.
    core = _core({"e0": LoadReport(waiting=8, kv_usage=0.75), "e1": LoadReport(waiting=0, kv_usage=0.0),
                  "e2": LoadReport(waiting=0, kv_usage=0.0)})
    m = Matches(per_endpoint={"e0": TierMatch(gpu=40), "e1": TierMatch(gpu=39)})
    s = _scores(core, _req("r"), m)
    assert s == {"e0": 2 + 0.25 + 0, "e1": 0 + 1 + 1, "e2": 0 + 1 + 1}
    d = core.decide(_req("r"), m, now=0.5)
    assert d.endpoint_id == "e0"   # 2.25 > 2
    # The shared offload store belongs to no pod: it adds nothing to any endpoint's prefix score.
    m2 = Matches(per_endpoint={"e0": TierMatch(gpu=40), "e1": TierMatch(gpu=39)}, store=TierMatch(cpu=100))
    assert _scores(core, _req("r"), m2) == s


def test_ties_break_by_a_stable_hash_of_the_session():
    reports = {f"e{i}": LoadReport(waiting=0, kv_usage=0.0) for i in range(4)}
    picks = {s: _core(reports).decide(_req("r", session=s), Matches(), now=0.5).endpoint_id
             for s in ("a", "b", "c", "d", "e", "f")}
    again = {s: _core(reports).decide(_req("r", session=s), Matches(), now=0.5).endpoint_id for s in picks}
    assert picks == again
    assert len(set(picks.values())) > 1   # new sessions spread, not all to one endpoint


def test_speculative_entries_draw_the_next_request_to_the_same_endpoint():
    core = _core({"e0": LoadReport(waiting=0, kv_usage=0.0), "e1": LoadReport(waiting=0, kv_usage=0.0)})
    d1 = core.decide(_req("r1", session="x"), Matches(), now=0.5)
    core.on_routed(_req("r1", session="x"), d1, now=0.5)
    other = "e1" if d1.endpoint_id == "e0" else "e0"
    # The sibling (another session) sees the first pick's blocks on d1's endpoint only:
    # prefix 1 there, 0 elsewhere; queues (one request sent since the report) and KV as computed.
    s = _scores(core, _req("r2", session="y"), Matches(), now=0.6)
    assert s == {d1.endpoint_id: 2 + 1 + 0, other: 0 + 1 + 1}
    assert core.decide(_req("r2", session="y"), Matches(), now=0.6).endpoint_id == d1.endpoint_id
    # The entries expire after llm-d's 30 s.
    s = _scores(core, _req("r3", session="y"), Matches(), now=31.0)
    assert s[d1.endpoint_id] < 3


def test_registered_for_the_simulator_and_the_live_router():
    from kvmesh.routing.registry import available_policies, make_policy

    assert {"llmd", "dynamo"} <= set(available_policies())
    assert make_policy("llmd").uses_index and make_policy("dynamo").uses_index   # both get the index's matches
