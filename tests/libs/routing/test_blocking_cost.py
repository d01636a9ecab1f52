"""The cost's defaults for scarce GPU cache, each on a small cluster where the answer is known by hand.

* blocking: a long prefill placed among many sessions makes their turns wait behind it, so it
  goes where fewer sessions are homed; the request's own session does not count, and a hit
  costs the others almost nothing;
* displacement at its recompute with attention over the mean context of the endpoint's sessions;
* the cliff only where no offload store holds what an LRU GPU cache thrashes;
* the working set keeps a session whose turn is in flight, however long it waits.
"""

from __future__ import annotations

import random

import pytest

from kvmesh.routing.load import LoadReport, LoadView
from kvmesh.routing.router import RouterCore, RouterCoreConfig
from kvmesh.routing.scoring import ScoringConfig, blocking_s, cliff_displaced, max_hit_blocks
from kvmesh.routing.types import EndpointView, Matches, RouteRequest, TierMatch

BS = 16
pytestmark = pytest.mark.timeout(60)


def _core(n: int, offload: bool = True, **scoring) -> RouterCore:
    core = RouterCore(RouterCoreConfig(policy="precise", block_size=BS, offload_enabled=offload,
                                       scoring=ScoringConfig(cluster_work_weight=0.0, **scoring)))
    for i in range(n):
        e = f"e{i}"
        core.set_endpoint(EndpointView(e, f"127.0.0.1:{9000 + i}", "m"))
    return core


def _capacity(core: RouterCore, blocks: int, *endpoints: str) -> None:
    for e in endpoints:   # vLLM's num_blocks counts its null block too
        core.load.update(e, LoadReport(num_blocks=blocks + 1, received_at=0.0))


def _home(core: RouterCore, session: str, endpoint: str, tokens: int) -> None:
    """A session whose last turn on ``endpoint`` (``tokens`` of context) ended at 0."""
    core.load.working_set.touch(session, endpoint, tokens, 0.0)
    core.load.working_set.refresh(session, endpoint, 0.0)


def _req(core: RouterCore, n: int, session: str) -> RouteRequest:
    rng = random.Random(0)
    keys = core.chain([rng.randrange(32000) for _ in range(n)], None, session).keys
    return RouteRequest("r", "m", keys, n, BS, session)


def _blocking(cfg: ScoringConfig, others: int, own: float) -> float:
    """Without a store (the cores below), where ``blocking_weight`` applies."""
    return cfg.blocking_weight * others * own * own / (2.0 * cfg.turn_interval_s)


# ---------------------------------------------------------------- blocking


def test_a_recompute_goes_where_fewer_sessions_wait_behind_it():
    n = 40_000
    core = _core(2, offload=False)
    cfg = core.cfg.scoring
    _capacity(core, 100_000, "e0", "e1")   # room for everyone: nothing is displaced
    for s in ("a", "b", "c"):
        _home(core, s, "e0", 1000)
    _home(core, "d", "e1", 1000)
    d = core.decide(_req(core, n, "s"), Matches(), now=1.0)
    by = {c.endpoint_id: c for c in d.candidates}
    own = cfg.prefill_cost(n, 0)
    assert by["e0"].own_s == by["e1"].own_s == own
    assert by["e0"].blocking_s == pytest.approx(_blocking(cfg, 3, own), rel=1e-12)
    assert by["e1"].blocking_s == pytest.approx(_blocking(cfg, 1, own), rel=1e-12)
    assert by["e0"].displace_s == by["e1"].displace_s == 0.0
    assert d.endpoint_id == "e1"
    # Without the term both cost the same, and the tie goes elsewhere than by the sessions.
    plain = _core(2, offload=False, blocking_weight=0.0)
    _capacity(plain, 100_000, "e0", "e1")
    for s in ("a", "b", "c"):
        _home(plain, s, "e0", 1000)
    _home(plain, "d", "e1", 1000)
    pd = plain.decide(_req(plain, n, "s"), Matches(), now=1.0)
    assert {c.endpoint_id: c.cost for c in pd.candidates}["e0"] == {c.endpoint_id: c.cost for c in pd.candidates}["e1"]


