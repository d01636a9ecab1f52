"""The indexer's central KV-event socket: real ZMQ publishers connect to one bound SUB socket.

Publishers are kvmesh's ``KvEventPublisher`` (vLLM's wire format and connect rule);
endpoints are named by llm-d's topic ``kv@<pod-ip>:<port>@<model>`` and replay
addresses are derived from the topic by the ``kv_events_replay`` template.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import zmq

from kvmesh.config import ConfigError
from kvmesh.events.codec import BlockRemoved, KVEventBatch, encode_batch
from kvmesh.events.publisher import KvEventPublisher
from kvmesh.events.topic import dp_endpoint
from kvmesh_api.indexer.v1 import indexer_pb2
from kvmesh_indexer.central_socket import (
    UNADMITTED,
    check_replay_template,
    replay_address,
    split_host_port,
)
from kvmesh_indexer.config import IndexerConfig
from kvmesh_tools.testing.ports import free_port
from tests.fixtures.indexer import awaits, wait_until
from tests.helpers.events import connect_when_ready, publish_lost
from tests.services.indexer.test_indexer_service import BS, HASHER, MODEL, MODELS, combined, stored, tokens

pytestmark = pytest.mark.timeout(60)


class Pod:
    """One engine connecting to the central socket with llm-d's topic and an ipc replay socket."""

    def __init__(self, central: str, pod: str, replay_dir: Path | None, model: str = MODEL) -> None:
        self.endpoint_id = pod
        self.central = central
        self.replay = f"ipc://{replay_dir}/replay-{split_host_port(pod)[1]}.sock" if replay_dir else None
        self.pub = KvEventPublisher(central, topic=f"kv@{pod}@{model}", replay_endpoint=self.replay)

    def publish(self, *events) -> int:  # noqa: ANN002
        return self.pub.publish(list(events))

    def publish_lost(self, *events) -> int:  # noqa: ANN002
        """A batch that never reaches the indexer but stays in the replay buffer."""
        return publish_lost(self.pub, events)

    def close(self) -> None:
        self.pub.close(linger_ms=0)


@pytest.fixture
def pods():  # noqa: ANN201
    made: list[Pod] = []

    def make(*args, **kw) -> Pod:  # noqa: ANN002, ANN003
        p = Pod(*args, **kw)
        made.append(p)
        return p
    yield make
    for p in made:
        p.close()


async def start_central(start_indexer, tmp_path: Path, **kw):  # noqa: ANN001, ANN003, ANN201
    kw.setdefault("models", MODELS)
    kw.setdefault("kv_events_replay", f"ipc://{tmp_path}/replay-{{port}}.sock")
    ix = await start_indexer(kv_events_bind="tcp://127.0.0.1:0", **kw)
    assert ix.app.central is not None and ix.app.central.bound[0].startswith("tcp://127.0.0.1:")
    return ix, ix.app.central.bound[0]


async def connected(pod: Pod, ix) -> None:  # noqa: ANN001
    """A PUB drops what it sends before the TCP connect completes: publish one block until it lands."""
    ev, keys = stored(tokens(999, 1))
    deadline = time.monotonic() + 10
    while not await combined(ix.stub, keys, pod.endpoint_id):
        assert time.monotonic() < deadline, f"{pod.endpoint_id}'s events never reached the indexer"
        pod.publish(ev)
        await asyncio.sleep(0.05)


def _rejected(ix, endpoint: str, reason: str) -> float:  # noqa: ANN001
    return ix.metric("kvmesh_indexer_rejected_total", {"endpoint": endpoint, "reason": reason}) or 0.0


async def test_many_engines_on_one_socket_named_by_topic(start_indexer, pods, tmp_path) -> None:
    ix, central = await start_central(start_indexer, tmp_path)
    a, b = pods(central, "10.0.0.1:8000", tmp_path), pods(central, "10.0.0.2:8001", tmp_path)
    await connected(a, ix)
    await connected(b, ix)
    ta, tb = tokens(1, 5), tokens(2, 3)
    ev_a, keys_a = stored(ta)
    ev_b, keys_b = stored(tb)
    a.publish(ev_a)
    b.publish(ev_b)
    await wait_until(lambda: awaits(combined(ix.stub, keys_a, "10.0.0.1:8000"), 5), what="a's blocks")
    await wait_until(lambda: awaits(combined(ix.stub, keys_b, "10.0.0.2:8001"), 3), what="b's blocks")
    # Each engine's events are attributed to its own topic's endpoint only.
    assert await combined(ix.stub, keys_a, "10.0.0.2:8001") == 0
    assert await combined(ix.stub, keys_b, "10.0.0.1:8000") == 0
    listed = {e.endpoint.endpoint_id: e for e in (await ix.stub.ListEndpoints(
        indexer_pb2.ListEndpointsRequest(), timeout=5)).endpoints}
    assert set(listed) == {"10.0.0.1:8000", "10.0.0.2:8001"}
    assert ix.metric("kvmesh_indexer_central_endpoints") == 2
    assert listed["10.0.0.1:8000"].endpoint.kv_events_replay_endpoint == f"ipc://{tmp_path}/replay-8000.sock"
    assert listed["10.0.0.1:8000"].endpoint.model == MODEL and listed["10.0.0.1:8000"].alive


