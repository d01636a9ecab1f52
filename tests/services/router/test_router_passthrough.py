"""External OpenAI endpoints: the router forwards the client's body (plus the tenant's salt),
reads load from vLLM's /metrics and routes around an endpoint it cannot connect to.

The router runs in-process (its FastAPI app over httpx's ASGI transport); the engines are
recording OpenAI servers over real HTTP (tests/helpers/openai_engine.py). Real vLLM: the
vLLM tier, test_router_vllm_external.py.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator

import anthropic
import grpc
import httpx
import httpx2
import pytest

from kvmesh.config import ConfigError
from kvmesh_api.common.v1 import common_pb2
from kvmesh_router.config import RouterConfig, parse_endpoint
from kvmesh_router.errors import UpstreamError
from kvmesh_router.http_api import build_app
from kvmesh_router.main import build_service
from kvmesh_router.service import GenInput, tenant_session
from tests.helpers.chat_cases import TOOLS
from tests.helpers.openai_engine import OpenAIEngine

pytestmark = pytest.mark.timeout(60)
MODEL = "tiny-llama"


@contextlib.asynccontextmanager
async def _routed(tiny_model_dir, engines: dict[str, OpenAIEngine], **cfg) -> AsyncIterator[tuple]:
    """An in-process router over ``engines`` (already started) and an HTTP client to it; on the
    way out the client, the router's cluster and the engines are stopped."""
    try:
        config = RouterConfig(model=MODEL, block_size=32, tokenizer_path=str(tiny_model_dir), http_port=0,
                              auth="off", **cfg)
        config.validate()
        svc = build_service(config)
        try:
            await svc.cluster.poll_all()
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(svc)),
                                         base_url="http://router", timeout=30) as client:
                yield svc, client
        finally:
            await svc.cluster.stop()
    finally:
        for e in engines.values():
            await e.stop()


@pytest.fixture
async def stack(tiny_model_dir):
    log: list[dict] = []
    engines = {"a": await OpenAIEngine(MODEL, log).start(), "b": await OpenAIEngine(MODEL, log).start()}
    async with _routed(tiny_model_dir, engines, endpoints=[f"{k}={e.url}/v1" for k, e in engines.items()],
                       external_connect_timeout_s=1.0) as (svc, client):
        yield svc, engines, client


def _chat(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "system", "content": "You are a coding agent."},
                                         {"role": "user", "content": "What's the weather in Paris?"}],
            "max_tokens": 4, **extra}


def _received(engines: dict[str, OpenAIEngine]) -> list[dict]:
    return next(iter(engines.values())).log


async def test_the_body_goes_through_unchanged_but_for_the_tenants_salt(stack) -> None:
    svc, engines, client = stack
    sent = _chat(tools=TOOLS, tool_choice="auto", logprobs=True, top_logprobs=2,
                 response_format={"type": "json_object"}, repetition_penalty=1.1, vendor_field={"x": [1, 2]})
    r = await client.post("/v1/chat/completions", json=sent, headers={"x-tenant": "acme"})
    assert r.status_code == 200, r.text
    eid = r.headers["x-kvmesh-endpoint"]
    assert eid in engines and int(r.headers["x-kvmesh-predicted-cached-tokens"]) == (
        int(r.headers["x-kvmesh-predicted-cached-tokens-gpu"])
        + int(r.headers["x-kvmesh-predicted-cached-tokens-offload"]))
    (got,) = _received(engines)
    assert got == {**sent, "cache_salt": svc.salts.salt("acme")}
    # The engine's answer comes back as it was (vLLM's own fields included).
    assert r.json()["choices"][0]["logprobs"] == {"content": []} and r.json()["usage"]["total_tokens"] == 12
    # Each tenant its secret salt; a client's own salt is mixed in; no tenant and no salt: none at all.
    await client.post("/v1/chat/completions", json=_chat(), headers={"x-tenant": "other"})
    await client.post("/v1/chat/completions", json=_chat(cache_salt="mine"))
    raw = json.dumps(_chat(), separators=(",", ":")).encode()
    await client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    bodies = _received(engines)[1:]
    assert [b.get("cache_salt") for b in bodies] == [svc.salts.salt("other"), svc.salts.salt("", "mine"), None]
    assert engines[eid].headers[0]["x-request-id"] == r.headers["x-kvmesh-request-id"]


