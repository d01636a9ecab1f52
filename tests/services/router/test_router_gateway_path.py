"""The gateway path (Envoy ext_proc picker): InferenceObjective shedding and llm-d's P/D header.

The router service runs in-process behind the picker adapter the ext_proc server calls;
its endpoints are recording OpenAI servers over real HTTP whose vLLM /metrics set the load.
"""

from __future__ import annotations

import pytest

from kvmesh.responses_api.store.memory import MemoryResponseStore
from kvmesh_router import extproc
from kvmesh_router.config import RouterConfig
from kvmesh_router.errors import Overloaded
from kvmesh_router.gateway_pick import gateway_pick_fn
from kvmesh_router.main import build_service
from kvmesh_router.picker import OBJECTIVE_HEADER, pick
from kvmesh_router.request_scope import scopes_from_config
from tests.helpers.openai_engine import OpenAIEngine

pytestmark = pytest.mark.timeout(60)
MODEL = "tiny-llama"


@pytest.fixture
async def gateway(tiny_model_dir):
    engines = [await OpenAIEngine(MODEL).start(), await OpenAIEngine(MODEL).start()]
    cfg = RouterConfig(model=MODEL, block_size=32, tokenizer_path=str(tiny_model_dir), http_port=0, auth="off",
                       endpoints=[f"e{i}={e.url}" for i, e in enumerate(engines)],
                       inference_objectives={"batch": -1, "chat": 10}, shed_queue_depth=3,
                       prefill_endpoints=["p1=127.0.0.1:1"], split_enabled=True, split_threshold_tokens=64)
    cfg.validate()
    svc = build_service(cfg)
    svc.cluster.http_addresses["p1"] = "10.1.2.3:8000"   # a prefill pod (registry-known in a fleet)
    yield svc, engines
    await svc.cluster.stop()
    for e in engines:
        await e.stop()


async def _poll(svc) -> None:
    for eid in list(svc.cluster.external.urls):
        await svc.cluster.poll_metrics(eid)


def _preq(objective: str | None, tokens: list[int]) -> extproc.PickRequest:
    headers = {":method": "POST", ":path": "/v1/completions"}
    if objective is not None:
        headers[OBJECTIVE_HEADER] = objective
    return extproc.PickRequest("r1", "POST", "/v1/completions", headers, {"model": MODEL, "prompt": tokens})


async def test_sheddable_requests_get_429_only_while_the_pool_is_saturated(gateway) -> None:
    svc, engines = gateway
    pick_fn = gateway_pick_fn(svc, scopes_from_config(svc.cfg))
    tokens = list(range(5, 40))
    for e in engines:
        e.waiting = 4
    await _poll(svc)
    with pytest.raises(extproc.ShedLoadError) as ei:
        await pick_fn(_preq("batch", tokens))
    assert ei.value.http_status == 429 and "batch" in str(ei.value)
    # Critical, default and unknown objectives are served on a saturated pool.
    for objective in ("chat", None, "unknown"):
        res = await pick_fn(_preq(objective, tokens))
        assert res.endpoint_id in ("e0", "e1")
        res.on_done(200)
    # KV usage saturates too; one endpoint with room is enough to serve sheddable work.
    engines[0].waiting, engines[0].kv_usage = 0, 0.95
    await _poll(svc)
    with pytest.raises(Overloaded):
        await pick(svc, MODEL, tokens=tokens, headers={OBJECTIVE_HEADER: "batch"})
    engines[1].waiting = 0
    await _poll(svc)
    picked = await pick(svc, MODEL, tokens=tokens, headers={OBJECTIVE_HEADER: "batch"})
    assert picked.endpoint_id in ("e0", "e1")
    picked.done()


async def test_the_split_decision_rides_in_llm_ds_prefill_header(gateway) -> None:
    svc, engines = gateway
    await _poll(svc)
    long_prompt = [7 + (i * 31) % 900 for i in range(600)]
    picked = await pick(svc, MODEL, tokens=long_prompt)
    assert picked.endpoint_id in ("e0", "e1")
    assert picked.extra_headers == {"x-prefiller-host-port": "10.1.2.3:8000"}, picked.reason
    picked.done()
    # Short prompts are not split; a gateway without a P/D sidecar turns the header off.
    short = await pick(svc, MODEL, tokens=list(range(5, 20)))
    assert short.extra_headers == {}
    short.done()
    svc.cfg.gateway_prefill_header = ""
    off = await pick(svc, MODEL, tokens=[9 + (i * 17) % 800 for i in range(600)])
    assert off.extra_headers == {}
    off.done()


async def test_a_data_parallel_pods_rank_rides_in_vllms_header(tiny_model_dir) -> None:
    """Behind Envoy too, the DP rank the picker predicted for is the rank that serves."""
    engine = await OpenAIEngine(MODEL).start()
    engine.engine_loads = {"0": (5, 1, 0.5), "1": (0, 0, 0.0)}
    cfg = RouterConfig(model=MODEL, block_size=32, tokenizer_path=str(tiny_model_dir), http_port=0, auth="off",
                       endpoints=[f"v={engine.url}"], external_dp_size=2)
    cfg.validate()
    svc = build_service(cfg)
    try:
        await _poll(svc)
        picked = await pick(svc, MODEL, tokens=list(range(5, 80)))
        assert picked.endpoint_id == "v_dp1"   # the idle rank
        assert picked.extra_headers == {"X-data-parallel-rank": "1"}
        assert picked.http_address == engine.url.removeprefix("http://")   # both ranks: the one pod
        picked.done()
    finally:
        await svc.cluster.stop()
        await engine.stop()


async def test_a_responses_body_is_picked_as_the_chat_it_renders_to(gateway) -> None:
    """Behind Envoy, /v1/responses goes to the engine's own Responses API: the picker renders the body as
    vLLM converts it, so the same conversation sent as chat is a prefix hit; state it cannot route is a 400."""
    svc, _ = gateway
    await _poll(svc)
    pick_fn = gateway_pick_fn(svc, scopes_from_config(svc.cfg))
    system = "You are a coding agent. " * 40
    chat = {"model": MODEL, "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}
    first = await pick_fn(extproc.PickRequest("r1", "POST", "/v1/chat/completions",
                                              {":path": "/v1/chat/completions"}, chat))
    first.on_done(200)
    body = {"model": MODEL, "instructions": system, "input": "hi", "prompt_cache_key": "conv-1"}
    second = await pick_fn(extproc.PickRequest("r2", "POST", "/v1/responses", {":path": "/v1/responses"}, body))
    second.on_done(200)
    assert second.endpoint_id == first.endpoint_id and second.predicted_cached_tokens > 0, second.reason
    with pytest.raises(extproc.BadRequestError, match="previous_response_id"):   # no store given
        await pick_fn(extproc.PickRequest("r3", "POST", "/v1/responses", {":path": "/v1/responses"},
                                          {**body, "previous_response_id": "resp_1"}))
    # With the router's store: an id the tenant never had is the client's 404, before any pick.
    stored = gateway_pick_fn(svc, scopes_from_config(svc.cfg), MemoryResponseStore(60, 1 << 20, 1 << 20))
    with pytest.raises(extproc.PickError, match="resp_1") as e:
        await stored(extproc.PickRequest("r4", "POST", "/v1/responses", {":path": "/v1/responses"},
                                         {**body, "previous_response_id": "resp_1"}))
    assert e.value.http_status == 404
