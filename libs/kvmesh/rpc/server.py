"""A ``grpc.aio`` server with health, reflection, tracing and graceful drain.

Health serves two views: the overall service ``""`` and each registered
service name report readiness (NOT_SERVING until ``set_ready(True)``), and the
service ``"liveness"`` is SERVING for as long as the process runs. On SIGTERM
or SIGINT readiness drops first, so load balancers stop sending, then in-flight
calls get ``grace_s`` to finish.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.rpc.authz import Authorizer, AuthzInterceptor
from kvmesh.rpc.interceptors import server_interceptors
from kvmesh.rpc.keepalive import server_keepalive_options
from kvmesh.rpc.parse_guard import ParseGuardInterceptor
from kvmesh.rpc.tls import TlsConfig, resolve, server_credentials

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
LIVENESS_SERVICE = "liveness"


@dataclass
class ServerOptions:
    """Listening and limits of a service's gRPC server."""

    host: str = field(default="127.0.0.1", metadata={"help": "gRPC listen host (0.0.0.0 = every interface)"})
    port: int = field(default=0, metadata={"help": "gRPC listen port (0 = pick a free one)"})
    max_message_bytes: int = field(default=DEFAULT_MAX_MESSAGE_BYTES, metadata={"help": "max gRPC message size"})
    grace_s: float = field(default=10.0, metadata={"help": "drain time for in-flight calls on shutdown"})
    max_concurrent_rpcs: int = field(default=0, metadata={"help": "0 = unlimited"})
    # None = the process's identity (kvmesh.rpc.tls.set_default, from the service's --tls flags).
    tls: TlsConfig | None = None


# (add_XServicer_to_server, servicer instance, full service name)
ServiceBinding = tuple[Callable[[Any, grpc.aio.Server], None], Any, str]


class ServiceServer:
    """Owns one ``grpc.aio.Server`` and its health state."""

    def __init__(self, name: str, bindings: Iterable[ServiceBinding], options: ServerOptions | None = None,
                 interceptors: list[grpc.aio.ServerInterceptor] | None = None) -> None:
        self.name = name
        self.options = options or ServerOptions()
        self.bindings = list(bindings)
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None   # serving (after start)
        self._bound: grpc.aio.Server | None = None    # bound (after bind)
        # The parse guard comes first (outermost) on every server, whatever else is installed.
        extra = interceptors if interceptors is not None else server_interceptors()
        self._interceptors = [ParseGuardInterceptor(), *extra]
        self.port = 0
        self.tls_files = None   # kvmesh.rpc.tls.CertFiles when TLS is on
        self.authorizer: Authorizer | None = None
        self._health_server: grpc.aio.Server | None = None
        self._stopped = asyncio.Event()
        self.on_drain: list[Callable[[], Any]] = []

    @property
    def service_names(self) -> list[str]:
        return [b[2] for b in self.bindings]

    async def bind(self) -> int:
        """Create the server and bind its port, not serving yet; returns the bound port.

        With port 0 the kernel picks a free port at the bind itself, so a caller that needs
        its port before it can build its servicers (a worker's endpoint id names it) binds
        first, appends to ``bindings`` and then calls ``start``: no pick-then-bind race.
        """
        if self._bound is not None:
            return self.port
        opts = self.options
        grpc_opts = [
            ("grpc.max_send_message_length", opts.max_message_bytes),
            ("grpc.max_receive_message_length", opts.max_message_bytes),
            ("grpc.so_reuseport", 0),
            *server_keepalive_options(),
        ]
        tls = resolve(opts.tls)
        interceptors = list(self._interceptors)
        if tls.enabled():
            # Last, so requests that do not even parse are refused before identity is looked at.
            self.authorizer = Authorizer(trust_domain=tls.tls_trust_domain)
            interceptors.append(AuthzInterceptor(self.authorizer))
        server = grpc.aio.server(
            interceptors=interceptors,
            options=grpc_opts,
            maximum_concurrent_rpcs=opts.max_concurrent_rpcs or None,
        )
        if tls.enabled():
            creds, self.tls_files = server_credentials(tls)
            self.port = server.add_secure_port(f"{opts.host}:{opts.port}", creds)
        else:
            self.port = server.add_insecure_port(f"{opts.host}:{opts.port}")
        if self.port == 0:
            raise RuntimeError(f"{self.name}: cannot bind {opts.host}:{opts.port}")
        self._bound = server
        return self.port

    async def start(self) -> int:
        """Bind (unless ``bind`` did), add the services and serve; returns the bound port."""
        await self.bind()
        server = self._bound
        assert server is not None
        for add_fn, servicer, _ in self.bindings:
            add_fn(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, server)
        await server.start()
        self._server = server
        tls = resolve(self.options.tls)
        if tls.enabled() and tls.tls_health_port:
            await self._start_health_port(tls)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self.set_ready(False)
        log.info("grpc server started", extra={"service": self.name, "port": self.port})
        return self.port

    async def _start_health_port(self, tls: TlsConfig) -> None:
        """Health alone, in plaintext, for probes that cannot present a certificate."""
        hs = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, hs)
        if hs.add_insecure_port(f"{tls.tls_health_host}:{tls.tls_health_port}") == 0:
            raise RuntimeError(f"{self.name}: cannot bind health port {tls.tls_health_host}:{tls.tls_health_port}")
        await hs.start()
        self._health_server = hs

    async def set_ready(self, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for svc in ["", *self.service_names]:
            await self.health.set(svc, status)

    async def stop(self, grace_s: float | None = None) -> None:
        """Drop readiness, run drain hooks, then let in-flight calls finish within the grace."""
        if self._server is None:
            if self._bound is not None:   # bound, never started: release the port
                # (grpc closes the listener of a server that never started only at shutdown
                # after a start; it serves nothing meanwhile, no service was added)
                await self._bound.start()
                await self._bound.stop(0)
                self._bound = None
            return
        grace = self.options.grace_s if grace_s is None else grace_s
        await self.set_ready(False)
        for hook in self.on_drain:
            res = hook()
            if asyncio.iscoroutine(res):
                await res
        log.info("draining", extra={"service": self.name, "grace_s": grace})
        await self._server.stop(grace)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._health_server is not None:
            await self._health_server.stop(0)
            self._health_server = None
        self._server = None
        self._bound = None
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda s=sig: asyncio.ensure_future(self._on_signal(s)))

    async def _on_signal(self, sig: signal.Signals) -> None:
        log.info("signal received", extra={"service": self.name, "signal": sig.name})
        await self.stop()
