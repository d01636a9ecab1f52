"""``ScoringConfig.cold_first``: a new session goes to an endpoint nothing was placed on yet.

Each case is a small cluster where the right answer is known: e0 holds the prompt's shared
prefix (so its cost is the lowest), e1 and e2 have never taken a request.
"""

from __future__ import annotations

import pytest

from kvmesh.routing.load import LoadReport
from kvmesh.routing.router import RouterCore, RouterCoreConfig
from kvmesh.routing.scoring import ScoringConfig
from kvmesh.routing.types import EndpointView, Matches, RouteRequest, TierMatch

BS = 16
pytestmark = pytest.mark.timeout(60)
SHARED = Matches(per_endpoint={"e0": TierMatch(gpu=60)})   # 60 of the prompt's 100 blocks on e0


def _core(cold_first: bool, reports: dict[str, LoadReport] | None = None, after_s: float = 0.0) -> RouterCore:
    core = RouterCore(RouterCoreConfig(policy="precise", block_size=BS,
                                       scoring=ScoringConfig(cold_first=cold_first, cold_after_s=after_s)))
    for ep, rep in (reports or {f"e{i}": LoadReport(num_blocks=1000) for i in range(3)}).items():
        core.set_endpoint(EndpointView(ep, "", "m"))
        core.load.update(ep, rep)
    return core


def _req(rid: str, session: str) -> RouteRequest:
    return RouteRequest(rid, "m", list(range(1, 101)), 100 * BS + 8, BS, session)


def _route(core: RouterCore, req: RouteRequest, matches: Matches, now: float):
    d = core.decide(req, matches, now=now)
    core.on_routed(req, d, now=now)
    return d


def test_off_a_new_session_takes_the_warm_prefix():
    assert _core(False).decide(_req("r", "s"), SHARED, now=0.5).endpoint_id == "e0"


def test_on_a_new_session_goes_to_a_cold_idle_endpoint_and_says_so():
    d = _core(True).decide(_req("r", "s"), SHARED, now=0.5)
    assert d.endpoint_id in ("e1", "e2")
    assert "cold endpoint" in d.reason
    # The cost is reported unchanged; e0 is reported as set aside for being warm.
    assert {c.endpoint_id: c.excluded for c in d.candidates}["e0"] == "warm"


def test_once_every_endpoint_was_used_the_cost_decides_again():
    core = _core(True)
    routed = [(_req(f"r{i}", f"s{i}"), 0.5 + i / 10) for i in (1, 2)]
    picks = [(r, _route(core, r, SHARED, t)) for r, t in routed]
    assert {d.endpoint_id for _, d in picks} == {"e1", "e2"}   # each cold endpoint once
    for r, d in picks:
        core.on_finished(r, d, now=1.0)
    # e0 was never placed on, but the index shows it holding the prompt: it is warm, and
    # the cheapest once the router's speculative entries on e1 and e2 have expired.
    d = _route(core, _req("r3", "s3"), SHARED, 10.0)
    assert d.endpoint_id == "e0" and "cold endpoint" not in d.reason


def test_a_session_with_a_home_is_not_moved_to_a_cold_endpoint():
    core = _core(True)
    r1 = _req("r1", "s1")
    d1 = _route(core, r1, Matches(), 0.5)
    core.on_finished(r1, d1, now=0.6)
    held = Matches(per_endpoint={d1.endpoint_id: TierMatch(gpu=99)})
    d = core.decide(_req("r2", "s1"), held, now=1.0)
    assert d.endpoint_id == d1.endpoint_id and "cold endpoint" not in d.reason


def test_a_cold_endpoint_with_a_queue_is_not_taken():
    reports = {"e0": LoadReport(num_blocks=1000), "e1": LoadReport(running=2, num_blocks=1000),
               "e2": LoadReport(waiting=1, waiting_prefill_tokens=4000, num_blocks=1000)}
    d = _core(True, reports).decide(_req("r", "s"), SHARED, now=0.5)
    assert d.endpoint_id == "e0" and "cold endpoint" not in d.reason


def test_when_every_endpoint_is_cold_the_cost_decides():
    on, off = _core(True), _core(False)
    picks = [(c.decide(_req("r", s), Matches(), now=0.5).endpoint_id) for c in (on, off) for s in "ab"]
    assert picks[:2] == picks[2:]
    assert "cold endpoint" not in on.decide(_req("r", "a"), Matches(), now=0.5).reason


def test_no_endpoint_is_cold_during_the_routers_warm_up():
    core = _core(True, after_s=300.0)
    # The router's first decision is at 0.5: for 300 s the cost decides, and takes the warm prefix.
    d = _route(core, _req("r1", "s1"), SHARED, 0.5)
    assert d.endpoint_id == "e0" and "cold endpoint" not in d.reason
    core.on_finished(_req("r1", "s1"), d, now=1.0)
    assert core.decide(_req("r2", "s2"), SHARED, now=300.0).endpoint_id == "e0"
    late = core.decide(_req("r2", "s2"), SHARED, now=300.5)
    assert late.endpoint_id in ("e1", "e2") and "cold endpoint" in late.reason


def test_an_endpoint_that_joins_after_the_warm_up_is_cold_at_once():
    # The delay is the router's warm-up. A worker added later (scale-out) is empty, and should
    # take new sessions now, not cold_after_s after it joined.
    core = _core(True, {"e0": LoadReport(num_blocks=1000)}, after_s=300.0)
    d = _route(core, _req("r1", "s1"), SHARED, 0.5)
    core.on_finished(_req("r1", "s1"), d, now=1.0)
    core.set_endpoint(EndpointView("e1", "", "m"))
    core.load.update("e1", LoadReport(num_blocks=1000))
    early = core.decide(_req("r2", "s2"), SHARED, now=200.0)   # still in the warm-up
    assert early.endpoint_id == "e0" and "cold endpoint" not in early.reason
    # The warm-up is over; e1 has been known to this router for 200 s only.
    late = core.decide(_req("r3", "s3"), SHARED, now=400.0)
    assert late.endpoint_id == "e1" and "cold endpoint" in late.reason


def test_a_forgotten_endpoint_counts_as_cold_when_it_returns():
    core = _core(True)
    ep = _route(core, _req("r1", "s1"), SHARED, 0.5).endpoint_id
    pol = core.policy("precise")
    assert ep in pol.placed
    pol.forget_endpoint(ep)
    assert ep not in pol.placed
