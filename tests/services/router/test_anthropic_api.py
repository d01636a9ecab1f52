"""The router's Anthropic Messages API, driven by the official ``anthropic`` client and raw HTTP,
against a real router with two sim workers and the tiny model's tokenizer and chat template."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import pytest

from kvmesh.tokenization import load_tokenizer
from kvmesh_tools.testing.ports import free_port
from kvmesh_tools.testing.procs import ServiceProcess
from tests.fixtures.router import MODEL, RouterStack, keys_args, start_router, start_workers

pytestmark = pytest.mark.timeout(120)
AUTH = {"x-api-key": "sk-tenant-a"}
KEYS = "tenant-a sk-tenant-a\ntenant-b sk-tenant-b\n"
MAX_BODY = 200_000
SYSTEM = "You are a careful coding agent. Answer tersely and use tools when they help. " * 8
TOOLS = [{"name": "read_file", "description": "Read a file from the workspace.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> Iterator[RouterStack]:
    tmp = tmp_path_factory.mktemp("router-anthropic")
    started: list[ServiceProcess] = []
    try:
        ws = start_workers(tmp, ["w1", "w2"])
        started.extend(ws.values())
        router, http = start_router(tmp, [(e, w.grpc_address) for e, w in ws.items()],
                                    extra=["--tokenizer-path", str(tiny_model_dir), "--max-prompt-tokens", "8000",
                                           "--max-text-bytes", str(MAX_BODY),
                                           *keys_args(tmp, KEYS)])
        started.append(router)
        yield RouterStack(router, http, ws)
    finally:
        for p in reversed(started):
            p.stop(grace_s=3)


def _client(stack: RouterStack, key: str = "sk-tenant-a") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.http_base, api_key=key, max_retries=0, timeout=30)


@pytest.fixture
def client(stack) -> anthropic.Anthropic:
    return _client(stack)


def _rendered_tokens(tiny_model_dir, messages: list[dict], tools: list[dict] | None = None) -> int:
    """The prompt length of an OpenAI-style conversation rendered locally with the tiny model's template."""
    tok = load_tokenizer(tiny_model_dir)
    return len(tok.encode(tok.render_chat(messages, tools=tools, add_generation_prompt=True)))


def _total_input(u) -> int:
    return u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)


def test_text_answer_with_usage(client, tiny_model_dir):
    msgs = [{"role": "user", "content": "Say hi in three words."}]
    m = client.messages.create(model=MODEL, max_tokens=5, system="You are terse.", messages=msgs,
                               extra_body={"temperature": 0.0, "top_p": 1.0, "top_k": 20},
                               extra_headers={"anthropic-beta": "x"})
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and isinstance(m.content[0].text, str)
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 5
    expected = _rendered_tokens(tiny_model_dir, [{"role": "system", "content": "You are terse."}, *msgs])
    assert _total_input(m.usage) == expected