async def test_gap_and_late_join_are_repaired_by_the_derived_replay_address(start_indexer, pods, tmp_path) -> None:
    ix, central = await start_central(start_indexer, tmp_path)
    pod = pods(central, "127.0.0.1:7001", tmp_path)
    await connected(pod, ix)
    gaps0 = ix.metric("kvmesh_indexer_seq_gaps_total", {"endpoint": pod.endpoint_id}) or 0
    toks = tokens(3, 8)
    keys = HASHER.block_keys(toks)
    first, _ = stored(toks[: 4 * BS])
    lost, _ = stored(toks, start_block=4)
    lost.block_hashes, lost.token_ids = keys[4:6], toks[4 * BS:6 * BS]
    last, _ = stored(toks, start_block=6)
    pod.publish(first)
    pod.publish_lost(lost)
    pod.publish(last)
    await wait_until(lambda: awaits(combined(ix.stub, keys, pod.endpoint_id), 8), what="gap repaired by replay")
    assert ix.metric("kvmesh_indexer_seq_gaps_total", {"endpoint": pod.endpoint_id}) - gaps0 == 1
    assert ix.metric("kvmesh_indexer_replays_total", {"endpoint": pod.endpoint_id, "outcome": "complete"}) >= 1
    assert ix.metric("kvmesh_indexer_endpoint_clears_total", {"endpoint": pod.endpoint_id, "reason": "gap"}) is None

    # An engine that published before the indexer listened: its first seen seq > 0 -> replay from 0.
    early = tokens(4, 3)
    ev_early, keys_early = stored(early)
    late = pods(central, "127.0.0.1:7002", tmp_path)
    for _ in range(2):
        late.publish_lost(ev_early)
    await connected(late, ix)
    await wait_until(lambda: awaits(combined(ix.stub, keys_early, late.endpoint_id), 3), what="late join replayed")


async def test_hostile_topics_are_counted_not_admitted(start_indexer, pods, tmp_path) -> None:
    ix, central = await start_central(start_indexer, tmp_path, kv_events_max_endpoints=2, auto_models=False)
    ok = pods(central, "10.1.0.1:8000", tmp_path)
    await connected(ok, ix)
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.PUB)
    raw.setsockopt(zmq.LINGER, 0)
    await asyncio.to_thread(connect_when_ready, raw, central)
    try:
        ev, keys = stored(tokens(5, 2))
        payload = encode_batch(KVEventBatch(time.time(), [ev]))

        def send(topic: bytes, seq: int = 0, frames: list[bytes] | None = None) -> None:
            raw.send_multipart(frames or [topic, seq.to_bytes(8, "big"), payload])

        send(b"")                                       # vLLM's default empty topic: no endpoint name
        send(b"not-a-kvmesh-topic")
        send(b"kv@10.9.9.9:1@no-such-model")            # unknown model, auto_models off
        send(b"kv@10.1.0.1:8000@" + MODEL.encode() + b"x")  # the admitted endpoint under another model
        send(b"kv@pod-without-port@" + MODEL.encode())  # the replay template needs a {port}
        send(b"", frames=[b"kv@10.1.0.9:1@tiny", b"two frames"])
        send(b"kv@" + b"h" * 200 + b"@" + MODEL.encode())  # endpoint id too long
        send(b"kv@10.1.0.2:8000@" + MODEL.encode())       # admitted: the 2nd of 2
        send(b"kv@10.1.0.3:8000@" + MODEL.encode())       # over the cap
        await wait_until(lambda: _rejected(ix, UNADMITTED, "endpoint_cap") == 1, what="cap rejection counted")
        for reason, n in (("bad_topic", 2), ("unknown_model", 1), ("model_mismatch", 1), ("bad_endpoint", 2),
                          ("malformed_frames", 1)):
            assert _rejected(ix, UNADMITTED, reason) == n, reason
        assert await combined(ix.stub, keys, "10.1.0.2:8000") == 2
        assert sorted(ix.app.central.endpoints) == ["10.1.0.1:8000", "10.1.0.2:8000"]
        # Still serving the admitted engine.
        ev2, keys2 = stored(tokens(6, 4))
        ok.publish(ev2)
        await wait_until(lambda: awaits(combined(ix.stub, keys2, ok.endpoint_id), 4), what="admitted engine still ingested")
    finally:
        raw.close(linger=0)


