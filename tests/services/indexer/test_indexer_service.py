"""The indexer service over real gRPC, real ZMQ publishers and a real redis-server."""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
import time

import grpc
import pytest
import zmq

from kvmesh.events.codec import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch
from kvmesh.events.publisher import KvEventPublisher
from kvmesh.events.topic import make_topic
from kvmesh.hashing import BlockHasher
from kvmesh.registration import IndexerRegistration
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.indexer.v1 import indexer_pb2
from kvmesh_tools.testing.redis_server import RedisProcess
from tests.fixtures.indexer import awaits, wait_until
from tests.helpers.events import publish_lost

pytestmark = pytest.mark.timeout(90)

BS = 16
MODEL = "tiny"
MODELS = f"{MODEL}@{BS}@sha256_cbor"
HASHER = BlockHasher("sha256_cbor", BS)


def tokens(seed: int, n_blocks: int, extra: int = 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 32000) for _ in range(n_blocks * BS + extra)]


def stored(toks: list[int], medium: str | None = "GPU", start_block: int = 0, parent: int | None = None
           ) -> tuple[BlockStored, list[int]]:
    """A BlockStored for blocks [start_block:] of ``toks`` hashed like kvmesh (fast path)."""
    keys = HASHER.block_keys(toks)
    sel = keys[start_block:]
    n = len(keys)
    ev = BlockStored(block_hashes=sel, parent_block_hash=keys[start_block - 1] if start_block else parent,
                     token_ids=toks[start_block * BS:n * BS], block_size=BS, medium=medium)
    return ev, keys


def chain_req(keys: list[int], **kw) -> indexer_pb2.LookupRequest:  # noqa: ANN003
    return indexer_pb2.LookupRequest(model=MODEL, chain=indexer_pb2.BlockChain(keys=keys), **kw)


def match_of(resp: indexer_pb2.LookupResponse, endpoint: str) -> indexer_pb2.EndpointMatch | None:
    for m in resp.matches:
        if m.endpoint_id == endpoint:
            return m
    return None


async def combined(stub, keys: list[int], endpoint: str) -> int:  # noqa: ANN001
    m = match_of(await stub.Lookup(chain_req(keys), timeout=5), endpoint)
    return m.combined_blocks if m else 0


class Engine:
    """A KvEventPublisher that connects to the indexer's bound SUB (vLLM's connect mode) + replay.

    No port is picked before it is bound: the indexer binds port 0 and the engine connects to the
    port it got (``bound_to``); the replay socket is an ipc path of this engine's own."""

    def __init__(self, endpoint_id: str, sock_dir: str, replay: bool = True) -> None:
        self.endpoint_id = endpoint_id
        self.zmq = "tcp://127.0.0.1:0"   # until bound_to(): the indexer binds where the kernel picks
        self.replay = f"ipc://{sock_dir}/{endpoint_id}-replay.sock" if replay else None
        self.pub: KvEventPublisher | None = None

    def engine_spec(self) -> dict:
        return {"endpoint_id": self.endpoint_id, "model": MODEL, "zmq_endpoint": "tcp://127.0.0.1:0",
                "replay_endpoint": self.replay, "bind": True}

    def bound_to(self, ix) -> None:  # noqa: ANN001
        """Connect to the SUB socket ``ix`` bound for this engine (call before ``start``)."""
        self.zmq = ix.app.subscriber.subs[self.endpoint_id].bound_endpoint

    def start(self) -> KvEventPublisher:
        self.pub = KvEventPublisher(self.zmq, topic=make_topic(self.endpoint_id, MODEL), replay_endpoint=self.replay)
        return self.pub

    def publish(self, *events) -> int:  # noqa: ANN002
        assert self.pub is not None
        return self.pub.publish(list(events))

    def publish_lost(self, *events) -> int:  # noqa: ANN002
        """Publish a batch that never reaches subscribers (but stays in the replay buffer)."""
        assert self.pub is not None
        return publish_lost(self.pub, events)

    def stop(self) -> None:
        if self.pub is not None:
            self.pub.close(linger_ms=0)
            self.pub = None


@pytest.fixture
def engines():  # noqa: ANN201
    made: list[Engine] = []
    sock_dir = tempfile.mkdtemp(prefix="kvm-ix-")   # short: an ipc path is at most 107 bytes

    def make(endpoint_id: str, replay: bool = True) -> Engine:
        e = Engine(endpoint_id, sock_dir, replay)
        made.append(e)
        return e
    yield make
    for e in made:
        e.stop()
    shutil.rmtree(sock_dir, ignore_errors=True)


async def _publish_until(publish, seen, what: str, timeout_s: float = 20.0) -> None:  # noqa: ANN001
    """ZMQ drops what a publisher sends before its connection is up (slow joiner), and the
    connection's timing is the machine's: send again (idempotent batches) until ``seen()``."""
    deadline = time.monotonic() + timeout_s
    while not await seen():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        publish()
        await asyncio.sleep(0.1)


