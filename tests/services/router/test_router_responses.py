"""The OpenAI Responses API through the router with the official ``openai`` client, as Codex CLI uses
it: the whole conversation as ``input`` every turn (``store: false``), flat function tools, calls
answered with ``function_call_output`` items, streamed events, ``prompt_cache_key`` as the session.
A real router process over a real sim worker (tool mode), on loopback."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.fixtures.router import MODEL, RouterStack, one_worker_stack
from tests.helpers.chat_cases import TOOLS as CHAT_TOOLS

pytestmark = pytest.mark.timeout(240)

# Responses tools are flat: {"type": "function", "name", "description", "parameters", "strict"}.
TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
SCHEMAS = {t["name"]: t.get("parameters") or {"type": "object"} for t in TOOLS}
INSTRUCTIONS = "You are a coding agent."
ASK = [{"role": "user", "content": [{"type": "input_text", "text": "What's the weather in Paris?"},
                                    {"type": "input_text", "text": "Then read the README."}]}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> Iterator[RouterStack]:
    with one_worker_stack(tmp_path_factory.mktemp("router-responses"), tiny_model_dir, ["--tokenizer", str(tiny_model_dir), "--max-model-len", "2048"]) as st:
        yield st


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_base + "/v1", api_key="k", max_retries=0, timeout=60)


def _check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_text_answer_is_the_chat_answer(client) -> None:
    """Instructions + input render as system + user messages: the same prompt, and (greedy) the same
    text as the chat completion of that conversation."""
    r = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input="Say hi.", max_output_tokens=6,
                                temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Say hi."}])
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == INSTRUCTIONS and r.max_output_tokens == 6 and r.store is True
    # The second time the prompt's blocks are cached: the hit is in the field clients read.
    again = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input="Say hi.", max_output_tokens=6,
                                    temperature=0)
    assert again.usage.input_tokens_details.cached_tokens > 0


def test_input_tokens_counts_the_prompt_create_sends(client) -> None:
    kw = dict(model=MODEL, instructions=INSTRUCTIONS, input=ASK, tools=TOOLS)
    count = client.responses.input_tokens.count(**kw)
    assert count.object == "response.input_tokens"
    assert count.input_tokens == client.responses.create(**kw, max_output_tokens=2).usage.input_tokens
    with pytest.raises(openai.NotFoundError):   # resolved as create resolves it: no such stored item
        client.responses.input_tokens.count(model=MODEL, input=[{"type": "item_reference", "id": "x"}])


def test_codex_style_tool_loop(client) -> None:
    """Turn 1 answers with a function call; turn 2 sends the whole history back with the call's output
    (no server state) and reuses turn 1's cached prefix."""
    key = "codex-conversation-1"
    r1 = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=ASK, tools=TOOLS,
                                 max_output_tokens=8, prompt_cache_key=key, store=False)
    calls = [o for o in r1.output if o.type == "function_call"]
    assert len(calls) == 1 and r1.status == "completed"
    call = calls[0]
    assert call.name == TOOLS[0]["name"] and call.call_id and call.id.startswith("fc_")
    _check_call(call.name, call.arguments)
    history: list[Any] = ASK + [o.model_dump(exclude_none=True) for o in r1.output]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"})
    r2 = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=history, tools=TOOLS,
                                 tool_choice="none", max_output_tokens=8, prompt_cache_key=key, store=False)
    assert [o.type for o in r2.output] == ["message"] and r2.status == "incomplete"
    assert r2.usage.input_tokens > r1.usage.input_tokens
    assert r2.usage.input_tokens_details.cached_tokens > 0   # turn 1's prefix was reused


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "name": "edit"}])
def test_streamed_events_build_the_final_response(client, choice) -> None:
    events = list(client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=ASK, tools=TOOLS,
                                          tool_choice=choice, max_output_tokens=8, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) >= 2   # the call streamed in pieces, not whole at the end
    done = [e.item for e in events if e.type == "response.output_item.done"]
    final = events[-1].response
    assert [o.model_dump() for o in final.output] == [d.model_dump() for d in done]
    [call] = [o for o in final.output if o.type == "function_call"]
    want = choice["name"] if isinstance(choice, dict) else TOOLS[0]["name"]
    assert call.name == want and "".join(d.delta for d in deltas) == call.arguments
    _check_call(call.name, call.arguments)
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [a.item.id for a in added] == [d.id for d in done]
    assert final.usage.output_tokens > 0
    # The SDK's own stream helper reads the same events into the same answer.
    with client.responses.stream(model=MODEL, instructions=INSTRUCTIONS, input=ASK, tools=TOOLS, tool_choice=choice,
                                 max_output_tokens=8) as s:
        got = s.get_final_response()
    [c2] = [o for o in got.output if o.type == "function_call"]
    assert (c2.name, c2.arguments) == (call.name, call.arguments)