async def test_completions_and_streams_pass_through(stack) -> None:
    svc, engines, client = stack
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "def f(x):", "max_tokens": 2,
                                                   "echo": True})
    assert r.status_code == 200 and _received(engines)[-1]["echo"] is True
    for e in engines.values():
        e.cached_tokens = 0
    r = await client.post("/v1/chat/completions",
                          json=_chat(stream=True, stream_options={"include_usage": True}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in r.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert "".join(json.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[:2]) == "hi"


async def test_the_engines_own_errors_come_back_unchanged(stack) -> None:
    svc, engines, client = stack
    r = await client.post("/v1/chat/completions", json=_chat(max_tokens=0))
    assert r.status_code == 400 and r.json()["error"]["message"] == "max_tokens must be at least 1"
    assert r.headers["x-kvmesh-endpoint"] in engines


async def test_an_engine_dying_mid_stream_ends_the_stream_with_an_error(stack) -> None:
    svc, engines, client = stack
    for e in engines.values():
        e.break_stream = True
    r = await client.post("/v1/chat/completions", json=_chat(stream=True))
    assert r.status_code == 200   # the answer had begun: too late for a status or a retry
    events = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: {")]
    assert events[0]["choices"][0]["delta"]["content"] == "h"
    assert events[-1]["error"]["type"] == "upstream_error" and "broke off" in events[-1]["error"]["message"]
    assert all(svc.core.load.inflight_count(e) == 0 for e in engines)   # the router settled it


async def test_load_comes_from_vllm_metrics(stack) -> None:
    svc, engines, client = stack
    engines["a"].waiting, engines["a"].running, engines["a"].kv_usage = 7, 2, 0.5
    await svc.cluster.poll_all()
    rep = svc.core.load.reports["a"]
    assert (rep.waiting, rep.running, rep.kv_usage) == (7, 2, 0.5)
    # A busy endpoint loses a new conversation to an idle one.
    r = await client.post("/v1/chat/completions", json=_chat(user="fresh-session"))
    assert r.headers["x-kvmesh-endpoint"] == "b"


async def test_an_unreadable_metrics_page_keeps_the_endpoint_routable(stack) -> None:
    svc, engines, client = stack
    engines["a"].metrics_status = 500
    await svc.cluster.poll_all()
    assert svc.core.endpoints["a"].alive
    # Down (a failed connect) comes back with the next page read over a working connection.
    engines["a"].metrics_status = 200
    svc.cluster.mark_dead("a", "test")
    assert not svc.core.endpoints["a"].alive
    await svc.cluster.poll_all()
    assert svc.core.endpoints["a"].alive


async def test_a_dead_endpoint_is_routed_around(stack) -> None:
    svc, engines, client = stack
    await engines["a"].stop()
    # Every conversation lands on b, whether the router tried a first (a refused connect) or not.
    for i in range(4):
        r = await client.post("/v1/chat/completions", json=_chat(user=f"s{i}"))
        assert r.status_code == 200 and r.headers["x-kvmesh-endpoint"] == "b", r.text
    await svc.cluster.poll_all()   # its /metrics connect fails too: down
    assert not svc.core.endpoints["a"].alive
    await engines["b"].stop()
    svc.cluster.mark_dead("b", "test")
    r = await client.post("/v1/chat/completions", json=_chat())
    assert r.status_code == 503 and r.json()["error"]["message"]


async def test_a_session_sent_off_its_endpoint_counts_as_moved(stack) -> None:
    """``kvmesh_router_moved_*`` on the pass-through path (kvmesh.routing.moves): turns that go back
    to their session's endpoint are not moves; the turn its dead endpoint sends elsewhere is one,
    with its engine-reported prompt and cached tokens. A dead endpoint's cache is nothing a move
    gives up (``kvmesh_router_moved_given_up_tokens_total``)."""
    from prometheus_client import REGISTRY

    def moved() -> tuple[float, ...]:
        return tuple(REGISTRY.get_sample_value(f"kvmesh_router_moved_{k}_total") or 0.0
                     for k in ("requests", "prompt_tokens", "cached_tokens", "given_up_tokens"))

    svc, engines, client = stack
    before = moved()
    homes = set()
    for _ in range(2):
        r = await client.post("/v1/chat/completions", json=_chat(session_id="mv"))
        assert r.status_code == 200, r.text
        homes.add(r.headers["x-kvmesh-endpoint"])
    assert len(homes) == 1 and moved() == before
    home = homes.pop()
    other = "b" if home == "a" else "a"
    engines[other].cached_tokens = 3
    await engines[home].stop()
    svc.cluster.mark_dead(home, "test")
    r = await client.post("/v1/chat/completions", json=_chat(session_id="mv"))
    assert r.status_code == 200 and r.headers["x-kvmesh-endpoint"] == other, r.text
    assert moved() == (before[0] + 1, before[1] + 10, before[2] + 3, before[3])


async def test_a_refused_connect_is_retried_on_the_next_endpoint(stack) -> None:
    svc, engines, client = stack
    await engines["a"].stop()
    engines["b"].waiting = 50   # a looks far better: the router tries it first
    await svc.cluster.poll_all()
    svc.core.set_alive("a", True)
    r = await client.post("/v1/chat/completions", json=_chat())
    assert r.status_code == 200 and r.headers["x-kvmesh-endpoint"] == "b"
    assert r.headers["x-kvmesh-attempts"] == "2" and not svc.core.endpoints["a"].alive


@pytest.mark.parametrize(("body", "param", "status"), [
    (b"{not json", "body", 400), (b"[1]", "body", 400), (json.dumps({"messages": []}).encode(), "model", 400),
    (json.dumps({"model": "other", "messages": [{"role": "user", "content": "x"}]}).encode(), "model", 404),
    (json.dumps({"model": MODEL, "messages": [{"content": "x"}]}).encode(), "messages[0]", 400),
    (json.dumps({"model": MODEL, "messages": "x"}).encode(), "messages", 400),
])
async def test_bad_requests_get_a_4xx_and_reach_no_engine(stack, body, param, status) -> None:
    svc, engines, client = stack
    r = await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert not _received(engines)


async def test_bad_completion_prompts_get_a_400(stack) -> None:
    svc, engines, client = stack
    for prompt in (None, "", [], [1, "x"], {"a": 1}):
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (prompt, r.text)
    assert not _received(engines)


async def test_token_id_requests_go_to_vllm_completions(stack) -> None:
    """The router's token path (gRPC Generate) reaches an external engine as a streamed
    completions request of token ids, with the tenant's salt; the ids stream back."""
    svc, engines, client = stack
    for e in engines.values():
        e.cached_tokens = 3
    inp = GenInput(model=MODEL, tokens=[1, 2, 3], tenant="acme",
                   sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.5, stop=["\n"], top_k=-1,
                                                      repetition_penalty=1.5))
    items = [x async for x in svc.generate(inp)]
    assert [ids for kind, ids in items if kind == "chunk"] == [[100], [101]]
    kind, fin = items[-1]
    assert kind == "final" and fin.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert fin.usage.prompt_tokens == 10 and fin.usage.cached_tokens == 3 and fin.output_ids == [100, 101]
    assert fin.routing.endpoint in engines and not fin.routing.split
    got = _received(engines)[-1]
    assert got["prompt"] == [1, 2, 3] and got["return_token_ids"] is True and got["stream"] is True
    assert got["cache_salt"] == svc.salts.salt("acme") and got["stop"] == ["\n"] and got["max_tokens"] == 2
    assert got["stream_options"] == {"include_usage": True} and got["temperature"] == 0.5
    assert got["top_k"] == 0 and got["repetition_penalty"] == 1.5 and "min_p" not in got   # the knobs set, only
    assert all(svc.core.load.inflight_count(e) == 0 for e in engines)


async def test_token_id_requests_the_engine_refuses_keep_its_message(stack) -> None:
    svc, engines, client = stack
    for e in engines.values():
        e.model = "another-model"   # the engine's own validation refuses the request
    with pytest.raises(UpstreamError) as err:
        [x async for x in svc.generate(GenInput(model=MODEL, tokens=[1, 2],
                                                sampling=common_pb2.SamplingParams(max_tokens=2)))]
    assert err.value.grpc_code == grpc.StatusCode.NOT_FOUND and "no such model" in err.value.message
    assert len(_received(engines)) == 1   # refused, not retried elsewhere


async def test_a_token_id_request_survives_a_dead_endpoint(stack) -> None:
    svc, engines, client = stack
    await engines["a"].stop()
    for _ in range(3):
        items = [x async for x in svc.generate(GenInput(model=MODEL, tokens=[5, 6, 7],
                                                        sampling=common_pb2.SamplingParams(max_tokens=2)))]
        assert items[-1][1].routing.endpoint == "b"
def _anthropic(svc) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url="http://router", api_key="k", max_retries=0, http_client=httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=build_app(svc))))


