"""The live router decides a ``session`` request's P/D split from the index, as the simulator does.

``session`` predicts no cached tokens, so without the index every prompt past the split threshold
would go to a prefill endpoint, even one whose context its decode endpoint holds. The service
(built as ``kvmesh serve router`` builds it) looks the prompt up for such a policy only when the
split may apply, leaves the policy's choice alone, and hands the answer to the split rule
(``RouterCore.split_lookup`` / ``decide_split``). The indexer's answer is stood in for by
``Cluster.lookup``: what it returns is the contract, and the real lookup path is the one
``precise`` uses (tests/services/router/test_router_indexer.py).
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from kvmesh.routing.types import Matches, RouteRequest, TierMatch
from kvmesh_router.config import RouterConfig
from kvmesh_router.main import build_service
from kvmesh_router.service import Prepared, RouterService

BS = 16
pytestmark = pytest.mark.timeout(60)


def _service(**kw) -> tuple[RouterService, list[list[int]]]:
    cfg = RouterConfig(endpoints=["e0=127.0.0.1:1", "e1=127.0.0.1:2"], prefill_endpoints=["p0=127.0.0.1:3"],
                       block_size=BS, policy="session", split_enabled=True, split_threshold_tokens=512, **kw)
    svc = build_service(cfg)
    looked_up: list[list[int]] = []
    holder = {"ep": ""}

    async def lookup(keys: list[int]) -> Matches:
        looked_up.append(list(keys))
        await asyncio.sleep(0.02)   # an indexer round trip: other requests decide meanwhile
        return Matches(per_endpoint={holder["ep"]: TierMatch(gpu=len(keys) - 1)} if holder["ep"] else {})

    svc.cluster.lookup = lookup   # type: ignore[method-assign]
    svc.holder = holder           # type: ignore[attr-defined]
    return svc, looked_up


def _prepared(svc: RouterService, n: int, rid: str, session: str = "s") -> Prepared:
    rng = random.Random(n)
    tokens = [rng.randrange(32000) for _ in range(n)]
    req = RouteRequest(rid, RouterConfig().model, svc.core.chain(tokens, None, session).keys, n, BS, session)
    return Prepared(request_id=rid, tokens=tokens, extra=None, salt="", req=req)


async def _decisions() -> None:
    svc, looked_up = _service()
    p = _prepared(svc, 4000, "r1")
    # Nothing holds the prompt: it splits, after one lookup.
    d, split = await svc.decide(p, "", set())
    assert split.split and split.prefill_endpoint == "p0" and len(looked_up) == 1
    # The decode endpoint session chose holds it: no split, and the choice is the same one.
    svc.holder["ep"] = d.endpoint_id   # type: ignore[attr-defined]
    d2, split2 = await svc.decide(p, "", set())
    assert d2.endpoint_id == d.endpoint_id and not split2.split
    assert split2.inputs["cached_from"] == "index" and split2.inputs["uncached_tokens"] < 512
    assert d2.predicted_cached_tokens == 0   # the decision is still the policy's own
    # ... and the split's survival rule learns from the index's view once the engine reports.
    assert d2.survival_predicted_tokens == (len(p.req.keys) - 1) * BS
    # The simulator's call on the same state splits the same.
    ref = svc.core.decide_split(d2, p.req, time.monotonic(), matches=await svc.cluster.lookup(p.req.keys))
    assert ref.split == split2.split
    # A prompt below the threshold cannot split: no lookup.
    n = len(looked_up)
    await svc.decide(_prepared(svc, 300, "short"), "", set())
    assert len(looked_up) == n
    # With --split-read-index false the router never looks up for session, and splits blindly.
    blind, blind_lookups = _service(split_read_index=False)
    blind.holder["ep"] = "e0"   # type: ignore[attr-defined]
    _, s = await blind.decide(_prepared(blind, 4000, "r2"), "", set())
    assert s.split and blind_lookups == []


def test_session_split_reads_the_index_for_its_choice():
    asyncio.run(_decisions())


async def _burst() -> list[str]:
    svc, _ = _service()

    async def one(i: int) -> str:
        p = _prepared(svc, 4000 + i, f"b{i}", session=f"new-{i}")
        d, split = await svc.decide(p, "", set())
        svc.record_routed(p, d, split)   # as the front doors do, right after the decision
        return d.endpoint_id

    return await asyncio.gather(*(one(i) for i in range(4)))


def test_a_burst_of_new_sessions_is_spread_while_their_lookups_are_in_flight():
    """session places a new session on the least-loaded endpoint. Its split's lookup comes before
    the decision, so no request decides on a load that misses the ones decided while it waited;
    with the lookup between decision and record, all four went to e0."""
    assert sorted(asyncio.run(_burst())) == ["e0", "e0", "e1", "e1"]
