"""Failures around the router: dead workers, deadlines, client cancel, no endpoints, indexer down."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh_api.worker.v1 import worker_pb2, worker_pb2_grpc
from kvmesh_tools.testing.ports import free_port
from kvmesh_tools.testing.procs import ServiceProcess
from tests.fixtures.router import MODEL, rand_tokens, start_router, start_worker, start_workers

pytestmark = pytest.mark.timeout(120)


def _req(tokens: list[int], max_tokens: int = 4, **kw) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(model=MODEL, tokens=common_pb2.TokenIds(ids=tokens),
                                      sampling=common_pb2.SamplingParams(max_tokens=max_tokens), **kw)


def _final(stub, req, timeout=30) -> router_pb2.Final:
    msgs = list(stub.Generate(req, timeout=timeout))
    return msgs[-1].final




def _running(addr: str) -> int:
    with grpc.insecure_channel(addr) as ch:
        r = worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
        return r.running + r.waiting


def _wait_idle(addr: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while _running(addr) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(addr) == 0, "the worker's request was not aborted"


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Iterator[tuple[ServiceProcess, dict[str, ServiceProcess]]]:
    """Two workers behind a router whose indexer is down and whose load polling is slow.

    Slow polling means the router only learns of a death from the failed call itself.
    """
    tmp = tmp_path_factory.mktemp("router-pair")
    workers = start_workers(tmp, ["w1", "w2"])
    router = None
    try:
        router, _ = start_router(tmp, [(e, w.grpc_address) for e, w in workers.items()],
                                 indexer=f"127.0.0.1:{free_port()}", extra=["--load-poll-s", "60"])
        router.tmp = tmp  # type: ignore[attr-defined]
        yield router, workers
    finally:
        if router is not None:
            router.stop(grace_s=3)
        for w in workers.values():
            w.stop(grace_s=3)


def test_indexer_down_falls_back_to_approx_not_an_error(pair):
    router, _ = pair
    with grpc.insecure_channel(router.grpc_address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        tokens = rand_tokens(500, 6)
        a = _final(stub, _req(tokens))
        b = _final(stub, _req(tokens + rand_tokens(64, 7)))
        assert a.routing.policy == "precise" and "fallback" in b.routing.reason
        assert b.routing.endpoint == a.routing.endpoint
        assert b.routing.predicted_cached_tokens == b.usage.cached_tokens > 0
    assert "indexer unavailable" in (router.tmp / "router.log").read_text()


def test_a_reused_request_id_is_two_requests_on_one_engine(pair):
    """Envoy retries a request on another router replica under the same x-request-id while the
    first try may still run on its engine, and a client may reuse an id: two requests in flight
    under one id on one engine both succeed, and both answers carry the client's id."""
    router, _ = pair
    with grpc.insecure_channel(router.grpc_address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        tokens = rand_tokens(400, 11)
        first = stub.Generate(_req(tokens, max_tokens=64, session_id="dup", request_id="same-id"), timeout=30)
        assert next(first).WhichOneof("kind") == "chunk"   # the first request is decoding
        second = list(stub.Generate(_req(tokens, max_tokens=64, session_id="dup", request_id="same-id"),
                                    timeout=30))[-1].final
        rest = list(first)
        assert rest and rest[-1].final.request_id == second.request_id == "same-id"
        assert rest[-1].final.routing.endpoint == second.routing.endpoint
        assert rest[-1].final.usage.completion_tokens == second.usage.completion_tokens == 64
        # The longest id a client may send still leaves the engine id room for retries and splits.
        longest = _final(stub, _req(tokens, session_id="dup", request_id="x" * 128))
        assert longest.request_id == "x" * 128 and longest.usage.completion_tokens == 4


def test_killed_worker_is_retried_around(pair):
    router, workers = pair
    with grpc.insecure_channel(router.grpc_address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        tokens = rand_tokens(600, 1)
        first = _final(stub, _req(tokens, session_id="s"))
        holder = first.routing.endpoint
        workers[holder].kill()
        again = _final(stub, _req(tokens + rand_tokens(50, 2), session_id="s"))
        assert again.routing.endpoint != holder
        assert again.routing.attempts == 2
        assert again.usage.completion_tokens == 4


def test_deadline_cancel_midstream_death_and_no_endpoint(tmp_path, procs):
    w1 = procs(start_worker(tmp_path, "w1", extra=["--time-scale", "1", "--itl-s", "0.05"]))
    router, http = start_router(tmp_path, [("w1", w1.grpc_address)], extra=["--max-attempts", "2"])
    procs(router)
    # An HTTP client that disconnects mid-stream aborts the worker's request too.
    with httpx.stream("POST", f"http://127.0.0.1:{http}/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": rand_tokens(100, 8), "max_tokens": 400, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                assert _running(w1.grpc_address) == 1
                break
    _wait_idle(w1.grpc_address)
    # Same for a non-streaming request whose client gives up.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"http://127.0.0.1:{http}/v1/completions", timeout=1.0,
                   json={"model": MODEL, "prompt": rand_tokens(100, 9), "max_tokens": 400})
    _wait_idle(w1.grpc_address)
    with grpc.insecure_channel(router.grpc_address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        # A deadline reaches the worker: its request is aborted.
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Generate(_req(rand_tokens(100, 4), max_tokens=400), timeout=0.5))
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        _wait_idle(w1.grpc_address)
        # So does a client cancel.
        call = stub.Generate(_req(rand_tokens(100, 5), max_tokens=400), timeout=30)
        next(iter(call))
        assert _running(w1.grpc_address) == 1
        call.cancel()
        _wait_idle(w1.grpc_address)
        # The worker dies after tokens were streamed: a clean error saying what was generated.
        got = 0
        with pytest.raises(grpc.RpcError) as ei:
            for msg in stub.Generate(_req(rand_tokens(100, 3), max_tokens=400), timeout=30):
                if msg.HasField("chunk"):
                    got += len(msg.chunk.token_ids)
                    if got >= 2 and w1.alive():
                        w1.kill()
        assert ei.value.code() == grpc.StatusCode.ABORTED
        assert "generated tokens" in ei.value.details() and "w1" in ei.value.details()
        # No live endpoint left: UNAVAILABLE, not a hang.
        with pytest.raises(grpc.RpcError) as ei:
            _final(stub, _req([1, 2, 3]))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
