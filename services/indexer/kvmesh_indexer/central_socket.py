"""One bound ZMQ SUB socket that any number of engines connect to (llm-d's layout).

Why: with per-engine subscriptions (``zmq_subscriber``) every engine has to be
configured or registered. In llm-d's layout the indexer binds one socket and
each vLLM pod points ``--kv-events-config``'s ``endpoint`` at it
(``tcp://indexer:5557``: a tcp address without ``*`` makes vLLM *connect* its PUB
socket) with ``topic`` ``kv@<pod-ip>:<port>@<model>``. Pods then come and go
without touching the indexer; the topic names the endpoint and its model.

Per-engine replay still works: the replay address is derived from the topic's
endpoint by a template (``tcp://{host}:5558``), since vLLM binds its replay
ROUTER on the pod. Admission (model known, endpoint id valid, not owned by a
per-engine subscription) is the servicer's decision; this module caps how many
endpoints it admits, so a flood of made-up topics costs a counter, not memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvmesh.events.codec import DecodeError, decode_seq
from kvmesh.events.topic import parse_topic
from kvmesh_indexer.pump import EndpointSource, IngestPump

log = logging.getLogger(__name__)

# Label under which messages that name no admitted endpoint are counted: a hostile topic
# must not become a metric label (unbounded series).
UNADMITTED = "<central>"

_HOST = re.compile(r"^(?:[A-Za-z0-9_.\-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\])$")
_SAFE_ID = re.compile(r"^[A-Za-z0-9_.\-:\[\]]{1,128}$")
_TEMPLATE_FIELDS = ("endpoint", "host", "port")


class AdmitError(ValueError):
    """The topic's endpoint is not admitted; ``reason`` is the metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def split_host_port(endpoint: str) -> tuple[str, str]:
    """``10.0.0.5:8000`` -> (``10.0.0.5``, ``8000``); ``[::1]:8000`` -> (``[::1]``, ``8000``); no port -> ''."""
    host, sep, port = endpoint.rpartition(":")
    if sep and port.isdigit() and host and (not host.startswith("[") or host.endswith("]")) and (
            host.startswith("[") or ":" not in host):
        return host, port
    return endpoint, ""


def check_replay_template(template: str) -> None:
    """ValueError unless ``template`` formats with the known fields into a ZMQ address."""
    try:
        out = template.format(endpoint="e", host="h", port="1")
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"replay template {template!r}: fields are {{{'}, {'.join(_TEMPLATE_FIELDS)}}} ({exc})") from None
    if not out.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"replay template {template!r} must start with tcp://, ipc:// or inproc://")


def replay_address(template: str, endpoint: str) -> str:
    """The engine's replay ROUTER address; ValueError when the endpoint id cannot fill the template."""
    host, port = split_host_port(endpoint)
    if "{host}" in template and not _HOST.match(host):
        # The host lands in an address the indexer connects to: only a plain host name or IP literal.
        raise ValueError(f"endpoint {endpoint!r}: host part {host!r} is not a host name or IP literal")
    if "{port}" in template and not port:
        raise ValueError(f"endpoint {endpoint!r} has no :port for the replay template")
    if "{endpoint}" in template and not _SAFE_ID.match(endpoint):
        raise ValueError(f"endpoint {endpoint!r} cannot be placed in a replay address")
    return template.format(endpoint=endpoint, host=host, port=port)


@dataclass
class CentralEndpoint:
    endpoint: str
    model: str
    first_seen: float
    last_message: float
    messages: int = 0


Admit = Callable[[str, str], Awaitable[EndpointSource]]
Purge = Callable[[str, str], Awaitable[int]]


