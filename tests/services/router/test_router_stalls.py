"""A hung worker never freezes a stream: silence before the first token is retried elsewhere,
silence after it ends the stream with an error that names what was sent.

The worker is stopped with SIGSTOP: its TCP connections stay open and nothing errors, which is
how a deadlocked or partitioned engine looks. Load polling is slowed so that the router learns
of the hang from the silence alone.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import grpc
import pytest

from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh_tools.testing.ports import free_port
from kvmesh_tools.testing.procs import ServiceProcess
from tests.fixtures.router import MODEL, rand_tokens, start_router, start_workers

pytestmark = pytest.mark.timeout(180)

FIRST_TOKEN_S = 2.0
IDLE_S = 1.5


def _req(tokens: list[int], max_tokens: int = 4, **kw) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(model=MODEL, tokens=common_pb2.TokenIds(ids=tokens),
                                      sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                      **kw)


def _pause(w: ServiceProcess, on: bool) -> None:
    assert w.proc is not None
    os.killpg(w.proc.pid, signal.SIGSTOP if on else signal.SIGCONT)


@pytest.fixture
def cluster(tmp_path) -> Iterator[tuple[ServiceProcess, dict[str, ServiceProcess]]]:
    workers = start_workers(tmp_path, ["s1", "s2"])
    router = None
    try:
        router, _ = start_router(tmp_path, [(e, w.grpc_address) for e, w in workers.items()],
                                 indexer=f"127.0.0.1:{free_port()}",
                                 extra=["--load-poll-s", "60", "--policy", "round_robin",
                                        "--first-token-timeout-s", str(FIRST_TOKEN_S),
                                        "--stream-idle-timeout-s", str(IDLE_S)])
        yield router, workers
    finally:
        for w in workers.values():
            if w.alive():
                _pause(w, False)
        if router is not None:
            router.stop(grace_s=3)
        for w in workers.values():
            w.stop(grace_s=3)


def test_requests_to_a_hung_worker_are_retried_before_their_first_token(cluster) -> None:
    router, workers = cluster
    _pause(workers["s1"], True)
    with grpc.insecure_channel(router.grpc_address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        ends = []
        for i in range(4):   # round robin: some land on the hung worker first
            t0 = time.monotonic()
            msgs = list(stub.Generate(_req(rand_tokens(300, 40 + i)), timeout=60))
            final = msgs[-1].final
            ends.append((final.routing.endpoint, final.routing.attempts, time.monotonic() - t0))
    assert all(ep == "s2" for ep, _, _ in ends), ends
    retried = [e for e in ends if e[1] > 1]
    assert retried, f"no request was sent to the hung worker first: {ends}"
    # Retried after the first-token timeout, not after an HTTP/2 ping timeout a minute later.
    assert all(FIRST_TOKEN_S * 0.9 <= s < FIRST_TOKEN_S + 10 for _, _, s in retried), ends


def test_a_stream_that_goes_silent_ends_with_an_error_naming_what_was_sent(cluster) -> None:
    router, workers = cluster
    with grpc.insecure_channel(router.grpc_address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        call = stub.Generate(_req(rand_tokens(300, 60), max_tokens=100_000), timeout=120)
        got: list[int] = list(next(call).chunk.token_ids)
        assert got, "the stream had started"
        # Stop whichever worker is streaming: both, so this test needs no routing knowledge.
        for w in workers.values():
            _pause(w, True)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            for msg in call:
                got.extend(msg.chunk.token_ids)
        silent = time.monotonic() - t0
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert "silent" in err.value.details() and "generated tokens" in err.value.details()
    assert silent < IDLE_S + 10, f"stream stayed open {silent:.1f}s"
