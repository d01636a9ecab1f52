"""The worker's OpenAI HTTP API over a real sim engine: answers, streaming, cache usage, bad input."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from kvmesh.worker.engine.sim.engine import SimEngine, SimEngineConfig
from kvmesh.worker.http_api import ENDPOINT_HEADER, HttpApiServer, start_http_api

# One engine + server (and one tokenizer load) for the whole module.
pytestmark = [pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="module")]
MODEL = "sim-http"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def api(tiny_model_dir: Path) -> AsyncIterator[tuple[httpx.AsyncClient, HttpApiServer, SimEngine]]:
    engine = SimEngine(SimEngineConfig(model=MODEL, endpoint_id="w-http", block_size=16, num_blocks=512,
                                       time_scale=50, enable_events=False))
    await engine.start()
    server = await start_http_api(engine, host="127.0.0.1", port=0, tokenizer=str(tiny_model_dir),
                                  endpoint_id="w-http")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as client:
        yield client, server, engine
    await server.stop()
    await engine.stop()


async def test_completion_with_token_ids_reports_cached_tokens(api) -> None:
    client, _, _ = api
    prompt = list(range(100, 180))
    first = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 5})
    assert first.status_code == 200, first.text
    assert first.headers[ENDPOINT_HEADER] == "w-http"
    body = first.json()
    assert body["object"] == "text_completion" and len(body["choices"][0]["token_ids"]) == 5
    assert body["usage"]["prompt_tokens"] == 80 and body["usage"]["completion_tokens"] == 5
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt + [7, 8], "max_tokens": 2})
    # the 80-token prefix is 5 full blocks of 16, now in the engine's prefix cache
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 80


async def test_a_reused_request_id_is_two_requests(api) -> None:
    """As on vLLM: two requests in flight under one x-request-id (a client reusing it, a gateway
    retrying a dropped try) both succeed, and both answers carry the client's id."""
    client, _, engine = api
    body = {"model": MODEL, "prompt": list(range(300, 380)), "max_tokens": 64}
    headers = {"x-request-id": "same-id"}
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=headers) as first:
        assert first.status_code == 200
        lines = first.aiter_lines()
        assert (await anext(lines)).startswith("data: ")   # the first request is decoding
        assert engine.load().running >= 1
        second = await client.post("/v1/completions", json=body, headers=headers)
        rest = [line async for line in lines if line]
    assert second.status_code == 200, second.text
    assert second.json()["id"] == "same-id" and second.json()["usage"]["completion_tokens"] == 64
    assert rest[-1] == "data: [DONE]"
    assert json.loads(next(x for x in reversed(rest) if x.startswith("data: {"))[6:])["id"] == "same-id"
    longest = await client.post("/v1/completions", json=body, headers={"x-request-id": "x" * 128})
    assert longest.status_code == 200 and longest.json()["id"] == "x" * 128, longest.text


async def test_chat_and_streaming(api) -> None:
    client, _, _ = api
    msgs = [{"role": "user", "content": "hello there, worker"}]
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 4})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": msgs, "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks if c["choices"]) == 4
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


async def test_text_prompt_and_models(api) -> None:
    client, _, _ = api
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "once upon a time", "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 0
    r = await client.get("/v1/models")
    assert r.json()["data"][0]["id"] == MODEL
    r = await client.get(f"/v1/models/{MODEL}")
    assert r.status_code == 200 and r.json() == (await client.get("/v1/models")).json()["data"][0]
    r = await client.get("/v1/models/org/other")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert (await client.get("/health")).status_code == 200


