"""The store's own KV events: vLLM wire format on ZMQ, and the indexer learning what is restorable."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import zmq

from kvmesh.events import BlockRemoved, BlockStored, decode_message
from kvmesh.events.publisher import KvEventPublisher
from kvmesh.hashing import BlockHasher
from kvmesh.kvstore.client import OffloadClient, SyncOffloadClient
from kvmesh.rpc.channel import aio_channel
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.indexer.v1 import indexer_pb2, indexer_pb2_grpc
from kvmesh_offload.events import EventBridge
from kvmesh_tools.testing.ports import free_port
from kvmesh_tools.testing.procs import ServiceProcess

pytestmark = pytest.mark.timeout(60)
NS = "sim-model/L2-H2-D32-bf16-bs16"
BS = 16


def _chain(tokens: list[int]) -> list[int]:
    return [int.from_bytes(d, "big") & ((1 << 64) - 1) for d in BlockHasher("sha256_cbor", BS).block_digests(tokens)]


def _drain(sub: zmq.Socket, want: int, timeout_s: float = 5.0) -> list[object]:
    events: list[object] = []
    deadline = time.monotonic() + timeout_s
    while len(events) < want and time.monotonic() < deadline:
        if sub.poll(100):
            events += decode_message(sub.recv_multipart()).batch.events
    return events


async def test_store_events_on_the_wire(offload_factory, tmp_path: Path) -> None:
    pub = KvEventPublisher("tcp://*:0", topic="kv@store-t@any")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint.replace("0.0.0.0", "127.0.0.1"))
    await asyncio.sleep(0.3)  # slow-joiner: let the SUB connect before we publish
    try:
        size = 8192
        st = await offload_factory(event_sink=EventBridge(pub), ram_capacity_bytes=4 * size,
                                   disk_path=str(tmp_path / "d"), disk_capacity_bytes=64 * size,
                                   eviction_policy="lru")
        tokens = list(range(4 * BS))
        keys = _chain(tokens)
        async with OffloadClient(st.address, use_shm=False) as c:
            await c.put(NS, [(k, os.urandom(size)) for k in keys], block_size=BS,
                        token_ids=[tokens[i * BS:(i + 1) * BS] for i in range(4)], parent=None)
            evs = await asyncio.to_thread(_drain, sub, 2)   # AllBlocksCleared at open, then the put
            stored = [e for e in evs if isinstance(e, BlockStored)]
            assert stored and stored[0].block_hashes == keys and stored[0].medium == "CPU"
            assert stored[0].token_ids == tokens and stored[0].block_size == BS
            assert stored[0].parent_block_hash is None
            # a second chain pushes the first down to disk: removed from CPU, stored on DISK
            await c.put(NS, [(k, os.urandom(size)) for k in (11, 12)])
            evs = await asyncio.to_thread(_drain, sub, 5)
            removed = [k for e in evs if isinstance(e, BlockRemoved) and e.medium == "CPU" for k in e.block_hashes]
            on_disk = [k for e in evs if isinstance(e, BlockStored) and e.medium == "DISK" for k in e.block_hashes]
            assert set(removed) == set(keys[2:]) and set(on_disk) == set(keys[2:])
            assert await c.delete(NS, [keys[3]]) == 1
            evs = await asyncio.to_thread(_drain, sub, 1)
            assert any(isinstance(e, BlockRemoved) and e.block_hashes == [keys[3]] and e.medium == "DISK"
                       for e in evs)
    finally:
        sub.close(0)
        pub.close()


async def test_registered_store_blocks_are_restorable_in_the_index(offload_process, tmp_path: Path) -> None:
    indexer = ServiceProcess.with_ports("indexer", lambda p: ["--host", "127.0.0.1", "--port", str(p), "--models",
                                                              f"sim-model@{BS}@sha256_cbor"],
                                        log_path=tmp_path / "indexer.log").start(timeout_s=30)
    try:
        store = offload_process("--indexer-address", indexer.grpc_address, "--events-endpoint", "tcp://*:0",
                                "--endpoint-id", "store-1", "--ram-capacity-bytes", str(16 << 20))
        tokens = list(range(500, 500 + 5 * BS))
        keys = _chain(tokens)
        with SyncOffloadClient(store.grpc_address) as c:
            c.put(NS, [(k, os.urandom(4096)) for k in keys], block_size=BS,
                  token_ids=[tokens[i * BS:(i + 1) * BS] for i in range(5)])
        async with aio_channel(indexer.grpc_address) as ch:
            stub = indexer_pb2_grpc.IndexerStub(ch)
            match = None
            for _ in range(100):
                resp = await stub.Lookup(indexer_pb2.LookupRequest(
                    model="sim-model", chain=indexer_pb2.BlockChain(keys=keys)), timeout=5)
                match = next((m for m in resp.matches if m.endpoint_id == "store-1"), None)
                if match is not None and match.combined_blocks == 5:
                    break
                await asyncio.sleep(0.1)
            assert match is not None and match.combined_blocks == 5
            assert {t.tier: t.blocks for t in match.tiers}.get(common_pb2.TIER_CPU) == 5
    finally:
        indexer.stop(grace_s=3)


async def test_store_with_host_form_events_endpoint_is_indexed(offload_process, tmp_path: Path) -> None:
    """``tcp://127.0.0.1:P`` makes the store's publisher connect (vLLM's rule), so the indexer must bind."""
    indexer = ServiceProcess.with_ports("indexer", lambda p: ["--host", "127.0.0.1", "--port", str(p), "--models",
                                                              f"sim-model@{BS}@sha256_cbor"],
                                        log_path=tmp_path / "indexer.log").start(timeout_s=30)
    try:
        events = f"tcp://127.0.0.1:{free_port()}"
        store = offload_process("--indexer-address", indexer.grpc_address, "--events-endpoint", events,
                                "--endpoint-id", "store-host", "--ram-capacity-bytes", str(16 << 20))
        async with aio_channel(indexer.grpc_address) as ch:
            stub = indexer_pb2_grpc.IndexerStub(ch)
            match = None
            with SyncOffloadClient(store.grpc_address) as c:
                for attempt in range(100):
                    # Fresh blocks each attempt: the first events can go out before the indexer has
                    # registered the store and bound its SUB socket (ZMQ slow joiner), and a re-put
                    # of present blocks publishes nothing.
                    tokens = list(range(900 + attempt * 3 * BS, 900 + (attempt + 1) * 3 * BS))
                    keys = _chain(tokens)
                    c.put(NS, [(k, os.urandom(4096)) for k in keys], block_size=BS,
                          token_ids=[tokens[i * BS:(i + 1) * BS] for i in range(3)])
                    await asyncio.sleep(0.2)
                    resp = await stub.Lookup(indexer_pb2.LookupRequest(
                        model="sim-model", chain=indexer_pb2.BlockChain(keys=keys)), timeout=5)
                    match = next((m for m in resp.matches if m.endpoint_id == "store-host"), None)
                    if match is not None and match.combined_blocks == 3:
                        break
            assert match is not None and match.combined_blocks == 3
            assert {t.tier: t.blocks for t in match.tiers}.get(common_pb2.TIER_CPU) == 3
    finally:
        indexer.stop(grace_s=3)
