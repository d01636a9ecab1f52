"""``precise`` routing on real engine KV events: sim workers → ZMQ → indexer (memory or Redis) → router."""

from __future__ import annotations

import concurrent.futures
import random
import time
from collections.abc import Iterator

import grpc
import pytest

from kvmesh.common.v1 import common_pb2
from kvmesh.indexer.v1 import indexer_pb2, indexer_pb2_grpc
from kvmesh.router.v1 import router_pb2
from kvmesh.testing.procs import ServiceProcess
from tests.fixtures.router import MODEL, RouterStack, start_indexer, start_router, start_workers

pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module", params=["memory", "redis"])
def istack(request, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterStack]:
    tmp = tmp_path_factory.mktemp(f"router-indexer-{request.param}")
    started: list[ServiceProcess] = []
    try:
        extra = []
        if request.param == "redis":
            redis = request.getfixturevalue("redis_server")
            extra = ["--backend", "redis", "--redis-url", redis.url, "--redis-namespace", f"rt{time.time_ns()}"]
        idx = start_indexer(tmp, extra)
        started.append(idx)
        workers = start_workers(tmp, ["w1", "w2", "w3"], indexer=idx.grpc_address)
        started.extend(workers.values())
        # No static endpoints: they all come from the indexer's registry.
        router, http = start_router(tmp, [], indexer=idx.grpc_address, extra=["--speculative-ttl-s", "0.5"])
        started.append(router)
        st = RouterStack(router, http, workers, idx)
        _wait_endpoints(st, 3)
        yield st
        st.close()
    finally:
        for p in reversed(started):
            p.stop(grace_s=3)


def _wait_endpoints(st: RouterStack, n: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        models = st.stub.ListModels(router_pb2.ListModelsRequest(), timeout=5).models
        if models and len(models[0].endpoints) >= n:
            return
        time.sleep(0.1)
    raise AssertionError("router did not discover the workers from the indexer registry")


def _gen(st: RouterStack, tokens: list[int], max_tokens: int = 4, **kw) -> tuple[list[int], router_pb2.Final]:
    req = router_pb2.GenerateRequest(model=MODEL, tokens=common_pb2.TokenIds(ids=tokens),
                                     sampling=common_pb2.SamplingParams(max_tokens=max_tokens), **kw)
    out: list[int] = []
    final = None
    for msg in st.stub.Generate(req, timeout=30):
        if msg.HasField("chunk"):
            out.extend(msg.chunk.token_ids)
        else:
            final = msg.final
    return out, final


def _rand(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(n)]


def _indexed(st: RouterStack, tokens_keys: list[int], endpoint: str, timeout: float = 5.0) -> None:
    """Wait until the indexer holds the chain on ``endpoint`` (engine events landed)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(st.indexer.grpc_address) as ch:
        stub = indexer_pb2_grpc.IndexerStub(ch)
        while time.monotonic() < deadline:
            r = stub.Lookup(indexer_pb2.LookupRequest(model=MODEL, tokens=common_pb2.TokenIds(ids=tokens_keys)),
                            timeout=5)
            if any(m.endpoint_id == endpoint and m.combined_blocks for m in r.matches):
                return
            time.sleep(0.05)


def test_session_turns_on_engine_events_with_exact_predictions(istack):
    tokens = _rand(800, 21)
    holder = None
    for turn in range(5):
        out, fin = _gen(istack, tokens, session_id="s-idx")
        holder = holder or fin.routing.endpoint
        assert fin.routing.endpoint == holder
        assert fin.routing.predicted_cached_tokens == fin.usage.cached_tokens, (turn, fin)
        assert not fin.routing.reason.startswith("fallback")
        tokens = tokens + out + _rand(90, 100 + turn)
        _indexed(istack, tokens[:64], holder)
        time.sleep(0.6)   # past the speculative TTL: the next prediction rests on engine events alone


def test_sibling_burst_colocates_before_events_arrive(istack):
    shared = _rand(1600, 31)

    def one(i: int) -> router_pb2.Final:
        return _gen(istack, shared + _rand(40, 2000 + i), max_tokens=2)[1]

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        finals = list(ex.map(one, range(8)))
    assert len({f.routing.endpoint for f in finals}) == 1, [f.routing.endpoint for f in finals]


def test_a_new_request_goes_where_the_engine_holds_its_prefix(istack):
    doc = _rand(1200, 41)
    _, a = _gen(istack, doc)
    _indexed(istack, doc[:64], a.routing.endpoint)
    time.sleep(0.6)
    _, b = _gen(istack, doc + _rand(64, 42))
    assert b.routing.endpoint == a.routing.endpoint
    assert b.routing.predicted_cached_tokens == b.usage.cached_tokens >= 1152


def test_offload_tier_is_credited_and_predicted_exactly(tmp_path, procs):
    """A prefix only in the shared offload store: any endpoint restores it, the router predicts it."""
    from kvmesh.testing.ports import free_port

    idx = procs(start_indexer(tmp_path))
    sp = free_port()
    store = procs(ServiceProcess(
        "offload", ["--host", "127.0.0.1", "--port", str(sp), "--model", MODEL, "--endpoint-id", "store-0",
                    "--events-endpoint", f"tcp://*:{free_port()}", "--indexer-address", idx.grpc_address,
                    "--advertise-host", "127.0.0.1"],
        f"127.0.0.1:{sp}", log_path=tmp_path / "offload.log").start(60))
    ws = start_workers(tmp_path, ["w1", "w2"], indexer=idx.grpc_address,
                       extra=["--offload-address", store.grpc_address])
    for w in ws.values():
        procs(w)
    router, http = start_router(tmp_path, [], indexer=idx.grpc_address, extra=["--speculative-ttl-s", "0.3"])
    st = RouterStack(procs(router), http, ws, idx)
    _wait_endpoints(st, 2)
    doc = _rand(1000, 51)
    _, first = _gen(st, doc)
    holder = first.routing.endpoint
    _indexed(st, doc[:64], "store-0")
    ws[holder].kill()   # its GPU copy is gone; the store's copy remains
    _, second = _gen(st, doc + _rand(100, 52))
    r = second.routing
    assert r.endpoint != holder
    assert r.predicted_cached_tokens_offload == second.usage.cached_tokens_offload == 992
    assert r.predicted_cached_tokens == second.usage.cached_tokens
    st.close()
