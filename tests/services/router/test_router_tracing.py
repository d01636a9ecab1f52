"""Every routing decision is traced: the router service in-process, a sim worker as a real process."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh.routing.types import COST_TERMS
from kvmesh.telemetry import setup_tracing
from kvmesh_api.common.v1 import common_pb2
from kvmesh_router.config import RouterConfig
from kvmesh_router.errors import BadRequest
from kvmesh_router.main import build_service
from kvmesh_router.picker import pick
from kvmesh_router.service import GenInput
from tests.fixtures.router import BLOCK, MODEL, start_worker

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = start_worker(tmp_path_factory.mktemp("trace-worker"), "tw1")
    yield w
    w.stop(grace_s=3)


async def test_decision_attributes_on_the_span(worker):
    exporter = InMemorySpanExporter()
    setup_tracing("kvmesh-router-test", exporter=exporter)
    cfg = RouterConfig(model=MODEL, block_size=BLOCK, endpoints=[f"tw1={worker.grpc_address}"], http_port=0)
    svc = build_service(cfg)
    await svc.cluster.poll_all()
    inp = GenInput(model=MODEL, tokens=list(range(1, 500)), session_id="t",
                   sampling=common_pb2.SamplingParams(max_tokens=3))
    items = [x async for x in svc.generate(inp)]
    assert items[-1][0] == "final"
    span = next(s for s in exporter.get_finished_spans() if s.name == "router.generate")
    a = span.attributes
    assert a["kvmesh.route.policy"] == "precise" and a["kvmesh.route.endpoint"] == "tw1"
    for key in ("kvmesh.route.predicted_cached_tokens", "kvmesh.route.uncached_tokens", "kvmesh.route.score",
                "kvmesh.route.reason", "kvmesh.route.candidates", "kvmesh.split", "kvmesh.split.reason",
                "kvmesh.split.uncached_tokens", "kvmesh.hash.hashed_blocks", "kvmesh.usage.cached_tokens"):
        assert key in a, key
    # The winner's cost by term: they add up to its score.
    assert sum(a[f"kvmesh.route.cost.{t}"] for t in COST_TERMS) == pytest.approx(a["kvmesh.route.score"], rel=1e-9)
    assert a["kvmesh.route.cost.kv_wait_s"] == 0.0   # off by default
    # The picker used by the Envoy ext_proc server makes the same decision without forwarding.
    picked = await pick(svc, MODEL, tokens=list(range(1, 500)) + [7] * 40, headers={"x-session-id": "t"})
    assert picked.endpoint_id == "tw1" and picked.grpc_address == worker.grpc_address
    assert picked.predicted_cached_tokens >= 448
    picked.done()
    with pytest.raises(BadRequest):
        await pick(svc, "other-model", tokens=[1, 2, 3])
    await svc.cluster.stop()


async def test_limits_and_unavailable_in_process():
    from kvmesh_router.errors import Unavailable

    cfg = RouterConfig(model=MODEL, block_size=BLOCK, max_prompt_tokens=100, max_model_len=120, http_port=0,
                       vocab_size=1000)
    svc = build_service(cfg)

    async def run(**kw):
        inp = GenInput(model=kw.pop("model", MODEL), **kw)
        return [x async for x in svc.generate(inp)]

    cases = [
        (dict(tokens=list(range(101))), "prompt", "over the limit"),
        (dict(tokens=list(range(90)), sampling=common_pb2.SamplingParams(max_tokens=40)), "prompt", "max_model_len"),
        (dict(tokens=[1, 2, 5000]), "prompt", "vocabulary"),
        (dict(tokens=[]), "prompt", "empty"),
        (dict(tokens=[1], lora_name="nope"), "lora_name", "LoRA"),
        (dict(tokens=[1], model="x"), "model", "unknown model"),
        (dict(tokens=[1], sampling=common_pb2.SamplingParams(max_tokens=500)), "max_tokens", "max_model_len"),
        (dict(tokens=[1], sampling=common_pb2.SamplingParams(max_tokens=2, top_k=-5)), "top_k", "from 1 to"),
        (dict(tokens=[1], sampling=common_pb2.SamplingParams(max_tokens=2, min_p=2.0)), "min_p", "[0, 1]"),
    ]
    for kw, param, words in cases:
        with pytest.raises(BadRequest) as ei:
            await run(**kw)
        assert ei.value.param == param and words in ei.value.message, (kw, ei.value.message)
    with pytest.raises(Unavailable):
        await run(tokens=[1, 2, 3])
    await svc.cluster.stop()