async def _connected(eng: Engine, ix) -> None:  # noqa: ANN001
    """ZMQ connects asynchronously: wait until a first batch lands (replay covers anything earlier)."""
    ev, keys = stored(tokens(999, 1))
    await _publish_until(lambda: eng.publish(ev), lambda: combined(ix.stub, keys, eng.endpoint_id),
                         "the engine's events to reach the indexer")


async def _indexer_on(start_indexer, eng: Engine, **kw) -> object:  # noqa: ANN001, ANN003
    """An indexer subscribed to ``eng`` alone, returned once the engine's events reach it."""
    ix = await start_indexer(models=MODELS, engines=f"[{_json(eng.engine_spec())}]", **kw)
    eng.bound_to(ix)
    eng.start()
    await _connected(eng, ix)
    return ix


async def test_zmq_ingest_lookup_by_chain_and_tokens(start_indexer, engines) -> None:
    eng = engines("e0")
    ix = await _indexer_on(start_indexer, eng)
    listed = await ix.stub.ListEndpoints(indexer_pb2.ListEndpointsRequest(), timeout=5)
    assert [e.endpoint.kv_events_endpoint for e in listed.endpoints] == [eng.zmq]   # the port its bind to 0 got
    assert not eng.zmq.endswith(":0")
    toks = tokens(1, 6)
    ev, keys = stored(toks)
    eng.publish(ev)
    await wait_until(lambda: combined(ix.stub, keys, "e0"), what="blocks ingested")
    by_chain = await ix.stub.Lookup(chain_req(keys + [12345]), timeout=5)
    m = match_of(by_chain, "e0")
    assert m.combined_blocks == 6 and [(t.tier, t.blocks) for t in m.tiers] == [(common_pb2.TIER_GPU, 6)]
    assert by_chain.chain_length == 7 and by_chain.block_size == BS
    by_tokens = await ix.stub.Lookup(indexer_pb2.LookupRequest(
        model=MODEL, tokens=common_pb2.TokenIds(ids=toks + [7] * 40)), timeout=5)
    assert list(by_tokens.keys)[:6] == keys and match_of(by_tokens, "e0").combined_blocks == 6
    # A cache_salt changes the chain: nothing matches.
    salted = await ix.stub.Lookup(indexer_pb2.LookupRequest(
        model=MODEL, tokens=common_pb2.TokenIds(ids=toks), extra_keys=common_pb2.ExtraKeys(cache_salt="t1")),
        timeout=5)
    assert match_of(salted, "e0") is None
    # Remove block 3: the leading match shrinks to 3.
    eng.publish(BlockRemoved(block_hashes=[keys[3]], medium="GPU"))
    await wait_until(lambda: awaits(combined(ix.stub, keys, "e0"), 3), what="removal applied")
    assert ix.metric("kvmesh_indexer_events_total", {"type": "stored"}) >= 2
    assert ix.metric("kvmesh_indexer_blocks", {"tier": "GPU"}) == 6  # warm-up 1 + 6 - 1


async def test_gap_is_repaired_by_replay(start_indexer, engines) -> None:
    eng = engines("e0", replay=True)
    ix = await _indexer_on(start_indexer, eng)
    # A warm-up batch lost to ZMQ's slow joiner is caught up by a replay too: count from here.
    gaps0 = ix.metric("kvmesh_indexer_seq_gaps_total", {"endpoint": "e0"}) or 0
    replays0 = ix.metric("kvmesh_indexer_replays_total", {"endpoint": "e0", "outcome": "complete"}) or 0
    toks = tokens(2, 8)
    keys = HASHER.block_keys(toks)
    first, _ = stored(toks[: 4 * BS])
    lost, _ = stored(toks, start_block=4)
    lost.block_hashes, lost.token_ids = keys[4:6], toks[4 * BS:6 * BS]
    last, _ = stored(toks, start_block=6)
    eng.publish(first)
    eng.publish_lost(lost)        # seq gap: the indexer never sees this one
    eng.publish(last)
    await wait_until(lambda: awaits(combined(ix.stub, keys, "e0"), 8), what="gap repaired")
    assert ix.metric("kvmesh_indexer_seq_gaps_total", {"endpoint": "e0"}) - gaps0 == 1
    assert ix.metric("kvmesh_indexer_replays_total", {"endpoint": "e0", "outcome": "complete"}) - replays0 == 1
    assert ix.metric("kvmesh_indexer_endpoint_clears_total", {"endpoint": "e0", "reason": "gap"}) is None


