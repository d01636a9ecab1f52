"""The vectorized candidate table decides exactly as the per-endpoint reference rule.

``scoring.evaluate`` / ``mark_hot`` / ``pick`` are the rule stated one endpoint at a time;
``CandidateTable`` applies it to every endpoint at once. On random clusters (reports fresh
and stale, requests in flight before and after reports, matches on every tier, many exact
ties) both must give the same winner, the same reason and bit-identical costs, and the
load view's columns must equal its per-endpoint ``effective``.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from kvmesh.hashing.prefix import common_prefix
from kvmesh.routing.candidate_table import CandidateTable, MatchColumns
from kvmesh.routing.endpoint_columns import ColumnLayout, EndpointColumns
from kvmesh.routing.load import LoadReport, LoadView
from kvmesh.routing.scoring import (
    ClusterState,
    ScoringConfig,
    cluster_state,
    evaluate,
    mark_hot,
    max_hit_blocks,
    pick,
    spread_key,
)
from kvmesh.routing.types import Candidate, Matches, RouteRequest, TierMatch
from kvmesh_tools.traffic.model import chain_keys

BS = 16


def _random_load(rng: random.Random, ids: list[str], now: float, blocks: tuple[int, ...] = (0, 1000, 40)) -> LoadView:
    lv = LoadView(staleness_s=1.0, reuse_window_s=rng.choice([0.0, 4.0, 600.0]))
    heads = [rng.randrange(3) for _ in range(4)]
    live: list[str] = []
    t = now - 3.0
    for step in range(rng.randrange(0, 60)):
        t += rng.random() * 0.1
        ep = rng.choice(ids)
        op = rng.random()
        if op < 0.3:
            lv.update(ep, LoadReport(running=rng.randrange(4), waiting=rng.randrange(4),
                                     kv_usage=rng.choice([0.0, 0.5, 0.99, rng.random()]),
                                     waiting_prefill_tokens=rng.choice([0, 100, rng.randrange(5000)]),
                                     num_blocks=rng.choice(blocks), received_at=rng.choice([t, t - 2.5])))
        elif op < 0.65:
            rid = f"r{step}"
            n = rng.randrange(1, 40)
            keys = chain_keys("t", [rng.choice(heads)] + [rng.randrange(4) for _ in range(n - 1)])
            lv.on_sent(ep, rid, rng.choice([0, rng.randrange(n * BS)]), t, keys=keys, num_tokens=n * BS,
                       cached_tokens=rng.choice([0, BS * rng.randrange(n)]), block_size=rng.choice([0, BS]))
            # Sessions' contexts in the working set, some of them old enough to expire.
            tokens = rng.choice([n * BS, 1000 * BS, rng.randrange(20_000)])
            lv.working_set.touch(rng.choice(["s1", "s2", "s3", "s4"]), ep, tokens, t - rng.choice([0.0, 5.0]),
                                 rng.choice([0, tokens, rng.randrange(tokens + 1), tokens + 7]))
            live.append(rid)
        elif op < 0.8 and live:
            lv.on_first_token(rng.choice(live), rng.choice([None, t]))
        elif op < 0.95 and live:
            # Timed finishes give endpoints a residence (the KV-space wait's rate).
            lv.on_finished(live.pop(rng.randrange(len(live))), rng.choice([None, t + rng.random() * 30]))
        elif op < 0.97:
            lv.reconfirm([ep, rng.choice(ids)], t)
        else:
            lv.forget(ep)
    return lv


def _random_match(rng: random.Random, cap: int) -> TierMatch:
    def n() -> int:
        return rng.choice([0, 0, 0, cap // 2, cap, cap + 3, rng.randrange(cap + 1)])
    return TierMatch(gpu=n(), cpu=n(), disk=n(), speculative=n(), pending=n())


@pytest.mark.parametrize("seed", range(300))
def test_table_decides_as_the_reference_rule(seed: int) -> None:
    _decide_both_ways(random.Random(seed))


@pytest.mark.parametrize("seed", range(100))
def test_table_prices_what_survives_on_the_gpu_as_the_reference_rule(seed: int) -> None:
    """``gpu_survival`` without a store, on caches small enough that in-flight contexts evict hits."""
    _decide_both_ways(random.Random(seed), survival=True)


@pytest.mark.parametrize("seed", range(100))
def test_table_prices_the_wait_for_kv_space_as_the_reference_rule(seed: int) -> None:
    """``kv_wait_weight`` on, on caches small enough that the in-flight contexts fill them."""
    _decide_both_ways(random.Random(seed), kv_wait=True)


def _decide_both_ways(rng: random.Random, survival: bool = False, kv_wait: bool = False) -> None:
    ids = [f"e{i}" for i in rng.sample(range(50), rng.randrange(1, 24))]
    now = 10.0
    load = _random_load(rng, ids, now, (40, 40, 1000, 0) if survival or kv_wait else (0, 1000, 40))
    if kv_wait:   # a timed request per endpoint (its residence) and contexts in flight that may fill it
        for j, e in enumerate(ids):
            if rng.random() < 0.8:
                load.on_sent(e, f"kv{j}", 0, now - 9.0, num_tokens=BS)
                load.on_first_token(f"kv{j}", now - rng.choice([8.0, 3.5]))
                load.on_finished(f"kv{j}", now - 2.0)
            for k in range(rng.randrange(3)):
                load.on_sent(e, f"kv{j}.{k}", rng.randrange(400), now - 1.0, num_tokens=rng.randrange(1, 700))
    if rng.random() < 0.4:   # a saturated cluster: every endpoint has prefill queued
        for e in ids:
            load.update(e, LoadReport(running=1, waiting_prefill_tokens=rng.randrange(1, 5000),
                                      num_blocks=rng.choice([0, 1000, 40] if survival else [0, 1000]),
                                      received_at=now - 0.1))
    nblocks = rng.randrange(1, 30)
    keys = chain_keys("t", [rng.randrange(3)] + [rng.randrange(4) for _ in range(nblocks - 1)])
    req = RouteRequest(request_id="q", model="m", keys=keys, num_tokens=nblocks * BS + rng.randrange(BS),
                       block_size=BS, session_id=rng.choice(["", "s1", "s2"]))
    cap = max_hit_blocks(req.num_tokens, BS)
    per = {e: _random_match(rng, cap) for e in ids if rng.random() < 0.6}
    if rng.random() < 0.3:   # many identical matches: exact ties everywhere
        same = _random_match(rng, cap)
        per = {e: same for e in ids}
    store = _random_match(rng, cap) if rng.random() < 0.5 else TierMatch()
    cfg = ScoringConfig(max_inflight=rng.choice([0, 0, 2]), tie_epsilon_s=rng.choice([0.0, 0.01, 0.5]),
                        cluster_work_weight=rng.choice([0.0, 1.0, 2.7]), saturation_s=rng.choice([0.0, 0.013, 0.37, 1.0]),
                        displace_weight=rng.choice([0.0, 0.6, 1.0]), reuse_window_s=600.0,
                        hold_min_ratio=rng.choice([0.0, 0.3, 0.5, 1.0]),
                        displace_free_at=rng.choice([0.0, 1.5, 2.0, 3.0]), displace_cliff=rng.random() < 0.5,
                        displace_store_price=rng.random() < 0.5, queue_attention=rng.random() < 0.5,
                        displace_cliff_with_store=rng.random() < 0.5, displace_attention=rng.random() < 0.5,
                        blocking_weight=rng.choice([0.0, 0.07, 1.0]), blocking_weight_with_store=rng.choice([0.0, 0.07, 0.3]),
                        turn_interval_s=rng.choice([0.0, 30.0, 120.0]),
                        displace_cliff_max_sessions=rng.choice([0, 1, 2, 4]), gpu_survival=survival or rng.random() < 0.5,
                        kv_wait_weight=rng.choice([1.0, 2.5] if kv_wait else [0.0, 0.0, 1.0]),
                        kv_wait_weight_with_store=rng.choice([1.0, 0.4] if kv_wait else [0.0, 1.0]))
    offload = not survival and rng.random() < 0.8
    affinity = rng.choice(["", "e999", *ids])
    if rng.random() < 0.5:   # store_keep, with a store that has lost nothing yet, or has a horizon
        cfg.store_keep = True
        load.store_horizon.horizon_s = rng.choice([math.inf, 0.0, 0.3, 5.0, 1e4])
        if rng.random() < 0.5 and req.session_id:
            load.working_set.touch(req.session_id, rng.choice(ids), req.num_tokens, now - rng.choice([0.0, 2.0, 9.0]))
    shared = load.pending_overlap(req.keys, BS)

    loads = {e: load.effective(e, now) for e in ids}

    home, mine = load.working_set.home(req.session_id)
    mine_stored = load.working_set.home_stored(req.session_id)
    life = load.store_life_s(req.session_id, now) if cfg.store_keep and offload else math.inf

    def scored(state: ClusterState | None) -> list[Candidate]:
        return [evaluate(e, per.get(e, TierMatch()), store, loads[e], req.num_tokens, BS, cfg, offload,
                         shared.get(e, 0), state, mine if e == home else 0, mine_stored if e == home else 0, life)
                for e in ids]
    # The cluster figures come from every endpoint's own evaluation (they do not depend on them).
    state = cluster_state(scored(None), cfg)
    ref: list[Candidate] = scored(state)
    assert cluster_state(ref, cfg) == state
    mark_hot(ref, loads, cap, cfg)
    ref_win, ref_why = pick(ref, cfg, affinity, spread_key(req))

    pos = {e: i for i, e in enumerate(ids)}
    table = CandidateTable(req, ids, load, now, MatchColumns(pos).put(per), store, shared, cfg, offload)
    table.mark_hot()
    choice = table.pick(affinity, spread_key(req))
    assert (ids[choice.index], choice.reason) == (ref_win.endpoint_id, ref_why)
    assert table.state == state
    for i, c in enumerate(ref):
        assert table.cost[i] == c.cost          # bit-identical, not approximately equal
        assert table.candidate(i) == c
    reported = table.reported(choice.index)
    assert reported[0].endpoint_id == ref_win.endpoint_id and len(reported) == min(len(ids), 16)


@pytest.mark.parametrize("session", [f"s{i}" for i in range(40)])
def test_loads_equal_after_rounding_tie_on_the_hash(session: str) -> None:
    """Loads that differ below the 4th decimal tie on load; the session's hash decides, as in ``pick``."""
    ids = [f"e{i}" for i in range(6)]
    load = LoadView()
    for i, e in enumerate(ids):
        load.update(e, LoadReport(kv_usage=0.0001 * (i + 1), num_blocks=1000, received_at=0.0))
    req = RouteRequest(request_id="q", model="m", keys=[1, 2], num_tokens=3 * BS, block_size=BS, session_id=session)
    cfg = ScoringConfig()
    ref = [evaluate(e, TierMatch(), TierMatch(), load.effective(e, 0.0), req.num_tokens, BS, cfg) for e in ids]
    assert len({round(c.wait_s + c.decode_s, 4) for c in ref}) == 1 < len({c.decode_s for c in ref})
    table = CandidateTable(req, ids, load, 0.0, MatchColumns({e: i for i, e in enumerate(ids)}), TierMatch(), {}, cfg)
    assert ids[table.pick("", spread_key(req)).index] == pick(ref, cfg, "", spread_key(req))[0].endpoint_id


