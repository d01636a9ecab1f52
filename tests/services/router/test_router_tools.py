"""Agent-style chat through the router with the official ``openai`` client: tool calls (sim tool mode),
streamed and not, the same prompt ids as the worker's own HTTP API, honest 400s, truthful defaults."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from kvmesh.openai.requests import UNSUPPORTED
from kvmesh_tools.testing.procs import ServiceProcess
from tests.fixtures.router import MODEL, RouterStack, start_router, start_worker
from tests.helpers.chat_cases import TOOLS

pytestmark = pytest.mark.timeout(240)

MAX_MODEL_LEN = 2048
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in TOOLS}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> Iterator[tuple[RouterStack, str]]:
    tmp = tmp_path_factory.mktemp("router-tools")
    started: list[ServiceProcess] = []
    try:
        w = start_worker(tmp, "w1", extra=["--tokenizer", str(tiny_model_dir), "--max-model-len", str(MAX_MODEL_LEN)],
                         port_flags=["--http-port"])
        started.append(w)
        http_port = w.flag_port("--http-port")
        router, http = start_router(tmp, [("w1", w.grpc_address)],
                                    extra=["--tokenizer-path", str(tiny_model_dir)])
        started.append(router)
        yield RouterStack(router, http, {"w1": w}), f"http://127.0.0.1:{http_port}"
    finally:
        for p in reversed(started):
            p.stop(grace_s=3)


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack[0].http_base + "/v1", api_key="k", max_retries=0, timeout=60)


def _history() -> list[dict]:
    return [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": [{"type": "text", "text": "What's the weather in Paris?"},
                                         {"type": "text", "text": "Then read the README."}]}]


def _check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_tool_round_trip_non_streaming(client) -> None:
    msgs = _history()
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=8)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == TOOLS[0]["function"]["name"]
    _check_call(call.function.name, call.function.arguments)
    # The agent runs the tool and sends the result back; with tool_choice "none" the model answers.
    msgs += [{"role": "assistant", "content": choice.message.content, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    r2 = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert r2.choices[0].finish_reason == "length" and not r2.choices[0].message.tool_calls
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    assert r2.usage.prompt_tokens_details.cached_tokens > 0   # the earlier turn's prefix was reused


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "edit"}}])
def test_tool_call_streamed_as_deltas(client, choice) -> None:
    rid = f"stream-{json.dumps(choice)}"
    stream = client.chat.completions.create(model=MODEL, messages=_history(), tools=TOOLS, tool_choice=choice,
                                            max_tokens=8, stream=True, extra_headers={"x-request-id": rid})
    calls: dict[int, dict] = {}
    finish = None
    pieces = 0
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                acc = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                acc["id"] += d.id or ""
                acc["name"] += d.function.name or ""
                acc["arguments"] += d.function.arguments or ""
                pieces += 1
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    assert pieces >= 2    # the call streamed in pieces, not whole at the end
    want = choice["function"]["name"] if isinstance(choice, dict) else TOOLS[0]["function"]["name"]
    assert calls[0]["name"] == want and calls[0]["id"]
    _check_call(want, calls[0]["arguments"])
    # The same request unstreamed gives the same call (the sim builds it from the schema; its id
    # is per request, as vLLM's), and the SDK's own accumulation of the deltas agrees with ours.
    plain = client.chat.completions.create(model=MODEL, messages=_history(), tools=TOOLS, tool_choice=choice,
                                           max_tokens=8, extra_headers={"x-request-id": rid})
    [call] = plain.choices[0].message.tool_calls
    assert [call.function.name, call.function.arguments] == [calls[0]["name"], calls[0]["arguments"]]
    assert call.id.startswith("call_") and call.id != calls[0]["id"]
    ours: dict[int, dict] = {}
    with client.chat.completions.stream(model=MODEL, messages=_history(), tools=TOOLS, tool_choice=choice,
                                        max_tokens=8, extra_headers={"x-request-id": rid}) as s:
        for event in s:
            if event.type == "chunk":
                for c in event.chunk.choices:
                    for d in c.delta.tool_calls or []:
                        acc = ours.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                        acc["id"] += d.id or ""
                        acc["name"] += d.function.name or ""
                        acc["arguments"] += d.function.arguments or ""
        final = s.get_final_completion()
    [acc] = final.choices[0].message.tool_calls
    assert [acc.id, acc.function.name, acc.function.arguments] == list(ours[0].values())
    assert [acc.function.name, acc.function.arguments] == [calls[0]["name"], calls[0]["arguments"]]


def test_router_and_worker_render_the_same_ids(client, stack) -> None:
    """Same request to the router (renders, sends ids over gRPC) and to the worker's HTTP API (renders
    itself): same prompt length and, greedy in the sim, the same output (a function of the prompt's tail)."""
    body = {"model": MODEL, "messages": _history() + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "Sunny"}]}],
        "tools": TOOLS, "tool_choice": "none", "max_tokens": 6, "temperature": 0}
    via_router = httpx.post(stack[0].http_base + "/v1/chat/completions", json=body, timeout=60).json()
    via_worker = httpx.post(stack[1] + "/v1/chat/completions", json=body, timeout=60).json()
    assert via_router["usage"]["prompt_tokens"] == via_worker["usage"]["prompt_tokens"]
    assert via_router["choices"][0]["token_ids"] == via_worker["choices"][0]["token_ids"]


