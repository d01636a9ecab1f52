"""One keepalive agreement for every kvmesh gRPC client and server.

Clients ping idle connections every ``CLIENT_KEEPALIVE_MS`` so a dead peer (a killed pod, a
dropped NAT entry) is noticed in seconds, not at the next call. A gRPC server by default accepts
a ping without data only every 5 minutes and answers more frequent ones with
``GOAWAY too_many_pings``, which drops the connection and every stream on it. So the servers
here accept pings at half the clients' interval: both sides read the numbers from this module.
"""

from __future__ import annotations

CLIENT_KEEPALIVE_MS = 20_000
CLIENT_KEEPALIVE_TIMEOUT_MS = 10_000


def client_keepalive_options(keepalive_ms: int = CLIENT_KEEPALIVE_MS) -> list[tuple[str, object]]:
    return [
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", CLIENT_KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_keepalive_options(client_keepalive_ms: int = CLIENT_KEEPALIVE_MS) -> list[tuple[str, object]]:
    """What a server must accept for clients pinging every ``client_keepalive_ms``."""
    return [
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", client_keepalive_ms // 2),
        ("grpc.http2.min_ping_interval_without_data_ms", client_keepalive_ms // 2),
        ("grpc.http2.max_ping_strikes", 0),   # 0 = never GOAWAY for pings alone
    ]
