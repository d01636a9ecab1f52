"""The router's lookup deadline is judged on when the indexer's answer arrived, from the send.

Under a soak the router's event loop runs tens of ms late per iteration, and a ``grpc.aio``
lookup took several iterations to be sent and several more to be read: answers that had
arrived in time were read past the deadline and the request fell back to the local view
(``lookup_timeout`` mispredictions). Lookups are now sent at once and answered on gRPC's own
thread (``kvmesh_router.index_lookup``). A real indexer process answers while the router's loop
is blocked past the deadline: the answer counts.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.fixtures.router import BLOCK, MODEL, start_indexer

pytestmark = pytest.mark.timeout(120)


def _cluster(address: str, **cfg: object):  # noqa: ANN202
    from kvmesh.routing.router import RouterCore, RouterCoreConfig
    from kvmesh_router.cluster import Cluster
    from kvmesh_router.config import RouterConfig

    return Cluster(RouterConfig(model=MODEL, block_size=BLOCK, indexer=address, endpoints=["g0=127.0.0.1:1"], **cfg),
                   RouterCore(RouterCoreConfig(block_size=BLOCK)))


def _lookups(outcome: str) -> float:
    from kvmesh_router import metrics

    return metrics.LOOKUPS.labels(outcome=outcome)._value.get()


async def test_an_answer_in_by_the_deadline_counts_though_the_loop_has_not_read_it(tmp_path: Path, procs) -> None:
    idx = procs(start_indexer(tmp_path))
    # No loop-lag grace: only the answer's arrival can make it count.
    cluster = _cluster(idx.grpc_address, lookup_timeout_s=0.3, lookup_loop_grace_s=0.0, loop_lag_period_s=0.0)
    keys = list(range(1, 40))
    try:
        for _ in range(50):   # the channel's first connection, once the indexer serves
            if await cluster.lookup(keys) is not None:
                break
            await asyncio.sleep(0.1)
        ok, local = _lookups("ok"), _lookups("local")
        task = asyncio.create_task(cluster.lookup(keys))
        await asyncio.sleep(0)      # the lookup is sent, and waits
        time.sleep(1.0)             # the loop is blocked past the deadline; the indexer answers meanwhile
        got = await task
        assert got is not None and got.source != "local", got
        assert _lookups("ok") == ok + 1 and _lookups("local") == local
    finally:
        await cluster.stop()


async def test_a_lookup_past_its_deadline_is_answered_by_the_local_view_and_merged_late(tmp_path: Path,
                                                                                        procs) -> None:
    """The indexer is stopped (SIGSTOP): nothing arrives, the local view answers, and the answer
    that comes once it runs again is merged into the view."""
    import os
    import signal

    from kvmesh.routing.types import Matches, TierMatch

    idx = procs(start_indexer(tmp_path))
    cluster = _cluster(idx.grpc_address, lookup_timeout_s=0.2, lookup_loop_grace_s=0.0, loop_lag_period_s=0.0,
                       lookup_late_s=5.0)
    keys = list(range(100, 140))
    try:
        for _ in range(50):
            if await cluster.lookup(keys) is not None:
                break
            await asyncio.sleep(0.1)
        cluster.local_view.learn(keys, Matches(per_endpoint={"g0": TierMatch(gpu=len(keys))}), time.monotonic())
        merged = _lookups("late_merged")
        os.kill(idx.proc.pid, signal.SIGSTOP)
        try:
            got = await cluster.lookup(keys)
        finally:
            os.kill(idx.proc.pid, signal.SIGCONT)
        assert got is not None and got.source == "local" and got.per_endpoint["g0"].gpu == len(keys)
        for _ in range(100):
            if _lookups("late_merged") > merged:
                break
            await asyncio.sleep(0.05)
        assert _lookups("late_merged") == merged + 1
    finally:
        await cluster.stop()