async def test_gap_without_replay_clears_endpoint(start_indexer, engines) -> None:
    eng = engines("e0", replay=False)
    ix = await _indexer_on(start_indexer, eng)
    a = tokens(3, 4)
    ev_a, keys_a = stored(a)
    eng.publish(ev_a)
    await wait_until(lambda: awaits(combined(ix.stub, keys_a, "e0"), 4), what="a ingested")
    b = tokens(4, 2)
    ev_b, keys_b = stored(b)
    eng.publish_lost(BlockRemoved(block_hashes=[keys_a[0]], medium="GPU"))
    eng.publish(ev_b)
    await wait_until(lambda: awaits(combined(ix.stub, keys_b, "e0"), 2), what="b ingested")
    # The lost removal could have made anything stale: the endpoint was cleared first.
    assert await combined(ix.stub, keys_a, "e0") == 0
    assert ix.metric("kvmesh_indexer_endpoint_clears_total", {"endpoint": "e0", "reason": "gap"}) == 1


async def test_engine_restart_and_all_blocks_cleared_clear_the_endpoint(start_indexer, engines) -> None:
    eng = engines("e0", replay=False)
    ix = await _indexer_on(start_indexer, eng)
    a = tokens(5, 3)
    ev, keys = stored(a)
    # The old run ends at seq >= 100 (re-sends are idempotent), so whichever of the new run's
    # first sends survives the slow joiner carries a lower seq: a reset, not a gap.
    for _ in range(100):
        eng.publish(ev)
    last, last_keys = stored(tokens(55, 1))
    eng.publish(last)   # in order on one connection: once it is in, every seq before it was seen
    await wait_until(lambda: awaits(combined(ix.stub, last_keys, "e0"), 1), what="old run ingested")
    assert await combined(ix.stub, keys, "e0") == 3
    eng.stop()
    eng.start()  # a new process: seq restarts at 0
    b = tokens(6, 2)
    ev_b, keys_b = stored(b)
    await _publish_until(lambda: eng.publish(ev_b), lambda: awaits(combined(ix.stub, keys_b, "e0"), 2),
                         "the post-restart batch")
    assert await combined(ix.stub, keys, "e0") == 0
    assert ix.metric("kvmesh_indexer_endpoint_clears_total", {"endpoint": "e0", "reason": "seq_reset"}) == 1
    eng.publish(AllBlocksCleared())
    await wait_until(lambda: awaits(combined(ix.stub, keys_b, "e0"), 0), what="AllBlocksCleared applied")


def _try_start(eng: Engine) -> bool:
    try:
        eng.start()
    except ValueError:
        return False
    return True


async def test_restart_whose_messages_are_all_lost_is_found_by_the_tail_probe(start_indexer, engines) -> None:
    """The engine restarts and its only batches never reach the indexer (ZMQ's slow joiner drops
    what a fresh publisher sends first). No later message shows a reset or a gap; the tail probe
    reads the replay buffer, clears the old entries and applies the new ones."""
    eng = engines("e0", replay=True)
    ix = await _indexer_on(start_indexer, eng, tail_probe_s=0.3)
    ev, keys = stored(tokens(7, 3))
    eng.publish(ev)
    await wait_until(lambda: awaits(combined(ix.stub, keys, "e0"), 3), what="a ingested")
    eng.stop()
    # A new process: seq from 0 again, on the same ports (their release by libzmq is asynchronous).
    await wait_until(lambda: _try_start(eng), what="publisher restarted on its ports")
    ev_b, keys_b = stored(tokens(8, 2))
    eng.publish_lost(ev_b)
    await wait_until(lambda: awaits(combined(ix.stub, keys_b, "e0"), 2), timeout_s=15, what="lost batch probed in")
    assert await combined(ix.stub, keys, "e0") == 0
    assert ix.metric("kvmesh_indexer_tail_probes_total", {"endpoint": "e0", "outcome": "restarted"}) == 1
    assert ix.metric("kvmesh_indexer_endpoint_clears_total", {"endpoint": "e0", "reason": "probe_restart"}) == 1
    # Probes of an engine in sync change nothing.
    await wait_until(lambda: (ix.metric("kvmesh_indexer_tail_probes_total",
                                        {"endpoint": "e0", "outcome": "in_sync"}) or 0) >= 1, what="in-sync probe")
    assert await combined(ix.stub, keys_b, "e0") == 2


