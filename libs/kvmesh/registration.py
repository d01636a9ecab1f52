"""Self-registration of a KV-event source with the indexer, kept alive by heartbeats.

Why it exists: the indexer must know each KV-event publisher (workers' engines
and the offload store alike) and its replay socket to subscribe to it, and must
notice when the source goes away so its blocks stop attracting traffic. Both
the worker services and the offload service register through this one module,
so they advertise endpoints and decide who binds the ZMQ pair the same way.
A source registers on start, heartbeats every ``heartbeat_s`` (re-registering
if the indexer forgot it, e.g. after an indexer restart) and may leave on
shutdown with a last heartbeat marked ``leaving`` (the indexer expires it at once;
deregistering is an admin's call, issue #20). An unreachable indexer is logged and retried; it never stops the
source from serving.
"""

from __future__ import annotations

import asyncio
import logging
import re

import grpc

from kvmesh.rpc.channel import aio_channel
from kvmesh_api.indexer.v1 import indexer_pb2, indexer_pb2_grpc

log = logging.getLogger(__name__)

_WILDCARD = re.compile(r"^(tcp://)(\*|0\.0\.0\.0|\[::\]|::)(:\d+)$")


def advertised_zmq_endpoint(endpoint: str, advertise_host: str) -> str:
    """``tcp://*:5557`` / ``tcp://0.0.0.0:5557`` -> ``tcp://<advertise_host>:5557``; others unchanged."""
    m = _WILDCARD.match(endpoint or "")
    if m:
        return f"{m.group(1)}{advertise_host}{m.group(3)}"
    return endpoint


def publisher_binds(endpoint: str) -> bool:
    """vLLM's rule: the PUB socket binds for ``*``/``::``/ipc/inproc, otherwise it connects
    (and then the indexer's subscriber must bind)."""
    from kvmesh.events.publisher import is_bind_endpoint

    return is_bind_endpoint(endpoint)


def kv_events_fields(endpoint: str, advertise_host: str, *, replay_endpoint: str = "",
                     opened_endpoint: str | None = None) -> dict[str, object]:
    """The ``indexer_pb2.Endpoint`` KV-event fields for a publisher configured with ``endpoint``.

    ``opened_endpoint`` is what the publisher actually opened when it differs
    (``tcp://*:0`` resolves to ``tcp://0.0.0.0:<port>``); who binds is decided
    from the configured form, because the resolved one no longer carries the ``*``.
    """
    return {
        "kv_events_endpoint": advertised_zmq_endpoint(opened_endpoint or endpoint, advertise_host),
        "kv_events_replay_endpoint": advertised_zmq_endpoint(replay_endpoint, advertise_host),
        "subscriber_binds": bool(endpoint) and not publisher_binds(endpoint),
    }


class IndexerRegistration:
    """Registers ``endpoint`` with the indexer at ``address`` and heartbeats until stopped.

    While unregistered it retries every ``retry_s`` (default: ``heartbeat_s``).
    """

    def __init__(self, address: str, endpoint: indexer_pb2.Endpoint, heartbeat_s: float = 2.0,
                 ttl_s: float = 10.0, retry_s: float | None = None) -> None:
        self.address = address
        self.endpoint = endpoint
        self.heartbeat_s = heartbeat_s
        self.ttl_s = ttl_s
        self.retry_s = heartbeat_s if retry_s is None else retry_s
        self._channel = aio_channel(address)
        self._stub = indexer_pb2_grpc.IndexerStub(self._channel)
        self._task: asyncio.Task | None = None
        self._closed = False
        self.registered = False

    async def register(self) -> bool:
        try:
            await self._stub.RegisterEndpoint(
                indexer_pb2.RegisterEndpointRequest(endpoint=self.endpoint, ttl_s=self.ttl_s), timeout=5)
        except grpc.aio.AioRpcError as exc:
            log.warning("indexer registration failed; will retry",
                        extra={"indexer": self.address, "code": exc.code().name, "details": exc.details()})
            self.registered = False
            return False
        if not self.registered:
            log.info("registered with indexer", extra={"indexer": self.address,
                                                       "endpoint_id": self.endpoint.endpoint_id})
        self.registered = True
        return True

    async def _loop(self) -> None:
        while True:
            if not self.registered:
                await self.register()
            else:
                try:
                    await self._stub.Heartbeat(indexer_pb2.HeartbeatRequest(endpoint_id=self.endpoint.endpoint_id),
                                               timeout=5)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.NOT_FOUND:
                        # The indexer forgot us (restart or TTL expiry): register again now.
                        self.registered = False
                        await self.register()
                    else:
                        log.warning("indexer heartbeat failed", extra={"indexer": self.address,
                                                                       "code": exc.code().name})
            await asyncio.sleep(self.heartbeat_s if self.registered else self.retry_s)

    async def start(self) -> None:
        await self.register()
        self._task = asyncio.create_task(self._loop(), name="indexer-heartbeat")

    async def stop(self, leave: bool = True) -> None:
        """Stop heartbeating, leave (a last heartbeat marked ``leaving``: the index expires us now
        and drops our blocks) and close. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if leave and self.registered:
            try:
                await self._stub.Heartbeat(
                    indexer_pb2.HeartbeatRequest(endpoint_id=self.endpoint.endpoint_id, leaving=True), timeout=2)
            except grpc.aio.AioRpcError as exc:
                log.info("leaving the indexer failed (the TTL will expire us)", extra={"code": exc.code().name})
            self.registered = False
        await self._channel.close()
