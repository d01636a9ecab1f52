"""Attack 2 of issue #20: one unauthenticated request to an engine's (or the store's) replay
socket returned every buffered event, token ids included.

Defaults: replay sockets bind loopback. With CURVE on (kvmesh's publishers), replay and the
event stream answer only subscribers whose keys are admitted; the indexer, holding an admitted
key and the publisher's public key, still indexes and replays the engine's events.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

from kvmesh.config import ConfigError
from kvmesh.events.codec import BlockStored, KVEventBatch
from kvmesh.events.curve import CurveClient, CurveServer, generate
from kvmesh.events.publisher import KvEventPublisher
from kvmesh.worker.config import WorkerConfig
from kvmesh_api.indexer.v1 import indexer_pb2
from kvmesh_indexer.replay_client import ReplayError, fetch_replay
from tests.fixtures.indexer import wait_until

pytestmark = pytest.mark.timeout(60)
M = "m"
BS = 16


def _batch(i: int) -> KVEventBatch:
    return KVEventBatch(0.0, [BlockStored(block_hashes=[1000 + i], parent_block_hash=None,
                                          token_ids=list(range(i * BS, (i + 1) * BS)), block_size=BS,
                                          medium="GPU")])


def test_replay_binds_loopback_by_default() -> None:
    cfg = WorkerConfig()
    assert cfg.kv_events_replay_endpoint.startswith("tcp://127.0.0.1:")
    assert cfg.host == "127.0.0.1"
    with KvEventPublisher("tcp://*:0", replay_endpoint=cfg.kv_events_replay_endpoint) as pub:
        assert pub.replay_endpoint is not None and pub.replay_endpoint.startswith("tcp://127.0.0.1:")


def test_vllm_engines_refuse_curve_settings(tmp_path: Path) -> None:
    _, secret = generate(tmp_path, "w")
    cfg = WorkerConfig(engine="vllm", kv_events_curve_secret=str(secret), kv_events_curve_clients=str(tmp_path))
    with pytest.raises(ConfigError, match="cannot use CURVE"):
        cfg.validate()


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    pub_pub, pub_sec = generate(tmp_path / "publisher", "e0")
    idx_pub, idx_sec = generate(tmp_path / "admitted", "indexer")
    _, stranger_sec = generate(tmp_path / "stranger", "stranger")
    servers = tmp_path / "servers"
    servers.mkdir()
    (servers / "e0.key").write_bytes(pub_pub.read_bytes())   # the indexer looks keys up by endpoint id
    return {"pub_secret": pub_sec, "pub_public": pub_pub, "clients": idx_pub.parent, "idx_secret": idx_sec,
            "stranger_secret": stranger_sec, "servers": servers}


def test_curve_replay_answers_only_admitted_subscribers(keys: dict[str, Path]) -> None:
    curve = CurveServer(str(keys["pub_secret"]), str(keys["clients"]))
    with KvEventPublisher("tcp://*:0", replay_endpoint="tcp://127.0.0.1:0", curve=curve) as pub:
        for i in range(3):
            pub.publish(_batch(i))
        rep = pub.replay_endpoint
        assert rep is not None
        with pytest.raises(ReplayError):
            fetch_replay(rep, 0, timeout_s=1.0)                                  # no key at all
        with pytest.raises(ReplayError):
            fetch_replay(rep, 0, timeout_s=1.0, curve=CurveClient(str(keys["stranger_secret"]),
                                                                  str(keys["pub_public"])))   # a key not admitted
        got = fetch_replay(rep, 0, timeout_s=5.0, curve=CurveClient(str(keys["idx_secret"]), str(keys["pub_public"])))
        assert [s for s, _ in got] == [0, 1, 2]
        # The live stream too: a plaintext subscriber never completes the handshake.
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint.replace("0.0.0.0", "127.0.0.1"))
        try:
            for i in range(3, 8):
                pub.publish(_batch(i))
            assert not sub.poll(500)
        finally:
            sub.close(linger=0)


async def test_indexer_ingests_and_replays_over_curve(start_indexer, keys: dict[str, Path]) -> None:
    curve = CurveServer(str(keys["pub_secret"]), str(keys["clients"]))
    ix = await start_indexer(models=f"{M}@{BS}@sha256_cbor", kv_events_curve_secret=str(keys["idx_secret"]),
                             kv_events_curve_servers=str(keys["servers"]))
    with KvEventPublisher("tcp://*:0", topic=f"kv@e0@{M}", replay_endpoint="tcp://127.0.0.1:0", curve=curve) as pub:
        pub.publish(_batch(0))   # before the indexer subscribes: it can only come back through replay
        ep = indexer_pb2.Endpoint(endpoint_id="e0", model=M, grpc_address="127.0.0.1:1",
                                  kv_events_endpoint=pub.endpoint.replace("0.0.0.0", "127.0.0.1"),
                                  kv_events_replay_endpoint=pub.replay_endpoint or "")
        await ix.stub.RegisterEndpoint(indexer_pb2.RegisterEndpointRequest(endpoint=ep, ttl_s=60), timeout=5)

        async def indexed() -> bool:
            pub.publish(_batch(1))
            st = await ix.stub.Stats(indexer_pb2.StatsRequest(), timeout=5)
            return st.entries >= 2   # block 0 came back through replay, the later ones live

        await wait_until(indexed, timeout_s=15, interval_s=0.3, what="events indexed over CURVE")