ANTHROPIC_TOOLS = [{"name": "read_file", "description": "Read a file.",
                    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]


async def test_messages_go_to_the_engines_own_messages_api(stack) -> None:
    """/v1/messages: vLLM's own Messages API gets the client's body with the tenant's salt
    (what only vLLM honours, like top_k and a forced tool, included); its answer comes back."""
    svc, engines, _ = stack
    client = _anthropic(svc)
    for e in engines.values():
        e.cached_tokens = 4
    kw = dict(model=MODEL, max_tokens=8, system="You are a coding agent.", tools=ANTHROPIC_TOOLS,
              tool_choice={"type": "tool", "name": "read_file"},
              messages=[{"role": "user", "content": "What is in a.py?"}])
    raw = await client.messages.with_raw_response.create(**kw, extra_headers={"x-tenant": "acme"},
                                                         extra_body={"kvmesh_policy": "precise", "top_k": 5})
    m = await raw.parse()
    assert m.content[0].text == "hi" and m.usage.cache_read_input_tokens == 4 and m.usage.input_tokens == 6
    assert raw.headers["x-kvmesh-endpoint"] in engines and int(raw.headers["x-kvmesh-predicted-cached-tokens"]) >= 0
    got = _received(engines)[-1]
    assert got == {**kw, "top_k": 5, "cache_salt": svc.salts.salt("acme")}   # kvmesh_policy is the router's, not sent
    # Streamed: vLLM's events come through as it wrote them.
    async with client.messages.stream(**kw) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == "hi" and final.usage.cache_read_input_tokens == 4
    assert _received(engines)[-1]["stream"] is True
    assert all(svc.core.load.inflight_count(e) == 0 for e in engines)


async def test_messages_errors_have_anthropics_shape(stack) -> None:
    svc, engines, _ = stack
    client = _anthropic(svc)
    with pytest.raises(anthropic.BadRequestError) as err:   # the router's own validation
        await client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "robot", "content": "x"}])
    assert err.value.body["error"]["type"] == "invalid_request_error" and "messages.0.role" in err.value.message
    with pytest.raises(anthropic.BadRequestError):
        await client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}],
                                     extra_body={"output_config": {"effort": "turbo"}})
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.create(model="nope", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    assert not _received(engines)
    for e in engines.values():
        e.break_stream = True
    with pytest.raises(anthropic.APIStatusError) as err:
        async with client.messages.stream(model=MODEL, max_tokens=8,
                                          messages=[{"role": "user", "content": "x"}]) as stream:
            async for _ in stream:
                pass
    assert "broke off the stream" in str(err.value)
    assert all(svc.core.load.inflight_count(e) == 0 for e in engines)


@pytest.fixture
async def dp_stack(tiny_model_dir):
    """Two external vLLM servers with --data-parallel-size 2 each."""
    engines = {"a": await OpenAIEngine(MODEL).start(), "b": await OpenAIEngine(MODEL).start()}
    for e in engines.values():
        e.engine_loads = {"0": (0, 0, 0.0), "1": (0, 0, 0.0)}
    async with _routed(tiny_model_dir, engines, endpoints=[f"{k}={e.url}" for k, e in engines.items()],
                       external_connect_timeout_s=1.0, external_dp_size=2) as (svc, client):
        yield svc, engines, client


def _reuse_counters() -> tuple[float, float]:
    """The router's (cached, transferred) token counters, over their tiers."""
    from prometheus_client import REGISTRY

    cached = sum(REGISTRY.get_sample_value("kvmesh_router_cached_tokens_total", {"tier": t}) or 0.0
                 for t in ("gpu", "offload"))
    return cached, REGISTRY.get_sample_value("kvmesh_router_transferred_tokens_total") or 0.0


def _reuse_since(before: tuple[float, float]) -> tuple[float, ...]:
    return tuple(a - b for a, b in zip(_reuse_counters(), before, strict=True))


@pytest.fixture
async def pd_stack(tiny_model_dir):
    """A decode engine "d" and a prefill engine "p" behind a router that splits every request."""
    engines = {"d": await OpenAIEngine(MODEL).start(), "p": await OpenAIEngine(MODEL).start()}
    async with _routed(tiny_model_dir, engines, endpoints=[f"d={engines['d'].url}"],
                       prefill_endpoints=[f"p={engines['p'].url}"], split_enabled=True,
                       split_threshold_tokens=1, split_store_wait_s=0.05) as (svc, client):
        yield svc, engines, client


async def test_data_parallel_servers_are_one_endpoint_per_rank(dp_stack) -> None:
    """Each DP rank is an endpoint named as the indexer names its events (<id>_dp<r>), with its own
    engine's load; the rank the router picked serves (vLLM's X-data-parallel-rank header)."""
    svc, engines, client = dp_stack
    assert set(svc.core.endpoints) == {"a", "a_dp1", "b", "b_dp1"}
    engines["a"].engine_loads = {"0": (0, 1, 0.25), "1": (7, 2, 0.5)}
    await svc.cluster.poll_all()
    rep0, rep1 = svc.core.load.reports["a"], svc.core.load.reports["a_dp1"]
    assert (rep0.waiting, rep0.running, rep0.kv_usage) == (0, 1, 0.25)
    assert (rep1.waiting, rep1.running, rep1.kv_usage) == (7, 2, 0.5)
    seen = set()
    for i in range(6):
        r = await client.post("/v1/chat/completions", json=_chat(session_id=f"s{i}"))
        assert r.status_code == 200, r.text
        eid = r.headers["x-kvmesh-endpoint"]
        server, rank = eid.split("_dp") if "_dp" in eid else (eid, "0")
        assert engines[server].headers[-1]["x-data-parallel-rank"] == rank
        seen.add(eid)
    items = [x async for x in svc.generate(GenInput(model=MODEL, tokens=[1, 2, 3],
                                                    sampling=common_pb2.SamplingParams(max_tokens=2)))]
    eid = items[-1][1].routing.endpoint
    server, rank = eid.split("_dp") if "_dp" in eid else (eid, "0")
    assert engines[server].headers[-1]["x-data-parallel-rank"] == rank
    # A server that refuses connections is down with every rank: one failed connect says so.
    await engines["a"].stop()
    svc.cluster.mark_dead("a_dp1", "ConnectError")
    assert not svc.core.endpoints["a"].alive and not svc.core.endpoints["a_dp1"].alive
    assert svc.core.endpoints["b"].alive and svc.core.endpoints["b_dp1"].alive
    for _ in range(4):
        r = await client.post("/v1/chat/completions", json=_chat())
        assert r.status_code == 200 and r.headers["x-kvmesh-endpoint"] in ("b", "b_dp1")


async def test_pd_split_prefills_on_the_prefill_engine_then_decodes(pd_stack) -> None:
    """llm-d's P/D convention toward external engines: the prefill engine gets the body with one
    token, no stream and the connector's prefill_only; then the decode engine gets the client's body."""
    svc, engines, client = pd_stack
    engines["p"].cached_tokens, engines["d"].cached_tokens = 2, 8
    before = _reuse_counters()
    sent = _chat(stream=True, stream_options={"include_usage": True}, n=1, max_completion_tokens=9)
    r = await client.post("/v1/chat/completions", json=sent, headers={"x-tenant": "acme"})
    assert r.status_code == 200 and r.headers["x-kvmesh-endpoint"] == "d"
    assert r.headers["x-kvmesh-split"] == "true" and r.headers["x-kvmesh-prefill-endpoint"] == "p"
    # The hit-rate counter counts what the prefill engine found cached, not the decode engine's restore.
    assert _reuse_since(before) == (2, 6)
    salt = svc.salts.salt("acme")
    (pre,), (dec,) = engines["p"].bodies, engines["d"].bodies
    assert dec == {**sent, "cache_salt": salt}
    want = {**sent, "cache_salt": salt, "stream": False, "max_tokens": 1, "max_completion_tokens": 1,
            "kv_transfer_params": {"kvmesh": {"prefill_only": True}}}
    del want["stream_options"]
    assert pre == want
    assert engines["p"].headers[0]["x-request-id"] == r.headers["x-kvmesh-request-id"] + "-prefill"
    # A prefill engine that is gone costs the split only.
    await engines["p"].stop()
    r = await client.post("/v1/chat/completions", json=_chat(session_id="x"))
    assert r.status_code == 200 and r.headers["x-kvmesh-split"] == "failed" and len(engines["d"].bodies) == 2
    assert all(svc.core.load.inflight_count(e) == 0 for e in engines)


async def test_a_session_id_is_its_tenants_own(stack) -> None:
    """Session ids are the client's choice: another tenant using the same one neither takes over
    the session's home (where its context is counted) nor shares its affinity, and the engine
    gets the id scoped to the tenant."""
    svc, engines, _ = stack
    ws = svc.core.load.working_set

    async def turn(tenant: str, n: int, session: str = "s-shared") -> str:
        items = [x async for x in svc.generate(GenInput(model=MODEL, tokens=list(range(1, n + 1)), tenant=tenant,
                                                        session_id=session,
                                                        sampling=common_pb2.SamplingParams(max_tokens=2)))]
        return items[-1][1].routing.endpoint

    home = await turn("acme", 90)
    assert ws.home(tenant_session("acme", "s-shared")) == (home, 90)
    other = await turn("evil", 40)
    assert ws.home(tenant_session("evil", "s-shared")) == (other, 40)
    assert ws.home(tenant_session("acme", "s-shared")) == (home, 90)   # untouched
    assert ws.home("s-shared") == ("", 0)
    assert tenant_session("acme", "s") != tenant_session("acm", "es") and tenant_session("", "s") == "s"
    # A session id is bounded only by the body: the router keeps a long one as its digest.
    huge = "u" * 100_000
    where = await turn("acme", 50, huge)
    assert ws.home(tenant_session("acme", huge)) == (where, 50) and len(tenant_session("acme", huge)) < 100
    assert not any(len(k) > 300 for k in ws._where)


async def test_pd_split_on_the_token_path_prefills_then_decodes(pd_stack) -> None:
    """gRPC Generate's token path splits toward external engines as the HTTP path does: the prefill
    engine gets the completions request of token ids with one token, no stream and the connector's
    prefill_only; then the decode engine streams. A prefill engine that is gone costs the split only."""
    svc, engines, _ = pd_stack
    engines["p"].cached_tokens, engines["d"].cached_tokens = 4, 9
    inp = GenInput(model=MODEL, tokens=list(range(1, 71)), tenant="acme", request_id="rq-1",
                   sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0))
    before = _reuse_counters()
    items = [x async for x in svc.generate(inp)]
    kind, fin = items[-1]
    assert kind == "final" and [ids for k, ids in items if k == "chunk"] == [[100], [101]]
    assert fin.routing.endpoint == "d" and fin.routing.split and fin.routing.prefill_endpoint == "p"
    # The prefill engine found 4 tokens cached; the decode engine's other 5 came from it: a transfer.
    assert (fin.usage.cached_tokens, fin.routing.reused_tokens, fin.routing.transferred_tokens) == (9, 4, 5)
    assert _reuse_since(before) == (4, 5)
    (pre,), (dec,) = engines["p"].bodies, engines["d"].bodies
    salt = svc.salts.salt("acme")
    assert dec["prompt"] == pre["prompt"] == list(range(1, 71))
    assert dec["stream"] is True and dec["max_tokens"] == 2 and dec["cache_salt"] == salt
    assert "kv_transfer_params" not in dec
    assert pre["stream"] is False and pre["max_tokens"] == 1 and "stream_options" not in pre
    assert pre["kv_transfer_params"] == {"kvmesh": {"prefill_only": True}} and pre["cache_salt"] == salt
    assert pre["temperature"] == 0.0
    # The client's id made unique per request (a retry on another replica may reuse it).
    rid = engines["d"].headers[0]["x-request-id"]
    assert re.fullmatch(r"rq-1-[0-9a-f]{8}", rid) and engines["p"].headers[0]["x-request-id"] == rid + "-prefill"
    assert fin.request_id == "rq-1"
    await engines["p"].stop()
    items = [x async for x in svc.generate(GenInput(model=MODEL, tokens=list(range(2, 72)),
                                                    sampling=common_pb2.SamplingParams(max_tokens=2)))]
    fin = items[-1][1]
    assert fin.routing.endpoint == "d" and not fin.routing.split and "prefill engine failed" in fin.routing.reason
    assert fin.output_ids == [100, 101] and len(engines["d"].bodies) == 2
    assert all(svc.core.load.inflight_count(e) == 0 for e in engines)


