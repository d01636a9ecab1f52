"""How fast a client finds a restarted peer again: one reconnect backoff for gRPC and ZMQ.

gRPC's default reconnect backoff starts at 1 s and grows to 120 s. A worker, store or
indexer that was down for a minute and comes back at the same address was therefore left
unrouted for up to two more minutes, though it answered at once. ZMQ's default waits 100 ms
between tries without growth, but nothing said so. Both are set here, once: retry after
``RECONNECT_INITIAL_MS``, growing to at most ``RECONNECT_MAX_MS``, so a restarted peer is
picked up within about half a second (plus the caller's own poll period), while a peer that
stays down costs one TCP connect attempt per half second per client.

gRPC's C-core reads ``grpc.min_reconnect_backoff_ms`` as the least time one connection attempt
gets (TCP connect, TLS and the server's first HTTP/2 SETTINGS frame), not as a backoff
(``ParseArgsForBackoffValues`` in its ``subchannel.cc``). Set to the backoff's 100 ms, a first
call to a peer on a loaded machine fails with UNAVAILABLE ("connection attempt timed out before
receiving SETTINGS frame"), and a router's first indexer lookup then routes by ``approx``. So an
attempt gets ``CONNECT_TIMEOUT_MS``, Envoy's default connect timeout; a refused connection (a
peer restarting) still fails at once and is retried on the backoff above.
"""

from __future__ import annotations

from typing import Any

RECONNECT_INITIAL_MS = 100
RECONNECT_MAX_MS = 500
CONNECT_TIMEOUT_MS = 5_000


def grpc_reconnect_options() -> list[tuple[str, object]]:
    """Channel arguments for a gRPC client (C-core names)."""
    return [
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_INITIAL_MS),
        ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),   # C-core: an attempt's least time
        ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
    ]


def tune_zmq_reconnect(sock: Any) -> None:
    """Set a connecting ZMQ socket's reconnect interval and its exponential cap."""
    import zmq

    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_INITIAL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
