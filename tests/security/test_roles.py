"""Authorization by role over mutual TLS, against the real indexer, offload store and sim worker.

Every method the role table restricts is called by every role that may not call it: each gets
PERMISSION_DENIED and the service's state (endpoints, stats, load) is what it was. Then the
attacks of issue #20: an endpoint registering, heartbeating or publishing as another one
(routing takeover), a non-admin deregistering someone, a non-router writing speculative entries.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from kvmesh.rpc.authz import ROLES, RULES
from kvmesh.rpc.channel import aio_channel
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.indexer.v1 import indexer_pb2, indexer_pb2_grpc
from kvmesh_api.offload.v1 import offload_pb2, offload_pb2_grpc
from kvmesh_api.worker.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.timeout(120)

DENIED = grpc.StatusCode.PERMISSION_DENIED
SERVICES = {"indexer": indexer_pb2.DESCRIPTOR.services_by_name["Indexer"],
            "offload": offload_pb2.DESCRIPTOR.services_by_name["Offload"],
            "worker": worker_pb2.DESCRIPTOR.services_by_name["Worker"]}


async def call(ch: grpc.aio.Channel, service: str, method: str, payload: bytes = b"") -> object:
    """Call any method with a raw (here: empty) request; return the response or raise."""
    m = SERVICES[service].methods_by_name[method]
    path = f"/{SERVICES[service].full_name}/{method}"
    if m.client_streaming:
        async def one() -> AsyncIterator[bytes]:
            yield payload
        mc = ch.stream_stream(path) if m.server_streaming else ch.stream_unary(path)
        req: object = one()
    else:
        mc = ch.unary_stream(path) if m.server_streaming else ch.unary_unary(path)
        req = payload
    res = mc(req, timeout=5)
    if m.server_streaming:
        return [x async for x in res]
    return await res


@pytest.fixture
async def mesh(certs, tmp_path) -> AsyncIterator[dict[str, str]]:  # noqa: ANN001
    """Indexer, offload store and a sim decode worker, each with its own certificate."""
    from kvmesh.rpc.server import ServerOptions, ServiceServer
    from kvmesh.worker.config import WorkerConfig
    from kvmesh.worker.run import start_worker
    from kvmesh_indexer.config import IndexerConfig
    from kvmesh_indexer.main import build_app
    from kvmesh_offload.config import OffloadConfig
    from kvmesh_offload.main import SERVICE_NAME, build_store
    from kvmesh_offload.servicer import OffloadServicer, add_offload_servicer

    idx = build_app(IndexerConfig(host="127.0.0.1", port=0, default_model="m", models="m@16@sha256_cbor",
                                  tls=certs("indexer", "indexer").tls_config()))
    idx_port = await idx.start()
    ocfg = OffloadConfig(host="127.0.0.1", port=0, ram_capacity_bytes=1 << 24, bulk_port=-1)
    store = build_store(ocfg, None)
    store.open()
    servicer = OffloadServicer(store, shm_enabled=True, max_block_bytes=ocfg.max_block_bytes, lease_ttl_s=5,
                               bulk_host="127.0.0.1", bulk_port=None)
    off = ServiceServer("offload", [(add_offload_servicer, servicer, SERVICE_NAME)],
                        ServerOptions(host="127.0.0.1", port=0, tls=certs("store", "offload-0").tls_config()))
    off_port = await off.start()
    await off.set_ready(True)
    worker = await start_worker(WorkerConfig(
        engine="sim", role="decode", model="m", endpoint_id="decode-0", block_size=16, num_blocks=64,
        host="127.0.0.1", time_scale=50.0, max_model_len=1024, vocab_size=1000,
        tls=certs("worker", "decode-0").tls_config()))
    try:
        yield {"indexer": f"127.0.0.1:{idx_port}", "offload": f"127.0.0.1:{off_port}",
               "worker": f"127.0.0.1:{worker.port}"}
    finally:
        await worker.stop(0)
        await off.stop(0)
        servicer.close()
        await idx.stop(0)


async def state(chans: dict[str, grpc.aio.Channel]) -> tuple[object, ...]:
    ix = indexer_pb2_grpc.IndexerStub(chans["indexer"])
    eps = await ix.ListEndpoints(indexer_pb2.ListEndpointsRequest(), timeout=5)
    stats = await ix.Stats(indexer_pb2.StatsRequest(), timeout=5)
    ostats = await offload_pb2_grpc.OffloadStub(chans["offload"]).Stats(offload_pb2.StatsRequest(), timeout=5)
    load = await worker_pb2_grpc.WorkerStub(chans["worker"]).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    # Endpoint liveness timestamps move on their own; identity and address are what matter.
    return (sorted((e.endpoint.endpoint_id, e.endpoint.grpc_address) for e in eps.endpoints),
            stats.entries, stats.keys, ostats.ram_blocks, ostats.ram_bytes,
            load.running, load.waiting)


async def test_every_restricted_method_refuses_every_other_role(mesh, certs) -> None:  # noqa: ANN001
    admin = {s: aio_channel(a, tls=certs("admin", "ops").tls_config()) for s, a in mesh.items()}
    before = await state(admin)
    refused = 0
    for role in ROLES:
        cfg = certs(role, f"{role}-x").tls_config()
        chans = {s: aio_channel(a, tls=cfg) for s, a in mesh.items()}
        for path, rule in RULES.items():
            service = {"/kvmesh.indexer.v1.Indexer/": "indexer", "/kvmesh.offload.v1.Offload/": "offload",
                       "/kvmesh.worker.v1.Worker/": "worker"}.get(path[:path.rindex("/") + 1])
            if service is None or role in rule.roles:
                continue
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(chans[service], service, path.rsplit("/", 1)[1])
            assert err.value.code() == DENIED, (role, path, err.value.details())
            refused += 1
        for ch in chans.values():
            await ch.close()
    assert refused >= len(ROLES) * 3
    assert await state(admin) == before
    for ch in admin.values():
        await ch.close()


def endpoint(eid: str, address: str) -> indexer_pb2.Endpoint:
    return indexer_pb2.Endpoint(endpoint_id=eid, model="m", role=common_pb2.ROLE_DECODE, grpc_address=address,
                                block_size=16)


async def test_an_endpoint_acts_only_as_itself(mesh, certs) -> None:  # noqa: ANN001
    as_cert = {n: aio_channel(mesh["indexer"], tls=certs(*n.split("/")).tls_config())
               for n in ("worker/decode-7", "worker/attacker", "router/router-0", "admin/ops")}
    stub = {n: indexer_pb2_grpc.IndexerStub(ch) for n, ch in as_cert.items()}
    victim = "10.0.0.7:50061"
    await stub["worker/decode-7"].RegisterEndpoint(
        indexer_pb2.RegisterEndpointRequest(endpoint=endpoint("decode-7", victim)), timeout=5)

    async def addresses() -> dict[str, str]:
        eps = await stub["admin/ops"].ListEndpoints(indexer_pb2.ListEndpointsRequest(), timeout=5)
        return {e.endpoint.endpoint_id: e.endpoint.grpc_address for e in eps.endpoints}

    before = await addresses()
    assert before["decode-7"] == victim
    attacks = [
        # Attack 1 of issue #20: take over decode-7's traffic by registering its id with our address.
        stub["worker/attacker"].RegisterEndpoint(
            indexer_pb2.RegisterEndpointRequest(endpoint=endpoint("decode-7", "10.6.6.6:1")), timeout=5),
        stub["worker/attacker"].Heartbeat(indexer_pb2.HeartbeatRequest(endpoint_id="decode-7"), timeout=5),
        stub["worker/attacker"].DeregisterEndpoint(
            indexer_pb2.DeregisterEndpointRequest(endpoint_id="decode-7"), timeout=5),
        stub["router/router-0"].DeregisterEndpoint(
            indexer_pb2.DeregisterEndpointRequest(endpoint_id="decode-7"), timeout=5),
        # Deregistering is the admin's: not even the endpoint itself may (it leaves by heartbeat).
        stub["worker/decode-7"].DeregisterEndpoint(
            indexer_pb2.DeregisterEndpointRequest(endpoint_id="decode-7"), timeout=5),
        # Nor may another worker make it "leave".
        stub["worker/attacker"].Heartbeat(indexer_pb2.HeartbeatRequest(endpoint_id="decode-7", leaving=True),
                                          timeout=5),
        stub["worker/attacker"].PutSpeculative(
            indexer_pb2.PutSpeculativeRequest(model="m", endpoint_id="decode-7", keys=[1, 2, 3]), timeout=5),
    ]
    for attack in attacks:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await attack
        assert err.value.code() == DENIED

    async def forged() -> AsyncIterator[indexer_pb2.IngestEventsRequest]:
        yield indexer_pb2.IngestEventsRequest(
            endpoint_id="decode-7", model="m", seq=1,
            batch=indexer_pb2.EventBatch(events=[indexer_pb2.KvEvent(cleared=indexer_pb2.AllBlocksCleared())]))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub["worker/attacker"].IngestEvents(forged(), timeout=5)
    assert err.value.code() == DENIED
    assert await addresses() == before

    # What is allowed: a router writes speculative entries, the admin deregisters anyone.
    await stub["router/router-0"].PutSpeculative(
        indexer_pb2.PutSpeculativeRequest(model="m", endpoint_id="decode-7", keys=[1, 2, 3]), timeout=5)
    await stub["admin/ops"].DeregisterEndpoint(indexer_pb2.DeregisterEndpointRequest(endpoint_id="decode-7"),
                                                timeout=5)
    assert "decode-7" not in await addresses()
    # An endpoint ends its own registration at shutdown: it expires at once and must register again.
    await stub["worker/decode-7"].RegisterEndpoint(
        indexer_pb2.RegisterEndpointRequest(endpoint=endpoint("decode-7", victim)), timeout=5)
    await stub["worker/decode-7"].Heartbeat(indexer_pb2.HeartbeatRequest(endpoint_id="decode-7", leaving=True),
                                            timeout=5)
    eps = await stub["admin/ops"].ListEndpoints(indexer_pb2.ListEndpointsRequest(), timeout=5)
    assert [e.alive for e in eps.endpoints if e.endpoint.endpoint_id == "decode-7"] == [False]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub["worker/decode-7"].Heartbeat(indexer_pb2.HeartbeatRequest(endpoint_id="decode-7"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    for ch in as_cert.values():
        await ch.close()


async def test_a_certificate_without_identity_or_from_another_domain_is_refused(mesh, ca, tmp_path) -> None:  # noqa: ANN001
    from kvmesh_tools.stack.certs import CertAuthority

    foreign = CertAuthority(ca.out, trust_domain="evil.example").issue("admin", "ops", out=tmp_path / "foreign")
    async with aio_channel(mesh["indexer"], tls=foreign.tls_config()) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await indexer_pb2_grpc.IndexerStub(ch).ListEndpoints(indexer_pb2.ListEndpointsRequest(), timeout=5)
        assert err.value.code() == DENIED
