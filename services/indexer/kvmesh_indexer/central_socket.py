"""One bound ZMQ SUB socket that any number of engines connect to (llm-d's layout).

Why: with per-engine subscriptions (``zmq_subscriber``) every engine has to be
configured or registered. In llm-d's layout the indexer binds one socket and
each vLLM pod points ``--kv-events-config``'s ``endpoint`` at it
(``tcp://indexer:5557``: a tcp address without ``*`` makes vLLM *connect* its PUB
socket) with ``topic`` ``kv@<pod-ip>:<port>@<model>``. Pods then come and go
without touching the indexer; the topic names the endpoint and its model.

Per-engine replay still works: the replay address is derived from the topic's
endpoint by a template (``tcp://{host}:5558``), since vLLM binds its replay
ROUTER on the pod.

Data-parallel engines (``--data-parallel-size N``): every DP rank of a vLLM
publishes the same topic, each with its own sequence numbers, from its own PUB
socket whose address vLLM offsets by the rank (``tcp`` port + rank, for the
connect address and the replay address alike). With ``dp_size`` N the indexer
binds each central address at ports P..P+N-1, so the socket a message came in on
names its rank: rank 0 keeps the topic's endpoint id, rank r > 0 is the endpoint
``<id>_dp<r>`` (vLLM's own suffix for per-rank endpoints), replayed from the
template's address offset by r. Admission (model known, endpoint id valid, not owned by a
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
from kvmesh.events.publisher import offset_endpoint_port
from kvmesh.events.topic import dp_endpoint, parse_topic
from kvmesh_indexer.pump import EndpointSource, IngestPump
from kvmesh_indexer.zmq_subscriber import rcvhwm_for

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


def dp_binds(binds: list[str], dp_size: int) -> list[tuple[str, int]]:
    """(address, rank) for every central address and DP rank; ValueError when a rank has no port."""
    out = []
    for addr in binds:
        for rank in range(dp_size):
            a = offset_endpoint_port(addr, rank) or addr
            if rank and a == addr:
                raise ValueError(f"{addr!r} needs a fixed port for {dp_size} data-parallel ranks "
                                 "(vLLM connects rank r to the port + r)")
            out.append((a, rank))
    return out


def replay_address(template: str, endpoint: str, rank: int = 0) -> str:
    """The engine's replay ROUTER address; ValueError when the endpoint id cannot fill the template."""
    host, port = split_host_port(endpoint)
    if "{host}" in template and not _HOST.match(host):
        # The host lands in an address the indexer connects to: only a plain host name or IP literal.
        raise ValueError(f"endpoint {endpoint!r}: host part {host!r} is not a host name or IP literal")
    if "{port}" in template and not port:
        raise ValueError(f"endpoint {endpoint!r} has no :port for the replay template")
    if "{endpoint}" in template and not _SAFE_ID.match(endpoint):
        raise ValueError(f"endpoint {endpoint!r} cannot be placed in a replay address")
    addr = template.format(endpoint=endpoint, host=host, port=port)
    # vLLM binds rank r's replay ROUTER at its replay address offset by r (ipc cannot be offset).
    return offset_endpoint_port(addr, rank) or addr


@dataclass
class CentralEndpoint:
    endpoint: str
    model: str
    first_seen: float
    last_message: float
    messages: int = 0


# (endpoint id, model, the topic's endpoint, DP rank) -> the admitted source
Admit = Callable[[str, str, str, int], Awaitable[EndpointSource]]
Purge = Callable[[str, str], Awaitable[int]]


