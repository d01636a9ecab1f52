"""The cost's cluster terms, each on a small cluster where the right answer is known by hand.

* cluster work: under saturation, a recompute away from the prefix's home is priced again,
  scaled by how saturated the cluster is; with an idle endpoint it is free;
* displacement: new blocks beyond an endpoint's empty ones evict cached KV, priced as its
  recompute; unknown cache contents (no count) price nothing.

Expected figures are derived from the config's latency figures, as the cost states them.
"""

from __future__ import annotations

import random

import pytest

from kvmesh.routing.load import LoadReport
from kvmesh.routing.router import RouterCore, RouterCoreConfig
from kvmesh.routing.scoring import ScoringConfig, max_hit_blocks
from kvmesh.routing.types import EndpointView, Matches, RouteRequest, TierMatch

BS = 16
pytestmark = pytest.mark.timeout(60)


def _core(n: int, **scoring: float) -> RouterCore:
    core = RouterCore(RouterCoreConfig(policy="precise", block_size=BS, scoring=ScoringConfig(**scoring)))
    for i in range(n):
        core.set_endpoint(EndpointView(f"e{i}", f"127.0.0.1:{9000 + i}", "m"))
    return core


def _req(core: RouterCore, n: int, rid: str, session: str = "", seed: int = 0) -> RouteRequest:
    rng = random.Random(seed)
    keys = core.chain([rng.randrange(32000) for _ in range(n)], None, session).keys
    return RouteRequest(rid, "m", keys, n, BS, session)


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
    plain = _core(2, cluster_work_weight=0.0)
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
    d = core.decide(_req(core, n, "r", session="s"), Matches(per_endpoint={"e0": TierMatch(gpu=cap)}), now=0.1)
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
    d = core.decide(_req(core, n, "r", session="s"), Matches(per_endpoint={"e0": TierMatch(gpu=cap)}), now=0.1)
    by = {c.endpoint_id: c for c in d.candidates}
    sat = min(1.0, q * cfg.prefill_s_per_token / cfg.saturation_s)
    assert by["e1"].work_s == cfg.cluster_work_weight * sat * (by["e1"].own_s - by["e0"].own_s)
    assert by["e1"].cost == by["e1"].wait_s + by["e1"].own_s + by["e1"].decode_s + by["e1"].work_s
    assert d.endpoint_id == "e0"


# ---------------------------------------------------------------- displaced KV


def _capacity(core: RouterCore, blocks: int, *endpoints: str) -> None:
    for e in endpoints:
        core.load.update(e, LoadReport(num_blocks=blocks, received_at=0.0))


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
        assert by["e0"].displace_s == cfg.displace_weight * need * cfg.prefill_s_per_token
        assert by["e1"].displace_s == cfg.displace_weight * (need - need // 2) * cfg.prefill_s_per_token
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
    core = _core(2, displace_weight=1.0)
    cfg = core.cfg.scoring
    nb = 2 * cap
    _capacity(core, nb, "e0", "e1")
    ws = core.load.working_set
    # Both caches are full of recent contexts; one of e0's is this session's own.
    ws.touch("s", "e0", n - 600, 0.0)
    ws.touch("other0", "e0", nb * BS - (n - 600), 0.0)
    ws.touch("other1", "e1", nb * BS, 0.0)
    d = core.decide(_req(core, n, "r", session="s"), Matches(per_endpoint={"e0": TierMatch(gpu=cap)}), now=0.1)
    by = {c.endpoint_id: c for c in d.candidates}
    assert d.endpoint_id == "e0"
    # At home only the new tokens' blocks count; they fit in what its own old context leaves.
    new = -(-by["e0"].uncached_tokens // BS) * BS
    assert by["e0"].displace_s == cfg.displace_weight * max(new - (n - 600), 0) * cfg.prefill_s_per_token == 0.0
    assert by["e1"].displace_s == cfg.displace_weight * (-(-n // BS) * BS) * cfg.prefill_s_per_token
    assert ws.home("s") == ("e0", n - 600)   # deciding changes nothing; routing counts the new prompt
    core.on_routed(_req(core, n, "r2", session="s"), d, now=0.2)
    assert ws.home("s") == ("e0", n)


def test_contexts_leave_the_working_set_after_the_reuse_window():
    core = _core(2, displace_weight=1.0, reuse_window_s=10.0)
    _capacity(core, 100, "e0", "e1")
    core.load.working_set.touch("a", "e0", 100 * BS, 0.0)
    core.load.working_set.touch("b", "e1", 100 * BS, 5.0)
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