@pytest.mark.parametrize(("body", "status", "needle"), [
    ({"prompt": [1, 2]}, 400, "'model' is required"),
    ({"model": "other", "prompt": [1, 2]}, 404, "not served here"),
    ({"model": MODEL}, 400, "'prompt' is required"),
    ({"model": MODEL, "prompt": ""}, 400, "empty"),
    ({"model": MODEL, "prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": [1, 2], "max_tokens": "3"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": [1, 2], "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": [1, 2], "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": [1, 2], "n": 2}, 400, "'n'"),
    ({"model": MODEL, "prompt": [1, 2], "stream": "yes"}, 400, "stream"),
    ({"model": MODEL, "prompt": [[1, 2], [3]]}, 400, "batched"),
    ({"model": MODEL, "prompt": [1, 999999999]}, 400, ""),
])
async def test_bad_completions_get_clear_errors(api, body, status, needle) -> None:
    client, _, _ = api
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status


async def test_bad_chat_and_body(api) -> None:
    client, _, _ = api
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"content": "no role"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    r = await client.post("/v1/completions", content=b"[1, 2]")
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = await client.post("/v1/completions", content=b"\xff\xfe")
    assert r.status_code == 400


async def test_stream_validation_errors_are_http_errors_not_events(api) -> None:
    client, _, _ = api
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 999999999], "stream": True})
    assert r.status_code == 400, r.text


async def test_without_tokenizer_text_needs_token_ids() -> None:
    engine = SimEngine(SimEngineConfig(model=MODEL, endpoint_id="w-notok", block_size=16, num_blocks=64,
                                       time_scale=50, enable_events=False))
    await engine.start()
    server = await start_http_api(engine, host="127.0.0.1", port=0)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as c:
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "text"})
            assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "stop": ["x"]})
            assert r.status_code == 400 and "stop" in r.json()["error"]["message"]
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 2})
            assert r.status_code == 200
    finally:
        await server.stop()
        await engine.stop()


async def test_errors_share_the_openai_shape(api) -> None:
    client, _, _ = api
    r = await client.get("/v1/nowhere")
    assert r.status_code == 404 and r.headers[ENDPOINT_HEADER] == "w-http"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 999999999]})
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.fixture
def seen(api, monkeypatch) -> list:
    """The engine requests the API makes during a test, in order."""
    engine = api[2]
    out: list = []
    real = engine.generate

    def spy(req, *a, **kw):
        out.append(req)
        return real(req, *a, **kw)

    monkeypatch.setattr(engine, "generate", spy)
    return out


async def test_sampling_knobs_reach_the_engine_request(api, seen) -> None:
    """vLLM's penalties, top_k and min_p go into the engine's request (top_k -1 as 0); unsent ones
    keep the values that change nothing."""
    client, _, _ = api
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, "top_k": -1,
                                                   "repetition_penalty": 1.05, "min_p": 0.1})
    assert r.status_code == 200, r.text
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 200, r.text
    sent, plain = seen
    assert (sent.top_k, sent.repetition_penalty, sent.min_p, sent.presence_penalty) == (0, 1.05, 0.1, 0.0)
    assert (plain.top_k, plain.repetition_penalty, plain.min_p, plain.frequency_penalty) == (0, 1.0, 0.0, 0.0)