async def test_oversized_message_drops_that_peer_only(start_indexer, pods, tmp_path) -> None:
    ix, central = await start_central(start_indexer, tmp_path)
    ok = pods(central, "10.4.0.1:8000", tmp_path)
    await connected(ok, ix)
    big = pods(central, "10.4.0.2:8000", tmp_path)
    ev, keys = stored(tokens(9, 2))
    limit = ix.app.central.max_message_bytes
    for _ in range(3):
        big.pub._pub.send_multipart([b"kv@10.4.0.2:8000@" + MODEL.encode(), (0).to_bytes(8, "big"),
                                     b"\0" * (limit + 8192)])
        await asyncio.sleep(0.1)
    ok.publish(ev)
    await wait_until(lambda: awaits(combined(ix.stub, keys, ok.endpoint_id), 2), what="the other engine still ingested")
    assert "10.4.0.2:8000" not in ix.app.central.endpoints   # never reached the indexer


async def test_both_modes_together_and_no_double_feed(start_indexer, pods, tmp_path) -> None:
    static = KvEventPublisher(f"ipc://{tmp_path}/static.sock", topic=f"kv@static-0@{MODEL}")
    try:
        spec = {"endpoint_id": "static-0", "model": MODEL, "zmq_endpoint": static.endpoint}
        ix, central = await start_central(start_indexer, tmp_path, engines=json.dumps([spec]))
        # A pod whose topic names the configured engine would feed it a second sequence: refused.
        clash = pods(central, "static-0", None)
        ev, keys = stored(tokens(7, 2))
        await wait_until(lambda: (clash.publish(ev), _rejected(ix, UNADMITTED, "endpoint_conflict") >= 1)[1],
                         interval_s=0.05, what="conflicting topic refused")
        assert "static-0" not in ix.app.central.endpoints
        # The per-engine subscription still works beside the central socket.
        deadline = time.monotonic() + 10
        while not await combined(ix.stub, keys, "static-0"):
            assert time.monotonic() < deadline
            static.publish([ev])
            await asyncio.sleep(0.05)
        pod = pods(central, "10.2.0.1:9000", tmp_path)
        await connected(pod, ix)
    finally:
        static.close(linger_ms=0)


async def test_idle_endpoint_is_purged_and_readmitted(start_indexer, pods, tmp_path) -> None:
    ix, central = await start_central(start_indexer, tmp_path, kv_events_idle_purge_s=0.4)
    pod = pods(central, "10.3.0.1:8000", tmp_path)
    await connected(pod, ix)
    ev, keys = stored(tokens(8, 3))
    pod.publish(ev)
    await wait_until(lambda: awaits(combined(ix.stub, keys, pod.endpoint_id), 3), what="ingested")
    await wait_until(lambda: awaits(combined(ix.stub, keys, pod.endpoint_id), 0), timeout_s=5, what="idle purge")
    assert pod.endpoint_id not in ix.app.central.endpoints
    assert ix.metric("kvmesh_indexer_endpoint_clears_total", {"endpoint": pod.endpoint_id, "reason": "purged"}) == 1
    pod.publish(BlockRemoved(block_hashes=[keys[0]], medium="GPU"))  # any message re-admits it
    await wait_until(lambda: pod.endpoint_id in ix.app.central.endpoints, what="re-admitted")


def test_replay_template_and_topic_host_parsing() -> None:
    assert split_host_port("10.0.0.5:8000") == ("10.0.0.5", "8000")
    assert split_host_port("[fd00::5]:8000") == ("[fd00::5]", "8000")
    assert split_host_port("fd00::5") == ("fd00::5", "")
    assert split_host_port("pod-a") == ("pod-a", "")
    assert replay_address("tcp://{host}:5558", "10.0.0.5:8000") == "tcp://10.0.0.5:5558"
    assert replay_address("tcp://{host}:5558", "[fd00::5]:8000") == "tcp://[fd00::5]:5558"
    assert replay_address("ipc:///run/r-{port}.sock", "10.0.0.5:8000") == "ipc:///run/r-8000.sock"
    for bad_ep in ("evil/x:1", "a b:1", "x;y:1"):
        with pytest.raises(ValueError, match="host"):
            replay_address("tcp://{host}:5558", bad_ep)
    with pytest.raises(ValueError, match="port"):
        replay_address("tcp://h:{port}", "pod-a")
    for bad in ("http://{host}:1", "tcp://{nope}:1", "tcp://{host:1"):
        with pytest.raises(ValueError):
            check_replay_template(bad)


