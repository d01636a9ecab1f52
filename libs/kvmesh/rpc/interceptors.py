"""OpenTelemetry gRPC interceptors with W3C trace-context propagation.

Thin wrappers over ``opentelemetry-instrumentation-grpc`` so every server and
channel in kvmesh gets the same tracing.
"""

from __future__ import annotations

import grpc
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    return [aio_server_interceptor()]


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    return list(aio_client_interceptors())