def test_the_requests_own_session_does_not_count_as_blocked():
    n = 40_000
    core = _core(2, offload=False)
    cfg = core.cfg.scoring
    _capacity(core, 100_000, "e0", "e1")
    _home(core, "s", "e0", 1000)     # the request's own session, homed on e0
    _home(core, "b", "e0", 1000)
    _home(core, "c", "e1", 1000)
    _home(core, "d", "e1", 1000)
    d = core.decide(_req(core, n, "s"), Matches(), now=1.0)
    by = {c.endpoint_id: c for c in d.candidates}
    own = cfg.prefill_cost(n, 0)
    assert by["e0"].blocking_s == pytest.approx(_blocking(cfg, 1, own), rel=1e-12)
    assert by["e1"].blocking_s == pytest.approx(_blocking(cfg, 2, own), rel=1e-12)
    assert d.endpoint_id == "e0"


def test_a_hit_at_home_costs_the_others_almost_nothing():
    n = 40_000
    core = _core(2, offload=False)
    cfg = core.cfg.scoring
    _capacity(core, 100_000, "e0", "e1")
    _home(core, "s", "e0", n)
    for s in ("a", "b", "c", "d", "e"):
        _home(core, s, "e0", 1000)
    cap = max_hit_blocks(n, BS)
    d = core.decide(_req(core, n, "s"), Matches(per_endpoint={"e0": TierMatch(gpu=cap)}), now=1.0)
    by = {c.endpoint_id: c for c in d.candidates}
    own = cfg.prefill_cost(n - cap * BS, cap * BS)
    assert by["e0"].blocking_s == pytest.approx(_blocking(cfg, 5, own), rel=1e-12)
    assert by["e0"].blocking_s < 1e-3 < by["e1"].own_s
    assert d.endpoint_id == "e0"


def test_the_blocking_weight_with_a_store_is_its_own():
    cfg = ScoringConfig(blocking_weight=0.14, blocking_weight_with_store=0.07, turn_interval_s=120.0)
    # 10 other sessions, a 36 s recompute: 0.14 * 10 * 36^2 / 240 = 7.56 s without a store.
    assert blocking_s(36.0, 10.0, cfg) == pytest.approx(7.56, rel=1e-12)
    assert blocking_s(36.0, 10.0, cfg, offload_enabled=False) == pytest.approx(7.56, rel=1e-12)
    assert blocking_s(36.0, 10.0, cfg, offload_enabled=True) == pytest.approx(3.78, rel=1e-12)
    assert blocking_s(36.0, 10.0, ScoringConfig(blocking_weight_with_store=0.0), offload_enabled=True) == 0.0


def test_blocking_is_off_at_weight_zero_or_without_other_sessions():
    cfg = ScoringConfig()
    assert blocking_s(10.0, 0.0, cfg) == 0.0
    assert blocking_s(0.0, 5.0, cfg) == 0.0
    assert blocking_s(10.0, 2.0, ScoringConfig(blocking_weight=0.0)) == 0.0
    assert blocking_s(10.0, 2.0, ScoringConfig(turn_interval_s=0.0)) == 0.0
    assert blocking_s(10.0, 2.0, cfg) == cfg.blocking_weight * 2.0 * 100.0 / (2.0 * cfg.turn_interval_s)


# ------------------------------------------------------- displacement with attention


@pytest.mark.parametrize("attention", [False, True])
def test_displaced_tokens_cost_their_recompute_with_attention_over_the_mean_context(attention: bool):
    n = 3200
    blocks = 1000
    core = _core(1, displace_attention=attention, displace_cliff=False, blocking_weight=0.0)
    cfg = core.cfg.scoring
    _capacity(core, blocks, "e0")
    _home(core, "a", "e0", 9000)
    _home(core, "b", "e0", 5400)    # 14,400 of 16,000 tokens: 1,600 left for a 3,200-token prompt
    d = core.decide(_req(core, n, "s"), Matches(), now=1.0)
    c = d.candidates[0]
    displaced = n - (blocks * BS - 14_400)
    per_token = cfg.prefill_s_per_token + (cfg.attn_s_per_token_pair * (14_400 / 2) / 2.0 if attention else 0.0)
    assert c.displace_s == pytest.approx(cfg.displace_weight * displaced * per_token, rel=1e-12)