@pytest.mark.parametrize("overrides,setting", [
    ({"kv_events_bind": "ipc:///tmp/x.sock"}, "kv_events_bind"),
    ({"kv_events_bind": "tcp://127.0.0.1:0", "kv_events_replay": "tcp://{pod}:1"}, "kv_events_replay"),
    ({"kv_events_bind": "tcp://127.0.0.1:0", "kv_events_max_endpoints": 0}, "kv_events_max_endpoints"),
    ({"kv_events_bind": "tcp://127.0.0.1:0", "kv_events_hash_algo": "md5"}, "kv_events_hash_algo"),
    ({"kv_events_idle_purge_s": -1}, "kv_events_idle_purge_s"),
    ({"kv_events_bind": "tcp://127.0.0.1:5557", "kv_events_dp_size": 0}, "kv_events_dp_size"),
    ({"kv_events_bind": "tcp://127.0.0.1:0", "kv_events_dp_size": 2}, "kv_events_bind"),   # rank 1: no port
])
def test_bad_central_settings_name_the_setting(overrides, setting) -> None:
    with pytest.raises(ConfigError, match=setting):
        IndexerConfig(models=MODELS, **overrides).validate()


async def test_bind_failure_is_a_config_error(start_indexer, tmp_path) -> None:
    ix, central = await start_central(start_indexer, tmp_path)
    with pytest.raises(ConfigError, match="kv_events_bind"):
        await start_indexer(models=MODELS, kv_events_bind=central)


class DpRank:
    """DP rank ``rank`` of one vLLM: same topic as every rank, its own PUB (vLLM connects rank r to
    the central address's port + r) and its own sequence numbers."""

    def __init__(self, central: str, pod: str, rank: int) -> None:
        self.endpoint_id = dp_endpoint(pod, rank)
        self.pub = KvEventPublisher(central, topic=f"kv@{pod}@{MODEL}", data_parallel_rank=rank)

    def publish(self, *events) -> int:  # noqa: ANN002
        return self.pub.publish(KVEventBatch(time.time(), list(events), self.pub._dp_rank))

    def close(self) -> None:
        self.pub.close(linger_ms=0)


async def test_data_parallel_ranks_are_endpoints_of_their_own(start_indexer) -> None:
    """vLLM with --data-parallel-size 2 publishes one topic from two ranks (ports P and P+1, each
    its own sequence): each rank is an endpoint of its own, replayed from its own replay port."""
    for _ in range(20):   # the ports P and P+1 must both be free: bind, retry elsewhere if taken
        base = free_port()
        try:
            ix = await start_indexer(models=MODELS, kv_events_bind=f"tcp://127.0.0.1:{base}", kv_events_dp_size=2,
                                     kv_events_replay="tcp://{host}:5558")
            break
        except ConfigError:
            continue
    else:
        pytest.fail("no free pair of ports for the central socket")
    assert ix.app.central.bound == [f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"]
    pod = "10.3.0.1:8000"
    ranks = [DpRank(f"tcp://127.0.0.1:{base}", pod, r) for r in (0, 1)]
    try:
        for r in ranks:
            await connected(r, ix)   # type: ignore[arg-type]
        (ev0, keys0), (ev1, keys1) = stored(tokens(21, 4)), stored(tokens(22, 2))
        ranks[0].publish(ev0)
        ranks[1].publish(ev1)
        await wait_until(lambda: awaits(combined(ix.stub, keys0, pod), 4), what="rank 0's blocks")
        await wait_until(lambda: awaits(combined(ix.stub, keys1, f"{pod}_dp1"), 2), what="rank 1's blocks")
        assert await combined(ix.stub, keys0, f"{pod}_dp1") == 0 and await combined(ix.stub, keys1, pod) == 0
        listed = {e.endpoint.endpoint_id: e.endpoint for e in (await ix.stub.ListEndpoints(
            indexer_pb2.ListEndpointsRequest(), timeout=5)).endpoints}
        assert listed[pod].kv_events_replay_endpoint == "tcp://10.3.0.1:5558"
        assert listed[f"{pod}_dp1"].kv_events_replay_endpoint == "tcp://10.3.0.1:5559"   # vLLM's offset
        # Neither rank's sequence numbers disturbed the other's (no gap, no clear).
        for eid in (pod, f"{pod}_dp1"):
            assert not ix.metric("kvmesh_indexer_endpoint_clears_total", {"endpoint": eid, "reason": "gap"})
    finally:
        for r in ranks:
            r.close()


def test_dp_replay_addresses_follow_vllms_offset() -> None:
    assert replay_address("tcp://{host}:5558", "10.0.0.1:8000", 3) == "tcp://10.0.0.1:5561"
    assert replay_address("inproc://replay-{port}", "h:1", 2) == "inproc://replay-1_dp2"
    assert dp_endpoint("h:1", 0) == "h:1" and dp_endpoint("h:1", 2) == "h:1_dp2"
    with pytest.raises(ValueError):   # vLLM cannot offset an ipc address either
        replay_address("ipc:///tmp/r-{port}.sock", "h:1", 1)