PATCH_TOOL = {"type": "custom", "name": "apply_patch", "description": "Apply a patch to the workspace."}


def test_custom_tool_round_trip(client) -> None:
    """A free-form tool: the call comes back as a custom_tool_call with its text input (unwrapped from vLLM's
    one-string shim), streamed as its input whole, and its output goes back as a custom_tool_call_output."""
    kw: dict[str, Any] = dict(model=MODEL, instructions=INSTRUCTIONS, input=ASK, tools=[PATCH_TOOL, TOOLS[1]],
                              tool_choice={"type": "custom", "name": "apply_patch"}, max_output_tokens=16)
    r = client.responses.create(**kw)
    [call] = r.output
    assert call.type == "custom_tool_call" and call.name == "apply_patch" and isinstance(call.input, str)
    assert call.id.startswith("ctc_") and call.call_id
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" not in kinds
    [done] = [e.item for e in events if e.type == "response.output_item.done"]
    assert done.type == "custom_tool_call" and done.input == call.input   # the sim's call is a function of the prompt
    assert "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta") == call.input
    history: list[Any] = ASK + [call.model_dump(exclude_none=True),
                                {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"}]
    r2 = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=history, tools=[PATCH_TOOL, TOOLS[1]],
                                 tool_choice="none", max_output_tokens=4)
    assert [o.type for o in r2.output] == ["message"]
    assert r2.usage.input_tokens_details.cached_tokens > 0


# What Codex 0.171 sends every turn besides function tools: its sub-agent tools in a namespace,
# OpenAI's hosted web search, reasoning summaries and client metadata.
AGENTS = {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for sub-agents.", "tools": [
    {"type": "function", "name": "spawn_agent", "description": "Spawn a sub-agent.", "strict": False,
     "parameters": {"type": "object", "properties": {"task": {"type": "string"}}, "required": ["task"],
                    "additionalProperties": False}}]}
CODEX_EXTRAS: dict[str, Any] = {"reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"],
                                "extra_body": {"client_metadata": {"turn_id": "t1"}}}


def test_a_codex_0171_turn_with_a_namespace_and_web_search(client) -> None:
    """The namespace's function is offered under vLLM's flat name, web search is left out of the prompt
    (the model cannot call it), and a call of the namespace's function comes back with its own name
    and its ``namespace``, whole and streamed; sent back in the history, it is reused from the cache."""
    tools = [TOOLS[0], AGENTS, {"type": "web_search", "external_web_access": False}]
    kw: dict[str, Any] = dict(model=MODEL, instructions=INSTRUCTIONS, input=ASK, tools=tools, max_output_tokens=16,
                              tool_choice={"type": "function", "name": "spawn_agent"}, **CODEX_EXTRAS)
    r = client.responses.create(**kw)
    [call] = r.output
    assert (call.type, call.name, call.namespace) == ("function_call", "spawn_agent", "multi_agent_v1")
    assert json.loads(call.arguments) == {"task": "kvmesh"}
    with client.responses.stream(**kw) as s:
        [streamed] = s.get_final_response().output
    assert (streamed.name, streamed.namespace, streamed.arguments) == (call.name, call.namespace, call.arguments)
    history: list[Any] = ASK + [call.model_dump(exclude_none=True),
                                {"type": "function_call_output", "call_id": call.call_id, "output": "agent 7"}]
    r2 = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=history, tools=tools,
                                 tool_choice="none", max_output_tokens=4, **CODEX_EXTRAS)
    assert r2.usage.input_tokens_details.cached_tokens > 0
    with pytest.raises(openai.BadRequestError):   # a hosted tool cannot be forced
        client.responses.create(**{**kw, "tool_choice": {"type": "web_search"}})


def test_streamed_text(client) -> None:
    events = list(client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=6, temperature=0,
                                          stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1]   # response.completed, as vLLM ends a stream the token limit cut
    assert final.type == "response.completed" and final.response.status == "incomplete"
    assert final.response.incomplete_details.reason == "max_output_tokens"
    assert final.response.output_text == text
    with client.responses.stream(model=MODEL, input="Say hi.", max_output_tokens=6, temperature=0) as s:
        assert s.get_final_response().output_text == text   # the SDK's helper needs response.completed
    plain = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=6, temperature=0)
    assert plain.output_text == text
    kinds = [e.type for e in events]
    assert kinds.index("response.output_text.done") < kinds.index("response.content_part.done") \
        < kinds.index("response.output_item.done")


