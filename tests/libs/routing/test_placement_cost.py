"""The cost's cluster terms, each on a small cluster where the right answer is known by hand.

* cluster work: under saturation, a recompute away from the prefix's home is priced again,
  scaled by how saturated the cluster is; with an idle endpoint it is free;
* displacement: new blocks beyond an endpoint's empty ones evict cached KV, priced as its
  recompute; unknown cache contents (no count) price nothing;
* hold: under saturation, only endpoints holding enough of the prompt (GPU or restorable)
  may take it; with an idle endpoint, or no holder, the cost decides.

Expected figures are derived from the config's latency figures, as the cost states them.
Each term is checked on its own: the cores here price displacement by the overflow estimate at
the linear recompute price, without the blocking term, unless a test turns one on (``PLAIN``);
tests/libs/routing/test_blocking_cost.py checks those defaults.
"""

from __future__ import annotations

import math
import random

import pytest

from kvmesh.routing.load import LoadReport
from kvmesh.routing.router import RouterCore, RouterCoreConfig
from kvmesh.routing.scoring import ScoringConfig, max_hit_blocks
from kvmesh.routing.types import Decision, EndpointView, Matches, RouteRequest, TierMatch

BS = 16
# The displacement and blocking defaults off: the formulas below are the plain ones. A test that
# turns the cliff on gets it with a store as well (RouterCore's default has one).
PLAIN = {"displace_cliff": False, "displace_cliff_with_store": True, "displace_attention": False,
         "blocking_weight": 0.0}
pytestmark = pytest.mark.timeout(60)


def _core(n: int, offload_enabled: bool = True, **scoring: float) -> RouterCore:
    core = RouterCore(RouterCoreConfig(policy="precise", block_size=BS, offload_enabled=offload_enabled,
                                       scoring=ScoringConfig(**(PLAIN | scoring))))
    for i in range(n):
        core.set_endpoint(EndpointView(f"e{i}", f"127.0.0.1:{9000 + i}", "m"))
    return core


def _req(core: RouterCore, n: int, rid: str, session: str = "", seed: int = 0) -> RouteRequest:
    rng = random.Random(seed)
    keys = core.chain([rng.randrange(32000) for _ in range(n)], None, session).keys
    return RouteRequest(rid, "m", keys, n, BS, session)


def _decide_held_on_e0(core: RouterCore, n: int, cap: int) -> Decision:
    """Route an ``n``-token turn of session ``s`` whose first ``cap`` blocks e0 holds on its GPU."""
    return core.decide(_req(core, n, "r", session="s"), Matches(per_endpoint={"e0": TierMatch(gpu=cap)}), now=0.1)


def _own(cfg: ScoringConfig, n: int, cached: int) -> float:
    return cfg.prefill_cost(n - cached, cached)


# ---------------------------------------------------------------- cluster work


def _saturated_home(core: RouterCore, n: int, home_q: int, other_q: int) -> None:
    core.load.update("e0", LoadReport(running=1, waiting=2, waiting_prefill_tokens=home_q, received_at=0.0))
    core.load.update("e1", LoadReport(running=1, waiting=1, waiting_prefill_tokens=other_q, received_at=0.0))


def test_saturated_cluster_keeps_the_turn_home_when_the_move_only_trades_queue_for_recompute():
    n = 4000
    cfg = ScoringConfig(cluster_work_weight=1.0, saturation_s=0.5)
    cap = max_hit_blocks(n, BS)
    own_home, own_away = _own(cfg, n, cap * BS), _own(cfg, n, 0)
    # Queues chosen by hand: the away endpoint's queue + the recompute is less than the home's
    # queue (the request alone would reach its first token sooner away), but the recompute is
    # work the saturated cluster's queued requests wait behind, and priced once more it is not.
    other_q = 4000
    other_wait = other_q * cfg.prefill_s_per_token
    gap = own_away - own_home
    home_q = int((other_wait + gap + gap / 2) / cfg.prefill_s_per_token)
    assert other_wait >= cfg.saturation_s
    req = _req(core := _core(2, cluster_work_weight=1.0, saturation_s=0.5), n, "r", session="s")
    _saturated_home(core, n, home_q, other_q)
    home = Matches(per_endpoint={"e0": TierMatch(gpu=cap)})
    d = core.decide(req, home, now=0.1)
    by = {c.endpoint_id: c for c in d.candidates}
    assert d.endpoint_id == "e0"
    assert by["e0"].work_s == 0.0
    assert by["e1"].work_s == cfg.cluster_work_weight * 1.0 * (own_away - own_home)
    assert by["e1"].wait_s + by["e1"].own_s + by["e1"].decode_s < by["e0"].cost   # the old cost would move it
    # The same cluster without the term moves the turn.
    plain = _core(2, cluster_work_weight=0.0, hold_min_ratio=0.0)
    _saturated_home(plain, n, home_q, other_q)
    assert plain.decide(_req(plain, n, "r", session="s"), home, now=0.1).endpoint_id == "e1"


def test_an_idle_endpoint_makes_the_recompute_free_for_the_cluster():
    n = 4000
    cap = max_hit_blocks(n, BS)
    core = _core(2, cluster_work_weight=1.0, saturation_s=0.5)
    cfg = core.cfg.scoring
    home_q = int(3 * _own(cfg, n, 0) / cfg.prefill_s_per_token)
    # e1 has nothing queued: the cluster is not saturated, a recompute there delays nobody.
    core.load.update("e0", LoadReport(running=1, waiting=2, waiting_prefill_tokens=home_q, received_at=0.0))
    core.load.update("e1", LoadReport(running=1, received_at=0.0))
    d = _decide_held_on_e0(core, n, cap)
    assert d.endpoint_id == "e1"
    assert all(c.work_s == 0.0 for c in d.candidates)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0, 3.0])
def test_cluster_work_scales_with_the_least_loaded_queue(fraction: float):
    n = 2000
    cap = max_hit_blocks(n, BS)
    core = _core(2, cluster_work_weight=2.0, saturation_s=1.0)
    cfg = core.cfg.scoring
    q = int(fraction * cfg.saturation_s / cfg.prefill_s_per_token)
    for e in ("e0", "e1"):
        core.load.update(e, LoadReport(running=1, waiting_prefill_tokens=q, received_at=0.0))
    d = _decide_held_on_e0(core, n, cap)
    by = {c.endpoint_id: c for c in d.candidates}
    sat = min(1.0, q * cfg.prefill_s_per_token / cfg.saturation_s)
    assert by["e1"].work_s == cfg.cluster_work_weight * sat * (by["e1"].own_s - by["e0"].own_s)
    assert by["e1"].cost == by["e1"].wait_s + by["e1"].own_s + by["e1"].decode_s + by["e1"].work_s
    assert d.endpoint_id == "e0"


# ---------------------------------------------------------------- displaced KV


def _evict(cfg: ScoringConfig, d: float) -> float:
    """The price of ``d`` tokens of other sessions' KV evicted: their recompute (linear part)."""
    return d * cfg.prefill_s_per_token