def test_streaming_has_the_exact_event_sequence(client, stack):
    body = {"model": MODEL, "max_tokens": 6, "stream": True, "messages": [{"role": "user", "content": "Stream!"}]}
    with httpx.stream("POST", stack.http_base + "/v1/messages", json=body, timeout=30,
                      headers={**AUTH, "anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    events = [ln.removeprefix("event: ") for ln in lines if ln.startswith("event: ")]
    docs = [json.loads(ln.removeprefix("data: ")) for ln in lines if ln.startswith("data: ")]
    assert [d["type"] for d in docs] == events
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[3:-3]) == {"content_block_delta"}
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in docs[3:-3])
    delta = docs[-2]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 6
    start = docs[0]["message"]
    assert start["content"] == [] and start["usage"]["output_tokens"] == 0
    assert _total_input_doc(start["usage"]) == _total_input_doc(delta["usage"])

    # The official client rebuilds the same message from those events.
    with client.messages.stream(model=MODEL, max_tokens=6, messages=body["messages"]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.content[0].text == text and final.usage.output_tokens == 6 and final.stop_reason == "max_tokens"


def _total_input_doc(u: dict) -> int:
    return u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_second_turn_reads_the_cache_and_count_tokens_agrees(client, stream):
    first = [{"role": "user", "content": f"Turn one ({stream}): " + "explain the build system in detail. " * 30}]
    sys_ = f"({stream}) " + SYSTEM   # a prompt no earlier test cached
    count1 = client.messages.count_tokens(model=MODEL, system=sys_, messages=first).input_tokens
    m1 = client.messages.create(model=MODEL, max_tokens=8, system=sys_, messages=first)
    assert m1.usage.cache_read_input_tokens == 0 and m1.usage.input_tokens == count1
    second = first + [{"role": "assistant", "content": m1.content[0].text},
                      {"role": "user", "content": "Now the tests, please."}]
    count2 = client.messages.count_tokens(model=MODEL, system=sys_, messages=second).input_tokens
    if stream:
        with client.messages.stream(model=MODEL, max_tokens=8, system=sys_, messages=second) as s:
            m2 = s.get_final_message()
    else:
        m2 = client.messages.create(model=MODEL, max_tokens=8, system=sys_, messages=second)
    assert m2.usage.cache_read_input_tokens > 0
    assert m2.usage.cache_creation_input_tokens == 0
    assert _total_input(m2.usage) == count2 > count1


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences_end_the_text(client, stream):
    msgs = [{"role": "user", "content": f"Write a long paragraph ({stream})."}]
    greedy = {"temperature": 0}   # the SDK no longer lists temperature; the wire still takes it
    full = client.messages.create(model=MODEL, max_tokens=40, messages=msgs, extra_body=greedy).content[0].text
    # A stop sequence the (deterministic, temperature 0) answer is known to contain, past its start.
    stop = next(full[i:i + 3] for i in range(4, len(full) - 3) if full[i:i + 3].strip())
    cut = full[:full.find(stop)]
    if stream:
        with client.messages.stream(model=MODEL, max_tokens=40, messages=msgs, extra_body=greedy,
                                    stop_sequences=["\x00never", stop]) as s:
            streamed = "".join(s.text_stream)
            m = s.get_final_message()
        assert streamed == cut
    else:
        m = client.messages.create(model=MODEL, max_tokens=40, messages=msgs, extra_body=greedy,
                                   stop_sequences=["\x00never", stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == cut
    assert 0 < m.usage.output_tokens < 40 and _total_input(m.usage) > 0


def _ask_tool(client, messages: list[dict], stream: bool, request_id: str):
    """One turn with tools; streamed, the message the client rebuilds from the events, and how many
    ``input_json_delta`` pieces the tool's input came in."""
    kw = dict(model=MODEL, max_tokens=8, system=SYSTEM, tools=TOOLS, messages=messages,
              tool_choice={"type": "auto"}, extra_headers={"x-request-id": request_id})
    if not stream:
        return client.messages.create(**kw), 0
    pieces = 0
    with client.messages.stream(**kw) as s:
        for ev in s:
            if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
                pieces += 1
        return s.get_final_message(), pieces


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_round_trip_renders_the_tool_result(client, tiny_model_dir, stream):
    user = {"role": "user", "content": "What does setup.cfg say?"}
    # The sim's tool mode calls the tool; its call is a function of the request id, so a streamed and
    # a plain answer to the same request id must carry the same call.
    m1, pieces = _ask_tool(client, [user], stream, f"tool-rt-{stream}")
    assert m1.stop_reason == "tool_use"
    [use] = [b for b in m1.content if b.type == "tool_use"]
    assert use.name == "read_file" and use.id
    jsonschema.validate(use.input, TOOLS[0]["input_schema"])
    if stream:
        plain, _ = _ask_tool(client, [user], False, "tool-rt-plain")
        [want] = [b for b in plain.content if b.type == "tool_use"]
        assert (use.name, use.input) == (want.name, want.input)
        assert pieces >= 2   # the input really streamed, in pieces
    result = "[metadata]\nname = kvmesh-tool-result-marker\n"
    turn2 = [user,
             {"role": "assistant", "content": [
                 {"type": "text", "text": "Reading it."},
                 {"type": "tool_use", "id": use.id, "name": "read_file", "input": use.input}]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": result}]},
                 {"type": "text", "text": "Summarize it."}]}]
    m2, _ = _ask_tool(client, turn2, stream, f"tool-rt2-{stream}")
    count = client.messages.count_tokens(model=MODEL, system=SYSTEM, tools=TOOLS, messages=turn2).input_tokens
    # The prompt is the tiny template's rendering of the OpenAI-style conversation, tool call and result
    # included: the engine saw the tool result.
    oa_tools = [{"type": "function", "function": {"name": "read_file", "description": TOOLS[0]["description"],
                                                  "parameters": TOOLS[0]["input_schema"]}}]
    oa = [{"role": "system", "content": SYSTEM}, user,
          {"role": "assistant", "content": "Reading it.", "tool_calls": [
              {"id": use.id, "type": "function",   # vLLM's key order: arguments, then name
               "function": {"arguments": json.dumps(use.input), "name": "read_file"}}]},
          {"role": "tool", "tool_call_id": use.id, "content": result},
          {"role": "user", "content": "Summarize it."}]
    assert count == _total_input(m2.usage) == _rendered_tokens(tiny_model_dir, oa, oa_tools)
    no_result = _rendered_tokens(tiny_model_dir, [m for m in oa if m["role"] != "tool"], oa_tools)
    assert count > no_result
    assert m2.usage.cache_read_input_tokens > 0   # turn 1's prompt is a prefix of turn 2's


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "read_file"}])
def test_forced_tool_choice_reaches_the_worker(client, choice):
    """``any`` and ``tool`` force a call (the worker constrains its output; the sim's tool mode calls)."""
    m = client.messages.create(model=MODEL, system=SYSTEM, tools=TOOLS, tool_choice=choice, max_tokens=16,
                               messages=[{"role": "user", "content": "Read setup.cfg."}])
    [use] = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "read_file"
    jsonschema.validate(use.input, TOOLS[0]["input_schema"])


