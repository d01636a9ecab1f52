"""``run_worker(role, argv)``: the whole life of a prefill or decode worker process.

Why it exists: both worker services are the same program with a different
role; this is that program. It parses ``WorkerConfig`` (flags > env
``KVMESH_WORKER_*`` > defaults), builds the engine its ``--engine`` names
(``kvmesh.worker.engine.registry``; ``vllm`` is imported only when asked for),
starts the gRPC server (NOT_SERVING until the engine is up), Prometheus metrics,
the optional OpenAI HTTP API, and the indexer registration with heartbeats. It
watches the engine and drops readiness if it dies, and drains gracefully on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvmesh.config import ConfigError, add_dataclass_args, load_config
from kvmesh.native_memory import limit_arenas, trim_every
from kvmesh.registration import IndexerRegistration, advertised_zmq_endpoint, kv_events_fields
from kvmesh.rpc import tls
from kvmesh.rpc.ports import free_port
from kvmesh.rpc.runner import run_async_main
from kvmesh.rpc.server import ServerOptions, ServiceServer
from kvmesh.worker.config import WorkerConfig
from kvmesh.worker.engine.base import Engine
from kvmesh.worker.engine.registry import ENGINES
from kvmesh.worker.metrics import WorkerMetrics
from kvmesh.worker.servicer import HASH_ALGO, ROLE, WorkerServicer
from kvmesh_api.indexer.v1 import indexer_pb2
from kvmesh_api.worker.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


def _pin_port(endpoint: str) -> str:
    """``tcp://*:0`` -> a concrete free port, so the address can be advertised before binding."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return endpoint[:-1] + str(free_port())
    return endpoint


def engine_class(cfg: WorkerConfig) -> type[Engine]:
    """The backend ``cfg.engine`` names (``kvmesh.worker.engine.registry``), imported now."""
    try:
        return ENGINES.load(cfg.engine)
    except ImportError as exc:
        raise ConfigError(f"setting 'engine': {cfg.engine} backend unavailable ({exc})") from exc


def build_engine(cfg: WorkerConfig, endpoint_id: str) -> Engine:
    """The engine for ``cfg.engine``; a backend's module is imported only when selected."""
    return engine_class(cfg).from_worker_config(cfg, endpoint_id)


@dataclass
class Worker:
    """A running worker (returned by ``start_worker``; tests drive it in-process)."""

    cfg: WorkerConfig
    engine: Engine
    server: ServiceServer
    servicer: WorkerServicer
    metrics: WorkerMetrics
    endpoint_id: str
    port: int
    http: Any = None
    registration: IndexerRegistration | None = None
    _watch: asyncio.Task | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def mark_dead(self) -> None:
        await self.server.set_ready(False)

    async def stop(self, grace_s: float | None = None) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self.registration is not None:
            await self.registration.stop()
        await self.server.stop(grace_s)
        if self.http is not None:
            await self.http.stop()
        await self.engine.stop()


async def _watch_engine(worker: Worker, period_s: float = 0.2) -> None:
    while True:
        await asyncio.sleep(period_s)
        if not worker.engine.healthy:
            log.error("engine is down; readiness NOT_SERVING", extra={"endpoint_id": worker.endpoint_id})
            await worker.server.set_ready(False)
            if worker.registration is not None:
                await worker.registration.stop(leave=True)
                worker.registration = None
            return


