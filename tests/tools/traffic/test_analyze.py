"""analyze: ceilings on hand-computable cases, reuse and burst statistics, the generator's shape."""

from __future__ import annotations

import statistics

import pytest

from kvmesh_tools.traffic.analyze import analyze, burst_sizes
from kvmesh_tools.traffic.ceilings import ceiling_infinite, ceiling_pooled
from kvmesh_tools.traffic.generator import GeneratorConfig, generate
from kvmesh_tools.traffic.model import Agent, Request, Session, Trace

pytestmark = pytest.mark.timeout(60)


def _req(i: int, ids: list[int], n_in: int, session: str = "s", t: float = 0.0, agent: str = "main") -> Request:
    return Request(uid=f"{session}/{agent}/{i}", session=session, agent=agent, t=t, input_tokens=n_in,
                   output_tokens=1, hash_ids=ids, namespace="ns", block_size=10, api_time=0.0)


def test_ceiling_infinite_hand_computed() -> None:
    reqs = [_req(0, [1, 2, 3], 35), _req(1, [1, 2, 3, 4], 45), _req(2, [5, 2], 25)]
    # r0: 0 hits; r1: 3 blocks = 30 tokens; r2: block 5 new -> 0 (prefix, not set membership)
    assert ceiling_infinite(reqs) == pytest.approx(30 / 105)


def test_ceiling_caps_last_token() -> None:
    # 20 tokens = 2 full blocks; the engine always computes the last token, so at most 1 block hits
    reqs = [_req(0, [1, 2], 20), _req(1, [1, 2], 20)]
    assert ceiling_infinite(reqs) == pytest.approx(10 / 40)


def test_ceiling_pooled_lru_hand_computed() -> None:
    a = _req(0, [1, 2], 25)
    b = _req(1, [7, 8], 25)
    a2 = _req(2, [1, 2], 25)
    # capacity 4 blocks: everything fits -> a2 hits 2 blocks
    assert ceiling_pooled([a, b, a2], 40) == pytest.approx(20 / 75)
    # capacity 2 blocks: b evicts a -> no hit
    assert ceiling_pooled([a, b, a2], 20) == 0.0
    # capacity 3 blocks: b's insert evicts a's tail first (block 2), a2 still hits block 1
    assert ceiling_pooled([a, b, a2], 30) == pytest.approx(10 / 75)
    assert ceiling_pooled([a, b, a2], 10**9) == ceiling_infinite([a, b, a2])


def test_reuse_and_bursts() -> None:
    main = Agent("main", 0.0, [_req(0, [1, 2, 3, 4], 40), _req(1, [1, 2, 3, 4, 5], 50),
                               _req(2, [1, 9], 20)])
    main.items.insert(2, Agent("x", 1.0, [_req(3, [20], 10, agent="x")]))
    main.items.insert(3, Agent("y", 1.0, [_req(4, [21], 10, agent="y")]))
    assert burst_sizes(main) == [2]
    tr = Trace([Session("s", main, 10)], fmt="native", block_size=10)
    rep = analyze(tr, pooled_capacity_tokens=1000)
    # turn 1 reuses 40/40, turn 2 reuses 10/50
    assert rep["reuse"]["turns"] == 2
    assert rep["reuse"]["share_reusing_ge_90pct"] == 0.5
    assert rep["subagent_bursts"]["sizes"]["p50"] == 2.0
    assert rep["requests"] == 5 and rep["subagent_requests"] == 2


def test_generator_is_seeded_and_has_the_published_shape() -> None:
    cfg = GeneratorConfig(sessions=12, seed=3, subagent_group_prob=0.05, turns_median=30)
    a, b = generate(cfg), generate(cfg)
    assert [(r.uid, r.input_tokens, r.hash_ids) for r in a.requests()] == \
           [(r.uid, r.input_tokens, r.hash_ids) for r in b.requests()]
    rep = analyze(a)
    assert rep["reuse"]["share_reusing_ge_90pct"] > 0.85
    growth = []
    for s in a.sessions:
        main = [it for it in s.root.items if isinstance(it, Request)]
        growth += [y.input_tokens - x.input_tokens - x.output_tokens for x, y in zip(main, main[1:], strict=False)
                   if y.input_tokens > x.input_tokens]
    assert 300 < statistics.median(growth) < 1200
    sizes = []
    for s in a.sessions:
        sizes += burst_sizes(s.root)
    assert sizes and 3 <= statistics.median(sizes) <= 14