async def test_structured_outputs_reach_the_engine_request(api, seen) -> None:
    """``response_format`` becomes the engine request's spec, as at the router; this sim engine has no
    tokenizer to write a matching answer with, so it refuses (a 400 that says how to fix it)."""
    client, _, _ = api
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "response_format": {"type": "json_object"}, "structured_outputs": {"disable_any_whitespace": True}})
    assert r.status_code == 400 and "--tokenizer" in r.json()["error"]["message"], r.text
    assert seen[0].structured_outputs == {"json_object": True, "disable_any_whitespace": True}
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 2,
                                                   "structured_outputs": {"choice": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text


RESPONSES_TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file.",
                    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


async def test_responses_api_on_the_worker(api) -> None:
    """/v1/responses on the worker itself (Envoy forwards a Responses body to the pod the picker chose):
    the prompt of the chat it converts to, function calls as items, streamed events ending in
    response.completed, and Responses errors in OpenAI's shape."""
    client, _, _ = api
    chat = await client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 3, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]})
    r = await client.post("/v1/responses", json={"model": MODEL, "instructions": "Be brief.", "input": "hi",
                                                 "max_output_tokens": 3})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert r.headers[ENDPOINT_HEADER] == "w-http" and doc["object"] == "response"
    assert doc["usage"]["input_tokens"] == chat.json()["usage"]["prompt_tokens"]
    assert doc["status"] == "incomplete" and doc["output"][0]["type"] == "message"
    body = {"model": MODEL, "input": [{"role": "user", "content": "Read a.py"}], "tools": RESPONSES_TOOLS,
            "max_output_tokens": 16}
    calls = (await client.post("/v1/responses", json=body)).json()["output"]
    assert [o["type"] for o in calls] == ["function_call"] and calls[0]["name"] == "read_file"
    assert isinstance(json.loads(calls[0]["arguments"]), dict)
    async with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as s:
        raw = (await s.aread()).decode()
    events = [json.loads(block.split("\ndata: ", 1)[1]) for block in raw.strip().split("\n\n")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed"
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["function_call"]
    bad = await client.post("/v1/responses", json={**body, "previous_response_id": "resp_1"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "previous_response_id"
    other = await client.post("/v1/responses", json={**body, "model": "nope"})
    assert other.status_code == 404


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 4000}),
    ("/v1/responses", {"input": "Write a long story.", "max_output_tokens": 4000}),
])
async def test_a_client_gone_mid_stream_frees_the_engine(api, path, body) -> None:
    """The engine stops decoding for a client that closed its stream; it does not run to max tokens."""
    client, _, engine = api
    async with client.stream("POST", path, json={"model": MODEL, "stream": True, **body}) as s:
        lines = s.aiter_lines()
        assert (await anext(lines)).startswith(("data: ", "event: "))
        assert engine.load().running >= 1
    for _ in range(100):
        if engine.load().running == 0:
            break
        await asyncio.sleep(0.05)
    assert engine.load().running == 0


async def test_a_reasoning_worker_answers_with_its_reasoning_apart(tiny_model_dir: Path) -> None:
    """A worker started with a reasoning parser (the sim splits by position) answers chat and
    Responses requests on its own HTTP API as vLLM's server does: ``reasoning`` beside the content,
    streamed as ``reasoning`` deltas that add up to it; completions are not parsed."""
    engine = SimEngine(SimEngineConfig(model=MODEL, endpoint_id="w-think", block_size=16, num_blocks=512,
                                       time_scale=50, enable_events=False, tokenizer=str(tiny_model_dir),
                                       reasoning_tokens=4))
    await engine.start()
    server = await start_http_api(engine, host="127.0.0.1", port=0, tokenizer=str(tiny_model_dir),
                                  endpoint_id="w-think")
    body = {"model": MODEL, "max_tokens": 10, "seed": 9, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Why?"}]}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as client:
            whole = (await client.post("/v1/chat/completions", json=body)).json()
            msg = whole["choices"][0]["message"]
            assert msg["reasoning"] and whole["usage"]["completion_tokens_details"]["reasoning_tokens"] == 4
            async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
                raw = (await s.aread()).decode()
            deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in raw.splitlines()
                      if line.startswith("data: {")]
            assert "".join(d.get("reasoning") or "" for d in deltas) == msg["reasoning"]
            assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
            bare = (await client.post("/v1/chat/completions", json={**body, "include_reasoning": False})).json()
            assert "reasoning" not in bare["choices"][0]["message"]
            assert bare["choices"][0]["message"]["content"] == msg["content"]
            r = (await client.post("/v1/responses", json={
                "model": MODEL, "input": "Why?", "max_output_tokens": 10, "seed": 9, "ignore_eos": True})).json()
            assert [o["type"] for o in r["output"]] == ["reasoning", "message"]
            assert r["output"][0]["content"][0]["text"] == msg["reasoning"]
            assert r["usage"]["output_tokens_details"]["reasoning_tokens"] == 4
            comp = (await client.post("/v1/completions", json={"model": MODEL, "prompt": "Why?", "max_tokens": 6})
                    ).json()
            assert "reasoning" not in comp["choices"][0]
    finally:
        await server.stop()
        await engine.stop()