BAD_VALUES = {"logprobs": True, "top_logprobs": 2,
              "prompt_logprobs": 1, "logit_bias": {"5": 10}, "best_of": 2, "use_beam_search": True, "suffix": "x", "echo": True,
              "guided_json": {"type": "object"}, "guided_regex": "a+",
              "guided_choice": ["a"], "guided_grammar": "root ::= a",
              "functions": [{"name": "f"}], "function_call": "auto", "audio": {"voice": "x"},
              "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"},
              "web_search_options": {"search_context_size": "low"}, "min_tokens": 3,
              "truncate_prompt_tokens": 10}


# Qwen3-Coder's recommended settings, and min_p and presence_penalty besides.
KNOB_VALUES = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "min_p": 0.05,
               "presence_penalty": 0.5, "frequency_penalty": 0.0}


def test_vllm_sampling_knobs_are_served_and_checked_alike(client, stack) -> None:
    """The router and the worker's own HTTP API serve vLLM's penalties, top_k and min_p, and refuse a
    value vLLM would refuse with the same 400 naming it (kvmesh.sampling)."""
    r = client.chat.completions.create(model=MODEL, messages=_history(), max_tokens=3, extra_body=KNOB_VALUES)
    assert r.usage.completion_tokens == 3
    w = httpx.post(stack[1] + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                       **KNOB_VALUES, "top_k": -1}, timeout=30)
    assert w.status_code == 200, w.text
    # Hostile values too: past the protocol's 32-bit fields, a 400, never a 500.
    for param, bad in (("top_k", -2), ("repetition_penalty", 0), ("presence_penalty", 3), ("min_p", "0.1"),
                       ("top_k", 2**40), ("repetition_penalty", 1e39)):
        with pytest.raises(openai.BadRequestError) as ei:
            client.chat.completions.create(model=MODEL, messages=_history(), max_tokens=2, extra_body={param: bad})
        assert ei.value.body["param"] == param and param in ei.value.body["message"]
        w = httpx.post(stack[1] + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                           param: bad}, timeout=30)
        assert w.status_code == 400 and w.json()["error"]["message"] == ei.value.body["message"]


def test_every_unsupported_parameter_has_a_value_here() -> None:
    assert set(BAD_VALUES) == set(UNSUPPORTED)


@pytest.mark.parametrize("param", sorted(UNSUPPORTED))
def test_unsupported_parameter_gets_a_400_naming_it(client, stack, param) -> None:
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=_history(), max_tokens=2,
                                       extra_body={param: BAD_VALUES[param]})
    assert ei.value.body["param"] == param and param in ei.value.body["message"]
    # The worker's own HTTP API refuses it the same way.
    r = httpx.post(stack[1] + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                       param: BAD_VALUES[param]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


@pytest.mark.parametrize("extra,param", [
    ({"chat_template_kwargs": {"not_in_template": 1}}, "chat_template_kwargs.not_in_template"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
])
def test_chat_field_errors_name_the_field(client, extra, param) -> None:
    body = {"messages": _history(), **extra}
    msgs = body.pop("messages")
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, extra_body=body)
    assert ei.value.body["param"] == param


def test_models_and_default_max_tokens_use_the_workers_max_model_len(client) -> None:
    [m] = client.models.list().data
    assert m.model_extra["max_model_len"] == MAX_MODEL_LEN
    r = client.chat.completions.create(model=MODEL, messages=_history())
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == MAX_MODEL_LEN
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=_history(), max_tokens=MAX_MODEL_LEN)
    assert ei.value.body["param"] == "messages"


# -- the same over the router's gRPC API ------------------------------------------------------------

def _grpc_chat(stack, messages: list[dict], choice: object = None, rid: str = "", **chat_kw):
    """A gRPC Generate of an OpenAI-shaped conversation: (chunks, final)."""
    from kvmesh_api.common.v1 import common_pb2
    from kvmesh_api.router.v1 import router_pb2

    msgs = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content)
        msgs.append(router_pb2.ChatMessage(
            role=m["role"], content=content or "", tool_call_id=m.get("tool_call_id", ""),
            tool_calls=[common_pb2.ToolCall(id=c["id"], name=c["function"]["name"],
                                            arguments=c["function"]["arguments"]) for c in m.get("tool_calls") or []]))
    chat = router_pb2.ChatMessages(messages=msgs, tools_json=json.dumps(TOOLS), **chat_kw)
    if choice is not None:
        chat.tool_choice_json = json.dumps(choice)
    req = router_pb2.GenerateRequest(model=MODEL, chat=chat, request_id=rid,
                                     sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0))
    out = list(stack[0].stub.Generate(req, timeout=60))
    return [r.chunk for r in out if r.HasField("chunk")], out[-1].final


