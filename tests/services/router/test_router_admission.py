"""The live router's decision loop honours admission control as the simulator does.

The router service is built as ``kvmesh serve router`` builds it (``build_service``), with two
static decode endpoints and no indexer. Both endpoints have prefill queued and another
session's context that leaves no room for a 4,000-token prompt (the cluster of
tests/libs/routing/test_admission.py), so ``RouterService.decide`` holds the request: it
decides again every ``admit_recheck_s`` and returns only once the cluster has an idle endpoint;
then its decision is the one ``RouterCore.decide`` (the simulator's call) gives for the same
state.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from kvmesh.routing.load import LoadReport
from kvmesh.routing.scoring import ScoringConfig
from kvmesh.routing.types import RouteRequest
from kvmesh_router import metrics
from kvmesh_router.config import RouterConfig
from kvmesh_router.main import build_service
from kvmesh_router.service import GenInput, Prepared, RouterService

BS = 16
N = 4000
pytestmark = pytest.mark.timeout(60)


def _report(queued: int) -> LoadReport:
    # The service decides on time.monotonic(); the reports never go stale here (load_staleness_s).
    return LoadReport(running=1, waiting=1, waiting_prefill_tokens=queued, num_blocks=401,
                      received_at=time.monotonic())


def _saturated_service(recheck_s: float) -> tuple[RouterService, Prepared]:
    cfg = RouterConfig(endpoints=["e0=127.0.0.1:1", "e1=127.0.0.1:2"], block_size=BS, load_staleness_s=1e9,
                       scoring=ScoringConfig(admit_miss_ratio=0.5, admit_recheck_s=recheck_s))
    svc = build_service(cfg)
    core = svc.core
    for ep in ("e0", "e1"):
        core.load.working_set.touch(f"other-{ep}", ep, 3000, time.monotonic())
    core.load.update("e0", _report(1000))
    core.load.update("e1", _report(40_000))
    rng = random.Random(2)
    tokens = [rng.randrange(32000) for _ in range(N)]
    req = RouteRequest("r1", cfg.model, core.chain(tokens, None, "s").keys, N, BS, "s")
    return svc, Prepared(request_id="r1", tokens=tokens, extra=None, salt="", req=req)


async def _held_then_sent() -> None:
    svc, p = _saturated_service(0.01)
    core, req = svc.core, p.req
    holds0 = metrics.HOLDS._value.get()
    task = asyncio.create_task(svc.decide(p, "", set()))
    # Held: it is decided again and again (a condition, not a sleep), and not sent.
    async with asyncio.timeout(30):
        while metrics.HOLDS._value.get() < holds0 + 3:
            await asyncio.sleep(0.01)
    assert not task.done()
    # e1's queue empties: the cluster is no longer saturated, the next decision sends it.
    core.load.update("e1", _report(0))
    d, _split = await asyncio.wait_for(task, 30)
    assert d.hold == ""
    # The simulator's call on the same state decides the same.
    ref = core.decide(req, None, time.monotonic())
    assert (d.endpoint_id, d.predicted_cached_tokens, d.score) == (ref.endpoint_id, ref.predicted_cached_tokens,
                                                                    ref.score)
    assert core.load.inflight_count(d.endpoint_id) == 0   # decided, not yet recorded as sent


def test_live_router_holds_then_sends_as_the_core_decides():
    asyncio.run(_held_then_sent())


async def _deadline_ends_the_hold() -> None:
    # Rechecks every 1,000 s: a request whose deadline comes first is sent at once, not held.
    svc, p = _saturated_service(1000.0)
    timing = GenInput(model="tiny", deadline=time.monotonic() + 60.0)
    d, _split = await asyncio.wait_for(svc.decide(p, "", set(), timing=timing), 30)
    assert d.hold == "" and d.endpoint_id == "e0"
    assert svc.core.decide(p.req, None, time.monotonic()).hold   # the core alone would hold it


def test_a_hold_never_outlasts_the_deadline():
    asyncio.run(_deadline_ends_the_hold())