class CentralSocket:
    """The bound SUB socket(s) and the endpoints named by the topics seen on them."""

    def __init__(self, pump: IngestPump, binds: list[str], admit: Admit, purge: Purge, max_endpoints: int = 1024,
                 idle_purge_s: float = 0.0, context: zmq.asyncio.Context | None = None,
                 now: Callable[[], float] = time.monotonic, max_message_bytes: int = 8 * 1024 * 1024,
                 dp_size: int = 1, buffer_bytes: int = 32 * 1024 * 1024) -> None:
        self.max_message_bytes = max_message_bytes
        self.dp_size = dp_size
        self.pump = pump
        self.binds = list(binds)
        self.admit = admit
        self.purge = purge
        self.max_endpoints = max_endpoints
        self.idle_purge_s = idle_purge_s
        self.ctx = context or zmq.asyncio.Context.instance()
        # Per publisher connection: ZMQ keeps one pipe per connected peer (zmq_subscriber.rcvhwm_for).
        self.rcvhwm = rcvhwm_for(buffer_bytes, max_message_bytes)
        self.now = now
        self.bound: list[str] = []
        self.endpoints: dict[str, CentralEndpoint] = {}
        self._by_topic: dict[tuple[int, bytes], CentralEndpoint] = {}
        self._socks: list[zmq.asyncio.Socket] = []
        self._tasks: list[asyncio.Task] = []
        self._warned: set[str] = set()
        self.rejected = 0

    async def start(self) -> list[str]:
        """Bind every address (and its DP ranks' ports); returns the bound ones (a ``:0`` port resolved)."""
        try:
            addrs = dp_binds(self.binds, self.dp_size)
        except ValueError as exc:
            raise ValueError(f"cannot bind the central KV-event socket: {exc}") from None
        # One socket per DP rank: the socket a message arrives on tells its rank.
        for addr, rank in addrs:
            if rank >= len(self._socks):
                sock = self.ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
                sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)   # bigger: the peer is disconnected
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SUBSCRIBE, b"")
                self._socks.append(sock)
            try:
                self._socks[rank].bind(addr)
                self.bound.append(self._socks[rank].getsockopt_string(zmq.LAST_ENDPOINT))
            except zmq.ZMQError as exc:
                for sock in self._socks:
                    sock.close(linger=0)
                self._socks.clear()
                raise ValueError(f"cannot bind the central KV-event socket {addr!r}: {exc}") from exc
        for rank, sock in enumerate(self._socks):
            self._tasks.append(asyncio.create_task(self._recv_loop(sock, rank), name=f"zmq-central-dp{rank}"))
        if self.idle_purge_s > 0:
            self._tasks.append(asyncio.create_task(self._idle_loop(), name="zmq-central-idle"))
        log.info("central kv-event socket bound", extra={"bound": self.bound, "max_endpoints": self.max_endpoints,
                                                         "dp_size": self.dp_size})
        return self.bound

    def _reject(self, reason: str, message: str) -> None:
        self.rejected += 1
        self.pump.ingestor.observer.on_rejected(UNADMITTED, reason, 1)
        if reason not in self._warned:  # once per reason: a flood must not flood the log too
            self._warned.add(reason)
            log.warning("central kv-event message rejected", extra={"reason": reason, "error": message})

    async def _resolve(self, topic: bytes, rank: int) -> CentralEndpoint | None:
        try:
            base, model = parse_topic(topic)
        except ValueError as exc:
            self._reject("bad_topic", str(exc))
            return None
        endpoint = dp_endpoint(base, rank)
        known = self.endpoints.get(endpoint)
        if known is not None:
            if known.model != model:
                self._reject("model_mismatch", f"endpoint {endpoint!r} publishes model {model!r}, "
                                               f"first seen with {known.model!r}")
                return None
            self._by_topic[(rank, topic)] = known
            return known
        if len(self.endpoints) >= self.max_endpoints:
            self._reject("endpoint_cap", f"{len(self.endpoints)} endpoints already (kv_events_max_endpoints); "
                                         f"{endpoint!r} not admitted")
            return None
        try:
            await self.admit(endpoint, model, base, rank)
        except AdmitError as exc:
            self._reject(exc.reason, str(exc))
            return None
        except Exception as exc:  # noqa: BLE001 - one bad topic never stops the socket
            log.exception("central endpoint admission failed", extra={"endpoint": endpoint})
            self._reject("admit_error", str(exc))
            return None
        t = self.now()
        ce = self.endpoints[endpoint] = CentralEndpoint(endpoint, model, t, t)
        self._by_topic[(rank, topic)] = ce
        log.info("central endpoint admitted", extra={"endpoint": endpoint, "model": model, "dp_rank": rank})
        return ce

    async def _recv_loop(self, sock: zmq.asyncio.Socket, rank: int) -> None:
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
            ce = self._by_topic.get((rank, topic))
            if ce is None:
                ce = await self._resolve(topic, rank)
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
        for sock in self._socks:
            sock.close(linger=0)
        self._socks.clear()