def test_the_cliff_applies_where_no_store_holds_the_thrashed_contexts():
    n = 3200
    blocks = 1000
    others = 14_400

    def displaced(offload: bool, **scoring) -> float:
        core = _core(1, offload=offload, displace_attention=False, blocking_weight=0.0, **scoring)
        _capacity(core, blocks, "e0")
        _home(core, "a", "e0", others)
        return core.decide(_req(core, n, "s"), Matches(), now=1.0).candidates[0].displace_s

    cfg = ScoringConfig()
    assert cfg.displace_cliff and not cfg.displace_cliff_with_store
    cliff = cfg.displace_weight * cliff_displaced(blocks * BS, others, n) * cfg.prefill_s_per_token
    overflow = cfg.displace_weight * (n - (blocks * BS - others)) * cfg.prefill_s_per_token
    assert displaced(offload=False) == pytest.approx(cliff, rel=1e-12)
    assert displaced(offload=True) == pytest.approx(overflow, rel=1e-12)
    assert displaced(offload=True, displace_cliff_with_store=True) == pytest.approx(cliff, rel=1e-12)
    assert displaced(offload=False, displace_cliff=False) == pytest.approx(overflow, rel=1e-12)


def test_the_cliff_applies_where_few_sessions_share_the_cache():
    n = 3200
    blocks = 1000

    def displaced(sessions: int, **scoring) -> float:
        core = _core(1, offload=False, displace_attention=False, blocking_weight=0.0, **scoring)
        _capacity(core, blocks, "e0")
        for i in range(sessions):   # 14,400 tokens in all, whatever the number of sessions
            _home(core, f"o{i}", "e0", 14_400 // sessions)
        return core.decide(_req(core, n, "s"), Matches(), now=1.0).candidates[0].displace_s

    cfg = ScoringConfig()
    assert cfg.displace_cliff_max_sessions == 4
    cliff = cfg.displace_weight * cliff_displaced(blocks * BS, 14_400, n) * cfg.prefill_s_per_token
    overflow = cfg.displace_weight * (n - (blocks * BS - 14_400)) * cfg.prefill_s_per_token
    assert displaced(4) == pytest.approx(cliff, rel=1e-12)        # four contexts come back in turn
    assert displaced(5) == pytest.approx(overflow, rel=1e-12)     # five in no fixed order
    assert displaced(5, displace_cliff_max_sessions=0) == pytest.approx(cliff, rel=1e-12)


# ------------------------------------------------------------ the working set


def test_a_session_stays_in_the_working_set_while_its_turn_is_in_flight():
    lv = LoadView(reuse_window_s=10.0)
    ws = lv.working_set
    ws.touch("a", "e0", 800_000, 0.0)
    lv.update("e0", LoadReport(num_blocks=100_001, received_at=0.0))
    # Queued for 100 s, ten times the window: still the endpoint's to keep.
    assert lv.effective("e0", 100.0).resident_sessions == 1.0
    assert lv.effective("e0", 100.0).resident_tokens == 800_000
    ws.refresh("a", "e0", 100.0)              # the turn ended: the window runs from here
    assert lv.effective("e0", 109.0).resident_sessions == 1.0
    assert lv.effective("e0", 111.0).resident_sessions == 0.0
    assert lv.effective("e0", 111.0).resident_tokens == 0.0


def test_a_turn_never_heard_of_again_leaves_after_the_in_flight_bound():
    lv = LoadView(reuse_window_s=10.0)
    ws = lv.working_set
    ws.touch("a", "e0", 1000, 0.0)
    assert lv.effective("e0", ws.inflight_s + 9.0).resident_sessions == 1.0
    assert lv.effective("e0", ws.inflight_s + 11.0).resident_sessions == 0.0


def test_a_new_turn_moves_the_session_and_its_count():
    lv = LoadView(reuse_window_s=10.0)
    ws = lv.working_set
    ws.touch("a", "e0", 1000, 0.0)
    ws.touch("a", "e1", 2000, 1.0)
    assert lv.effective("e0", 2.0).resident_sessions == 0.0
    assert (lv.effective("e1", 2.0).resident_sessions, lv.effective("e1", 2.0).resident_tokens) == (1.0, 2000)
    ws.refresh("a", "e0", 3.0)                 # the old endpoint's end says nothing now
    assert lv.effective("e1", 3600.0).resident_sessions == 1.0
