"""A split request is hedged too: its prefill endpoint stalls, an unsplit copy answers.

Real processes: an offload store, a prefill sim worker that takes 10 s (real) for any step
that admits a request (``--request-overhead-s``, which load reports do not show), and two
decode sim workers. The router splits long prompts and hedges after 0.3 s, one hedge in all.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvmesh_tools.testing.procs import ServiceProcess
from tests.fixtures.router import (
    MODEL,
    RouterStack,
    metric,
    rand_tokens,
    start_router,
    start_worker,
    wait_for,
)

pytestmark = pytest.mark.timeout(180)

SLOW_OVERHEAD_S = 200.0   # sim seconds; the fixture's workers run 20x real time: 10 s


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterStack, int, int]]:
    tmp = tmp_path_factory.mktemp("hedge-split")
    started: list[ServiceProcess] = []
    try:
        store = ServiceProcess.with_ports(
            "offload", lambda p: ["--host", "127.0.0.1", "--port", str(p), "--model", MODEL,
                                  "--events-endpoint", "", "--events-replay-endpoint", ""],
            log_path=tmp / "offload.log")
        started.append(store)
        store.start(60)   # ready first: a retried start moves its address
        off = ["--offload-address", store.grpc_address]
        pre = start_worker(tmp, "p1", role="prefill", wait=False, port_flags=["--metrics-port"], extra=[
            *off, "--request-overhead-s", str(SLOW_OVERHEAD_S)])
        started.append(pre)
        decode = {e: start_worker(tmp, e, wait=False, extra=off) for e in ("w1", "w2")}
        started.extend(decode.values())
        for proc in started:
            proc.wait_ready(90)
        pport = pre.flag_port("--metrics-port")
        router, http = start_router(
            tmp, [(e, w.grpc_address) for e, w in decode.items()], prefill=[("p1", pre.grpc_address)],
            port_flags=["--metrics-port"],
            extra=["--split-enabled", "true", "--split-threshold-tokens", "1024",
                   "--load-poll-s", "60", "--first-token-timeout-s", "60",
                   "--hedge-delay-s", "0.3", "--hedge-budget", "0", "--hedge-burst", "1"])
        started.append(router)
        rport = router.flag_port("--metrics-port")
        st = RouterStack(router, http, decode)
        yield st, pport, rport
        st.close()
    finally:
        for proc in reversed(started):
            proc.stop(grace_s=3)


def test_a_split_whose_prefill_stalls_is_hedged_unsplit(stack) -> None:
    st, pport, rport = stack
    out, fin = st.generate(rand_tokens(3000, seed=7), max_tokens=4)
    r = fin.routing
    assert len(out) == 4
    # The copy won: unsplit, on the decode endpoint the split did not pick, long before the
    # prefill endpoint's 10 s step (and the 60 s first-token timeout).
    assert "hedged after" in r.reason and not r.split and r.attempts == 1, r
    assert metric(rport, "kvmesh_router_hedges_total", event="sent") == 1
    assert metric(rport, "kvmesh_router_hedges_total", event="won") == 1
    # The lost split's prefill call was cancelled: once its step is over (the sim aborts between
    # steps), the prefill endpoint holds no request.
    wait_for(lambda: metric(pport, "vllm:num_requests_running") == 0
          and metric(pport, "vllm:num_requests_waiting") == 0, "p1 to drop the cancelled prefill", timeout=90)
