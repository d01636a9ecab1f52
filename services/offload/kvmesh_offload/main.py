"""``kvmesh serve offload``: the shared KV offload store service.

Wires the config to the store core (RAM tier, optional disk tier), the gRPC
servicer, the KV-event publisher and, optionally, self-registration with the
indexer as a ``ROLE_STORE`` endpoint so the indexer subscribes to our events.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from kvmesh.config import ConfigError, add_dataclass_args, load_config
from kvmesh.kvstore.eviction_registry import make_eviction_policy
from kvmesh.logs import setup_logging
from kvmesh.registration import IndexerRegistration, kv_events_fields
from kvmesh.rpc import tls
from kvmesh.rpc.runner import run_async_main
from kvmesh.rpc.server import ServerOptions, ServiceServer
from kvmesh.telemetry import setup_tracing, start_metrics_server
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.indexer.v1 import indexer_pb2
from kvmesh_api.offload.v1 import offload_pb2
from kvmesh_offload.arena import malloc_trim, tune_malloc
from kvmesh_offload.config import OffloadConfig
from kvmesh_offload.disk_tier import DiskTier
from kvmesh_offload.metrics import bind_store
from kvmesh_offload.servicer import OffloadServicer, add_offload_servicer
from kvmesh_offload.store import OffloadStore

log = logging.getLogger(__name__)
SERVICE_NAME = offload_pb2.DESCRIPTOR.services_by_name["Offload"].full_name


def build_pool(cfg: OffloadConfig):  # noqa: ANN201 - a PoolTier, or None for the local byte pool
    """Join the Mooncake pool (``--byte-pool mooncake``); imports Mooncake only then."""
    if cfg.byte_pool != "mooncake":
        return None
    import dataclasses

    from kvmesh.kvstore.mooncake.pool import MIN_SEGMENT, Pool, PoolError
    from kvmesh_offload.pool_tier import HEADROOM, PoolTier, pool_prefix

    pc = cfg.mooncake
    if pc.segment_bytes == -1:
        pc = dataclasses.replace(pc, segment_bytes=max(MIN_SEGMENT, int(cfg.ram_capacity_bytes * HEADROOM)))
    try:
        return PoolTier(Pool(pc), pool_prefix(cfg.endpoint_id))
    except PoolError as exc:
        raise ConfigError(str(exc)) from None


def build_store(cfg: OffloadConfig, event_sink=None, pool=None) -> OffloadStore:  # noqa: ANN001
    if pool is not None:
        # The bytes are the pool's: the store keeps sizes, chains, checksums and its policy.
        return OffloadStore(cfg.ram_capacity_bytes, policy=cfg.eviction_policy, evict_on_full=cfg.evict_on_full,
                            event_sink=pool.sink(event_sink), metadata_only=True,
                            max_block_bytes=cfg.max_block_bytes)
    disk = None
    if cfg.disk_path:
        disk = DiskTier(cfg.disk_path, cfg.disk_capacity_bytes, make_eviction_policy("lru"), fsync=cfg.disk_fsync)
    return OffloadStore(cfg.ram_capacity_bytes, policy=cfg.eviction_policy, disk=disk,
                        evict_on_full=cfg.evict_on_full, event_sink=event_sink, max_block_bytes=cfg.max_block_bytes)


def store_endpoint(cfg: OffloadConfig, grpc_port: int, pub) -> indexer_pb2.Endpoint:  # noqa: ANN001
    """This store as a ``ROLE_STORE`` index endpoint (who binds the ZMQ pair follows the configured form)."""
    return indexer_pb2.Endpoint(
        endpoint_id=cfg.endpoint_id, model=cfg.model, role=common_pb2.ROLE_STORE,
        grpc_address=f"{cfg.advertise_host}:{grpc_port}",
        **kv_events_fields(cfg.events_endpoint, cfg.advertise_host, replay_endpoint=pub.replay_endpoint or "",
                           opened_endpoint=pub.endpoint),
        labels={"kind": "offload"})


async def serve(cfg: OffloadConfig) -> int:
    setup_tracing("kvmesh-offload")
    tls.set_default(cfg.tls)
    pub = None
    sink = None
    if cfg.events_endpoint:
        from kvmesh.events.curve import CurveServer
        from kvmesh.events.publisher import KvEventPublisher
        from kvmesh.events.topic import make_topic
        from kvmesh_offload.events import EventBridge

        curve = CurveServer(cfg.events_curve_secret, cfg.events_curve_clients) if cfg.events_curve_secret else None
        pub = KvEventPublisher(cfg.events_endpoint, topic=make_topic(cfg.endpoint_id, cfg.model),
                               replay_endpoint=cfg.events_replay_endpoint or None, curve=curve)
        sink = EventBridge(pub)
    pool = await asyncio.to_thread(build_pool, cfg)
    store = build_store(cfg, sink, pool)
    try:
        found = await asyncio.to_thread(store.open)
    except OSError as exc:
        raise ConfigError(f"disk_path {cfg.disk_path!r} is not usable: {exc}") from exc
    bind_store(store)
    servicer = OffloadServicer(store, shm_enabled=cfg.shm_enabled, max_block_bytes=cfg.max_block_bytes,
                               lease_ttl_s=cfg.lease_ttl_s, bulk_host=cfg.host,
                               bulk_port=cfg.bulk_port if cfg.bulk_port >= 0 else None,
                               lease_bind_host=cfg.lease_bind_host, direct_put=cfg.direct_put, pool=pool)
    server = ServiceServer("offload", [(add_offload_servicer, servicer, SERVICE_NAME)],
                           ServerOptions(host=cfg.host, port=cfg.port, grace_s=cfg.grace_s, tls=cfg.tls))

    def drain() -> None:
        servicer.draining = True
    server.on_drain.append(drain)
    port = await server.start()
    server.install_signal_handlers()
    start_metrics_server(cfg.metrics_port, host=cfg.host, auth=cfg.metrics_auth, tls=cfg.tls)
    await server.set_ready(True)
    registration = None
    if cfg.indexer_address and pub is not None:
        registration = IndexerRegistration(cfg.indexer_address, store_endpoint(cfg, port, pub),
                                           heartbeat_s=max(0.5, cfg.register_ttl_s / 3), ttl_s=cfg.register_ttl_s,
                                           retry_s=1.0)
        await registration.start()
    log.info("offload store ready", extra={"port": port, "disk_blocks_recovered": found,
                                           "bulk_port": servicer.bulk.port if servicer.bulk else None,
                                           "events": pub.endpoint if pub else None,
                                           "policy": store.policy_name,
                                           "byte_pool": cfg.byte_pool})
    trim = asyncio.create_task(_trim_loop(cfg.malloc_trim_s), name="malloc-trim") if cfg.malloc_trim_s > 0 else None
    try:
        await server.wait()
    finally:
        if trim is not None:
            trim.cancel()
        if registration is not None:
            await registration.stop(leave=False)
        servicer.close()
        if pool is not None:
            pool.close()
        if pub is not None:
            pub.close()
    return 0


async def _trim_loop(period_s: float) -> None:
    """Return freed heap memory to the OS every ``period_s`` (see ``arena.malloc_trim``)."""
    while True:
        await asyncio.sleep(period_s)
        await asyncio.to_thread(malloc_trim)


def main(argv: list[str] | None = None) -> int:
    tune_malloc()
    parser = argparse.ArgumentParser(prog="kvmesh serve offload", description=__doc__)
    add_dataclass_args(parser, OffloadConfig)
    args = parser.parse_args(argv)
    setup_logging()

    async def run() -> int:
        cfg = load_config(OffloadConfig, args)
        return await serve(cfg)
    return run_async_main(run)


if __name__ == "__main__":
    raise SystemExit(main())
