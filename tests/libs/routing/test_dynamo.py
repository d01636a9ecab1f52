"""``dynamo`` reproduces Dynamo's KV router cost on small clusters computed by hand."""

from __future__ import annotations

import pytest

from kvmesh.routing.load import LoadReport
from kvmesh.routing.policy import RouteContext
from kvmesh.routing.registry import make_policy
from kvmesh.routing.router import RouterCore, RouterCoreConfig
from kvmesh.routing.types import EndpointView, Matches, RouteRequest, TierMatch

BS = 16
pytestmark = pytest.mark.timeout(60)


def _core(reports: dict[str, LoadReport]) -> RouterCore:
    core = RouterCore(RouterCoreConfig(policy="dynamo", block_size=BS))
    for ep, rep in reports.items():
        core.set_endpoint(EndpointView(ep, "", "m"))
        core.load.update(ep, rep)
    return core


def _req(rid: str, session: str = "s1") -> RouteRequest:
    return RouteRequest(rid, "m", list(range(1, 101)), 100 * BS + 8, BS, session)   # 100 full blocks


def _logits(core: RouterCore, req: RouteRequest, matches: Matches, now: float = 0.5, weight: float = 1.0):
    pol = make_policy("dynamo", overlap_score_weight=weight)
    eps = core.decode_endpoints("m")
    ctx = RouteContext(endpoints=eps, load=core.load, now=now, matches=matches)
    from kvmesh.routing.candidate_table import MatchColumns
    return dict(zip(ctx.ids, pol.logits(req, ctx, MatchColumns(ctx.pos).put_matches(matches)).tolist(), strict=True))


REPORTS = {"e0": LoadReport(waiting_prefill_tokens=3200, kv_usage=0.5, num_blocks=1000),
           "e1": LoadReport(kv_usage=0.25, num_blocks=1000),
           "e2": LoadReport(waiting_prefill_tokens=800, num_blocks=1000)}
MATCHES = Matches(per_endpoint={"e0": TierMatch(gpu=60), "e2": TierMatch(gpu=20)})


def test_logit_is_weighted_prefill_blocks_plus_decode_blocks():
    core = _core(REPORTS)
    # prefill blocks = (queued prefill + 1608 - overlap*16) / 16; decode = active blocks + 100.
    assert _logits(core, _req("r"), MATCHES) == {
        "e0": (3200 + 1608 - 60 * BS) / BS + (500 + 100),
        "e1": (0 + 1608) / BS + (250 + 100),
        "e2": (800 + 1608 - 20 * BS) / BS + (0 + 100)}
    d = core.decide(_req("r"), MATCHES, now=0.5)
    assert d.endpoint_id == "e2" and d.policy == "dynamo"
    assert d.predicted_cached_tokens_gpu == 20 * BS


def test_weight_scales_the_prefill_term_only():
    core = _core(REPORTS)
    assert _logits(core, _req("r"), MATCHES, weight=0.0) == {"e0": 600.0, "e1": 350.0, "e2": 100.0}
    big = _logits(core, _req("r"), MATCHES, weight=10.0)
    assert big["e0"] == 10 * (3200 + 1608 - 60 * BS) / BS + 600
    # The shared offload store is not a worker's overlap: it changes no logit.
    with_store = Matches(per_endpoint=MATCHES.per_endpoint, store=TierMatch(cpu=100))
    assert _logits(core, _req("r"), with_store) == _logits(core, _req("r"), MATCHES)


def test_requests_sent_since_the_report_count_on_their_worker():
    core = _core(REPORTS)
    r1 = _req("r1")
    d1 = core.decide(r1, MATCHES, now=0.5)
    core.on_routed(r1, d1, now=0.5)
    assert d1.endpoint_id == "e2" and d1.uncached_tokens == 1608 - 20 * BS
    # e2 now has r1's 1288 uncached tokens queued and its 1608 context tokens running.
    lg = _logits(core, _req("r2", "s2"), MATCHES, now=0.6)
    assert lg["e2"] == (800 + 1288 + 1608 - 20 * BS) / BS + (0 + 1608 / BS + 100)
    assert lg["e1"] == (0 + 1608) / BS + (250 + 100)
    assert core.decide(_req("r2", "s2"), MATCHES, now=0.6).endpoint_id == "e2"   # 411.5 < 450.5


def test_ties_break_by_a_stable_hash_of_the_session():
    reports = {f"e{i}": LoadReport() for i in range(4)}
    picks = {s: _core(reports).decide(_req("r", s), Matches(), now=0.5).endpoint_id for s in "abcdef"}
    assert picks == {s: _core(reports).decide(_req("r", s), Matches(), now=0.5).endpoint_id for s in "abcdef"}
    assert len(set(picks.values())) > 1