def test_tenants_by_x_api_key_are_isolated(stack):
    msgs = [{"role": "user", "content": "tenant isolation check " * 40}]
    a, b = _client(stack, "sk-tenant-a"), _client(stack, "sk-tenant-b")
    a.messages.create(model=MODEL, max_tokens=2, messages=msgs)
    assert a.messages.create(model=MODEL, max_tokens=2, messages=msgs).usage.cache_read_input_tokens > 0
    assert b.messages.create(model=MODEL, max_tokens=2, messages=msgs).usage.cache_read_input_tokens == 0


@pytest.mark.parametrize("how", ["metadata", "header"])
def test_session_keeps_unrelated_prompts_on_one_endpoint(stack, how):
    endpoints = set()
    for i in range(4):
        body = {"model": MODEL, "max_tokens": 2,
                "messages": [{"role": "user", "content": f"unrelated prompt number {i} about {how}"}]}
        headers = dict(AUTH)
        if how == "metadata":
            body["metadata"] = {"user_id": f"user_abc_session_{how}"}
        else:
            headers["x-session-id"] = f"session-{how}"
        r = httpx.post(stack.http_base + "/v1/messages", json=body, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        endpoints.add(r.json()["kvmesh"]["endpoint"])
    assert len(endpoints) == 1


def _bad(**over):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    body.update(over)
    return {k: v for k, v in body.items() if v is not None}


@pytest.mark.parametrize("body,status,etype,field", [
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error", "max_tokens"),
    (_bad(max_tokens="ten"), 400, "invalid_request_error", "max_tokens"),
    (_bad(max_tokens=0), 400, "invalid_request_error", "max_tokens"),
    (_bad(messages=[{"role": "robot", "content": "hi"}]), 400, "invalid_request_error", "messages.0.role"),
    (_bad(messages="hi"), 400, "invalid_request_error", "messages"),
    (_bad(messages=[]), 400, "invalid_request_error", "messages"),
    (_bad(messages=[{"role": "user", "content": 7}]), 400, "invalid_request_error", "messages.0.content"),
    (_bad(messages=[{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]),
     400, "invalid_request_error", "messages.0.content.0"),
    (_bad(temperature=3), 400, "invalid_request_error", "temperature"),
    (_bad(top_k=0), 400, "invalid_request_error", "top_k"),
    (_bad(top_k=2**40), 400, "invalid_request_error", "top_k"),   # past the protocol's int32: a 400, not a 500
    (_bad(stop_sequences="END"), 400, "invalid_request_error", "stop_sequences"),
    (_bad(system=[{"type": "image"}]), 400, "invalid_request_error", "system.0.type"),
    (_bad(tools=[{"name": "t"}]), 400, "invalid_request_error", "tools.0.input_schema"),
    (_bad(tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400, "invalid_request_error",
     "tools.0.type"),
    (_bad(tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": "yes"}), 400,
     "invalid_request_error", "tool_choice.disable_parallel_tool_use"),
    (_bad(tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}), 400, "invalid_request_error",
     "tool_choice.name"),
    (_bad(thinking={"type": "enabled", "budget_tokens": 100}), 400, "invalid_request_error", "thinking.budget_tokens"),
    (_bad(thinking={"type": "enabled", "budget_tokens": 2048}), 400, "invalid_request_error", "endpoint"),
    (_bad(frobnicate=True), 400, "invalid_request_error", "frobnicate"),
    (_bad(metadata={"user_id": 5}), 400, "invalid_request_error", "metadata.user_id"),
    (_bad(model="claude-opus-4"), 404, "not_found_error", "model"),
    (_bad(max_tokens=10_000_000), 400, "invalid_request_error", "max_tokens"),
])
def test_bad_requests_get_anthropic_errors(stack, body, status, etype, field):
    r = httpx.post(stack.http_base + "/v1/messages", json=body, timeout=10, headers=AUTH)
    assert r.status_code == status, r.text
    doc = r.json()
    assert doc["type"] == "error" and doc["error"]["type"] == etype
    assert doc["error"]["message"].startswith(field), doc


def test_garbage_bodies_and_unknown_routes(stack, client):
    base = stack.http_base
    r = httpx.post(base + "/v1/messages", content=b"\xff{garbage" * (1_000_000 // 10), timeout=10,
                   headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = httpx.post(base + "/v1/messages", content=b"{not json", timeout=10,
                   headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(base + "/v1/messages/count_tokens", json=[1, 2], timeout=10, headers=AUTH)
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.get(base + "/v1/messages", timeout=10, headers=AUTH)
    assert r.status_code == 405 and r.json()["type"] == "error"
    r = httpx.post(base + "/v1/messages/batches", json={}, timeout=10, headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    # The official client raises the matching exception classes.
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    # The model list and one model, in the fields of Anthropic's model object too.
    assert [m.id for m in client.models.list()] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.type == "model" and card.display_name == MODEL
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("claude-nope")
    # The router still answers after all of that.
    assert client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "ok?"}]).usage


def test_no_live_endpoint_is_overloaded_error(tmp_path, procs, tiny_model_dir):
    # The only endpoint's address has nothing listening: every attempt fails before a token.
    router, http = start_router(tmp_path, [("gone", f"127.0.0.1:{free_port()}")],
                                extra=["--tokenizer-path", str(tiny_model_dir)])
    procs(router)
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{http}", api_key="k", max_retries=0, timeout=30)
    msgs = [{"role": "user", "content": "anyone there?"}]
    with pytest.raises(anthropic.OverloadedError) as err:
        client.messages.create(model=MODEL, max_tokens=4, messages=msgs)
    assert err.value.status_code == 529 and err.value.body["error"]["type"] == "overloaded_error"
    with pytest.raises(anthropic.OverloadedError):   # a stream fails before it starts: a status, not an event
        with client.messages.stream(model=MODEL, max_tokens=4, messages=msgs) as s:
            s.get_final_message()
    assert client.messages.count_tokens(model=MODEL, messages=msgs).input_tokens > 0   # no endpoint needed


def test_a_claude_code_2_1_197_turn_is_answered(client):
    """The real Claude Code 2.1.197 failed on its first request (a 400 on ``context_management``): every
    turn it sends adaptive thinking, a context edit that keeps all thinking, an effort and a JSON
    ``metadata.user_id``. vLLM's /v1/messages serves that; so does the router, streamed, and the
    conversation's second turn reads the first from the cache."""
    extra = {"thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
             "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}}
    meta = {"user_id": '{"device_id":"d1","account_uuid":"","session_id":"cc-session-1"}'}
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197; cch=1;"},
              {"type": "text", "text": "You are Claude Code. " * 40, "cache_control": {"type": "ephemeral"}}]
    turn = [{"role": "user", "content": "List the files."}]
    with client.messages.stream(model=MODEL, max_tokens=8, system=system, messages=turn, metadata=meta,
                                extra_body=extra) as s:
        first = s.get_final_message()
    assert first.stop_reason == "max_tokens" and first.content[0].type == "text"
    turn += [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "Now read a.py."}]
    second = client.messages.create(model=MODEL, max_tokens=4, system=system, messages=turn, metadata=meta,
                                    extra_body=extra)
    assert second.usage.cache_read_input_tokens > 0