async def test_malformed_input_is_counted_and_skipped(start_indexer) -> None:
    spec = {"endpoint_id": "raw", "model": MODEL, "zmq_endpoint": "tcp://127.0.0.1:0", "bind": True}
    ix = await start_indexer(models=MODELS, engines=f"[{_json(spec)}]")
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(ix.app.subscriber.subs["raw"].bound_endpoint)
    try:
        topic = make_topic("raw", MODEL).encode()
        toks = tokens(7, 3)
        good, keys = stored(toks)
        seq = 0

        def send(payload: bytes, frames: list[bytes] | None = None) -> None:
            nonlocal seq
            pub.send_multipart(frames or [topic, seq.to_bytes(8, "big"), payload])
            seq += 1

        warm, warm_keys = stored(tokens(70, 1))   # once one is in, the connection is up: nothing below is lost
        await _publish_until(lambda: send(encode_batch(KVEventBatch(time.time(), [warm]))),
                             lambda: combined(ix.stub, warm_keys, "raw"), "the connection")

        send(b"", frames=[topic, b"only two frames"])                  # wrong frame count
        send(b"", frames=[topic, b"\x00\x01", b"x"])                     # bad seq frame
        send(b"\xc1\xc1 not msgpack")                                   # garbage payload
        mixed = KVEventBatch(time.time(), [good])
        raw = bytearray(encode_batch(mixed))
        # One good event plus an unknown type and a wrong-typed hash in the same batch:
        import msgpack
        obj = msgpack.unpackb(bytes(raw), raw=False)
        obj[1].append({"type": "NoSuchEvent", "x": 1})
        obj[1].append({"type": "BlockRemoved", "block_hashes": ["not-a-hash"], "medium": "GPU"})
        send(msgpack.packb(obj))
        await wait_until(lambda: combined(ix.stub, keys, "raw"), what="good event of the mixed batch")
        assert await combined(ix.stub, keys, "raw") == 3
        rejected = sum(s.value for m in ix.registry.collect() if m.name == "kvmesh_indexer_rejected"
                       for s in m.samples if s.name.endswith("_total") and s.labels["endpoint"] == "raw")
        assert rejected >= 5  # 2 bad frames + 1 bad payload + 2 bad events
        assert ix.app.server._server is not None  # still serving
    finally:
        pub.close(linger=0)


async def test_grpc_ingest_structured_and_vllm_payload(start_indexer) -> None:
    ix = await start_indexer(models=MODELS)
    toks = tokens(8, 4)
    ev, keys = stored(toks)
    payload = encode_batch(KVEventBatch(time.time(), [ev]))
    removal = indexer_pb2.KvEvent(removed=indexer_pb2.BlockRemoved(block_hashes=[keys[2]], tier=common_pb2.TIER_GPU))
    cpu = indexer_pb2.KvEvent(stored=indexer_pb2.BlockStored(block_hashes=keys, block_size=BS,
                                                             token_ids=toks[:4 * BS], tier=common_pb2.TIER_CPU))
    reqs = [
        indexer_pb2.IngestEventsRequest(endpoint_id="g0", model=MODEL, seq=0, vllm_payload=payload),
        indexer_pb2.IngestEventsRequest(endpoint_id="g0", model=MODEL, seq=1,
                                        batch=indexer_pb2.EventBatch(ts=1.0, events=[removal, cpu])),
        indexer_pb2.IngestEventsRequest(model=MODEL, seq=2, vllm_payload=payload),          # no endpoint id
        indexer_pb2.IngestEventsRequest(endpoint_id="g0", seq=2, vllm_payload=b"\x93garbage"),
        indexer_pb2.IngestEventsRequest(endpoint_id="g0", model="nope", seq=3, vllm_payload=payload),
        indexer_pb2.IngestEventsRequest(endpoint_id="g0", seq=3, batch=indexer_pb2.EventBatch(
            events=[indexer_pb2.KvEvent(cleared=indexer_pb2.AllBlocksCleared())] * 10_001)),
    ]
    resp = await ix.stub.IngestEvents(iter(reqs), timeout=10)
    assert resp.batches_accepted == 2 and resp.batches_rejected == 4
    assert resp.events_applied == 3
    m = match_of(await ix.stub.Lookup(chain_req(keys), timeout=5), "g0")
    tiers = {t.tier: t.blocks for t in m.tiers}
    assert tiers == {common_pb2.TIER_GPU: 2, common_pb2.TIER_CPU: 4} and m.combined_blocks == 4
    stats = await ix.stub.Stats(indexer_pb2.StatsRequest(), timeout=5)
    assert stats.backend == "memory" and stats.entries == 7 and stats.counters["entries_cpu"] == 4


