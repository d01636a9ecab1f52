"""Tracing: spans reach an in-memory exporter and W3C context crosses a real gRPC hop."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh.rpc.channel import aio_channel
from kvmesh.telemetry import setup_tracing, tracer
from tests.helpers.slow_server import SERVICE, make_server


async def test_client_and_server_spans_share_one_trace() -> None:
    exporter = InMemorySpanExporter()
    setup_tracing("kvmesh-test", exporter=exporter)
    srv = make_server()
    port = await srv.start()
    try:
        with tracer("test").start_as_current_span("root") as root:
            async with aio_channel(f"127.0.0.1:{port}") as ch:
                fn = ch.unary_unary(f"/{SERVICE}/Sleep")
                assert await fn(b"0", timeout=5) == b"done"
        spans = exporter.get_finished_spans()
        trace_id = root.get_span_context().trace_id
        kinds = {s.kind.name for s in spans if s.context.trace_id == trace_id}
        assert {"CLIENT", "SERVER"} <= kinds, [(s.name, s.kind) for s in spans]
    finally:
        await srv.stop(0)
        exporter.clear()

