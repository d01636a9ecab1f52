"""``precise`` routing on real engine KV events: sim workers → ZMQ → indexer (memory or Redis) → router."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator

import pytest

from kvmesh_api.router.v1 import router_pb2
from kvmesh_tools.testing.procs import ServiceProcess
from tests.fixtures.router import (
    MODEL,
    RouterStack,
    rand_tokens,
    start_indexer,
    start_router,
    start_workers,
    wait_endpoints,
)

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
        wait_endpoints(st, 3)
        yield st
        st.close()
    finally:
        for p in reversed(started):
            p.stop(grace_s=3)


def test_session_turns_on_engine_events_with_exact_predictions(istack):
    tokens = rand_tokens(800, 21)
    holder = None
    for turn in range(5):
        out, fin = istack.generate(tokens, session_id="s-idx")
        holder = holder or fin.routing.endpoint
        assert fin.routing.endpoint == holder
        assert fin.routing.predicted_cached_tokens == fin.usage.cached_tokens, (turn, fin)
        assert not fin.routing.reason.startswith("fallback")
        tokens = tokens + out + rand_tokens(90, 100 + turn)
        istack.wait_indexed(holder, tokens=tokens[:64])
        time.sleep(0.6)   # past the speculative TTL: the next prediction rests on engine events alone


def test_sibling_burst_colocates_before_events_arrive(istack):
    shared = rand_tokens(1600, 31)

    def one(i: int) -> router_pb2.Final:
        return istack.generate(shared + rand_tokens(40, 2000 + i), max_tokens=2)[1]

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        finals = list(ex.map(one, range(8)))
    assert len({f.routing.endpoint for f in finals}) == 1, [f.routing.endpoint for f in finals]


def test_a_new_request_goes_where_the_engine_holds_its_prefix(istack):
    doc = rand_tokens(1200, 41)
    _, a = istack.generate(doc)
    istack.wait_indexed(a.routing.endpoint, tokens=doc[:64])
    time.sleep(0.6)
    _, b = istack.generate(doc + rand_tokens(64, 42))
    assert b.routing.endpoint == a.routing.endpoint
    assert b.routing.predicted_cached_tokens == b.usage.cached_tokens >= 1152


def test_shared_speculative_entry_lives_until_the_estimated_prefill_is_done(istack):
    """Other router replicas see a pick through the indexer's speculative entry; it must outlive
    the prefill the router expects (its score), not only the configured 0.5 s event delay."""
    import grpc

    from kvmesh_api.common.v1 import common_pb2
    from kvmesh_api.indexer.v1 import indexer_pb2, indexer_pb2_grpc

    doc = rand_tokens(4000, 61)   # uncached: about a second of prefill by the router's estimate
    sent = time.monotonic()
    _, fin = istack.generate(doc, max_tokens=1)
    with grpc.insecure_channel(istack.indexer.grpc_address) as ch:
        r = indexer_pb2_grpc.IndexerStub(ch).Lookup(indexer_pb2.LookupRequest(
            model=MODEL, tokens=common_pb2.TokenIds(ids=doc), include_speculative=True), timeout=5)
    elapsed = time.monotonic() - sent
    (m,) = [m for m in r.matches if m.endpoint_id == fin.routing.endpoint]
    assert fin.routing.score > 0.5, fin.routing
    assert m.speculative_blocks > 0
    # The workers run 20x faster than the estimate, so the entry is still young.
    assert 0.5 + fin.routing.score - elapsed <= m.speculative_ttl_s <= 0.5 + fin.routing.score + 1e-6


def test_offload_tier_is_credited_and_predicted_exactly(tmp_path, procs):
    """A prefix only in the shared offload store: any endpoint restores it, the router predicts it."""

    idx = procs(start_indexer(tmp_path))
    store = procs(ServiceProcess.with_ports(
        "offload", lambda sp, ep: ["--host", "127.0.0.1", "--port", str(sp), "--model", MODEL, "--endpoint-id",
                                   "store-0", "--events-endpoint", f"tcp://*:{ep}", "--indexer-address",
                                   idx.grpc_address, "--advertise-host", "127.0.0.1"],
        count=2, log_path=tmp_path / "offload.log").start(60))
    ws = start_workers(tmp_path, ["w1", "w2"], indexer=idx.grpc_address,
                       extra=["--offload-address", store.grpc_address])
    for w in ws.values():
        procs(w)
    router, http = start_router(tmp_path, [], indexer=idx.grpc_address, extra=["--speculative-ttl-s", "0.3"])
    st = RouterStack(procs(router), http, ws, idx)
    wait_endpoints(st, 2)
    doc = rand_tokens(1000, 51)
    _, first = st.generate(doc)
    holder = first.routing.endpoint
    st.wait_indexed("store-0", tokens=doc[:64])
    ws[holder].kill()   # its GPU copy is gone; the store's copy remains
    _, second = st.generate(doc + rand_tokens(100, 52))
    r = second.routing
    assert r.endpoint != holder
    assert r.predicted_cached_tokens_offload == second.usage.cached_tokens_offload == 992
    assert r.predicted_cached_tokens == second.usage.cached_tokens
    st.close()