async def test_lookup_and_speculative_validation(start_indexer) -> None:
    ix = await start_indexer(models=MODELS)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await ix.stub.Lookup(chain_req([]), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty chain" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await ix.stub.Lookup(indexer_pb2.LookupRequest(model="nope", tokens=common_pb2.TokenIds(ids=[1] * 32)),
                             timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown model" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await ix.stub.Lookup(chain_req(list(range(1, 65_538))), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await ix.stub.PutSpeculative(indexer_pb2.PutSpeculativeRequest(model=MODEL, endpoint_id="x", keys=[1],
                                                                       ttl_s=301), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ttl_s" in e.value.details()
    for bad in ("a;b", "a=1", "x" * 129):   # would break the Redis layouts' "<endpoint>=<expiry>" values
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await ix.stub.PutSpeculative(indexer_pb2.PutSpeculativeRequest(model=MODEL, endpoint_id=bad, keys=[1]),
                                         timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "endpoint_id" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await ix.stub.Heartbeat(indexer_pb2.HeartbeatRequest(endpoint_id="ghost"), timeout=5)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    await ix.stub.PutSpeculative(indexer_pb2.PutSpeculativeRequest(model=MODEL, endpoint_id="s", keys=[5, 6, 7]),
                                 timeout=5)
    m = match_of(await ix.stub.Lookup(chain_req([5, 6, 9], include_speculative=True), timeout=5), "s")
    assert m.speculative_blocks == 2 and 0 < m.speculative_ttl_s <= 2.0 and m.combined_blocks == 0


async def test_registration_subscribes_and_dead_endpoint_disappears(start_indexer, engines) -> None:
    ix = await start_indexer(models=MODELS)
    eng = engines("w1", replay=True)
    ep = indexer_pb2.Endpoint(endpoint_id="w1", model=MODEL, role=common_pb2.ROLE_DECODE,
                              kv_events_endpoint=eng.zmq, kv_events_replay_endpoint=eng.replay,
                              subscriber_binds=True, block_size=BS, hash_algo=common_pb2.HASH_ALGO_SHA256_CBOR,
                              hash_seed_matches=True)
    # Registered and kept alive as a worker is (a TTL of 2 s, a heartbeat every 0.2 s): a loaded
    # CI machine (the vLLM tier runs alongside) once let a bare 0.6 s TTL lapse before ZMQ had
    # even connected.
    reg = IndexerRegistration(ix.address, ep, heartbeat_s=0.2, ttl_s=2.0)
    await reg.start()
    try:
        assert reg.registered
        eng.bound_to(ix)
        eng.start()
        await _connected(eng, ix)
        toks = tokens(9, 3)
        ev, keys = stored(toks)
        eng.publish(ev)
        await wait_until(lambda: awaits(combined(ix.stub, keys, "w1"), 3), what="registered engine ingested")
        listed = await ix.stub.ListEndpoints(indexer_pb2.ListEndpointsRequest(model=MODEL), timeout=5)
        st = {s.endpoint.endpoint_id: s for s in listed.endpoints}["w1"]
        assert st.alive and st.blocks == 4 and st.seconds_since_event >= 0
    finally:
        await reg.stop(leave=False)
    # Heartbeats stop: excluded from answers as soon as the TTL passes, then purged.
    await asyncio.sleep(2.1)
    assert await combined(ix.stub, keys, "w1") == 0
    await wait_until(lambda: ix.app.servicer.index.endpoint_blocks("w1") == 0, what="dead endpoint purged")
    listed = await ix.stub.ListEndpoints(indexer_pb2.ListEndpointsRequest(), timeout=5)
    assert not {s.endpoint.endpoint_id: s for s in listed.endpoints}["w1"].alive
    with pytest.raises(grpc.aio.AioRpcError) as e:  # expired: it must register again
        await ix.stub.Heartbeat(indexer_pb2.HeartbeatRequest(endpoint_id="w1"), timeout=5)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    # Register again, then deregister: purged and unknown.
    await ix.stub.RegisterEndpoint(indexer_pb2.RegisterEndpointRequest(endpoint=ep, ttl_s=5), timeout=5)
    await ix.stub.DeregisterEndpoint(indexer_pb2.DeregisterEndpointRequest(endpoint_id="w1"), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await ix.stub.Heartbeat(indexer_pb2.HeartbeatRequest(endpoint_id="w1"), timeout=5)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


async def test_registration_with_other_block_size_is_rejected(start_indexer) -> None:
    ix = await start_indexer(models=MODELS)
    ep = indexer_pb2.Endpoint(endpoint_id="w2", model=MODEL, block_size=32)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await ix.stub.RegisterEndpoint(indexer_pb2.RegisterEndpointRequest(endpoint=ep), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "block_size 32" in e.value.details()


async def test_silent_engine_is_visible_in_metrics(start_indexer, engines) -> None:
    eng = engines("quiet", replay=False)
    ix = await start_indexer(models=MODELS, engines=f"[{_json(eng.engine_spec())}]")
    await asyncio.sleep(0.2)
    assert ix.metric("kvmesh_indexer_endpoint_published", {"endpoint": "quiet"}) == 0
    assert ix.metric("kvmesh_indexer_seconds_since_last_event", {"endpoint": "quiet"}) >= 0.2


@pytest.mark.parametrize("server", ["redis_server", "redis_cluster"])
async def test_two_replicas_on_one_redis_answer_identically(start_indexer, request, server: str) -> None:
    # a redis+cluster:// URL selects the cluster backend by itself
    url = request.getfixturevalue(server).url
    ns = f"rep{random.randrange(1 << 30)}"
    a = await start_indexer(models=MODELS, backend="redis", redis_url=url, redis_namespace=ns)
    b = await start_indexer(models=MODELS, backend="redis", redis_url=url, redis_namespace=ns)
    assert a.app.cfg.backend == ("redis-cluster" if server == "redis_cluster" else "redis")
    chains = []
    for i, ep in enumerate(["x", "y", "z"]):
        toks = tokens(20 + i, 5)
        ev, keys = stored(toks)
        ev.block_hashes, ev.token_ids = keys[: 2 + i], toks[: (2 + i) * BS]
        chains.append(keys)
        await a.stub.IngestEvents(iter([indexer_pb2.IngestEventsRequest(
            endpoint_id=ep, model=MODEL, seq=0, vllm_payload=encode_batch(KVEventBatch(0.0, [ev])))]), timeout=5)
    await b.stub.PutSpeculative(indexer_pb2.PutSpeculativeRequest(model=MODEL, endpoint_id="y", keys=chains[0][:3],
                                                                  ttl_s=30), timeout=5)
    for keys in chains:
        ra = await a.stub.Lookup(chain_req(keys, include_speculative=True), timeout=5)
        rb = await b.stub.Lookup(chain_req(keys, include_speculative=True), timeout=5)
        for m in list(ra.matches) + list(rb.matches):
            m.speculative_ttl_s = 0  # remaining TTL differs by the ms between the two calls
        assert ra == rb and len(ra.matches) >= 1
    ra = await a.stub.Lookup(chain_req(chains[0], include_speculative=True), timeout=5)
    assert match_of(ra, "y").speculative_blocks == 3
    sa = await a.stub.Stats(indexer_pb2.StatsRequest(), timeout=5)
    sb = await b.stub.Stats(indexer_pb2.StatsRequest(), timeout=5)
    assert sa.entries == sb.entries == 2 + 3 + 4
    if server == "redis_cluster":   # every lookup counted by the shards it read, never more than two
        counted = {n: a.metric("kvmesh_indexer_lookup_shards_total", {"shards": n}) or 0 for n in ("1", "2", "3")}
        assert counted["1"] + counted["2"] >= len(chains) + 1 and counted["3"] == 0


@pytest.mark.parametrize("server", ["redis_server", "redis_cluster"])
async def test_replicas_keep_a_block_until_the_engines_last_copy_goes(start_indexer, request, server: str) -> None:
    """An engine computed a cached prefix again: vLLM holds two copies of each block, announces
    both stores and, later, each eviction. Two replicas apply every batch to one Redis;
    the block stays while one copy does, and goes with the last."""
    url = request.getfixturevalue(server).url
    ns = f"cp{random.randrange(1 << 30)}"
    reps = [await start_indexer(models=MODELS, backend="redis", redis_url=url, redis_namespace=ns)
            for _ in range(2)]
    toks = tokens(77, 4)
    ev, keys = stored(toks)
    batches = [[ev], [ev], [BlockRemoved(block_hashes=keys[::-1], medium="GPU")],
               [BlockRemoved(block_hashes=keys[::-1], medium="GPU")]]
    held = []
    for seq, events in enumerate(batches):
        for r in reps:
            await r.stub.IngestEvents(iter([indexer_pb2.IngestEventsRequest(
                endpoint_id="e", model=MODEL, seq=seq, vllm_payload=encode_batch(KVEventBatch(0.0, events)))]),
                timeout=5)
        got = [match_of(await r.stub.Lookup(chain_req(keys), timeout=5), "e") for r in reps]
        held.append([0 if m is None else m.combined_blocks for m in got])
    assert held == [[4, 4], [4, 4], [4, 4], [0, 0]]


async def test_redis_down_lookup_unavailable_then_resync_by_replay(start_indexer, engines) -> None:
    redis = RedisProcess().start()
    try:
        eng = engines("e0", replay=True)
        ix = await _indexer_on(start_indexer, eng, backend="redis", redis_url=redis.url, redis_timeout_s=0.3,
                               lookup_timeout_s=0.5)
        toks = tokens(30, 6)
        keys = HASHER.block_keys(toks)
        ev1, _ = stored(toks[: 3 * BS])
        eng.publish(ev1)
        await wait_until(lambda: awaits(combined(ix.stub, keys, "e0"), 3), what="before outage")
        redis.stop()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await ix.stub.Lookup(chain_req(keys), timeout=30)
        # UNAVAILABLE (not DEADLINE_EXCEEDED): the indexer gave up on Redis by its own bound.
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        ev2, _ = stored(toks, start_block=3)
        eng.publish(ev2)              # cannot be applied while Redis is down
        await asyncio.sleep(0.5)
        redis.start()                 # same port, empty: the indexer notices the new run id
        await wait_until(lambda: _ok_eq(combined(ix.stub, keys, "e0"), 6), timeout_s=10,
                         what="index rebuilt from replay after Redis came back")
    finally:
        redis.stop()


async def test_applied_batches_never_count_a_batch_the_answer_missed(start_indexer, redis_server) -> None:
    """A batch applied while a Lookup's index read is in flight is not in the answer, so the
    answer's ``applied_batches`` must not count it: the router reads an answer whose count
    covers the engine's events as up to date, and a miss against it as a view bug. (In a soak
    the Redis read took 10-200 ms, a sibling's blocks landed meanwhile, and a lagging answer
    was classed ``view_bug``.)"""
    import threading

    ix = await start_indexer(models=MODELS, backend="redis", redis_url=redis_server.url,
                             redis_namespace=f"ap{random.randrange(1 << 30)}", lookup_timeout_s=30)
    toks = tokens(40, 6)
    keys = HASHER.block_keys(toks)
    first, _ = stored(toks[: 4 * BS])
    rest, _ = stored(toks, start_block=4)

    async def ingest(seq: int, ev: BlockStored) -> None:
        await ix.stub.IngestEvents(iter([indexer_pb2.IngestEventsRequest(
            endpoint_id="e0", model=MODEL, seq=seq, vllm_payload=encode_batch(KVEventBatch(0.0, [ev])))]),
            timeout=10)

    await ingest(0, first)
    index = ix.app.servicer.index
    real_lookup = index.lookup
    read, release = threading.Event(), threading.Event()

    def held_lookup(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the backend's own signature
        got = real_lookup(*args, **kwargs)
        read.set()
        assert release.wait(20), "the test never released the lookup"
        return got

    real_async = getattr(index, "lookup_async", None)

    async def held_lookup_async(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the loop-side path
        got = await real_async(*args, **kwargs)
        read.set()
        for _ in range(2000):
            if release.is_set():
                return got
            await asyncio.sleep(0.01)
        raise AssertionError("the test never released the lookup")

    index.lookup = held_lookup
    if real_async is not None:
        index.lookup_async = held_lookup_async
    try:
        call = asyncio.ensure_future(ix.stub.Lookup(chain_req(keys, include_applied=True), timeout=25))
        await wait_until(read.is_set, timeout_s=20, what="the lookup read the index")
        await ingest(1, rest)   # applied while the lookup's answer is in flight
        assert ix.app.servicer.ingestor.endpoints["e0"].last_seq == 1
        release.set()
        resp = await call
    finally:
        release.set()
        index.lookup = real_lookup
        if real_async is not None:
            index.lookup_async = real_async
    assert match_of(resp, "e0").combined_blocks == 4       # the state it read: batch 0 only
    assert resp.applied_batches["e0"] == 1                  # so it rests on one batch, not two
    after = await ix.stub.Lookup(chain_req(keys, include_applied=True), timeout=5)
    assert match_of(after, "e0").combined_blocks == 6 and after.applied_batches["e0"] == 2


def test_cli_bad_config_names_the_setting(tmp_path) -> None:
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "kvmesh_tools.cli.main", "serve", "indexer", "--port", "0",
                          "--models", "tiny@abc@sha256_cbor"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "setting 'models'" in out.stderr and "block_size" in out.stderr


def test_cli_serves_and_drains(tmp_path) -> None:
    import urllib.request

    from kvmesh_api.indexer.v1 import indexer_pb2_grpc
    from kvmesh_tools.testing.procs import ServiceProcess

    quiet = f"quiet@{MODEL}@ipc://{tmp_path}/quiet.sock"   # an engine that never publishes
    proc = ServiceProcess.with_ports(
        "indexer", lambda port, mport: ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(mport)],
        count=2, env={"KVMESH_INDEXER_MODELS": MODELS, "KVMESH_INDEXER_ENGINES": quiet},
        log_path=tmp_path / "indexer.log").start(timeout_s=60)
    mport = proc.flag_port("--metrics-port")
    try:
        with grpc.insecure_channel(proc.grpc_address) as ch:
            stats = indexer_pb2_grpc.IndexerStub(ch).Stats(indexer_pb2.StatsRequest(), timeout=5)
            assert stats.backend == "memory"
        text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()
        assert "kvmesh_indexer_backend_up 1.0" in text
        # The engine that never published is visible at a glance.
        assert 'kvmesh_indexer_endpoint_published{endpoint="quiet"} 0.0' in text
        assert 'kvmesh_indexer_seconds_since_last_event{endpoint="quiet"}' in text
    finally:
        assert proc.stop() == 0


# ---- small helpers ----------------------------------------------------------------------------
def _json(obj: dict) -> str:
    import json
    return json.dumps(obj)


async def _ok_eq(coro, value: int) -> bool:  # noqa: ANN001
    try:
        return (await coro) == value
    except grpc.aio.AioRpcError:
        await asyncio.sleep(0.1)
        return False


async def test_offload_store_blocks_answer_under_their_own_endpoint_and_tier(start_indexer) -> None:
    ix = await start_indexer(models=MODELS)
    store = indexer_pb2.Endpoint(endpoint_id="offload-0", model="any", role=common_pb2.ROLE_STORE)
    await ix.stub.RegisterEndpoint(indexer_pb2.RegisterEndpointRequest(endpoint=store, ttl_s=30), timeout=5)
    toks = tokens(40, 5)
    ev, keys = stored(toks, medium="CPU")
    disk, _ = stored(toks[: 2 * BS], medium="STORAGE")
    resp = await ix.stub.IngestEvents(iter([indexer_pb2.IngestEventsRequest(
        endpoint_id="offload-0", seq=0, vllm_payload=encode_batch(KVEventBatch(0.0, [ev, disk])))]), timeout=5)
    assert resp.events_applied == 2
    m = match_of(await ix.stub.Lookup(chain_req(keys), timeout=5), "offload-0")
    assert {t.tier: t.blocks for t in m.tiers} == {common_pb2.TIER_CPU: 5, common_pb2.TIER_DISK: 2}
    assert m.combined_blocks == 5


async def test_spans_on_lookup_and_ingest_batch(start_indexer) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvmesh.telemetry import setup_tracing

    exporter = InMemorySpanExporter()
    setup_tracing("kvmesh-indexer-test", exporter)
    ix = await start_indexer(models=MODELS)
    toks = tokens(50, 2)
    ev, keys = stored(toks)
    await ix.stub.IngestEvents(iter([indexer_pb2.IngestEventsRequest(
        endpoint_id="t0", model=MODEL, seq=0, vllm_payload=encode_batch(KVEventBatch(0.0, [ev])))]), timeout=5)
    await ix.stub.Lookup(chain_req(keys), timeout=5)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["indexer.ingest_batch"].attributes["kvmesh.endpoint"] == "t0"
    assert spans["indexer.ingest_batch"].attributes["kvmesh.applied"] == 1
    assert spans["indexer.lookup"].attributes["kvmesh.best_combined"] == 2
    assert "index.lookup" in spans


async def test_publisher_binds_indexer_connects(start_indexer, tmp_path) -> None:
    addr = f"ipc://{tmp_path}/pub.sock"       # vLLM binds ipc endpoints; the indexer connects
    # The replay socket binds where the kernel picks; the spec names the port it got.
    pub = KvEventPublisher(addr, topic=make_topic("b0", MODEL), replay_endpoint="tcp://127.0.0.1:0")
    replay = pub.replay_endpoint
    try:
        spec = {"endpoint_id": "b0", "model": MODEL, "zmq_endpoint": addr, "replay_endpoint": replay}
        ix = await start_indexer(models=MODELS, engines=f"[{_json(spec)}]")
        toks = tokens(60, 3)
        ev, keys = stored(toks)
        pub.publish([ev])                      # likely before the SUB connected: replay recovers it
        later = stored(tokens(61, 1))[0]       # the first one heard shows the gap
        await _publish_until(lambda: pub.publish([later]), lambda: awaits(combined(ix.stub, keys, "b0"), 3),
                             "ingest over a connecting SUB")
    finally:
        pub.close(linger_ms=0)


@pytest.mark.parametrize("server", [None, "redis_server", "redis_cluster"])
async def test_packed_chain_answers_as_repeated_keys(start_indexer, request, server: str | None) -> None:
    """``BlockChain.keys_be64`` (what a router sends) gives the answer ``keys`` gives, on every backend
    (Redis ones take the bytes as they are); a malformed one is INVALID_ARGUMENT."""
    from kvmesh.index.packed import pack_keys

    kw = {} if server is None else {"backend": "redis", "redis_url": request.getfixturevalue(server).url,
                                    "redis_namespace": f"pk{random.randrange(1 << 30)}"}
    ix = await start_indexer(models=MODELS, **kw)
    toks = tokens(41, 6)
    ev, keys = stored(toks)
    await ix.stub.IngestEvents(iter([indexer_pb2.IngestEventsRequest(
        endpoint_id="g0", model=MODEL, seq=0, vllm_payload=encode_batch(KVEventBatch(time.time(), [ev])))]),
        timeout=10)
    await ix.stub.PutSpeculative(indexer_pb2.PutSpeculativeRequest(model=MODEL, endpoint_id="s", keys=keys[:4],
                                                                   ttl_s=60), timeout=5)
    for q in (keys, keys[:2], [*keys, (1 << 64) - 1], [(1 << 64) - 1]):
        want = await ix.stub.Lookup(chain_req(q, include_speculative=True), timeout=5)
        got = await ix.stub.Lookup(indexer_pb2.LookupRequest(
            model=MODEL, chain=indexer_pb2.BlockChain(keys_be64=pack_keys(q)), include_speculative=True), timeout=5)
        for m in list(want.matches) + list(got.matches):
            m.speculative_ttl_s = 0   # the remaining TTL differs by the ms between the two calls
        assert got == want
    assert match_of(got, "g0") is None and match_of(want, "g0") is None
    full = await ix.stub.Lookup(indexer_pb2.LookupRequest(model=MODEL, chain=indexer_pb2.BlockChain(
        keys_be64=pack_keys(keys)), include_speculative=True), timeout=5)
    assert match_of(full, "g0").combined_blocks == len(keys) and match_of(full, "s").speculative_blocks == 4
    for chain, words in ((indexer_pb2.BlockChain(keys_be64=b"\0" * 7), "multiple of 8"),
                         (indexer_pb2.BlockChain(keys=[1], keys_be64=b"\0" * 8), "not both"),
                         (indexer_pb2.BlockChain(keys_be64=b"\0" * 8 * 65_537), "exceeds")):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await ix.stub.Lookup(indexer_pb2.LookupRequest(model=MODEL, chain=chain), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()
