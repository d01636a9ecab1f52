"""``kvmesh serve offload``: the shared KV offload store service.

Wires the config to the store core (RAM tier, optional disk tier), the gRPC
servicer, the KV-event publisher and, optionally, self-registration with the
indexer as a ``ROLE_STORE`` endpoint so the indexer subscribes to our events.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging

import grpc

from kvmesh.common.v1 import common_pb2
from kvmesh.config import ConfigError, add_dataclass_args, load_config
from kvmesh.kvstore.arena import tune_malloc
from kvmesh.kvstore.disk_tier import DiskTier
from kvmesh.kvstore.eviction import make_policy
from kvmesh.kvstore.store import OffloadStore
from kvmesh.logs import setup_logging
from kvmesh.offload.v1 import offload_pb2
from kvmesh.rpc.channel import aio_channel
from kvmesh.rpc.runner import run_async_main
from kvmesh.rpc.server import ServerOptions, ServiceServer
from kvmesh.telemetry import setup_tracing, start_metrics_server
from kvmesh_offload.config import OffloadConfig
from kvmesh_offload.metrics import bind_store
from kvmesh_offload.servicer import OffloadServicer, add_offload_servicer

log = logging.getLogger(__name__)
ENV_PREFIX = "KVMESH_OFFLOAD_"
SERVICE_NAME = offload_pb2.DESCRIPTOR.services_by_name["Offload"].full_name


def build_store(cfg: OffloadConfig, event_sink=None) -> OffloadStore:  # noqa: ANN001
    disk = None
    if cfg.disk_path:
        disk = DiskTier(cfg.disk_path, cfg.disk_capacity_bytes, make_policy("lru"), fsync=cfg.disk_fsync)
    return OffloadStore(cfg.ram_capacity_bytes, policy=cfg.eviction_policy, disk=disk,
                        evict_on_full=cfg.evict_on_full, event_sink=event_sink, max_block_bytes=cfg.max_block_bytes)


def _advertised(endpoint: str, host: str) -> str:
    """``tcp://0.0.0.0:5560`` -> ``tcp://<host>:5560`` for other processes."""
    if endpoint.startswith("tcp://"):
        port = endpoint.rsplit(":", 1)[1]
        return f"tcp://{host}:{port}"
    return endpoint


async def _register_loop(cfg: OffloadConfig, grpc_port: int, pub) -> None:  # noqa: ANN001
    from kvmesh.indexer.v1 import indexer_pb2, indexer_pb2_grpc

    ep = indexer_pb2.Endpoint(
        endpoint_id=cfg.endpoint_id, model=cfg.model, role=common_pb2.ROLE_STORE,
        grpc_address=f"{cfg.advertise_host}:{grpc_port}",
        kv_events_endpoint=_advertised(pub.endpoint, cfg.advertise_host),
        kv_events_replay_endpoint=_advertised(pub.replay_endpoint or "", cfg.advertise_host),
        labels={"kind": "offload"})
    async with aio_channel(cfg.indexer_address) as ch:
        stub = indexer_pb2_grpc.IndexerStub(ch)
        registered = False
        while True:
            try:
                if not registered:
                    await stub.RegisterEndpoint(indexer_pb2.RegisterEndpointRequest(endpoint=ep,
                                                                                    ttl_s=cfg.register_ttl_s),
                                                timeout=5)
                    registered = True
                    log.info("registered with indexer", extra={"indexer": cfg.indexer_address,
                                                               "endpoint_id": cfg.endpoint_id})
                else:
                    await stub.Heartbeat(indexer_pb2.HeartbeatRequest(endpoint_id=cfg.endpoint_id), timeout=5)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    registered = False  # the indexer forgot us (restart): register again
                log.warning("indexer registration/heartbeat failed",
                            extra={"indexer": cfg.indexer_address, "code": str(exc.code())})
                await asyncio.sleep(1.0)
                continue
            await asyncio.sleep(max(0.5, cfg.register_ttl_s / 3))


async def serve(cfg: OffloadConfig) -> int:
    setup_tracing("kvmesh-offload")
    pub = None
    sink = None
    if cfg.events_endpoint:
        from kvmesh.events.publisher import KvEventPublisher
        from kvmesh.events.topic import make_topic
        from kvmesh_offload.events import EventBridge

        pub = KvEventPublisher(cfg.events_endpoint, topic=make_topic(cfg.endpoint_id, cfg.model),
                               replay_endpoint=cfg.events_replay_endpoint or None)
        sink = EventBridge(pub)
    store = build_store(cfg, sink)
    try:
        found = await asyncio.to_thread(store.open)
    except OSError as exc:
        raise ConfigError(f"disk_path {cfg.disk_path!r} is not usable: {exc}") from exc
    bind_store(store)
    servicer = OffloadServicer(store, shm_enabled=cfg.shm_enabled, max_block_bytes=cfg.max_block_bytes)
    server = ServiceServer("offload", [(add_offload_servicer, servicer, SERVICE_NAME)],
                           ServerOptions(host=cfg.host, port=cfg.port, grace_s=cfg.grace_s))

    def drain() -> None:
        servicer.draining = True
    server.on_drain.append(drain)
    port = await server.start()
    server.install_signal_handlers()
    start_metrics_server(cfg.metrics_port)
    reg_task = None
    if cfg.indexer_address and pub is not None:
        reg_task = asyncio.create_task(_register_loop(cfg, port, pub))
    await server.set_ready(True)
    log.info("offload store ready", extra={"port": port, "disk_blocks_recovered": found,
                                           "events": pub.endpoint if pub else None,
                                           "policy": store.policy_name})
    try:
        await server.wait()
    finally:
        if reg_task is not None:
            reg_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reg_task
        servicer.close()
        if pub is not None:
            pub.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    tune_malloc()
    parser = argparse.ArgumentParser(prog="kvmesh serve offload", description=__doc__)
    add_dataclass_args(parser, OffloadConfig)
    args = parser.parse_args(argv)
    setup_logging()

    async def run() -> int:
        cfg = load_config(OffloadConfig, args, env_prefix=ENV_PREFIX)
        return await serve(cfg)
    return run_async_main(run)


if __name__ == "__main__":
    raise SystemExit(main())