async def start_worker(cfg: WorkerConfig, on_listening: Callable[[int], None] | None = None) -> Worker:
    """Start engine, gRPC server, metrics, HTTP API and registration; ready when this returns.

    ``on_listening(port)`` is called once the gRPC server serves liveness on its bound port,
    before the engine has started (readiness follows it).
    """
    role = cfg.role or "both"
    if not cfg.kv_events_endpoint:
        cfg.kv_events_replay_endpoint = ""
    elif not engine_class(cfg).reports_event_ports:
        # vLLM's publisher cannot report a port it picked, so choose them up front. The sim's
        # publisher binds port 0 itself and reports the real port (no pick-then-bind race).
        cfg.kv_events_endpoint = _pin_port(cfg.kv_events_endpoint)
        cfg.kv_events_replay_endpoint = _pin_port(cfg.kv_events_replay_endpoint)
    # Bind first (port 0: the kernel picks at the bind, no pick-then-bind race); the endpoint
    # id and every advertised address name the port actually bound.
    server = ServiceServer(f"{role}-worker", [], ServerOptions(host=cfg.host, port=cfg.port, grace_s=cfg.grace_s,
                                                               tls=cfg.tls))
    port = await server.bind()
    try:
        endpoint_id = cfg.resolve_endpoint_id(port)
        engine = build_engine(cfg, endpoint_id)
        metrics = WorkerMetrics(engine, cfg.model_name, role, endpoint_id)
        servicer = WorkerServicer(engine, role=role, endpoint_id=endpoint_id, model_name=cfg.model_name,
                                  default_max_tokens=cfg.default_max_tokens, metrics=metrics)
    except BaseException:
        await server.stop(0)   # release the bound port
        raise
    server.bindings.append((worker_pb2_grpc.add_WorkerServicer_to_server, servicer, SERVICE_NAME))
    worker = Worker(cfg=cfg, engine=engine, server=server, servicer=servicer, metrics=metrics,
                    endpoint_id=endpoint_id, port=port)
    servicer.on_engine_dead = worker.mark_dead
    # The server is up (liveness) before the engine; readiness waits for the engine.
    worker.port = await server.start()
    if on_listening is not None:
        on_listening(worker.port)
    try:
        await engine.start()
    except Exception:
        await server.stop(0)
        raise
    info = engine.info()
    opened_events = info.kv_events_endpoint or cfg.kv_events_endpoint
    opened_replay = info.kv_events_replay_endpoint or cfg.kv_events_replay_endpoint
    servicer.kv_events_endpoint = advertised_zmq_endpoint(opened_events, cfg.advertise_host)
    servicer.kv_events_replay_endpoint = advertised_zmq_endpoint(opened_replay, cfg.advertise_host)
    metrics.serve(cfg.metrics_port, host=cfg.host, auth=cfg.metrics_auth, tls=cfg.tls)
    if cfg.http_port >= 0:
        worker.http = await _start_http(cfg, engine, endpoint_id, metrics)
        if worker.http is not None:
            servicer.http_address = f"{cfg.advertise_host}:{worker.http.port}"
    await server.set_ready(True)
    if cfg.indexer_address:
        ep = indexer_pb2.Endpoint(
            endpoint_id=endpoint_id, model=cfg.model_name, role=ROLE.get(role, 0),
            grpc_address=f"{cfg.advertise_host}:{worker.port}", http_address=servicer.http_address,
            **kv_events_fields(cfg.kv_events_endpoint, cfg.advertise_host, replay_endpoint=opened_replay,
                               opened_endpoint=opened_events),
            block_size=info.block_size, hash_algo=HASH_ALGO.get(info.hash_algo, 0),
            hash_seed_matches=info.hash_seed_matches, labels={"engine": info.engine, **cfg.labels},
        )
        worker.registration = IndexerRegistration(cfg.indexer_address, ep, cfg.heartbeat_s, cfg.registration_ttl_s)
        await worker.registration.start()
    worker._watch = asyncio.create_task(_watch_engine(worker))
    log.info("worker ready", extra={"role": role, "endpoint_id": endpoint_id, "port": worker.port,
                                    "engine": cfg.engine, "model": cfg.model_name,
                                    "kv_events": servicer.kv_events_endpoint})
    return worker


async def _start_http(cfg: WorkerConfig, engine: Engine, endpoint_id: str, metrics: WorkerMetrics) -> Any:
    try:
        from kvmesh.worker import http_api
    except ImportError:
        log.warning("http_port set but kvmesh.worker.http_api is not available")
        return None
    from kvmesh.http_tls import http_tls_enabled, roles_list

    https = http_tls_enabled(cfg.http_tls, cfg.tls)
    if https and not cfg.tls.enabled():
        raise ConfigError("--http-tls on needs the worker's certificate (--tls-cert, --tls-key, --tls-ca)")
    if not https:
        log.warning("the worker's OpenAI HTTP API is plaintext and open to anyone who reaches it "
                    "(--tls on, or --http-tls on, to require a client certificate)")
    return await http_api.start_http_api(engine, host=cfg.host, port=cfg.http_port, model=cfg.model_name,
                                         tokenizer=cfg.tokenizer or None, endpoint_id=endpoint_id,
                                         default_max_tokens=cfg.default_max_tokens, metrics=metrics,
                                         tls=cfg.tls if https else None,
                                         client_roles=roles_list(cfg.http_client_roles))


def parse_config(role: str, argv: list[str] | None) -> WorkerConfig:
    parser = argparse.ArgumentParser(prog=f"kvmesh serve {role}",
                                     description=f"kvmesh {role} worker (env prefix {WorkerConfig.ENV_PREFIX})")
    add_dataclass_args(parser, WorkerConfig)
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default: INFO; env KVMESH_LOG_LEVEL)")
    args = parser.parse_args(argv)
    cfg = load_config(WorkerConfig, args)
    if not cfg.role:
        cfg.role = role
    cfg.validate()
    args_level = getattr(args, "log_level", None)
    if args_level:
        logging.getLogger().setLevel(args_level.upper())
    return cfg


def run_worker(role: str, argv: list[str] | None = None) -> int:
    """Entry point of the prefill and decode services."""
    from kvmesh.logs import setup_logging
    from kvmesh.telemetry import setup_tracing

    setup_logging()

    async def amain() -> int:
        cfg = parse_config(role, argv)
        setup_tracing(f"kvmesh-{role}")
        tls.set_default(cfg.tls, export=True)   # the vLLM engine core runs the offload connector
        # Before the engine's and gRPC's threads exist: arenas are made as threads first allocate.
        limit_arenas(cfg.malloc_arena_max)
        worker = await start_worker(cfg)
        trim = asyncio.create_task(trim_every(cfg.malloc_trim_s)) if cfg.malloc_trim_s > 0 else None
        worker.server.install_signal_handlers()
        if worker.registration is not None:
            # Leave the index first so no new traffic is routed here while in-flight calls drain.
            worker.server.on_drain.append(worker.registration.stop)
        await worker.server.wait()
        if trim is not None:
            trim.cancel()
        await worker.stop(0)
        return 0

    return run_async_main(amain)
