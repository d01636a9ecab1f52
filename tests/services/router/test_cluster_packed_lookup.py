"""The router sends its lookups' chains packed (``BlockChain.keys_be64``); an indexer that predates
the field reads an empty chain, and the router then sends repeated keys, getting the same answer."""

from __future__ import annotations

import time

import grpc

from kvmesh.events.codec import KVEventBatch, encode_batch
from kvmesh_api.indexer.v1 import indexer_pb2, indexer_pb2_grpc
from tests.services.indexer.test_indexer_service import MODEL, MODELS, stored, tokens


class _OlderIndexer(indexer_pb2_grpc.IndexerServicer):
    """A real indexer behind a front that drops ``keys_be64``, as an indexer built before it would."""

    def __init__(self, stub: indexer_pb2_grpc.IndexerStub) -> None:
        self.stub = stub
        self.seen: list[str] = []

    async def Lookup(self, request, context):  # noqa: ANN001, ANN201, N802 - the gRPC method's name
        self.seen.append("packed" if request.chain.keys_be64 else "keys")
        request.chain.ClearField("keys_be64")
        try:
            return await self.stub.Lookup(request, timeout=5)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details())


async def _cluster(address: str):  # noqa: ANN202
    from kvmesh.routing.router import RouterCore, RouterCoreConfig
    from kvmesh_router.cluster import Cluster
    from kvmesh_router.config import RouterConfig

    return Cluster(RouterConfig(model=MODEL, block_size=16, indexer=address, endpoints=["g0=127.0.0.1:1"]),
                   RouterCore(RouterCoreConfig(block_size=16)))


async def test_packed_lookups_and_the_fallback_for_an_older_indexer(start_indexer) -> None:
    ix = await start_indexer(models=MODELS)
    ev, keys = stored(tokens(52, 5))
    await ix.stub.IngestEvents(iter([indexer_pb2.IngestEventsRequest(
        endpoint_id="g0", model=MODEL, seq=0, vllm_payload=encode_batch(KVEventBatch(time.time(), [ev])))]),
        timeout=10)
    new = await _cluster(ix.address)
    got = await new.lookup(keys)
    assert new.packed_lookups and got.per_endpoint["g0"].gpu == len(keys)

    front = _OlderIndexer(ix.stub)
    server = grpc.aio.server()
    indexer_pb2_grpc.add_IndexerServicer_to_server(front, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    old = await _cluster(f"127.0.0.1:{port}")
    try:
        first = await old.lookup(keys)
        assert front.seen == ["packed", "keys"] and not old.packed_lookups
        assert first.per_endpoint == got.per_endpoint and old.indexer_up
        assert (await old.lookup(keys)).per_endpoint == got.per_endpoint and front.seen[2:] == ["keys"]
    finally:
        await old.stop()
        await new.stop()
        await server.stop(0)
