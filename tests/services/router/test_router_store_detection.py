"""``--offload-enabled auto``: the router prices a shared offload store only while the indexer lists a
live one, so a fleet without a store (bring-your-own vLLM) gets the no-store cost with no flag."""

from __future__ import annotations

from prometheus_client import REGISTRY

from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.indexer.v1 import indexer_pb2
from tests.services.indexer.test_indexer_service import MODEL, MODELS

STORE = indexer_pb2.Endpoint(endpoint_id="offload-0", model="any", role=common_pb2.ROLE_STORE)


async def _cluster(address: str, offload: str):  # noqa: ANN202
    from kvmesh.routing.router import RouterCore
    from kvmesh_router.cluster import Cluster
    from kvmesh_router.config import RouterConfig
    from kvmesh_router.main import core_config

    cfg = RouterConfig(model=MODEL, block_size=16, indexer=address, offload_enabled=offload)
    return Cluster(cfg, RouterCore(core_config(cfg)))


def _gauge() -> float | None:
    return REGISTRY.get_sample_value("kvmesh_router_offload_enabled")


async def test_auto_follows_a_live_store_in_the_registry(start_indexer) -> None:
    ix = await start_indexer(models=MODELS)
    cluster = await _cluster(ix.address, "auto")
    core = cluster.core
    await cluster.refresh_registry()
    assert core.cfg.offload_enabled is False and _gauge() == 0
    assert core.cfg.scoring.blocking_w(core.cfg.offload_enabled) == core.cfg.scoring.blocking_weight

    await ix.stub.RegisterEndpoint(indexer_pb2.RegisterEndpointRequest(endpoint=STORE, ttl_s=30), timeout=5)
    await cluster.refresh_registry()
    assert core.cfg.offload_enabled is True and _gauge() == 1
    assert core.cfg.scoring.blocking_w(core.cfg.offload_enabled) == core.cfg.scoring.blocking_weight_with_store
    assert not core.cfg.scoring.cliff(core.cfg.offload_enabled)

    # The store shuts down (it ends its own registration): displaced contexts are recomputes again.
    await ix.stub.Heartbeat(indexer_pb2.HeartbeatRequest(endpoint_id="offload-0", leaving=True), timeout=5)
    await cluster.refresh_registry()
    assert core.cfg.offload_enabled is False and _gauge() == 0
    await cluster.stop()


async def test_a_fixed_setting_ignores_the_registry(start_indexer) -> None:
    ix = await start_indexer(models=MODELS)
    off = await _cluster(ix.address, "false")
    on = await _cluster(ix.address, "true")
    assert on.core.cfg.offload_enabled is True
    await on.refresh_registry()
    assert on.core.cfg.offload_enabled is True   # told there is one, though none is listed

    await ix.stub.RegisterEndpoint(indexer_pb2.RegisterEndpointRequest(endpoint=STORE, ttl_s=30), timeout=5)
    await off.refresh_registry()
    assert off.core.cfg.offload_enabled is False
    await off.stop()
    await on.stop()