@pytest.mark.parametrize("body,param,words", [
    ({"tools": [{"type": "image_to_hologram"}]}, "tools[0]", "function, namespace and custom tools"),
    ({"input": None}, "input", "required"),
    ({"input": []}, "input", "non-empty"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}]},
     "input[0]", "text only"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0]", "not supported"),
    ({"input": [{"type": "reasoning", "encrypted_content": "gAAAA"}]}, "input[0]", "encrypted"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"temperature": 3}, "temperature", "[0, 2]"),
    ({"top_k": -7}, "top_k", "top_k"),
    ({"text": {"format": {"type": "yaml"}}}, "text", "json_schema"),
    ({"reasoning": {"effort": "turbo"}}, "reasoning", "reasoning"),
    ({"top_logprobs": 2}, "top_logprobs", "log probabilities"),
    ({"background": True, "store": False}, "background", "store: true"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice", "nope"),
    ({"metadata": {"k": 1}}, "metadata", "metadata"),
    ({"truncation": "auto"}, "truncation", "disabled"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(client, body, param, words) -> None:
    req = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **body}
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/responses", body=req, cast_to=dict)
    err = e.value.body
    assert err["param"] == param and words in err["message"], err


def test_a_background_response_through_the_stack(client) -> None:
    """background=True through the real router and workers: answered at once, polled to its answer,
    which then chains like any stored response."""
    r = client.responses.create(model=MODEL, input="Summarise the lexer module.", max_output_tokens=8,
                                background=True)
    assert r.status == "queued" and r.background is True
    deadline = time.monotonic() + 30
    while (got := client.responses.retrieve(r.id)).status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert got.status in ("completed", "incomplete") and got.output_text and got.usage.output_tokens > 0
    nxt = client.responses.create(model=MODEL, previous_response_id=r.id, input="Shorter.", max_output_tokens=4)
    assert nxt.usage.input_tokens > got.usage.input_tokens


def test_unknown_model_and_retrieval_are_404s(client, stack) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="gpt-4o", input="hi", max_output_tokens=4)
    assert e.value.body["param"] == "model"
    for call in (lambda: client.responses.retrieve("resp_123"),
                 lambda: client.responses.create(model=MODEL, input="hi", previous_response_id="resp_123"),
                 lambda: client.responses.create(model=MODEL, input=[{"type": "item_reference", "id": "msg_1"}])):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert "not found" in e.value.body["message"]
    r = httpx.post(stack.http_base + "/v1/responses", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"


def test_the_session_is_the_prompt_cache_key(client) -> None:
    """Two conversations with the same text but different keys are two sessions; the decision says so."""
    for key in ("conv-a", "conv-b"):
        r = client.responses.create(model=MODEL, input="Same text.", max_output_tokens=2, prompt_cache_key=key)
        assert r.model_extra["kvmesh"]["endpoint"] == "w1"


def test_a_chained_turn_is_the_prefix_its_first_turn_cached(client, stack) -> None:
    """Through the real stack: the second turn names the first by id and sends only its new message. It
    is routed to where the first turn's prefix is cached, and its prompt is the one a client sending the
    whole conversation sends."""
    r1 = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input="Explain the scheduler. " * 40,
                                 max_output_tokens=6, prompt_cache_key="chain-1")
    r2 = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, previous_response_id=r1.id,
                                 input="And the block manager?", max_output_tokens=6, prompt_cache_key="chain-1")
    assert r2.previous_response_id == r1.id and r2.store is True
    whole = [{"role": "user", "content": "Explain the scheduler. " * 40},
             *[o.model_dump(exclude_none=True) for o in r1.output],
             {"role": "user", "content": "And the block manager?"}]
    r3 = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=whole, max_output_tokens=6,
                                 prompt_cache_key="chain-1", store=False)
    assert r2.usage.input_tokens == r3.usage.input_tokens > r1.usage.input_tokens
    counted = client.responses.input_tokens.count(model=MODEL, instructions=INSTRUCTIONS, previous_response_id=r1.id,
                                                  input="And the block manager?")
    assert counted.input_tokens == r2.usage.input_tokens   # counted as create renders the chain
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens // 2
    assert client.responses.retrieve(r2.id).output[0].content[0].text == r2.output_text