def _scan(lv: LoadView, endpoint_id: str, now: float) -> tuple:
    """The effective load by its definition, from the in-flight requests one by one."""
    rep = lv.reports.get(endpoint_id)
    fresh = rep is not None and now - rep.received_at <= lv.staleness_s
    mine = [f for f in lv._inflight.values() if f.endpoint_id == endpoint_id]
    new = [f for f in mine if not fresh or f.sent_at > rep.received_at]  # type: ignore[union-attr]
    prefill = sum(f.prefill_tokens for f in new if f.prefilling)
    queue = len(new) + (rep.running + rep.waiting if fresh else 0)  # type: ignore[union-attr]
    return (queue, prefill + (rep.waiting_prefill_tokens if fresh else 0),  # type: ignore[union-attr]
            sum(f.num_tokens for f in new), len(mine))


def _overlap_scan(load: LoadView, keys: list[int]) -> dict[str, int]:
    """``pending_overlap`` from scratch: every in-flight request still queued for prefill."""
    out: dict[str, int] = {}
    for f in load._inflight.values():
        if f.prefilling and f.prefill_tokens > 0 and f.keys and f.keys[0] == keys[0]:
            shared = min(common_prefix(f.keys, keys) * BS, f.num_tokens or 1 << 62)
            n = min(max(0, shared - f.cached_tokens), f.prefill_tokens)
            if n > out.get(f.endpoint_id, 0):
                out[f.endpoint_id] = n
    return out


