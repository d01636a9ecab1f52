"""Hedged first tokens, with real processes: a router, a slow sim worker and a quick one.

The slow worker takes 30 s (real) for any step that admits a new request, an injected delay
(``--request-overhead-s``) that load reports do not show, as a stalled engine would look.
Round robin sends every other request to it first. The router hedges after 0.3 s with a
budget of exactly one hedge (burst 1, fraction 0), so:
- the first request sent to the slow worker is hedged, the copy on the quick worker answers
  first, and the slow worker's call is cancelled: its engine request is aborted;
- the next request sent there finds the budget spent: no hedge, it waits for the first-token
  timeout and is retried.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvmesh_tools.testing.procs import ServiceProcess
from tests.fixtures.router import RouterStack, metric, rand_tokens, start_router, start_worker, wait_for

pytestmark = pytest.mark.timeout(180)

FIRST_TOKEN_S = 3.0
SLOW_OVERHEAD_S = 600.0   # sim seconds; the fixture's workers run 20x real time: 30 s


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterStack, dict[str, int], int]]:
    tmp = tmp_path_factory.mktemp("hedge")
    workers: dict[str, ServiceProcess] = {}
    router = None
    try:
        workers["s1"] = start_worker(tmp, "s1", wait=False, port_flags=["--metrics-port"], extra=[
            "--request-overhead-s", str(SLOW_OVERHEAD_S)])
        workers["s2"] = start_worker(tmp, "s2", wait=False, port_flags=["--metrics-port"])
        for w in workers.values():
            w.wait_ready(90)
        wports = {e: w.flag_port("--metrics-port") for e, w in workers.items()}
        router, http = start_router(tmp, [(e, w.grpc_address) for e, w in workers.items()], port_flags=[
            "--metrics-port"], extra=[
            "--policy", "round_robin", "--load-poll-s", "60",
            "--first-token-timeout-s", str(FIRST_TOKEN_S),
            "--hedge-delay-s", "0.3", "--hedge-budget", "0", "--hedge-burst", "1"])
        st = RouterStack(router, http, workers)
        yield st, wports, router.flag_port("--metrics-port")
        st.close()
    finally:
        if router is not None:
            router.stop(grace_s=3)
        for w in workers.values():
            w.stop(grace_s=3)


def test_a_hedge_beats_a_stalled_worker_and_the_budget_bounds_hedges(stack) -> None:
    st, wports, rport = stack
    # 1. The first request sent to s1 is hedged; the copy on s2 wins; s1's call is cancelled.
    hedged = None
    for i in range(4):
        out, fin = st.generate(rand_tokens(200, 100 + i), max_tokens=4)
        assert fin.routing.endpoint == "s2", fin.routing   # s1 never answers in time
        assert len(out) == 4
        if "hedged" in fin.routing.reason:
            hedged = fin
            break
    assert hedged is not None, "no request was sent to the slow worker first"
    assert "s2 answered before s1" in hedged.routing.reason, hedged.routing.reason
    assert hedged.routing.attempts == 1   # a hedge is not a retry
    assert metric(rport, "kvmesh_router_hedges_total", event="sent") == 1
    assert metric(rport, "kvmesh_router_hedges_total", event="won") == 1
    # The loser is released: s1 aborted its engine request, long before its 30 s step ends.
    wait_for(lambda: metric(wports["s1"], "kvmesh_worker_requests_total", rpc="generate", outcome="cancelled") >= 1,
          "s1 to see the losing call cancelled")
    wait_for(lambda: metric(wports["s1"], "vllm:num_requests_running") == 0
          and metric(wports["s1"], "vllm:num_requests_waiting") == 0, "s1 to hold no request")
    assert metric(wports["s1"], "kvmesh_worker_requests_total", rpc="generate", outcome="length") == 0

    # 2. The budget is spent: the next request sent to s1 is not hedged; it is retried after the
    # first-token timeout instead.
    retried = None
    for i in range(4):
        _, fin = st.generate(rand_tokens(200, 200 + i), max_tokens=4)
        assert fin.routing.endpoint == "s2", fin.routing
        assert "hedged" not in fin.routing.reason, fin.routing.reason
        if fin.routing.attempts > 1:
            retried = fin
            break
    assert retried is not None, "no request was sent to the slow worker first"
    assert metric(rport, "kvmesh_router_hedges_total", event="sent") == 1
    assert metric(rport, "kvmesh_router_hedges_total", event="denied") >= 1
    assert metric(rport, "kvmesh_router_stalls_total", stage="first_token") >= 1
