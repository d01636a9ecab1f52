"""Client channels with keepalive, size limits, tracing and a retry policy.

UNAVAILABLE is retried by gRPC itself (service-config retry policy) for
idempotent unary calls; streaming calls are retried by their callers, which
know whether tokens were already delivered.
"""

from __future__ import annotations

import json

import grpc

from kvmesh.rpc.interceptors import client_interceptors
from kvmesh.rpc.keepalive import CLIENT_KEEPALIVE_MS, client_keepalive_options
from kvmesh.rpc.reconnect import grpc_reconnect_options
from kvmesh.rpc.server import DEFAULT_MAX_MESSAGE_BYTES
from kvmesh.rpc.tls import TlsConfig, aio_secure_channel, resolve


def _service_config(retry_attempts: int) -> str:
    return json.dumps({
        "methodConfig": [{
            "name": [{}],
            "retryPolicy": {
                "maxAttempts": max(2, retry_attempts),
                "initialBackoff": "0.05s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }]
    })


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, retry_attempts: int = 3,
                    keepalive_ms: int = CLIENT_KEEPALIVE_MS) -> list[tuple[str, object]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        *client_keepalive_options(keepalive_ms),
        *grpc_reconnect_options(),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", _service_config(retry_attempts)),
    ]


def aio_channel(target: str, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, retry_attempts: int = 3,
                traced: bool = True, tls: TlsConfig | None = None) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``host:port`` with kvmesh defaults.

    Mutual TLS when ``tls`` (default: the process's identity, ``kvmesh.rpc.tls.set_default``) is
    on; the channel then follows certificate rotations on disk.
    """
    cfg = resolve(tls)
    options = channel_options(max_message_bytes, retry_attempts)
    interceptors = client_interceptors() if traced else None
    if cfg.enabled():
        return aio_secure_channel(target, cfg, options, interceptors)
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