@pytest.mark.parametrize("seed", range(100))
def test_load_columns_equal_effective(seed: int) -> None:
    rng = random.Random(seed)
    ids = [f"e{i}" for i in range(rng.randrange(1, 12))]
    now = 10.0
    load = _random_load(rng, ids, now)
    asked = ids + ["never-seen"]
    for _ in range(5):
        query = chain_keys("t", [rng.randrange(3)] + [rng.randrange(4) for _ in range(rng.randrange(40))])
        assert load.pending_overlap(query, BS) == _overlap_scan(load, query)
    cols = load.columns(asked, now)
    for i, e in enumerate(asked):
        eff = load.effective(e, now)
        assert _scan(load, e, now) == (eff.queue, eff.prefill_tokens, eff.inflight_ctx_tokens, eff.inflight)
        assert (cols.queue[i], cols.prefill_tokens[i], cols.kv_usage[i], cols.inflight[i], cols.active_blocks[i],
                cols.inflight_ctx_tokens[i], cols.capacity_blocks[i], cols.resident_tokens[i], cols.stored_tokens[i],
                cols.prefill_ctx_tokens[i], cols.all_inflight_ctx_tokens[i], cols.residence_s[i],
                cols.inflight_kv_tokens[i]) == (
                    eff.queue, eff.prefill_tokens, eff.kv_usage, eff.inflight, eff.active_blocks,
                    eff.inflight_ctx_tokens, eff.capacity_blocks, eff.resident_tokens, eff.stored_tokens,
                    eff.prefill_ctx_tokens, eff.all_inflight_ctx_tokens, eff.residence_s,
                    eff.inflight_kv_tokens)