@pytest.mark.parametrize("choice", [None, "required", {"type": "function", "function": {"name": "edit"}}])
def test_grpc_tool_call_round_trip(client, stack, choice) -> None:
    """gRPC carries tools and tool calls both ways: the call comes back in Final.tool_calls and as
    parsed deltas that join to it, equal to what the HTTP front door returns for the same request."""
    from kvmesh_api.common.v1 import common_pb2

    rid = f"grpc-{json.dumps(choice)}"
    history = [{"role": "system", "content": "You are a coding agent."},
               {"role": "user", "content": "What's the weather in Paris? Then read the README."}]
    chunks, final = _grpc_chat(stack, history, choice, rid)
    assert final.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    [call] = final.tool_calls
    want = choice["function"]["name"] if isinstance(choice, dict) else TOOLS[0]["function"]["name"]
    assert call.name == want and call.id
    _check_call(call.name, call.arguments)
    joined: dict[int, list[str]] = {}
    for c in chunks:
        if c.parsed:
            for d in c.tool_call_deltas:
                acc = joined.setdefault(d.index, ["", "", ""])
                acc[0] += d.id
                acc[1] += d.name
                acc[2] += d.arguments
    assert joined == {0: [call.id, call.name, call.arguments]}
    http = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0,
                                          extra_headers={"x-request-id": rid},
                                          **({} if choice is None else {"tool_choice": choice}))
    [hcall] = http.choices[0].message.tool_calls
    assert (hcall.function.name, hcall.function.arguments) == (call.name, call.arguments)
    assert hcall.id.startswith("call_") and call.id.startswith("call_")
    assert http.usage.prompt_tokens == final.usage.prompt_tokens
    # The agent's next turn: its call and the tool's result, rendered as over HTTP (same prompt length).
    turn2 = history + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny"}]
    _, final2 = _grpc_chat(stack, turn2, "none")
    assert not final2.tool_calls and final2.finish_reason == common_pb2.FINISH_REASON_LENGTH
    http2 = client.chat.completions.create(model=MODEL, messages=turn2, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, temperature=0)
    assert final2.usage.prompt_tokens == http2.usage.prompt_tokens > final.usage.prompt_tokens


@pytest.mark.parametrize("field,value,words", [
    ("tools_json", "[{", "tools"), ("tools_json", '{"a": 1}', "tools"),
    ("tool_choice_json", '"sometimes"', "tool_choice"),
    ("tool_choice_json", '{"type": "function", "function": {"name": "nope"}}', "tool_choice"),
    ("chat_template_kwargs_json", "[1]", "chat_template_kwargs")])
def test_grpc_bad_tool_fields_are_invalid_argument_naming_the_field(stack, field, value, words) -> None:
    import grpc

    from kvmesh_api.router.v1 import router_pb2

    chat = router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content="hi")],
                                   tools_json=json.dumps(TOOLS))
    setattr(chat, field, value)
    with pytest.raises(grpc.RpcError) as ei:
        list(stack[0].stub.Generate(router_pb2.GenerateRequest(model=MODEL, chat=chat), timeout=30))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in ei.value.details()


@pytest.mark.parametrize("tools", [False, True])
def test_grpc_add_generation_prompt_false_is_honoured(client, stack, tools) -> None:
    """``ChatMessages.add_generation_prompt`` is proto3 ``optional``: unset renders with the
    generation prompt (OpenAI's default), an explicit false without it, as the HTTP front door
    renders the same conversation (with and without tools, which take another path)."""
    from kvmesh_api.common.v1 import common_pb2
    from kvmesh_api.router.v1 import router_pb2

    history = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Say hi."}]

    def grpc_prompt(**kw) -> int:  # noqa: ANN003
        chat = router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(**m) for m in history],
                                       tools_json=json.dumps(TOOLS) if tools else "", **kw)
        out = list(stack[0].stub.Generate(router_pb2.GenerateRequest(
            model=MODEL, chat=chat, sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0)), timeout=60))
        return out[-1].final.usage.prompt_tokens

    def http_prompt(agp: bool) -> int:
        extra = {"tools": TOOLS} if tools else {}
        r = client.chat.completions.create(model=MODEL, messages=history, max_tokens=1, temperature=0,
                                           extra_body={"add_generation_prompt": agp}, **extra)
        return r.usage.prompt_tokens

    unset, yes, no = grpc_prompt(), grpc_prompt(add_generation_prompt=True), grpc_prompt(add_generation_prompt=False)
    assert unset == yes == http_prompt(True)
    assert no == http_prompt(False) < yes
