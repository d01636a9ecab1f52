"""A KV-event publisher indistinguishable on the wire from vLLM's ``ZmqEventPublisher``.

The simulated engine and the offload store announce their blocks with this, so the
indexer's subscriber (and any llm-d-style consumer) treats them exactly like a real vLLM:
same bind-or-connect rule, same 3-frame messages with a per-process sequence from 0, same
ROUTER replay protocol and end marker.

Unlike vLLM (which queues to a background thread), :meth:`KvEventPublisher.publish` sends
synchronously under a lock and returns the sequence number it assigned: callers (and
tests) then know exactly which seq carried which events. A PUB socket never blocks (it
drops at the high-water mark), so this costs one memcpy into ZMQ's queue.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq

from kvmesh.events.codec import REPLAY_END_SEQ, KVEvent, KVEventBatch, encode_batch
from kvmesh.events.curve import CurveServer, apply_server
from kvmesh.rpc.reconnect import tune_zmq_reconnect

log = logging.getLogger(__name__)

_END_SEQ_BYTES = REPLAY_END_SEQ.to_bytes(8, "big")
# Replay buffer bound in bytes (besides ``buffer_steps``): what an indexer that missed a few
# seconds of events needs, not the whole history of a long run.
DEFAULT_BUFFER_BYTES = 16 << 20
# ... and in age: a publisher with few events (a prefill worker) took half an hour to fill the
# byte bound, growing all the while; by age every publisher reaches its steady size in minutes.
DEFAULT_BUFFER_AGE_S = 120.0
_clock = time.monotonic   # the buffer's age clock (tests replace it)


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to everything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's per-DP-rank endpoint: tcp port + rank (port 0 untouched), inproc gets ``_dp<rank>``."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        base, _, port = endpoint.rpartition(":")
        if not base or not port.isdigit() or int(port) == 0:
            return endpoint
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(f"invalid endpoint {endpoint!r}: must be inproc or tcp to offset by rank")


class KvEventPublisher:
    """ZMQ PUB of KV-event batches plus an optional ROUTER replay service.

    ``endpoint`` e.g. ``tcp://*:5557`` (bind) or ``tcp://indexer:5557`` (connect; the
    subscriber binds). Port ``0`` or ``*`` (``tcp://*:0``, ``tcp://127.0.0.1:*``: a bind, by
    vLLM's rule too) lets the kernel pick the port at the bind; ``endpoint`` then names it, so
    nothing picks a port that must stay free until someone binds it.
    ``replay_endpoint`` is always bound. Thread-safe.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        data_parallel_rank: int = 0,
        buffer_age_s: float = DEFAULT_BUFFER_AGE_S,
        context: zmq.Context | None = None,
        curve: CurveServer | None = None,
    ) -> None:
        if buffer_steps <= 0:
            raise ValueError("buffer_steps must be > 0")
        self._ctx = context or zmq.Context.instance()
        self._topic = topic.encode("utf-8")
        self._dp_rank = data_parallel_rank
        self._lock = threading.Lock()
        # Bounded in batches and in bytes: a batch carries its blocks' token ids, so 10,000
        # batches of long prompts would hold gigabytes and the process would grow for hours.
        self._buffer: deque[tuple[int, bytes, float]] = deque()   # (seq, payload, monotonic time)
        self._buffer_steps = buffer_steps
        self._buffer_max_bytes = max(1, buffer_bytes)
        self._buffer_age_s = buffer_age_s   # <= 0: no age bound
        self.buffer_bytes = 0
        self._next_seq = 0
        self._closed = False
        self.replay_requests = 0

        ep = offset_endpoint_port(endpoint, data_parallel_rank)
        assert ep is not None
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        tune_zmq_reconnect(self._pub)   # a restarted peer is found again within ~0.5 s
        if curve is not None:
            if not is_bind_endpoint(ep):
                self._pub.close(linger=0)
                raise ValueError(f"CURVE needs a binding KV-event endpoint ('*'), got {ep!r}")
            apply_server(self._pub, curve)   # only admitted subscribers receive (and can decrypt) events
        try:
            if is_bind_endpoint(ep):
                self._pub.bind(ep)
                ep = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) if ep.endswith((":0", ":*")) else ep
            else:
                self._pub.connect(ep)
        except zmq.ZMQError as e:
            self._pub.close(linger=0)
            raise ValueError(f"cannot open KV-event endpoint {ep!r}: {e}") from e
        self.endpoint = ep

        self.replay_endpoint: str | None = None
        self._replay: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        rep = offset_endpoint_port(replay_endpoint, data_parallel_rank)
        if rep is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            if curve is not None:
                apply_server(self._replay, curve)   # replay answers admitted subscribers only
            try:
                self._replay.bind(rep)
            except zmq.ZMQError as e:
                self._replay.close(linger=0)
                self._pub.close(linger=0)
                raise ValueError(f"cannot bind KV-event replay endpoint {rep!r}: {e}") from e
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve_replay, name="kv-event-replay", daemon=True)
            self._thread.start()
        log.info(
            "kv event publisher ready",
            extra={"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint, "topic": topic},
        )

    @property
    def topic(self) -> str:
        return self._topic.decode("utf-8")

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def publish(self, events: Sequence[KVEvent] | KVEventBatch, ts: float | None = None) -> int:
        """Send one batch; returns its sequence number."""
        if isinstance(events, KVEventBatch):
            batch = events
            if batch.data_parallel_rank is None:
                batch = KVEventBatch(batch.ts, batch.events, self._dp_rank)
        else:
            batch = KVEventBatch(time.time() if ts is None else ts, list(events), self._dp_rank)
        payload = encode_batch(batch)
        with self._lock:
            if self._closed:
                raise RuntimeError("publisher is closed")
            seq = self._next_seq
            self._next_seq += 1
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
            now = _clock()
            self._buffer.append((seq, payload, now))
            self.buffer_bytes += len(payload)
            # The newest batch always stays, whatever its size or age.
            old = now - self._buffer_age_s if self._buffer_age_s > 0 else float("-inf")
            while len(self._buffer) > 1 and (len(self._buffer) > self._buffer_steps
                                             or self.buffer_bytes > self._buffer_max_bytes
                                             or self._buffer[0][2] < old):
                self.buffer_bytes -= len(self._buffer.popleft()[1])
        return seq

    def _serve_replay(self) -> None:
        sock = self._replay
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not dict(poller.poll(100)):
                    continue
                frames = sock.recv_multipart()
            except zmq.ZMQError as e:
                if self._stop.is_set():
                    return
                log.warning("replay socket error", extra={"error": str(e)})
                continue
            if len(frames) != 3:
                log.warning("invalid replay request", extra={"frames": len(frames)})
                continue
            client, _, start_b = frames
            if len(start_b) != 8:
                log.warning("invalid replay start seq", extra={"length": len(start_b)})
                continue
            start = int.from_bytes(start_b, "big")
            with self._lock:
                snapshot = [(s, p) for s, p, _ in self._buffer if s >= start]
            self.replay_requests += 1
            try:
                for s, p in snapshot:
                    sock.send_multipart((client, b"", self._topic, s.to_bytes(8, "big"), p), copy=False)
                sock.send_multipart((client, b"", b"", _END_SEQ_BYTES, b""))
            except zmq.ZMQError as e:
                log.warning("replay send failed", extra={"error": str(e)})

    def close(self, linger_ms: int = 100) -> None:
        """Stop the replay service and close the sockets (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._pub.close(linger=linger_ms)

    def __enter__(self) -> KvEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