@pytest.mark.parametrize("seed", range(50))
def test_index_rows_read_as_the_per_endpoint_dict(seed: int) -> None:
    """Matches given as arrays (the simulator's index) fill the table as the dict form does,
    whatever the arrays' endpoint order, and with endpoints the router does not route to."""
    rng = random.Random(seed)
    ids = [f"e{i}" for i in rng.sample(range(50), rng.randrange(1, 24))]
    pos = {e: i for i, e in enumerate(ids)}
    per = {e: TierMatch(rng.randrange(9), rng.randrange(9), rng.randrange(9)) for e in ids if rng.random() < 0.7}
    order = ids + [f"p{i}" for i in range(rng.randrange(3))]
    rng.shuffle(order)
    rows = {e: per.get(e, TierMatch(rng.randrange(9), 0, 0) if e.startswith("p") else TierMatch()) for e in order}
    cols = EndpointColumns(ColumnLayout(order), *(np.asarray([getattr(rows[e], f) for e in order], dtype=np.int64)
                                                  for f in ("gpu", "cpu", "disk")))
    m = Matches(columns=cols)
    from_rows = MatchColumns(pos).put_matches(m)
    from_dict = MatchColumns(pos).put_matches(Matches(per_endpoint=per))
    for f in MatchColumns.FIELDS:
        assert from_rows.array(f).tolist() == from_dict.array(f).tolist()
    for e in order:
        assert m.get(e) == rows[e]
    assert m.get("nobody") == TierMatch()
    # The alignment is kept for the same positions object and redone for another.
    assert MatchColumns(pos).put_matches(m).array("gpu").tolist() == from_dict.array("gpu").tolist()
    pos2 = {e: i for i, e in enumerate(reversed(ids))}
    assert MatchColumns(pos2).put_matches(m).array("gpu").tolist() == \
        MatchColumns(pos2).put(per).array("gpu").tolist()