def _capacity(core: RouterCore, blocks: int, *endpoints: str) -> None:
    """Endpoints that hold ``blocks`` blocks of KV: vLLM's num_blocks counts its null block too."""
    for e in endpoints:
        core.load.update(e, LoadReport(num_blocks=blocks + 1, received_at=0.0))


def test_a_new_session_goes_where_its_blocks_displace_no_reusable_kv():
    n = 1000
    need = -(-n // BS) * BS
    core = _core(3, displace_weight=1.0)
    cfg = core.cfg.scoring
    nb = 10 * need // BS
    _capacity(core, nb, "e0", "e1", "e2")
    ws = core.load.working_set
    # Recently used contexts: e0's fill its cache, e1's leave room for half the request, e2 has none.
    ws.touch("a", "e0", nb * BS // 2, 0.0)
    ws.touch("b", "e0", nb * BS // 2, 0.0)
    ws.touch("c", "e1", nb * BS - need // 2, 0.0)
    for i in range(8):
        d = core.decide(_req(core, n, f"r{i}", session=f"s{i}", seed=i), Matches(), now=0.1)
        by = {c.endpoint_id: c for c in d.candidates}
        assert d.endpoint_id == "e2"
        assert by["e0"].displace_s == cfg.displace_weight * _evict(cfg, need)
        assert by["e1"].displace_s == cfg.displace_weight * _evict(cfg, need - need // 2)
        assert by["e2"].displace_s == 0.0
    # Without the term every endpoint ties on cost and the session's hash spreads them.
    plain = _core(3, displace_weight=0.0)
    _capacity(plain, nb, "e0", "e1", "e2")
    picks = {plain.decide(_req(plain, n, f"r{i}", session=f"s{i}", seed=i), Matches(), now=0.1).endpoint_id
             for i in range(8)}
    assert len(picks) > 1


def test_the_sessions_own_context_is_not_displaced_by_its_next_turn():
    n = 3000
    cap = max_hit_blocks(n, BS)
    need = -(-n // BS) * BS
    core = _core(2, displace_weight=1.0)
    cfg = core.cfg.scoring
    nb = 2 * cap
    _capacity(core, nb, "e0", "e1")
    ws = core.load.working_set
    # Both caches are full of recent contexts; one of e0's is this session's own, and the
    # other one there leaves exactly room for this whole (longer) prompt.
    ws.touch("s", "e0", n - 600, 0.0)
    ws.touch("other0", "e0", nb * BS - need, 0.0)
    ws.touch("other1", "e1", nb * BS, 0.0)
    d = _decide_held_on_e0(core, n, cap)
    by = {c.endpoint_id: c for c in d.candidates}
    assert d.endpoint_id == "e0"
    # At home the old context is reused, not displaced; the prompt fits beside other0's.
    assert by["e0"].displace_s == 0.0
    assert by["e1"].displace_s == cfg.displace_weight * _evict(cfg, need)
    assert ws.home("s") == ("e0", n - 600)   # deciding changes nothing; routing counts the new prompt
    core.on_routed(_req(core, n, "r2", session="s"), d, now=0.2)
    assert ws.home("s") == ("e0", n)


def test_cached_blocks_of_a_prompt_occupy_the_cache_beside_the_others():
    n = 3000
    cap = max_hit_blocks(n, BS)
    need = -(-n // BS) * BS
    core = _core(1, displace_weight=1.0)
    cfg = core.cfg.scoring
    nb = 2 * cap
    _capacity(core, nb, "e0")
    ws = core.load.working_set
    # The session's old context (all but the last 600 tokens) is cached at home; another
    # session's context takes the rest of the cache. The new blocks have no room of their
    # own: they evict other0's KV, as many tokens as the prompt exceeds what other0 leaves
    # (the blocks allocated), never more.
    ws.touch("s", "e0", n - 600, 0.0)
    ws.touch("other0", "e0", nb * BS - (n - 600), 0.0)
    d = _decide_held_on_e0(core, n, cap)
    c = d.candidates[0]
    fresh = -(-c.uncached_tokens // BS) * BS
    over = need - (n - 600)
    assert c.displace_s == cfg.displace_weight * _evict(cfg, min(fresh, over)) > 0.0


def test_refresh_keeps_a_context_in_the_working_set_until_a_window_after_its_turn_ends():
    core = _core(2, displace_weight=1.0, reuse_window_s=10.0)
    ws = core.load.working_set
    ws.touch("s", "e0", 1000, 0.0)
    ws.refresh("s", "e1", 8.0)        # a turn elsewhere does not refresh e0's entry
    ws.refresh("s", "e0", 8.0)        # the turn routed at 0 ended at 8 (it queued that long)
    ws.expire(15.0)
    assert ws.home("s") == ("e0", 1000)
    ws.expire(18.5)
    assert ws.home("s") == ("", 0)
    # Through the router core: finishing a turn refreshes its session's context.
    req = _req(core, 500, "r", session="t")
    d = core.decide(req, Matches(), now=20.0)
    core.on_routed(req, d, now=20.0)
    core.on_finished(req, d, now=29.0)
    ws.expire(35.0)
    assert ws.home("t") == (d.endpoint_id, 500)


def test_contexts_leave_the_working_set_after_the_reuse_window():
    core = _core(2, displace_weight=1.0, reuse_window_s=10.0)
    _capacity(core, 100, "e0", "e1")
    core.load.working_set.touch("a", "e0", 100 * BS, 0.0)
    core.load.working_set.touch("b", "e1", 100 * BS, 5.0)
    # Both turns ended when they were routed (the window runs from a turn's end).
    core.load.working_set.refresh("a", "e0", 0.0)
    core.load.working_set.refresh("b", "e1", 5.0)
    d = core.decide(_req(core, 500, "r", session="s"), Matches(), now=12.0)
    by = {c.endpoint_id: c for c in d.candidates}
    # a's context is 12 s old, past the window: evicting it is free. b's is 7 s old.
    assert by["e0"].displace_s == 0.0 < by["e1"].displace_s
    assert d.endpoint_id == "e0"


def test_unknown_capacity_prices_no_displacement():
    core = _core(2, displace_weight=1.0)
    core.load.working_set.touch("a", "e0", 10_000, 0.0)
    d = core.decide(_req(core, 500, "r", session="s"), Matches(), now=0.1)
    assert all(c.displace_s == 0.0 for c in d.candidates)


def test_capacity_is_the_reported_blocks_minus_the_null_block():
    n = 640
    need = -(-n // BS) * BS
    core = _core(2, displace_weight=1.0)
    cfg = core.cfg.scoring
    # Both report 41 blocks, 40 of which hold KV. e0's recent contexts leave exactly this
    # request's blocks free; e1's leave one block fewer.
    for e in ("e0", "e1"):
        core.load.update(e, LoadReport(num_blocks=41, received_at=0.0))
    assert core.load.effective("e0", 0.1).capacity_blocks == 40
    core.load.working_set.touch("a", "e0", 40 * BS - need, 0.0)
    core.load.working_set.touch("b", "e1", 40 * BS - need + BS, 0.0)
    d = core.decide(_req(core, n, "r", session="s"), Matches(), now=0.1)
    by = {c.endpoint_id: c for c in d.candidates}
    assert by["e0"].displace_s == 0.0
    assert by["e1"].displace_s == cfg.displace_weight * _evict(cfg, BS)
    assert d.endpoint_id == "e0"


def test_blocks_restored_from_the_store_displace_like_recomputed_ones():
    n = 3200
    cap = max_hit_blocks(n, BS)
    need = -(-n // BS) * BS
    core = _core(2, displace_weight=1.0)
    cfg = core.cfg.scoring
    nb = 4 * cap
    _capacity(core, nb, "e0", "e1")
    ws = core.load.working_set
    # e0 holds the session's context on its GPU; e1's cache is full of other sessions' recent
    # contexts. The store holds the whole prefix, so on e1 the request recomputes one block
    # and restores the rest, and every one of those blocks needs a GPU block there.
    ws.touch("s", "e0", n - 600, 0.0)
    ws.touch("other", "e1", nb * BS, 0.0)
    m = Matches(per_endpoint={"e0": TierMatch(gpu=cap)}, store=TierMatch(cpu=cap))
    d = core.decide(_req(core, n, "r", session="s"), m, now=0.1)
    by = {c.endpoint_id: c for c in d.candidates}
    assert by["e1"].offload_blocks == cap and by["e1"].uncached_tokens == n - cap * BS
    assert by["e1"].displace_s == cfg.displace_weight * _evict(cfg, need)
    assert by["e0"].displace_s == 0.0
    assert d.endpoint_id == "e0"



# ---------------------------------------------------------------- holding a turn for its holder


def _queues(core: RouterCore, **prefill: int) -> None:
    """Load reports with ``prefill[e]`` tokens of prefill queued on each endpoint (0: idle)."""
    for e, q in prefill.items():
        core.load.update(e, LoadReport(running=1, waiting=2 if q else 0, waiting_prefill_tokens=q, received_at=0.0))


def _long_home_queue(cfg: ScoringConfig, n: int) -> int:
    """Prefill queued on the home: its wait exceeds a recompute elsewhere plus every other term."""
    return int(20 * _own(cfg, n, 0) / cfg.prefill_s_per_token)


@pytest.mark.parametrize("ratio", [0.25, 0.5, 1.0])
def test_saturated_cluster_holds_the_turn_for_the_endpoint_that_holds_its_prompt(ratio: float):
    n = 4000
    cap = max_hit_blocks(n, BS)
    core = _core(3, hold_min_ratio=ratio, cluster_work_weight=0.0, displace_weight=0.0)
    cfg = core.cfg.scoring
    _queues(core, e0=_long_home_queue(cfg, n), e1=BS, e2=2 * BS)
    # The home is hot too: its queue is far above the others'.
    core.load.update("e0", LoadReport(running=1, waiting=12, waiting_prefill_tokens=_long_home_queue(cfg, n),
                                      received_at=0.0))
    held = math.ceil(ratio * cap)   # the fewest blocks that still hold the prompt
    d = core.decide(_req(core, n, "r", session="s"), Matches(per_endpoint={"e0": TierMatch(gpu=held)}), now=0.1)
    by = {c.endpoint_id: c for c in d.candidates}
    # On cost alone e1 wins by far (e0's queue); it is excluded, and e0 is hot but holds.
    assert by["e1"].cost < by["e0"].cost and by["e0"].hot
    assert d.endpoint_id == "e0"
    assert (by["e0"].excluded, by["e1"].excluded, by["e2"].excluded) == ("", "held", "held")


def test_below_the_ratio_the_cost_decides():
    n = 4000
    cap = max_hit_blocks(n, BS)
    core = _core(2, hold_min_ratio=0.5, cluster_work_weight=0.0, displace_weight=0.0)
    cfg = core.cfg.scoring
    _queues(core, e0=_long_home_queue(cfg, n), e1=BS)
    m = Matches(per_endpoint={"e0": TierMatch(gpu=cap // 2 - 1)})
    d = core.decide(_req(core, n, "r", session="s"), m, now=0.1)
    assert d.endpoint_id == "e1"
    assert all(c.excluded != "held" for c in d.candidates)


def test_an_idle_endpoint_lifts_the_hold():
    n = 4000
    cap = max_hit_blocks(n, BS)
    core = _core(2, hold_min_ratio=0.5, cluster_work_weight=0.0, displace_weight=0.0)
    cfg = core.cfg.scoring
    # e1 has nothing queued: the cluster is not saturated, a recompute there evicts in no queue.
    _queues(core, e0=_long_home_queue(cfg, n), e1=0)
    d = _decide_held_on_e0(core, n, cap)
    assert d.endpoint_id == "e1"


def test_a_prefix_restorable_from_the_store_is_held_everywhere():
    n = 4000
    cap = max_hit_blocks(n, BS)
    core = _core(2, hold_min_ratio=0.5, cluster_work_weight=0.0, displace_weight=0.0)
    cfg = core.cfg.scoring
    _queues(core, e0=_long_home_queue(cfg, n), e1=BS)
    # Every endpoint can restore the prefix: a move recomputes nothing, so nothing is held.
    m = Matches(per_endpoint={"e0": TierMatch(gpu=cap)}, store=TierMatch(cpu=cap))
    d = core.decide(_req(core, n, "r", session="s"), m, now=0.1)
    assert d.endpoint_id == "e1"
    assert all(not c.excluded for c in d.candidates)


def test_hold_off_moves_the_turn():
    n = 4000
    cap = max_hit_blocks(n, BS)
    core = _core(2, hold_min_ratio=0.0, cluster_work_weight=0.0, displace_weight=0.0)
    cfg = core.cfg.scoring
    _queues(core, e0=_long_home_queue(cfg, n), e1=BS)
    d = _decide_held_on_e0(core, n, cap)
    assert d.endpoint_id == "e1"


def test_a_new_prompt_is_placed_by_cost_under_saturation():
    n = 4000
    core = _core(3, hold_min_ratio=0.5, cluster_work_weight=0.0, displace_weight=0.0)
    cfg = core.cfg.scoring
    _queues(core, e0=_long_home_queue(cfg, n), e1=BS, e2=4 * BS)
    d = core.decide(_req(core, n, "r", session="s"), Matches(), now=0.1)
    assert d.endpoint_id == "e1"


# ---------------------------------------------------------------- displacement on a thrashing endpoint


@pytest.mark.parametrize("others_x", [1.0, 1.5, 2.0, 3.0])
def test_displacement_fades_as_the_others_working_set_exceeds_the_cache(others_x: float):
    n = 3200
    nb = 1000
    core = _core(1, displace_weight=1.0, displace_free_at=2.0)
    cfg = core.cfg.scoring
    _capacity(core, nb, "e0")
    cap_t = nb * BS
    core.load.working_set.touch("other", "e0", int(others_x * cap_t), 0.0)
    d = core.decide(_req(core, n, "r", session="s"), Matches(), now=0.1)
    need = -(-n // BS) * BS
    full = cfg.displace_weight * _evict(cfg, need)     # nothing fits beside the others: all of it evicts
    kept = min(1.0, max(0.0, 2.0 - others_x))          # linear from 1x (all kept) to 2x (none)
    assert d.candidates[0].displace_s == pytest.approx(full * kept)


def test_a_thrashing_endpoint_takes_a_new_session_before_one_at_capacity():
    n = 3200
    nb = 1000
    core = _core(2, displace_weight=1.0, displace_free_at=2.0)
    _capacity(core, nb, "e0", "e1")
    core.load.working_set.touch("a", "e0", nb * BS, 0.0)         # exactly full of live contexts
    core.load.working_set.touch("b", "e1", 3 * nb * BS, 0.0)     # three caches' worth: recycled anyway
    d = core.decide(_req(core, n, "r", session="s"), Matches(), now=0.1)
    by = {c.endpoint_id: c for c in d.candidates}
    assert by["e1"].displace_s == 0.0 < by["e0"].displace_s
    assert d.endpoint_id == "e1"
    # Priced in full everywhere (the default), the two endpoints tie and the hash decides.
    plain = _core(2, displace_weight=1.0)
    _capacity(plain, nb, "e0", "e1")
    plain.load.working_set.touch("a", "e0", nb * BS, 0.0)
    plain.load.working_set.touch("b", "e1", 3 * nb * BS, 0.0)
    pd = plain.decide(_req(plain, n, "r", session="s"), Matches(), now=0.1)
    assert {c.endpoint_id: c.displace_s for c in pd.candidates}["e0"] == \
        {c.endpoint_id: c.displace_s for c in pd.candidates}["e1"] > 0.0


# ---------------------------------------------------------------- displacement at the LRU cliff


@pytest.mark.parametrize(("others_x", "expect"), [
    (0.5, "fits"), (0.99, "pushes over"), (1.0, "pushes over"), (1.01, "already over"), (3.0, "already over")])
def test_cliff_prices_the_working_set_a_placement_pushes_over_the_cache(others_x: float, expect: str):
    n = 3200
    nb = 1000
    core = _core(1, displace_weight=1.0, displace_cliff=True)
    cfg = core.cfg.scoring
    _capacity(core, nb, "e0")
    cap_t = nb * BS
    others = int(others_x * cap_t)
    core.load.working_set.touch("other", "e0", others, 0.0)
    d = core.decide(_req(core, n, "r", session="s"), Matches(), now=0.1)
    need = -(-n // BS) * BS
    displaced = {"fits": 0, "pushes over": others + need, "already over": need}[expect]
    if expect == "fits":
        assert others + need <= cap_t
    assert d.candidates[0].displace_s == pytest.approx(cfg.displace_weight * _evict(cfg, displaced))


def test_cliff_sends_a_new_session_to_the_thrashing_endpoint_not_over_the_edge():
    n = 3200
    nb = 1000
    need = -(-n // BS) * BS

    def decide(cliff: bool):
        core = _core(2, displace_weight=1.0, displace_cliff=cliff)
        _capacity(core, nb, "e0", "e1")
        core.load.working_set.touch("a", "e0", nb * BS - need // 2, 0.0)   # half the prompt fits beside "a"
        core.load.working_set.touch("b", "e1", 2 * nb * BS, 0.0)           # twice the cache: thrashes already
        return core.decide(_req(core, n, "r", session="s"), Matches(), now=0.1)

    # The overflow estimate evicts half a prompt on e0 against a whole one on e1, so it tips e0
    # over its cache; at the cliff that costs everything "a" has there, so e1 takes the session.
    d = decide(cliff=False)
    assert d.endpoint_id == "e0"
    d = decide(cliff=True)
    by = {c.endpoint_id: c for c in d.candidates}
    cfg = ScoringConfig()
    assert by["e0"].displace_s == pytest.approx(_evict(cfg, nb * BS - need // 2 + need))
    assert by["e1"].displace_s == pytest.approx(_evict(cfg, need))
    assert d.endpoint_id == "e1"


def test_cliff_leaves_a_session_home_while_its_own_context_fits_there():
    n = 3200
    nb = 1000
    cap = max_hit_blocks(n, BS)
    core = _core(2, displace_weight=1.0, displace_cliff=True, cluster_work_weight=0.0)
    _capacity(core, nb, "e0", "e1")
    # The session's own context (last turn, 3,000 tokens) is counted on e0 but is what it reuses.
    core.load.working_set.touch("s", "e0", 3000, 0.0)
    core.load.working_set.touch("a", "e0", nb * BS - 3300, 0.0)
    d = _decide_held_on_e0(core, n, cap)
    assert d.endpoint_id == "e0"
    assert {c.endpoint_id: c.displace_s for c in d.candidates}["e0"] == 0.0


# ---------------------------------------------------------------- displaced KV the store holds


def _restore(cfg: ScoringConfig, d: float) -> float:
    """The price of ``d`` displaced tokens the store gives back: their host-to-device copy."""
    return d * cfg.cpu_restore_s_per_token


@pytest.mark.parametrize("cliff", [False, True])
@pytest.mark.parametrize(("others", "case"), [(14_000, "pushes over"), (20_000, "already over")])
def test_store_price_charges_a_restore_for_the_displaced_kv_the_store_holds(cliff: bool, others: int, case: str):
    n, nb = 3200, 1000          # capacity 16,000 tokens; the prompt needs 3,200 (200 blocks)
    others_stored = 6000        # what the store held of the other session's context when it was routed
    own_stored = 100 * BS       # the store's leading match of this prompt
    core = _core(1, displace_weight=1.0, displace_cliff=cliff, displace_store_price=True)
    cfg = core.cfg.scoring
    _capacity(core, nb, "e0")
    core.load.working_set.touch("other", "e0", others, 0.0, others_stored)
    d = core.decide(_req(core, n, "r", session="s"), Matches(store=TierMatch(cpu=100)), now=0.1)
    if cliff:
        # Whole contexts go: the other's and the prompt's (pushed over), or the prompt's alone.
        displaced, stored = {"pushes over": (others + n, others_stored + own_stored),
                             "already over": (n, own_stored)}[case]
    else:
        # The overflow estimate: the prompt's new blocks beyond the room left, at most its new blocks
        # (here all 200: none is on the GPU), taken from the others' contexts in their stored share.
        displaced = min(n, max(n - (nb * BS - others), 0))
        stored = displaced * others_stored / others
    want = _evict(cfg, displaced - stored) + _restore(cfg, stored)
    assert d.candidates[0].displace_s == pytest.approx(want, rel=1e-12)
    assert 0.0 < want < _evict(cfg, displaced)
    # Off (the default), every displaced token is a recompute.
    plain = _core(1, displace_weight=1.0, displace_cliff=cliff)
    _capacity(plain, nb, "e0")
    plain.load.working_set.touch("other", "e0", others, 0.0, others_stored)
    p = plain.decide(_req(plain, n, "r", session="s"), Matches(store=TierMatch(cpu=100)), now=0.1)
    assert p.candidates[0].displace_s == pytest.approx(_evict(cfg, displaced), rel=1e-12)


def test_store_price_sends_a_session_where_the_store_keeps_what_it_displaces():
    n, nb = 3200, 1000
    core = _core(2, displace_weight=1.0, displace_store_price=True, cluster_work_weight=0.0)
    _capacity(core, nb, "e0", "e1")
    # The same working set on both endpoints; only e1's sessions' contexts are kept by the store.
    core.load.working_set.touch("a", "e0", 14_000, 0.0, 0)
    core.load.working_set.touch("b", "e1", 14_000, 0.0, 14_000)
    d = core.decide(_req(core, n, "r", session="s"), Matches(), now=0.1)
    by = {c.endpoint_id: c.displace_s for c in d.candidates}
    cfg = core.cfg.scoring
    assert by["e0"] == pytest.approx(_evict(cfg, n - 2000), rel=1e-12)
    assert by["e1"] == pytest.approx(_restore(cfg, n - 2000), rel=1e-12)
    assert d.endpoint_id == "e1"


def test_store_price_is_off_without_an_offload_store():
    core = RouterCore(RouterCoreConfig(policy="precise", block_size=BS, offload_enabled=False,
                                       scoring=ScoringConfig(**PLAIN, displace_weight=1.0, displace_store_price=True)))
    core.set_endpoint(EndpointView("e0", "127.0.0.1:9000", "m"))
    _capacity(core, 1000, "e0")
    core.load.working_set.touch("other", "e0", 14_000, 0.0, 14_000)
    d = core.decide(_req(core, 3200, "r", session="s"), Matches(store=TierMatch(cpu=100)), now=0.1)
    assert d.candidates[0].displace_s == pytest.approx(_evict(core.cfg.scoring, 3200 - 2000), rel=1e-12)


def test_routed_session_counts_what_the_store_held_of_its_prompt():
    n = 3200
    core = _core(2, displace_weight=1.0, displace_store_price=True)
    _capacity(core, 1000, "e0", "e1")
    req = _req(core, n, "r", session="s")
    d = core.decide(req, Matches(store=TierMatch(cpu=120)), now=0.1)
    core.on_routed(req, d, now=0.1)
    ws = core.load.working_set
    assert ws.home("s") == (d.endpoint_id, n)
    assert ws.home_stored("s") == 120 * BS
    assert core.load.effective(d.endpoint_id, 0.2).stored_tokens == 120 * BS
    # The next turn replaces the session's entry: its stored part goes with it.
    req2 = _req(core, n + 160, "r2", session="s")
    d2 = core.decide(req2, Matches(), now=0.3)
    core.on_routed(req2, d2, now=0.3)
    assert ws.home_stored("s") == 0
    assert sum(core.load.effective(e, 0.4).stored_tokens for e in ("e0", "e1")) == 0


# ------------------------------------------------- store_keep: what a churning store keeps


def _restore_cost(cfg: ScoringConfig, tokens: float) -> float:
    return cfg.restore_overhead_s + tokens * cfg.cpu_restore_s_per_token


@pytest.mark.parametrize("wait_of_life", [0.0, 0.25, 0.5, 1.0, 2.0])
def test_store_keep_prices_a_restore_the_store_loses_while_the_turn_waits(wait_of_life: float):
    """The store keeps the session's context ``life`` more seconds; the turn waits ``wait`` on the
    only endpoint. A share wait/life of the restorable tokens is gone when it is scheduled, and is
    priced as a recompute after the kept part."""
    n, store_blocks = 3200, 150          # the store holds 2,400 of 3,200 tokens
    core = _core(1, store_keep=True, displace_weight=0.0, cluster_work_weight=0.0)
    cfg = core.cfg.scoring
    life, age = 400.0, 100.0             # horizon 500 s; the session's last turn ended 100 s ago
    wait = wait_of_life * life
    core.load.store_horizon.horizon_s = life + age
    core.load.working_set.touch("s", "e0", 3000, 0.0)
    core.load.working_set.refresh("s", "e0", 1.0)
    _queues(core, e0=int(round(wait / cfg.prefill_s_per_token)))
    d = core.decide(_req(core, n, "r", session="s"), Matches(store=TierMatch(cpu=store_blocks)), now=1.0 + age)
    c = d.candidates[0]
    restorable = store_blocks * BS
    lost = min(1.0, c.wait_s / life) * restorable
    want = (cfg.prefill_cost(n - restorable + lost, restorable - lost)
            + _restore_cost(cfg, restorable) - lost * cfg.cpu_restore_s_per_token)
    assert c.own_s == pytest.approx(want, rel=1e-12)
    # The prediction is what the store holds now: the term prices the risk, it changes no view.
    assert c.offload_blocks == store_blocks and d.predicted_cached_tokens_offload == restorable
    if wait_of_life == 0.0:
        assert c.own_s == pytest.approx(_own(cfg, n, restorable) + _restore_cost(cfg, restorable), rel=1e-12)


def test_store_keep_leaves_a_turn_home_when_the_move_counts_on_a_store_that_churns():
    """e0 holds the context on its GPU behind a long queue; e1 has a shorter queue and could
    restore the context from the store. With a store that keeps contexts (no loss seen) the
    restore is cheap and the turn moves; with a store whose horizon is shorter than e1's queue
    the restore would be gone by the time the turn runs there, and it stays home."""
    n = 4000
    cap = max_hit_blocks(n, BS)

    def decide(horizon: float) -> str:
        core = _core(2, store_keep=True, displace_weight=0.0, cluster_work_weight=0.0)
        cfg = core.cfg.scoring
        core.load.store_horizon.horizon_s = horizon
        # e1's queue: 5 s; e0's: e1's plus half a recompute of the prompt.
        q1 = 5.0
        q0 = q1 + 0.5 * _own(cfg, n, 0)
        _queues(core, e0=int(q0 / cfg.prefill_s_per_token), e1=int(q1 / cfg.prefill_s_per_token))
        m = Matches(per_endpoint={"e0": TierMatch(gpu=cap)}, store=TierMatch(cpu=cap))
        return core.decide(_req(core, n, "r", session="s"), m, now=1.0).endpoint_id

    assert decide(math.inf) == "e1"     # nothing lost yet: the restore is a copy
    assert decide(4.0) == "e0"          # the store keeps contexts 4 s; e1's queue is 5 s


def test_store_keep_is_off_without_an_offload_store():
    core = RouterCore(RouterCoreConfig(policy="precise", block_size=BS, offload_enabled=False,
                                       scoring=ScoringConfig(**PLAIN, store_keep=True)))
    core.set_endpoint(EndpointView("e0", "127.0.0.1:9000", "m"))
    core.load.store_horizon.horizon_s = 1.0
    _queues(core, e0=100_000)
    d = core.decide(_req(core, 3200, "r", session="s"), Matches(store=TierMatch(cpu=150)), now=0.5)
    assert d.candidates[0].own_s == pytest.approx(_own(core.cfg.scoring, 3200, 0), rel=1e-12)


def test_store_horizon_follows_what_the_store_kept_of_returning_sessions():
    """A routed turn compares what the store holds of the session's previous prompt with what it
    was given when that turn ended: a loss pulls the horizon down to its age, a context kept past
    the horizon pushes it up; nothing is learnt while the option is off."""
    n = 3200                              # 200 blocks
    core = _core(1, store_keep=True)
    hz = core.load.store_horizon

    def turn(rid: str, t: float, stored: int, end: float) -> None:
        req = _req(core, n, rid, session="s")
        d = core.decide(req, Matches(per_endpoint={"e0": TierMatch(gpu=199)}, store=TierMatch(cpu=stored)), now=t)
        core.on_routed(req, d, now=t)
        core.on_finished(req, d, now=end)

    turn("r1", 0.0, 0, 1.0)               # first turn: nothing to compare
    assert (hz.samples, hz.horizon_s) == (0, math.inf)
    turn("r2", 101.0, 199, 102.0)         # 100 s later the store kept all of it: no loss yet
    assert (hz.samples, hz.losses, hz.horizon_s) == (1, 0, math.inf)
    turn("r3", 302.0, 120, 303.0)         # 200 s later it lost the tail: horizon 200 s
    assert (hz.losses, hz.horizon_s) == (1, pytest.approx(200.0))
    turn("r4", 703.0, 199, 704.0)         # 400 s later all kept: up by a tenth of the difference
    assert hz.horizon_s == pytest.approx(220.0)
    turn("r5", 754.0, 10, 755.0)          # a loss at 50 s: down by a tenth
    assert hz.horizon_s == pytest.approx(220.0 + 0.1 * (50.0 - 220.0))
    # The session's life in the store counts from its last turn's end.
    assert core.load.store_life_s("s", 800.0) == pytest.approx(hz.horizon_s - 45.0)
    assert core.load.store_life_s("new", 800.0) == pytest.approx(hz.horizon_s)
    off = _core(1)
    req = _req(off, n, "q", session="s")
    off.load.working_set.touch("s", "e0", n, 0.0)
    d = off.decide(req, Matches(store=TierMatch(cpu=10)), now=500.0)
    off.on_routed(req, d, now=500.0)
    assert off.load.store_horizon.samples == 0


# ---------------------------------------------------------------- queue attention


def test_queue_attention_prices_the_queued_prefill_with_the_context_it_attends_to():
    """e0 has one request in flight, 4,000 new tokens after 60,000 cached: its prefill attends to
    a mean context of 60,000 + 4,000/2 = 62,000 tokens per new token. With ``queue_attention``
    the next request waits 4,000 x (prefill_s + attn_s x 62,000); without it the linear part."""
    for on in (False, True):
        core = _core(1, queue_attention=on, displace_weight=0.0, cluster_work_weight=0.0)
        cfg = core.cfg.scoring
        core.load.on_sent("e0", "a", 4000, 0.0, keys=[1, 2, 3], num_tokens=64000, cached_tokens=60000)
        assert core.load.effective("e0", 0.1).prefill_ctx_tokens == 62000.0
        c = core.decide(_req(core, 320, "r"), Matches(), now=0.1).candidates[0]
        per_token = cfg.prefill_s_per_token + (cfg.attn_s_per_token_pair * 62000 if on else 0.0)
        assert c.wait_s == pytest.approx(4000 * per_token, rel=1e-12)
    # 250 us + 3.3 ns x 62,000 = 454.6 us per queued token at the default figures.
    assert c.wait_s == pytest.approx(4000 * 454.6e-6, rel=1e-9)
    # Once its first token is out, nothing of it is queued and the mean context is 0 again.
    core.load.on_first_token("a")
    assert core.load.effective("e0", 0.2).prefill_ctx_tokens == 0.0


def test_queue_attention_moves_a_turn_off_a_queue_of_long_context_prefill():
    """e0 holds the turn's 100,000-token context on its GPU behind a 50,000-token tail on a
    250,000-token context; e1 is idle but would recompute the context (25 s linear + 16.5 s
    attention = 41.5 s). Counted linearly, e0's queue is 12.5 s and the turn stays; with the
    attention it is 50,000 x (250 us + 3.3 ns x 275,000) = 57.9 s, which the engine would take
    to compute it, and the turn moves."""
    n = 100_000
    cap = max_hit_blocks(n, BS)

    def decide(on: bool) -> tuple[str, float]:
        core = _core(2, queue_attention=on, displace_weight=0.0, cluster_work_weight=0.0)
        core.load.on_sent("e0", "a", 50_000, 0.0, keys=[7, 8], num_tokens=300_000, cached_tokens=250_000)
        d = _decide_held_on_e0(core, n, cap)
        return d.endpoint_id, {c.endpoint_id: c for c in d.candidates}["e0"].wait_s

    assert decide(False) == ("e0", pytest.approx(50_000 * 250e-6))
    ep, wait = decide(True)
    assert ep == "e1" and wait == pytest.approx(50_000 * (250e-6 + 3.3e-9 * 275_000))


# ------------------------------------ decode horizon: shorter where the store holds the prompt


@pytest.mark.parametrize(("stored", "want"), [(0, 64.0), (50, 48.0), (100, 32.0), (150, 32.0)])
def test_decode_horizon_shortens_with_the_share_the_store_holds(stored: int, want: float):
    cfg = ScoringConfig(decode_horizon_steps=64.0, decode_horizon_steps_stored=32.0)
    assert cfg.decode_horizon(stored, 100) == want
    assert ScoringConfig(decode_horizon_steps_stored=64.0).decode_horizon(stored, 100) == 64.0


def test_a_stored_turn_stays_home_unless_the_decode_load_outweighs_its_restore():
    """e0 holds a 64k-token context on its GPU while decoding 130k tokens of other contexts; e1
    is idle; the store holds the whole prompt. At the full horizon, 64 decode steps over that
    load (0.65 s) cost more than restoring the prompt on e1 (0.44 s) and the turn moves; at the
    stored horizon (32 steps: 0.32 s) it stays. A prompt the store does not hold keeps the full
    horizon (a move would be a recompute anyway)."""
    n, decoding = 64_000, 130_000
    cap = max_hit_blocks(n, BS)

    def decide(stored_horizon: float, store_blocks: int) -> tuple[str, float]:
        core = _core(2, displace_weight=0.0, cluster_work_weight=0.0, decode_horizon_steps_stored=stored_horizon)
        blocks = 100_000
        core.load.update("e0", LoadReport(running=1, kv_usage=decoding / BS / blocks, num_blocks=blocks,
                                          received_at=0.0))
        core.load.update("e1", LoadReport(num_blocks=blocks, received_at=0.0))
        m = Matches(per_endpoint={"e0": TierMatch(gpu=cap)}, store=TierMatch(cpu=store_blocks))
        d = core.decide(_req(core, n, "r", session="s"), m, now=0.5)
        home = next(c for c in d.candidates if c.endpoint_id == "e0")
        return d.endpoint_id, home.decode_s

    cfg = ScoringConfig()
    restore = _restore_cost(cfg, cap * BS)
    full = 64 * (cfg.decode_s_per_seq + decoding * cfg.decode_s_per_ctx_token)
    assert full > restore > full / 2
    ep, decode = decide(64.0, cap)
    assert (ep, decode) == ("e1", pytest.approx(full, rel=1e-9))
    ep, decode = decide(32.0, cap)
    assert (ep, decode) == ("e0", pytest.approx(full / 2, rel=1e-9))
    assert decide(32.0, 0)[1] == pytest.approx(full, rel=1e-9)


# ----------------------------------------- gpu_survival: what the in-flight contexts evict first


def _no_store_core(n: int, **scoring: float) -> RouterCore:
    core = _core(n, offload_enabled=False, **scoring)
    for i in range(n):
        core.load.update(f"e{i}", LoadReport(num_blocks=1001, received_at=0.0))   # 1,000 blocks: 16,000 tokens
    return core


@pytest.mark.parametrize(("inflight", "lost"), [(0, 0), (4000, 0), (8000, 0), (10_000, 2000), (30_000, 7984)])
def test_gpu_survival_prices_the_tail_the_inflight_contexts_evict_first(inflight: int, lost: int):
    """The endpoint caches 16,000 tokens and holds 7,984 of the 8,000-token prompt. Requests in
    flight there with ``inflight`` context tokens touch their blocks before the turn runs: what
    they and the prompt exceed the cache by comes off the hit's tail (at most all of it). The
    ``evicted`` term is its recompute after what is left, beyond the prefill of the predicted hit."""
    n = 8000
    cap = max_hit_blocks(n, BS)
    hit = cap * BS
    core = _no_store_core(1, gpu_survival=True, displace_weight=0.0, cluster_work_weight=0.0)
    cfg = core.cfg.scoring
    if inflight:
        core.load.on_sent("e0", "a", 0, 0.0, keys=[1, 2], num_tokens=inflight, cached_tokens=inflight)
    assert core.load.effective("e0", 0.1).all_inflight_ctx_tokens == inflight
    d = _decide_held_on_e0(core, n, cap)
    c = d.candidates[0]
    assert c.evicted_s == pytest.approx(cfg.prefill_cost(n - hit + lost, hit - lost) - _own(cfg, n, hit), rel=1e-12)
    assert c.cost == c.own_s + c.evicted_s + c.decode_s
    # The prediction and the other terms are the index's: the term prices the risk and changes no view.
    assert c.own_s == pytest.approx(_own(cfg, n, hit), rel=1e-12)
    assert c.gpu_blocks == cap and d.predicted_cached_tokens == hit
    off = _no_store_core(1, displace_weight=0.0, cluster_work_weight=0.0)
    if inflight:
        off.load.on_sent("e0", "a", 0, 0.0, keys=[1, 2], num_tokens=inflight, cached_tokens=inflight)
    d = _decide_held_on_e0(off, n, cap)
    assert d.candidates[0].evicted_s == 0.0


def test_gpu_survival_moves_a_turn_whose_home_will_have_evicted_it():
    """e0 holds the whole 8,000-token prompt, behind a 2,000-token prefill of a 30,000-token
    context that overflows e0's 16,000-token cache; e1 is idle and holds nothing. Counted as a
    hit, the turn waits 0.5 s at home and stays; priced as what survives (nothing), home is the
    same recompute after the wait, and the turn goes to e1."""
    n = 8000
    cap = max_hit_blocks(n, BS)

    def decide(on: bool) -> tuple[str, float]:
        core = _no_store_core(2, gpu_survival=on, displace_weight=0.0, cluster_work_weight=0.0)
        core.load.on_sent("e0", "a", 2000, 0.05, keys=[1, 2], num_tokens=30_000, cached_tokens=28_000)
        d = _decide_held_on_e0(core, n, cap)
        home = {c.endpoint_id: c for c in d.candidates}["e0"]
        return d.endpoint_id, home.own_s + home.evicted_s

    cfg = ScoringConfig()
    assert decide(False) == ("e0", pytest.approx(_own(cfg, n, cap * BS), rel=1e-12))
    assert decide(True) == ("e1", pytest.approx(_own(cfg, n, 0), rel=1e-12))


def test_gpu_survival_is_off_with_an_offload_store():
    """With a store, evicted GPU blocks are offloaded and come back by a restore; the term is not used."""
    n, cap = 8000, max_hit_blocks(8000, BS)
    core = RouterCore(RouterCoreConfig(policy="precise", block_size=BS,
                                       scoring=ScoringConfig(**PLAIN, gpu_survival=True)))
    core.set_endpoint(EndpointView("e0", "127.0.0.1:9000", "m"))
    core.load.update("e0", LoadReport(num_blocks=1001, received_at=0.0))
    core.load.on_sent("e0", "a", 0, 0.0, keys=[1, 2], num_tokens=30_000, cached_tokens=30_000)
    d = _decide_held_on_e0(core, n, cap)
    assert d.candidates[0].evicted_s == 0.0
    assert d.candidates[0].own_s == pytest.approx(_own(core.cfg.scoring, n, cap * BS), rel=1e-12)


# ------------------------------------------------------ kv_wait: the wait for KV space beside the running


def _timed_core(n: int, residence_s: float, offload_enabled: bool = True, **scoring: float) -> RouterCore:
    """Endpoints of 1,000 blocks (16,000 tokens), each with one finished request that held its KV
    for ``residence_s`` after its first token."""
    core = _core(n, offload_enabled=offload_enabled, **scoring)
    for i in range(n):
        e = f"e{i}"
        core.load.update(e, LoadReport(num_blocks=1001, received_at=0.0))
        core.load.on_sent(e, f"done{i}", 0, 0.0, keys=[7], num_tokens=16)
        core.load.on_first_token(f"done{i}", 0.0)
        core.load.on_finished(f"done{i}", residence_s)
    return core


@pytest.mark.parametrize(("inflight", "over"), [(0, 0), (8000, 0), (12_000, 4000), (40_000, 32_000)])
@pytest.mark.parametrize("weight", [0.1, 1.0])
def test_kv_wait_is_the_excess_over_the_cache_at_its_residence(inflight: int, over: int, weight: float):
    """e0 caches 16,000 tokens and its requests lately held their KV for 20 s after their first
    token, so the running ones free the whole cache in about 20 s. Requests in flight there hold
    ``inflight`` context tokens; the 8,000-token prompt needs 8,000 more. What they exceed the
    cache by waits that share of the residence, at the weight (nothing is queued for prefill, so
    all of it exceeds ``wait``)."""
    core = _timed_core(1, 20.0, kv_wait_weight_with_store=weight, displace_weight=0.0, cluster_work_weight=0.0)
    if inflight:
        core.load.on_sent("e0", "a", 0, 0.0, keys=[1, 2], num_tokens=inflight, cached_tokens=inflight)
    assert core.load.effective("e0", 0.1).residence_s == 20.0
    d = _decide_held_on_e0(core, 8000, max_hit_blocks(8000, BS))
    c = d.candidates[0]
    assert c.kv_wait_s == pytest.approx(weight * over / 16_000 * 20.0, rel=1e-12)
    assert c.cost == c.own_s + c.decode_s + c.kv_wait_s
    assert c.wait_s == 0.0   # the queued-prefill wait is its own term


@pytest.mark.parametrize(("inflight", "kv_wait"), [(12_000, 4.0), (10_000, 1.5), (8800, 0.0), (7000, 0.0)])
def test_kv_wait_adds_only_what_exceeds_the_queued_prefill_wait(inflight: int, kv_wait: float):
    """The requests ahead wait for compute and for space at once. e0 has 4,000 tokens of prefill
    queued (1 s at 250 us a token), and contexts in flight that with the 8,000-token prompt exceed
    its 16,000-token cache by ``inflight`` + 8,000 - 16,000: at a 20 s residence, 5 s for 4,000
    over, 2.5 s for 2,000, 1 s for 800. The cost adds what that exceeds the 1 s ``wait`` by, and
    nothing if it does not exceed it."""
    core = _timed_core(1, 20.0, kv_wait_weight_with_store=1.0, displace_weight=0.0, cluster_work_weight=0.0)
    core.load.on_sent("e0", "q", 4000, 0.05, keys=[1, 2], num_tokens=inflight, cached_tokens=inflight - 4000)
    c = _decide_held_on_e0(core, 8000, max_hit_blocks(8000, BS)).candidates[0]
    assert c.wait_s == pytest.approx(1.0, rel=1e-12)
    assert c.kv_wait_s == pytest.approx(max(0.0, inflight + 8000 - 16_000) / 16_000 * 20.0 - 1.0 if kv_wait else 0.0,
                                        rel=1e-12, abs=1e-12)
    assert c.kv_wait_s == pytest.approx(kv_wait, abs=1e-9)
    assert c.cost == c.wait_s + c.own_s + c.decode_s + c.kv_wait_s


def test_the_residence_is_an_average_of_the_endpoint_s_finished_requests():
    """The first timed request sets it; each later one moves it ``residence_rate`` of the way.
    A request whose first token came untimed, or that never had one, says nothing."""
    core = _timed_core(1, 20.0)
    lv = core.load
    lv.on_sent("e0", "b", 0, 30.0, num_tokens=16)
    lv.on_first_token("b", 30.0)
    lv.on_finished("b", 70.0)                       # held it 40 s
    assert lv.effective("e0", 70.0).residence_s == pytest.approx(20.0 + lv.residence_rate * 20.0, rel=1e-12)
    before = lv.effective("e0", 70.0).residence_s
    lv.on_sent("e0", "c", 0, 80.0, num_tokens=16)
    lv.on_first_token("c")                          # untimed
    lv.on_finished("c", 500.0)
    lv.on_sent("e0", "d", 0, 80.0, num_tokens=16)
    lv.on_finished("d", 600.0)                      # failed before its first token
    assert lv.effective("e0", 600.0).residence_s == before
    assert lv.effective("never-seen", 600.0).residence_s == 0.0


def test_kv_wait_is_off_by_default_and_without_a_residence():
    """Both weights are 0 by default; without a store the weight is ``kv_wait_weight``, with one
    ``kv_wait_weight_with_store``. With no finished request timed there, nothing says how fast the
    cache frees, and the term is 0."""
    assert ScoringConfig().kv_wait_w(True) == ScoringConfig().kv_wait_w(False) == 0.0
    for core in (_timed_core(1, 20.0), _timed_core(1, 20.0, offload_enabled=False),
                 _timed_core(1, 20.0, offload_enabled=False, kv_wait_weight_with_store=1.0),
                 _core(1, kv_wait_weight_with_store=1.0)):
        core.load.update("e0", LoadReport(num_blocks=1001, received_at=0.0))
        core.load.on_sent("e0", "a", 0, 0.0, keys=[1, 2], num_tokens=40_000, cached_tokens=40_000)
        assert _decide_held_on_e0(core, 8000, max_hit_blocks(8000, BS)).candidates[0].kv_wait_s == 0.0
    on = _timed_core(1, 20.0, offload_enabled=False, kv_wait_weight=1.0)
    on.load.on_sent("e0", "a", 0, 0.0, keys=[1, 2], num_tokens=40_000, cached_tokens=40_000)
    assert _decide_held_on_e0(on, 8000, max_hit_blocks(8000, BS)).candidates[0].kv_wait_s == pytest.approx(40.0)


def test_in_flight_kv_counts_a_prefix_shared_with_requests_in_flight_once():
    """Three requests in flight on e0 share a 4,000-token prefix: vLLM's prefix cache gives them
    the same blocks, so they hold 4,000 + 3 x 1,000 tokens, not 15,000. Sent with the keys' block
    size, each counts its context less its longest common prefix with those in flight there; an
    unrelated prompt, or one sent without a block size, counts whole. A finished request takes
    its own count away."""
    lv = _core(1).load
    head = list(range(250))   # 4,000 tokens of 16-token blocks
    for k in range(3):
        lv.on_sent("e0", f"s{k}", 0, 0.0, keys=head + [1000 * (k + 1) + j for j in range(62)], num_tokens=5000,
                   block_size=BS)
    assert lv.effective("e0", 0.1).inflight_kv_tokens == 5000 + 1000 + 1000
    assert lv.effective("e0", 0.1).all_inflight_ctx_tokens == 15_000
    lv.on_sent("e0", "other", 0, 0.0, keys=[7, 8, 9], num_tokens=48, block_size=BS)
    lv.on_sent("e0", "nobs", 0, 0.0, keys=head, num_tokens=4000)
    assert lv.columns(["e0"], 0.1).inflight_kv_tokens[0] == 7000 + 48 + 4000
    lv.on_finished("s1")
    lv.on_finished("nobs")
    assert lv.effective("e0", 0.1).inflight_kv_tokens == 6000 + 48


def test_kv_wait_does_not_count_what_the_prompt_shares_with_a_sibling_in_flight():
    """A sibling in flight on e0 is computing the prompt's first 4,000 tokens: those blocks will
    be its, shared, so the prompt needs only the rest of the cache."""
    core = _timed_core(1, 20.0, kv_wait_weight_with_store=1.0, displace_weight=0.0, cluster_work_weight=0.0)
    req = _req(core, 8000, "r", session="s")
    core.load.on_sent("e0", "sib", 4000, 0.0, keys=req.keys[:250], num_tokens=4000)
    core.load.on_sent("e0", "a", 0, 0.0, keys=[1, 2], num_tokens=16_000, cached_tokens=16_000)
    c = core.decide(req, Matches(per_endpoint={}), now=0.1).candidates[0]
    # In flight 20,000 tokens; the prompt's 8,000 less the sibling's 4,000: 8,000 over the cache.
    assert c.kv_wait_s == pytest.approx(8000 / 16_000 * 20.0, rel=1e-12)


def test_kv_wait_moves_a_turn_off_a_home_full_of_running_contexts():
    """e0 holds the 8,000-token prompt on its GPU, but its cache is full of contexts in flight
    (48,000 tokens: two more caches' worth wait). The store holds the prompt too, so e1 restores
    it. Without the term the turn stays home for its GPU hit; with it, home waits two residences
    and the turn goes to e1."""
    n = 8000
    cap = max_hit_blocks(n, BS)

    def decide(weight: float) -> str:
        core = _timed_core(2, 20.0, kv_wait_weight_with_store=weight, displace_weight=0.0, cluster_work_weight=0.0)
        core.load.on_sent("e0", "a", 0, 0.0, keys=[1, 2], num_tokens=48_000, cached_tokens=48_000)
        req = _req(core, n, "r", session="s")
        m = Matches(per_endpoint={"e0": TierMatch(gpu=cap)}, store=TierMatch(cpu=cap))
        return core.decide(req, m, now=0.1).endpoint_id

    assert decide(0.0) == "e0"
    assert decide(1.0) == "e1"
