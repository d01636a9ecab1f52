"""ZMQ SUB sockets that receive engines' KV events in vLLM's wire format.

Why one socket per engine: vLLM's publisher either binds (endpoint with
``*``/``::``, ipc, inproc) and the indexer connects, or connects and the
indexer binds; which one is a per-engine choice. A per-engine socket also
ties every message to its endpoint even when the engine's topic is not
kvmesh's ``kv@<endpoint>@<model>`` (vLLM's default topic is empty).

Frames are handed to the ingest pump undecoded (decoding happens on the
endpoint's worker), so a burst from one engine never stalls the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvmesh.events.codec import DecodeError, decode_seq
from kvmesh.events.curve import apply_client
from kvmesh.events.topic import parse_topic
from kvmesh.rpc.reconnect import tune_zmq_reconnect
from kvmesh_indexer.pump import EndpointSource, IngestPump

log = logging.getLogger(__name__)


@dataclass
class Subscription:
    source: EndpointSource
    zmq_endpoint: str
    bind: bool
    socket: zmq.asyncio.Socket
    task: asyncio.Task
    messages: int = 0
    watch: asyncio.Task | None = None
    reconnects: int = 0
    # What the socket really listens on when it binds: ``tcp://h:0`` lets the kernel pick the port
    # at the bind (no port picked early that someone else can take first); engines connect here.
    bound_endpoint: str = ""


def rcvhwm_for(buffer_bytes: int, max_message_bytes: int) -> int:
    """ZMQ's receive high-water mark (in messages) that keeps a connection's unread bytes under
    ``buffer_bytes`` whatever the messages' sizes.

    ZMQ bounds a pipe by message count only. At 100,000 messages a publisher flooding 3 MiB
    messages while the indexer's loop lagged held ~450 MiB in ZMQ's pipe, before the byte-bounded
    ingest queue saw any of it. At the mark ZMQ stops reading that TCP connection (measured: no
    message lost), so the backlog stays on the publisher, which drops at its own mark and the gap
    is replayed."""
    return max(2, buffer_bytes // max(1, max_message_bytes))


class ZmqSubscriber:
    def __init__(self, pump: IngestPump, context: zmq.asyncio.Context | None = None,
                 max_message_bytes: int = 8 * 1024 * 1024, buffer_bytes: int = 32 * 1024 * 1024) -> None:
        self.pump = pump
        self.max_message_bytes = max_message_bytes
        self.ctx = context or zmq.asyncio.Context.instance()
        self.rcvhwm = rcvhwm_for(buffer_bytes, max_message_bytes)
        self.subs: dict[str, Subscription] = {}

    async def add(self, source: EndpointSource, zmq_endpoint: str, bind: bool = False) -> Subscription:
        """Subscribe to one engine (replacing an earlier subscription of the same endpoint)."""
        if source.endpoint in self.subs:
            old = self.subs[source.endpoint]
            if old.zmq_endpoint == zmq_endpoint and old.bind == bind:
                self.pump.configure(source)
                old.source = source
                return old
            await self.remove(source.endpoint)
        self.pump.configure(source)
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
        # A peer sending a bigger message is disconnected by ZMQ before Python sees a byte of it.
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sock.setsockopt(zmq.LINGER, 0)
        curve = self.pump.curve_for(source.endpoint)
        if curve is not None:
            apply_client(sock, curve)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        tune_zmq_reconnect(sock)   # a restarted peer is found again within ~0.5 s
        try:
            if bind:
                sock.bind(zmq_endpoint)
            else:
                sock.connect(zmq_endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ValueError(f"cannot {'bind' if bind else 'connect'} KV-event socket {zmq_endpoint!r} for "
                             f"endpoint {source.endpoint!r}: {exc}") from exc
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT) if bind else ""
        task = asyncio.create_task(self._recv_loop(source.endpoint, sock), name=f"zmq-sub-{source.endpoint}")
        sub = Subscription(source, zmq_endpoint, bind, sock, task, bound_endpoint=bound)
        if not bind:
            sub.watch = asyncio.create_task(self._watch(source.endpoint, sub), name=f"zmq-watch-{source.endpoint}")
        self.subs[source.endpoint] = sub
        log.info("subscribed to kv events", extra={"endpoint": source.endpoint, "zmq": bound or zmq_endpoint,
                                                   "mode": "bind" if bind else "connect",
                                                   "replay": source.replay_endpoint or ""})
        return sub

    async def _recv_loop(self, endpoint: str, sock: zmq.asyncio.Socket) -> None:
        observer = self.pump.ingestor.observer
        while True:
            try:
                frames = await sock.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                log.warning("kv-event socket error", extra={"endpoint": endpoint, "error": str(exc)})
                await asyncio.sleep(0.1)
                continue
            sub = self.subs.get(endpoint)
            if sub is not None:
                sub.messages += 1
            if len(frames) != 3:
                observer.on_rejected(endpoint, "malformed_frames", 1)
                log.warning("malformed kv-event message", extra={"endpoint": endpoint, "frames": len(frames)})
                continue
            topic, seq_b, payload = frames
            try:
                seq = decode_seq(seq_b)
            except DecodeError as exc:
                observer.on_rejected(endpoint, "malformed_frames", 1)
                log.warning("malformed kv-event sequence", extra={"endpoint": endpoint, "error": str(exc)})
                continue
            model = None
            if topic:
                with contextlib.suppress(ValueError):
                    topic_ep, model = parse_topic(topic)
                    if topic_ep != endpoint:
                        log.debug("topic endpoint differs from configured id",
                                  extra={"endpoint": endpoint, "topic": topic_ep})
            src = self.pump.sources.get(endpoint)
            if src is not None:
                model = src.model  # configuration wins over the topic
            self.pump.submit_nowait(endpoint, seq, payload=payload, model=model)

    async def _watch(self, endpoint: str, sub: Subscription) -> None:
        """Reconnect after ZMQ drops the connection for a message over MAXMSGSIZE.

        libzmq treats that as a protocol error and, unlike a lost connection, never
        reconnects by itself: one oversized message would silence the engine for good.
        The messages lost meanwhile count as drops and the endpoint is re-synced by replay.
        """
        mon = sub.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                await mon.recv_multipart()
                sub.reconnects += 1
                log.warning("kv-event connection dropped (oversized message or peer gone); reconnecting",
                            extra={"endpoint": endpoint, "zmq": sub.zmq_endpoint})
                with contextlib.suppress(zmq.ZMQError):
                    sub.socket.disconnect(sub.zmq_endpoint)
                sub.socket.connect(sub.zmq_endpoint)
                self.pump.dropped(endpoint)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sub.socket.disable_monitor()
            mon.close(linger=0)

    async def remove(self, endpoint: str) -> None:
        sub = self.subs.pop(endpoint, None)
        if sub is None:
            return
        sub.task.cancel()
        if sub.watch is not None:
            sub.watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await sub.watch
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await sub.task
        sub.socket.close(linger=0)

    async def close(self) -> None:
        for ep in list(self.subs):
            await self.remove(ep)
