"""``kvmesh serve router``: gRPC ``Router`` + OpenAI HTTP (+ optional ext_proc picker) in one event loop."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
from typing import Any

import uvicorn

from kvmesh.config import ConfigError, add_dataclass_args, load_config
from kvmesh.hashing import BlockHasher
from kvmesh.http_tls import ServerSsl, http_tls_enabled, peer_aware
from kvmesh.responses_api.store.registry import open_store
from kvmesh.routing.hash_cache import HashCacheConfig
from kvmesh.routing.pd_split import SplitConfig
from kvmesh.routing.router import RouterCore, RouterCoreConfig
from kvmesh.rpc import tls
from kvmesh.rpc.interceptors import server_interceptors
from kvmesh.rpc.runner import run_async_main
from kvmesh.rpc.server import ServerOptions, ServiceServer
from kvmesh.telemetry import setup_tracing, start_metrics_server
from kvmesh_api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh_router.cluster import Cluster
from kvmesh_router.config import RouterConfig
from kvmesh_router.grpc_api import AuthInterceptor, RouterServicer
from kvmesh_router.http_api import build_app
from kvmesh_router.http_guard import guarded_protocol
from kvmesh_router.request_scope import scopes_from_config
from kvmesh_router.service import RouterService

log = logging.getLogger(__name__)


def core_config(cfg: RouterConfig) -> RouterCoreConfig:
    # offload_enabled "auto" with an indexer starts without a store; Cluster.refresh_registry turns it
    # on once the indexer lists a live one (its first poll runs at start-up). Without an indexer no
    # store can be seen, and one is assumed: the workers' --offload-address still carries a P/D
    # split's KV and sibling restores (the pending entries the cost credits).
    return RouterCoreConfig(
        policy=cfg.policy, block_size=cfg.block_size, hash_algo=cfg.hash_algo, hash_seed=cfg.hash_seed or None,
        load_staleness_s=cfg.load_staleness_s, speculative_ttl_s=cfg.speculative_ttl_s,
        approx_capacity_blocks=cfg.approx_capacity_blocks, offload_enabled=cfg.offload_enabled == "true" or (cfg.offload_enabled == "auto" and not cfg.indexer),
        scoring=cfg.scoring,
        split=SplitConfig(enabled=cfg.split_enabled, threshold_tokens=cfg.split_threshold_tokens,
                          survival_floor=cfg.split_survival_floor, survival_decay=cfg.split_survival_decay,
                          read_index=cfg.split_read_index),
        hash_cache=HashCacheConfig(verify=cfg.hash_cache_verify, max_blocks=cfg.hash_cache_max_blocks,
                                   max_bytes=cfg.hash_cache_max_bytes))


def build_service(cfg: RouterConfig) -> RouterService:
    tokenizer = None
    if cfg.tokenizer_path:
        from kvmesh.tokenization import load_tokenizer

        tokenizer = load_tokenizer(cfg.tokenizer_path)
        if tokenizer.chat_template:
            _ = tokenizer.renderer   # load transformers now, not inside the first chat request
    ccfg = core_config(cfg)
    core = RouterCore(ccfg, BlockHasher(ccfg.hash_algo, ccfg.block_size, ccfg.hash_seed))
    return RouterService(cfg, core, Cluster(cfg, core), tokenizer)


async def serve(cfg: RouterConfig) -> int:
    setup_tracing("kvmesh-router")
    tls.set_default(cfg.tls)
    start_metrics_server(cfg.metrics_port, host=cfg.host, auth=cfg.metrics_auth, tls=cfg.tls)
    service = build_service(cfg)
    scopes = scopes_from_config(cfg)   # one request scope for the gRPC and HTTP front doors
    # One store for the HTTP front door and the gateway's picker: a turn may come either way.
    store = open_store(cfg.responses_store, cfg.responses_store_ttl_s, cfg.responses_store_max_bytes,
                       cfg.responses_store_tenant_max_bytes)
    server = ServiceServer("router", [(router_pb2_grpc.add_RouterServicer_to_server, RouterServicer(service, scopes),
                                       router_pb2.DESCRIPTOR.services_by_name["Router"].full_name)],
                           ServerOptions(host=cfg.host, port=cfg.port, grace_s=cfg.grace_s, tls=cfg.tls),
                           interceptors=[*server_interceptors(), AuthInterceptor(scopes)])
    await server.start()
    server.install_signal_handlers()
    if service.cluster.indexer is not None:
        try:
            await service.cluster.refresh_registry()
        except Exception as exc:  # noqa: BLE001 - the indexer may come up later
            log.warning("indexer registry not reachable at start", extra={"error": str(exc)})
    await service.cluster.poll_all()
    service.cluster.start()
    http_server = None
    http_task = None
    if cfg.http_port:
        protocol = guarded_protocol(cfg.http_max_connections, cfg.http_header_timeout_s, cfg.http_max_header_bytes,
                                    cfg.http_keepalive_s)
        https: dict[str, Any] = {}
        if http_tls_enabled(cfg.http_tls, cfg.tls):
            if not cfg.tls.enabled():
                raise ConfigError("--http-tls on needs the router's certificate (--tls-cert, --tls-key, --tls-ca)")
            ssl_ctx = ServerSsl(cfg.tls).ctx   # client certificates optional: they name trusted gateways
            protocol = peer_aware(protocol)
            https = {"ssl_context_factory": lambda _cfg, _default: ssl_ctx}
        elif scopes.gateways:
            log.warning("--trusted-gateways is set but the HTTP front door is plaintext (--http-tls on): "
                        "gateways are recognised on gRPC only")
        ucfg = uvicorn.Config(build_app(service, scopes, store), host=cfg.host, port=cfg.http_port, log_level="warning",
                              lifespan="off", access_log=False, http=protocol,
                              timeout_keep_alive=cfg.http_keepalive_s, **https)
        http_server = uvicorn.Server(ucfg)
        http_server.install_signal_handlers = lambda: None  # the gRPC server owns SIGTERM
        http_task = asyncio.create_task(http_server.serve())
        while not http_server.started and not http_task.done():
            await asyncio.sleep(0.02)
        if http_task.done():
            http_task.result()
    extproc_server = None
    if cfg.extproc_port:
        if importlib.util.find_spec("kvmesh_router.extproc") is None:
            log.error("--extproc-port given but kvmesh_router.extproc is not installed")
        else:
            from kvmesh_router import extproc
            from kvmesh_router.gateway_pick import gateway_pick_fn

            extproc_server = await extproc.start_extproc_server(gateway_pick_fn(service, scopes, store),
                                                                cfg.extproc_port, cfg.host, tls=cfg.tls)

    async def drain() -> None:
        if http_server is not None:
            http_server.should_exit = True
        if extproc_server is not None:
            await extproc_server.stop(1.0)

    server.on_drain.append(drain)
    await server.set_ready(True)
    log.info("router ready", extra={"grpc_port": server.port, "http_port": cfg.http_port, "policy": cfg.policy,
                                    "endpoints": len(service.core.endpoints), "auth": cfg.auth})
    if cfg.auth == "off":
        log.warning("AUTH IS OFF: this router serves anyone who can reach it, as any tenant they claim "
                    "(--auth keys --api-keys-file FILE to require API keys)")
    await server.wait()
    if http_task is not None:
        await http_task
    await service.cluster.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh serve router", description=__doc__)
    add_dataclass_args(parser, RouterConfig)
    args = parser.parse_args(argv)

    async def run() -> int:
        cfg = load_config(RouterConfig, args)
        return await serve(cfg)

    return run_async_main(run)
