"""OpenTelemetry tracing and Prometheus metrics setup shared by all services.

Tracing exports over OTLP only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set;
otherwise spans are created against a provider with no processor, so there is
no export cost. Tests pass an exporter (e.g. ``InMemorySpanExporter``).
"""

from __future__ import annotations

import logging
import os
import threading

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter

from kvmesh.metrics_http import MetricsAuthConfig, serve_metrics
from kvmesh.rpc.tls import TlsConfig

log = logging.getLogger(__name__)
_lock = threading.Lock()
_provider: TracerProvider | None = None
_metrics_started: set[int] = set()


def setup_tracing(service_name: str, exporter: SpanExporter | None = None) -> TracerProvider:
    """Install the global tracer provider once per process and return it."""
    global _provider
    with _lock:
        if _provider is None:
            resource = Resource.create({"service.name": service_name})
            _provider = TracerProvider(resource=resource)
            if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

                _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
                log.info("otlp trace export on", extra={"endpoint": os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"]})
            trace.set_tracer_provider(_provider)
        if exporter is not None:
            _provider.add_span_processor(SimpleSpanProcessor(exporter))
        return _provider


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def start_metrics_server(port: int, host: str = "127.0.0.1", auth: MetricsAuthConfig | None = None,
                         tls: TlsConfig | None = None) -> int:
    """Serve Prometheus ``/metrics`` on ``port`` (0 disables), with the scrape credentials of
    ``auth`` (``kvmesh.metrics_http``; ``tls`` is the service's identity). Idempotent per port."""
    if port <= 0:
        return 0
    with _lock:
        if port not in _metrics_started:
            serve_metrics(port, host, auth=auth, tls=tls)
            _metrics_started.add(port)
    return port