async def test_messages_merge_inline_system_prompts_as_vllm_does(stack) -> None:
    """A template that wants the system prompt first (Qwen's): vLLM's /v1/messages merges inline
    system messages into the leading one, so the router predicts the merged conversation."""
    svc, engines, _ = stack
    client = _anthropic(svc)
    seen = []
    prepare = svc.prepare

    async def spy(inp):  # noqa: ANN001, ANN202
        seen.append(inp.chat_request.messages)
        return await prepare(inp)

    svc.prepare = spy
    msgs = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
            {"role": "system", "content": "reminder"}, {"role": "user", "content": "u2"}]
    await client.messages.create(model=MODEL, max_tokens=4, system="S", messages=msgs)
    assert [m["role"] for m in seen[-1]] == ["system", "user", "assistant", "system", "user"]   # kept in place
    svc.tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('System message must be at the beginning.') }}{% endif %}{{ m.content }}{% endfor %}")
    api = _anthropic(svc)   # a new app: the template's need is read once per app
    await api.messages.create(model=MODEL, max_tokens=4, system="S", messages=msgs)
    assert seen[-1][0] == {"content": "Sreminder", "role": "system"}
    assert [m["role"] for m in seen[-1]] == ["system", "user", "assistant", "user"]
    assert _received(engines)[-1]["messages"] == msgs   # the engine still gets the body as sent