class CentralSocket:
    """The bound SUB socket(s) and the endpoints named by the topics seen on them."""

    def __init__(self, pump: IngestPump, binds: list[str], admit: Admit, purge: Purge, max_endpoints: int = 1024,
                 idle_purge_s: float = 0.0, context: zmq.asyncio.Context | None = None, rcvhwm: int = 100_000,
                 now: Callable[[], float] = time.monotonic, max_message_bytes: int = 8 * 1024 * 1024) -> None:
        self.max_message_bytes = max_message_bytes
        self.pump = pump
        self.binds = list(binds)
        self.admit = admit
        self.purge = purge
        self.max_endpoints = max_endpoints
        self.idle_purge_s = idle_purge_s
        self.ctx = context or zmq.asyncio.Context.instance()
        self.rcvhwm = rcvhwm
        self.now = now
        self.bound: list[str] = []
        self.endpoints: dict[str, CentralEndpoint] = {}
        self._by_topic: dict[bytes, CentralEndpoint] = {}
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._warned: set[str] = set()
        self.rejected = 0

    async def start(self) -> list[str]:
        """Bind every address; returns the bound ones (a ``:0`` port resolved)."""
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)   # bigger: the peer is disconnected
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            for addr in self.binds:
                sock.bind(addr)
                self.bound.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ValueError(f"cannot bind the central KV-event socket {addr!r}: {exc}") from exc
        self._sock = sock
        self._tasks.append(asyncio.create_task(self._recv_loop(sock), name="zmq-central"))
        if self.idle_purge_s > 0:
            self._tasks.append(asyncio.create_task(self._idle_loop(), name="zmq-central-idle"))
        log.info("central kv-event socket bound", extra={"bound": self.bound, "max_endpoints": self.max_endpoints})
        return self.bound

    def _reject(self, reason: str, message: str) -> None:
        self.rejected += 1
        self.pump.ingestor.observer.on_rejected(UNADMITTED, reason, 1)
        if reason not in self._warned:  # once per reason: a flood must not flood the log too
            self._warned.add(reason)
            log.warning("central kv-event message rejected", extra={"reason": reason, "error": message})

    async def _resolve(self, topic: bytes) -> CentralEndpoint | None:
        try:
            endpoint, model = parse_topic(topic)
        except ValueError as exc:
            self._reject("bad_topic", str(exc))
            return None
        known = self.endpoints.get(endpoint)
        if known is not None:
            if known.model != model:
                self._reject("model_mismatch", f"endpoint {endpoint!r} publishes model {model!r}, "
                                               f"first seen with {known.model!r}")
                return None
            self._by_topic[topic] = known
            return known
        if len(self.endpoints) >= self.max_endpoints:
            self._reject("endpoint_cap", f"{len(self.endpoints)} endpoints already (kv_events_max_endpoints); "
                                         f"{endpoint!r} not admitted")
            return None
        try:
            await self.admit(endpoint, model)
        except AdmitError as exc:
            self._reject(exc.reason, str(exc))
            return None
        except Exception as exc:  # noqa: BLE001 - one bad topic never stops the socket
            log.exception("central endpoint admission failed", extra={"endpoint": endpoint})
            self._reject("admit_error", str(exc))
            return None
        t = self.now()
        ce = self.endpoints[endpoint] = CentralEndpoint(endpoint, model, t, t)
        self._by_topic[topic] = ce
        log.info("central endpoint admitted", extra={"endpoint": endpoint, "model": model})
        return ce

    async def _recv_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await sock.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                log.warning("central kv-event socket error", extra={"error": str(exc)})
                await asyncio.sleep(0.1)
                continue
            if len(frames) != 3:
                self._reject("malformed_frames", f"{len(frames)} frames (want topic, seq, payload)")
                continue
            topic, seq_b, payload = frames
            ce = self._by_topic.get(topic)
            if ce is None:
                ce = await self._resolve(topic)
                if ce is None:
                    continue
            try:
                seq = decode_seq(seq_b)
            except DecodeError as exc:
                self.pump.ingestor.observer.on_rejected(ce.endpoint, "malformed_frames", 1)
                log.warning("malformed kv-event sequence", extra={"endpoint": ce.endpoint, "error": str(exc)})
                continue
            ce.messages += 1
            ce.last_message = self.now()
            self.pump.submit_nowait(ce.endpoint, seq, payload=payload, model=ce.model)

    async def _idle_loop(self) -> None:
        interval = max(0.05, min(5.0, self.idle_purge_s / 4))
        while True:
            await asyncio.sleep(interval)
            cutoff = self.now() - self.idle_purge_s
            for ce in [c for c in self.endpoints.values() if c.last_message < cutoff]:
                try:
                    await self.forget(ce.endpoint, "idle")
                except Exception:  # noqa: BLE001 - backend down: retried on the next round
                    log.warning("idle endpoint purge failed", extra={"endpoint": ce.endpoint}, exc_info=True)

    async def forget(self, endpoint: str, reason: str) -> int:
        """Purge an endpoint's entries; a later message from it admits it afresh."""
        ce = self.endpoints.get(endpoint)
        if ce is None:
            return 0
        blocks = await self.purge(endpoint, reason)
        self.endpoints.pop(endpoint, None)
        for topic in [t for t, c in self._by_topic.items() if c is ce]:
            del self._by_topic[topic]
        return blocks

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
