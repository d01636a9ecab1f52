"""The lookup deadline does not charge the indexer for the router's own event-loop lag."""

from __future__ import annotations

import asyncio
import time

from kvmesh_router.loop_lag import LoopLag, wait_answer


def test_behind_adds_up_late_wake_ups_and_an_overdue_one() -> None:
    now = [100.0]
    lag = LoopLag(period_s=0.02, clock=lambda: now[0])
    assert lag.woke(due=100.0, now=100.3) > 0.29
    assert lag.woke(due=101.0, now=100.9) == 0.0   # early is not behind
    assert abs(lag.behind() - 0.3) < 1e-9
    lag._due = 100.5                                # a wake-up planned for 100.5, not run yet
    now[0] = 101.0
    assert abs(lag.behind() - 0.8) < 1e-9


async def test_an_answer_a_blocked_loop_could_not_read_is_not_late() -> None:
    loop = asyncio.get_running_loop()
    lag = LoopLag(period_s=0.01)
    lag.start()
    try:
        await asyncio.sleep(0.05)
        call = loop.create_future()
        # The answer is due 1.5 s after the lookup starts; the loop is blocked for the first
        # 1.0 s of it, so the 1.0 s deadline's timer fires late, before the answer is set. The
        # loop's lag (~1 s) is granted back, so the answer counts as in time.
        loop.call_later(1.5, call.set_result, "answer")
        loop.call_soon(time.sleep, 1.0)
        answered, _ = await wait_answer(call, 1.0, lag, max_grace_s=5.0)
        assert answered and call.result() == "answer"
    finally:
        await lag.stop()


async def test_a_slow_answer_on_an_idle_loop_times_out() -> None:
    loop = asyncio.get_running_loop()
    lag = LoopLag(period_s=0.01)
    lag.start()
    try:
        call = loop.create_future()
        answered, _ = await wait_answer(call, 0.1, lag, max_grace_s=5.0)
        assert not answered and not call.done()   # never cancelled by the wait
        # Without a lag monitor (or grace 0) the deadline is the plain one.
        assert (await wait_answer(call, 0.05, None, 5.0))[0] is False
        assert (await wait_answer(call, 0.05, lag, 0.0))[0] is False
    finally:
        await lag.stop()


def test_a_slow_load_poll_marks_an_endpoint_down_only_when_it_repeats() -> None:
    """GetLoad past its deadline: a loaded machine, not a dead worker, until it happens in a row."""
    import grpc

    from kvmesh.routing.router import RouterCore, RouterCoreConfig
    from kvmesh_router.cluster import Cluster
    from kvmesh_router.config import RouterConfig

    class _Stub:
        def __init__(self) -> None:
            self.code = grpc.StatusCode.DEADLINE_EXCEEDED

        async def GetLoad(self, *_a, **_kw):  # noqa: N802 - the gRPC method's name
            raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), "slow")

    async def run() -> None:
        cl = Cluster(RouterConfig(model="m", block_size=16, endpoints=["a=127.0.0.1:1"], load_deadline_strikes=3),
                     RouterCore(RouterCoreConfig(block_size=16)))
        stub = _Stub()
        cl.stub = lambda eid: stub   # type: ignore[method-assign]
        alive = lambda: cl.core.endpoints["a"].alive   # noqa: E731
        await cl.poll_load("a")
        await cl.poll_load("a")
        assert alive()
        await cl.poll_load("a")
        assert not alive()
        # A refused connection is down at once.
        cl.core.set_alive("a", True)
        cl._load_strikes.clear()
        stub.code = grpc.StatusCode.UNAVAILABLE
        await cl.poll_load("a")
        assert not alive()
        await cl.stop()

    asyncio.run(run())
