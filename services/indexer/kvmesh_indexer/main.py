"""``kvmesh serve indexer``: the cluster-wide KV block index service.

Builds the configured backend (embedded memory by default, or Redis), wraps it
with metrics/tracing, subscribes to the statically configured engines and/or
binds the central socket engines connect to (``central_socket``), serves
the ``Indexer`` gRPC API and purges endpoints whose heartbeats stop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
from dataclasses import dataclass

import redis
from prometheus_client import REGISTRY, CollectorRegistry, Gauge

from kvmesh.config import ConfigError, add_dataclass_args, load_config
from kvmesh.events.curve import CurveClient, server_public_file
from kvmesh.index.base import BlockIndex
from kvmesh.index.memory import MemoryIndex
from kvmesh.logs import setup_logging
from kvmesh.rpc import tls
from kvmesh.rpc.runner import run_async_main
from kvmesh.rpc.server import ServerOptions, ServiceServer
from kvmesh.telemetry import setup_tracing, start_metrics_server
from kvmesh_api.indexer.v1 import indexer_pb2, indexer_pb2_grpc
from kvmesh_indexer.central_socket import CentralSocket
from kvmesh_indexer.config import IndexerConfig
from kvmesh_indexer.copy_ledger import CopyCountingIndex
from kvmesh_indexer.ingest import Ingestor
from kvmesh_indexer.keys import ModelSpec
from kvmesh_indexer.liveness import Liveness
from kvmesh_indexer.metrics import IndexMetrics, InstrumentedIndex, MetricsObserver, StateCollector
from kvmesh_indexer.pump import IngestPump
from kvmesh_indexer.servicer import IndexerServicer
from kvmesh_indexer.zmq_subscriber import ZmqSubscriber

log = logging.getLogger(__name__)
SERVICE_NAME = indexer_pb2.DESCRIPTOR.services_by_name["Indexer"].full_name


def build_index(cfg: IndexerConfig) -> BlockIndex:
    if cfg.backend == "redis-cluster":
        from kvmesh_indexer.redis_cluster_backend import RedisClusterIndex

        try:
            cindex = RedisClusterIndex(cfg.redis_url, namespace=cfg.redis_namespace, timeout_s=cfg.redis_timeout_s,
                                       anchor_depth=cfg.redis_anchor_depth)
            cindex.check_auth()
        except (ValueError, redis.RedisError, redis.exceptions.RedisClusterException) as exc:
            raise ConfigError(f"setting 'redis_url': {exc}") from None
        try:
            cindex.check_layout()
        except ValueError as exc:
            raise ConfigError(f"setting 'redis_namespace': {exc}") from None
        return cindex
    if cfg.backend == "redis":
        from kvmesh_indexer.redis_backend import RedisIndex

        try:
            index = RedisIndex(cfg.redis_url, namespace=cfg.redis_namespace, timeout_s=cfg.redis_timeout_s,
                               probe_stride=cfg.redis_probe_stride)
            index.check_auth()
        except ValueError as exc:
            raise ConfigError(f"setting 'redis_url': {exc}") from None
        try:
            index.check_layout()
        except ValueError as exc:
            raise ConfigError(f"setting 'redis_namespace': {exc}") from None
        return index
    return MemoryIndex(max_entries=cfg.max_entries)


@dataclass
class IndexerApp:
    """Everything one indexer process runs; tests build several in one process."""

    cfg: IndexerConfig
    servicer: IndexerServicer
    server: ServiceServer
    pump: IngestPump
    subscriber: ZmqSubscriber
    metrics: IndexMetrics
    central: CentralSocket | None = None
    _sweeper: asyncio.Task | None = None

    @property
    def port(self) -> int:
        return self.server.port

    async def start(self) -> int:
        port = await self.server.start()
        await self.pump.start()
        if self.central is not None:
            try:
                self.servicer.central_bound = await self.central.start()
            except ValueError as exc:
                await self.server.stop(0)
                await self.pump.close()
                raise ConfigError(f"setting 'kv_events_bind': {exc}") from None
        for eng in self.cfg.engine_configs(self.servicer.models):
            await self.servicer.add_static_engine(eng)
        if not await asyncio.to_thread(self.servicer.index.ping):
            log.warning("index backend not reachable at start; lookups answer UNAVAILABLE until it is",
                        extra={"backend": self.cfg.backend})
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="liveness-sweeper")
        await self.server.set_ready(True)
        log.info("indexer ready", extra={"port": port, "backend": self.cfg.backend,
                                         "models": sorted(self.servicer.models),
                                         "engines": len(self.subscriber.subs),
                                         "central": self.servicer.central_bound})
        return port

    async def _sweep_loop(self) -> None:
        interval = max(0.05, min(1.0, self.cfg.heartbeat_ttl_s / 4))
        while True:
            await asyncio.sleep(interval)
            try:
                await self.servicer.sweep_dead()
            except Exception:  # noqa: BLE001
                log.exception("liveness sweep failed")

    async def stop(self, grace_s: float | None = 0.5) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await self.server.stop(grace_s)
        if self.central is not None:
            await self.central.close()
        await self.subscriber.close()
        await self.pump.close()
        self.servicer.index.close()


def _curve_client(secret: str, servers_dir: str, endpoint_id: str) -> CurveClient | None:
    """CURVE settings for an endpoint whose publisher key is in ``servers_dir`` (else plaintext)."""
    server = server_public_file(servers_dir, endpoint_id)
    return CurveClient(secret, server) if server else None


def build_app(cfg: IndexerConfig, registry: CollectorRegistry | None = None) -> IndexerApp:
    """Wire backend, ingest, liveness and the gRPC server (not started)."""
    models = cfg.model_specs()
    if cfg.default_model and cfg.default_model not in models:
        # Token lookups for the default model work before any engine registers.
        models[cfg.default_model] = ModelSpec(cfg.default_model, cfg.default_block_size, cfg.default_hash_algo)
    registry = registry if registry is not None else CollectorRegistry()
    metrics = IndexMetrics(registry)
    backend = build_index(cfg)
    if not backend.counts_copies and cfg.gpu_copy_ledger_max_keys:
        backend = CopyCountingIndex(backend, max_keys=cfg.gpu_copy_ledger_max_keys)
    index = InstrumentedIndex(backend, metrics)
    ingestor = Ingestor(index, models, MetricsObserver(metrics), max_events_per_batch=cfg.max_batch_events,
                        max_seq_jump=cfg.max_seq_jump)
    pump = IngestPump(ingestor, replay_timeout_s=cfg.replay_timeout_s, queue_size=cfg.queue_size,
                      on_drop=lambda ep: metrics.dropped.labels(ep).inc(), queue_bytes=cfg.queue_bytes,
                      max_payload_bytes=cfg.max_message_bytes, tail_probe_s=cfg.tail_probe_s)
    if cfg.kv_events_curve_secret:
        pump.curve_for = functools.partial(_curve_client, cfg.kv_events_curve_secret, cfg.kv_events_curve_servers)
    subscriber = ZmqSubscriber(pump, max_message_bytes=cfg.max_message_bytes, buffer_bytes=cfg.socket_buffer_bytes)
    liveness = Liveness(cfg.heartbeat_ttl_s)
    servicer = IndexerServicer(cfg, index, ingestor, pump, subscriber, liveness)
    registry.register(StateCollector(index.stats, servicer.freshness))
    server = ServiceServer("indexer", [(indexer_pb2_grpc.add_IndexerServicer_to_server, servicer, SERVICE_NAME)],
                           ServerOptions(host=cfg.host, port=cfg.port, grace_s=cfg.grace_s, tls=cfg.tls))
    central = None
    if cfg.central_binds():
        central = CentralSocket(pump, cfg.central_binds(), servicer.admit_central, servicer.purge_central,
                                max_endpoints=cfg.kv_events_max_endpoints, idle_purge_s=cfg.kv_events_idle_purge_s,
                                dp_size=cfg.kv_events_dp_size, buffer_bytes=cfg.socket_buffer_bytes,
                                max_message_bytes=cfg.max_message_bytes)
        # How close the socket is to kv_events_max_endpoints (beyond it new pods are refused).
        Gauge("kvmesh_indexer_central_endpoints", "Endpoints admitted on the central KV-event socket",
              registry=registry).set_function(lambda: len(central.endpoints))
    return IndexerApp(cfg, servicer, server, pump, subscriber, metrics, central)


async def serve(cfg: IndexerConfig) -> int:
    setup_tracing("kvmesh-indexer")
    tls.set_default(cfg.tls)
    app = build_app(cfg, REGISTRY)
    await app.start()
    app.server.install_signal_handlers()
    start_metrics_server(cfg.metrics_port, host=cfg.host, auth=cfg.metrics_auth, tls=cfg.tls)
    try:
        await app.server.wait()
    finally:
        if app.central is not None:
            await app.central.close()
        await app.subscriber.close()
        await app.pump.close()
        app.servicer.index.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh serve indexer", description=__doc__)
    add_dataclass_args(parser, IndexerConfig)
    args = parser.parse_args(argv)
    setup_logging()

    async def run() -> int:
        cfg = load_config(IndexerConfig, args)
        return await serve(cfg)
    return run_async_main(run)


if __name__ == "__main__":
    raise SystemExit(main())
