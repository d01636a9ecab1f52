"""Client side of vLLM's KV-event replay protocol (DEALER -> engine ROUTER).

Why: a sequence gap means lost events; the engine keeps its last
``buffer_steps`` batches and resends them on request, which repairs the gap
without clearing the endpoint. Protocol: send ``[b"", start_seq (8 bytes BE)]``;
the engine answers ``[b"", topic, seq, payload]`` per buffered batch with
``seq >= start_seq`` and ends with ``[b"", b"", 0xFF*8, b""]``.

Synchronous on purpose: ingest calls it from a worker thread, bounded by a
total timeout, and a fresh socket per request keeps a half-read reply from an
earlier timeout from leaking into the next one.
"""

from __future__ import annotations

import logging
import time

import zmq

from kvmesh.events.codec import REPLAY_END_SEQ
from kvmesh.events.curve import CurveClient, apply_client
from kvmesh.rpc.reconnect import tune_zmq_reconnect

log = logging.getLogger(__name__)

_END = REPLAY_END_SEQ.to_bytes(8, "big")


class ReplayError(RuntimeError):
    """The replay socket did not answer completely in time."""


def fetch_replay(endpoint: str, start_seq: int, timeout_s: float = 2.0, max_batches: int = 100_000,
                 context: zmq.Context | None = None, max_message_bytes: int = 8 * 1024 * 1024,
                 max_bytes: int = 64 * 1024 * 1024, curve: CurveClient | None = None) -> list[tuple[int, bytes]]:
    """Buffered ``(seq, payload)`` pairs with ``seq >= start_seq``; raises ``ReplayError``.

    At most ``max_bytes`` of payloads are kept (a hostile or broken replay socket must not
    fill the indexer's memory); each message is capped by ZMQ at ``max_message_bytes``."""
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if curve is not None:
        apply_client(sock, curve)   # a CURVE replay socket answers admitted keys only
    tune_zmq_reconnect(sock)   # a restarted peer is found again within ~0.5 s
    # A DEALER whose peer has no live pipe (a CURVE handshake the peer refused, a peer that
    # is down) blocks in send; the request must stay bounded by the same total timeout.
    sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
    deadline = time.monotonic() + timeout_s
    try:
        sock.connect(endpoint)
        try:
            sock.send_multipart([b"", int(start_seq).to_bytes(8, "big")])
        except zmq.Again:
            raise ReplayError(f"replay from {endpoint}: request not accepted within {timeout_s}s") from None
        out: list[tuple[int, bytes]] = []
        total = 0
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(int(left * 1000) + 1):
                raise ReplayError(f"replay from {endpoint} timed out after {timeout_s}s "
                                  f"({len(out)} batches received)")
            frames = sock.recv_multipart()
            if len(frames) != 4 or frames[0] != b"":
                raise ReplayError(f"replay from {endpoint}: malformed reply of {len(frames)} frames")
            _, topic, seq_b, payload = frames
            if seq_b == _END and not topic and not payload:
                return out
            if len(seq_b) != 8:
                raise ReplayError(f"replay from {endpoint}: sequence frame of {len(seq_b)} bytes")
            out.append((int.from_bytes(seq_b, "big"), payload))
            total += len(payload)
            if total > max_bytes:
                raise ReplayError(f"replay from {endpoint}: more than {max_bytes} bytes")
            if len(out) > max_batches:
                raise ReplayError(f"replay from {endpoint}: more than {max_batches} batches")
    finally:
        sock.close(linger=0)