def test_endpoint_specs() -> None:
    assert parse_endpoint("v0=http://10.0.0.1:8000/v1/") == ("v0", "http://10.0.0.1:8000")
    assert parse_endpoint("http://10.0.0.1:8000") == ("10.0.0.1:8000", "http://10.0.0.1:8000")
    assert parse_endpoint("w=127.0.0.1:50061") == ("w", "127.0.0.1:50061")
    for bad in ("v0=http://:8000", "v0=http://h:1/?q=1", "v0=https://h:1#x"):
        with pytest.raises(ConfigError):
            parse_endpoint(bad)
    # A prefill engine hands its KV to decode engines of its own kind (external: through the store).
    with pytest.raises(ConfigError, match="external OpenAI prefill endpoint"):
        RouterConfig(prefill_endpoints=["p=http://h:1"]).validate()
    RouterConfig(endpoints=["d=http://h:2"], prefill_endpoints=["p=http://h:1"], auth="off").validate()
    with pytest.raises(ConfigError, match="NAMESPACE/NAME"):
        RouterConfig(inference_pool="just-a-name").validate()


async def test_responses_go_to_the_engines_own_responses_api(stack) -> None:
    """/v1/responses: vLLM's own Responses API gets the client's body with the tenant's salt, what only
    vLLM honours (structured output, reasoning effort, log probabilities) included; its answer and events
    come back; its cached tokens are counted as the engine's."""
    from kvmesh_router import metrics

    svc, engines, client = stack
    for e in engines.values():
        e.cached_tokens = 4
    sent = {"model": MODEL, "instructions": "You are a coding agent.", "max_output_tokens": 8,
            "input": [{"role": "user", "content": "What is in a.py?"}],
            "tools": [{"type": "function", **TOOLS[1]["function"]}], "prompt_cache_key": "conv-1", "store": False,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            "reasoning": {"effort": "low"}, "top_logprobs": 2}
    cached = metrics.CACHED_TOKENS.labels(tier="gpu")._value.get()
    r = await client.post("/v1/responses", json={**sent, "kvmesh_policy": "precise"}, headers={"x-tenant": "acme"})
    assert r.status_code == 200, r.text
    assert r.json()["output"][0]["content"][0]["text"] == "hi" and r.headers["x-kvmesh-endpoint"] in engines
    assert _received(engines)[-1] == {**sent, "cache_salt": svc.salts.salt("acme")}   # kvmesh_policy stays here
    assert metrics.CACHED_TOKENS.labels(tier="gpu")._value.get() == cached + 4
    # Streamed: the engine's events come through as it wrote them, and its usage is read from the last one.
    async with client.stream("POST", "/v1/responses", json={**sent, "stream": True}) as s:
        raw = (await s.aread()).decode()
    assert raw.count("event: ") == 6 and "event: response.completed" in raw
    assert metrics.CACHED_TOKENS.labels(tier="gpu")._value.get() == cached + 8
    # An unknown previous response is the router's 404, before any engine sees it.
    n = len(_received(engines))
    r = await client.post("/v1/responses", json={**sent, "previous_response_id": "resp_1"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    r = await client.post("/v1/responses", json={**sent, "background": True, "store": True})   # run by the router's own workers
    assert r.status_code == 400 and "external engines" in r.json()["error"]["message"]
    assert len(_received(engines)) == n
    assert all(svc.core.load.inflight_count(e) == 0 for e in engines)


async def test_external_engines_answers_are_kept_by_the_router_and_chained(stack) -> None:
    """A stored conversation over external engines: the router keeps each engine answer as it goes by
    (the engine is told store: false), a chained turn reaches the engine as the whole conversation, and
    the answers echo what the router did, streamed or not."""
    svc, engines, client = stack
    first = {"model": MODEL, "input": "What is in a.py?", "max_output_tokens": 8, "instructions": "Be brief."}
    r1 = (await client.post("/v1/responses", json=first)).json()
    assert r1["store"] is True and r1["previous_response_id"] is None
    assert _received(engines)[-1]["store"] is False and _received(engines)[-1]["input"] == "What is in a.py?"
    r2 = (await client.post("/v1/responses", json={"model": MODEL, "previous_response_id": r1["id"],
                                                   "input": "And b.py?", "max_output_tokens": 8})).json()
    assert r2["store"] is True and r2["previous_response_id"] == r1["id"]
    sent = _received(engines)[-1]
    assert "previous_response_id" not in sent and sent["store"] is False and "instructions" not in sent
    assert [(i.get("role"), i.get("id")) for i in sent["input"]] == [
        ("user", sent["input"][0]["id"]), ("assistant", r1["output"][0]["id"]), ("user", sent["input"][2]["id"])]
    assert sent["input"][0]["content"] == "What is in a.py?" and sent["input"][2]["content"] == "And b.py?"
    async with client.stream("POST", "/v1/responses", json={"model": MODEL, "previous_response_id": r2["id"],
                                                            "input": "Thanks.", "stream": True}) as s:
        raw = (await s.aread()).decode()
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events][0] == "response.created" and events[-1]["type"] == "response.completed"
    done = events[-1]["response"]
    assert done["store"] is True and done["previous_response_id"] == r2["id"]
    assert events[0]["response"]["previous_response_id"] == r2["id"]
    assert raw.count("event: ") == 6   # every event came through
    got = (await client.get(f"/v1/responses/{done['id']}")).json()
    assert got["output"] == done["output"]
    items = (await client.get(f"/v1/responses/{done['id']}/input_items", params={"order": "asc"})).json()["data"]
    assert [i["content"][0]["text"] for i in items if i.get("role") == "user"] == ["What is in a.py?", "And b.py?",
                                                                          "Thanks."]
    # store: false goes through as the client sent it, and nothing is kept.
    r4 = (await client.post("/v1/responses", json={**first, "store": False})).json()
    assert r4.get("store") is not True and (await client.get(f"/v1/responses/{r4['id']}")).status_code == 404


async def test_a_conversation_over_external_engines(stack) -> None:
    """The Conversations API over external engines: each engine gets the conversation so far (store false),
    and its input and output join the conversation as they pass."""
    svc, engines, client = stack
    c = (await client.post("/v1/conversations", json={"items": [{"role": "developer", "content": "Repo."}]})).json()
    for turn in ("First?", "Second?"):
        r = await client.post("/v1/responses", json={"model": MODEL, "conversation": c["id"], "input": turn,
                                                     "max_output_tokens": 4, "store": False})
        assert r.status_code == 200, r.text
        assert r.json()["conversation"] == {"id": c["id"]} and r.json()["store"] is False
    sent = _received(engines)[-1]
    assert sent["store"] is False and "conversation" not in sent
    assert [(i.get("role"), i["content"] if isinstance(i["content"], str) else i["content"][0]["text"])
            for i in sent["input"]] == [("developer", "Repo."), ("user", "First?"), ("assistant", "hi"),
                                        ("user", "Second?")]
    items = (await client.get(f"/v1/conversations/{c['id']}/items", params={"order": "asc"})).json()["data"]
    assert [i.get("role") for i in items] == ["developer", "user", "assistant", "user", "assistant"]


@pytest.mark.parametrize("doc, want", [
    ({"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 7}}}, 7),
    ({"usage": {"prompt_tokens": 9, "prompt_tokens_details": None}}, None),   # no --enable-prompt-tokens-details
    ({"usage": {"prompt_tokens": 9}}, None),
    ({"usage": {"prompt_tokens_details": {"cached_tokens": -1}}}, None),
    ({"usage": {"prompt_tokens_details": {"cached_tokens": True}}}, None),
    ({"usage": {"prompt_tokens_details": {"cached_tokens": "7"}}}, None),
    ({"usage": {"prompt_tokens_details": [7]}}, None),
    ({"usage": {"input_tokens": 2, "cache_read_input_tokens": 5}}, 5),   # an Anthropic Messages answer
    ([1, 2], None),
])
def test_a_prefill_answers_cached_tokens_are_read_only_when_well_formed(doc, want) -> None:
    """A split's reuse is the prefill engine's reported count; an answer without one (or with a
    malformed one) leaves the decode engine's count in place (``RouterService.count_reuse``)."""
    import httpx

    from kvmesh_router.external_split import answer_cached_tokens

    assert answer_cached_tokens(httpx.Response(200, json=doc)) == want
    assert answer_cached_tokens(httpx.Response(200, content=b"not json")) is None
