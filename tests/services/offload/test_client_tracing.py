"""Both offload clients trace their puts and gets with the same spans, and the store's spans join them."""

from __future__ import annotations

import asyncio
import os

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from kvmesh.kvstore.client import OffloadClient, StoreUnavailable, SyncOffloadClient
from kvmesh.telemetry import setup_tracing, tracer
from kvmesh_tools.testing.ports import free_port

pytestmark = pytest.mark.timeout(60)
NS = "tiny-llama/L2-H2-D32-bf16-bs32"
BLOCK = 512 * 1024
# Which path carries a put and a get, by client setting.
PATHS = {"shm": ("shm", "shm"), "bulk": ("stream", "bulk"), "grpc": ("stream", "stream")}


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    exp = InMemorySpanExporter()
    setup_tracing("kvmesh-offload-client-test", exporter=exp)
    yield exp
    exp.clear()


def _client_spans(spans: tuple[ReadableSpan, ...], trace_id: int) -> list[ReadableSpan]:
    return [s for s in spans if s.context.trace_id == trace_id and s.kind == SpanKind.CLIENT]


@pytest.mark.parametrize("path", sorted(PATHS))
async def test_sync_client_traces_like_the_async_one(offload_factory, exporter, path: str) -> None:
    st = await offload_factory(ram_capacity_bytes=64 << 20)
    data = [(i + 1, os.urandom(BLOCK)) for i in range(3)]
    keys = [k for k, _ in data]
    opts = {"use_shm": path == "shm", "use_bulk": path == "bulk"}

    def sync_calls() -> int:
        with tracer("test").start_as_current_span("sync-root") as root, \
                SyncOffloadClient(st.address, **opts) as c:
            c.delete(NS, keys)
            assert c.put(NS, data).stored == len(data)
            assert c.get(NS, keys) == [d for _, d in data]
            assert c.get_into(NS, keys, [bytearray(BLOCK) for _ in keys]) == len(keys)
        return root.get_span_context().trace_id

    async def async_calls() -> int:
        with tracer("test").start_as_current_span("async-root") as root:
            async with OffloadClient(st.address, **opts) as c:
                await c.delete(NS, keys)
                assert (await c.put(NS, data)).stored == len(data)
                assert await c.get(NS, keys) == [d for _, d in data]
                assert await c.get_into(NS, keys, [bytearray(BLOCK) for _ in keys]) == len(keys)
        return root.get_span_context().trace_id

    sync_trace = await asyncio.to_thread(sync_calls)
    async_trace = await async_calls()
    spans = exporter.get_finished_spans()

    sync_spans = _client_spans(spans, sync_trace)
    put_path, get_path = PATHS[path]
    assert [s.name for s in sync_spans] == ["offload.put", "offload.get", "offload.get"]
    put, get, get_into = (dict(s.attributes) for s in sync_spans)
    assert put == {"kvmesh.offload.namespace": NS, "server.address": st.address,
                   "kvmesh.offload.blocks": len(data), "kvmesh.offload.bytes": len(data) * BLOCK,
                   "kvmesh.offload.path": put_path, "kvmesh.offload.via_shm": put_path == "shm",
                   "kvmesh.offload.stored": len(data)}
    for got in (get, get_into):
        assert got == {"kvmesh.offload.namespace": NS, "server.address": st.address,
                       "kvmesh.offload.blocks_requested": len(keys), "kvmesh.offload.blocks": len(keys),
                       "kvmesh.offload.bytes": len(keys) * BLOCK, "kvmesh.offload.path": get_path}
    # The async client's spans are the same, name for name and attribute for attribute.
    async_spans = _client_spans(spans, async_trace)
    assert [(s.name, dict(s.attributes)) for s in async_spans] == [(s.name, dict(s.attributes))
                                                                    for s in sync_spans]
    # The store's server spans are children of each client span: the context crossed the call.
    for client_span in sync_spans + async_spans:
        children = [s for s in spans if s.kind == SpanKind.SERVER and s.parent is not None
                    and s.parent.span_id == client_span.context.span_id]
        assert children, f"no store span under {client_span.name} ({path})"
    assert st.servicer.open_leases == 0


def test_sync_client_span_records_a_failed_put(exporter) -> None:
    dead = f"127.0.0.1:{free_port()}"
    with tracer("test").start_as_current_span("root") as root, \
            SyncOffloadClient(dead, use_shm=False, timeout_s=1.0) as c:
        with pytest.raises(StoreUnavailable):
            c.put(NS, [(1, b"x" * 64)])
    (put,) = _client_spans(exporter.get_finished_spans(), root.get_span_context().trace_id)
    assert put.name == "offload.put" and put.status.status_code == StatusCode.ERROR
    assert put.attributes["server.address"] == dead
