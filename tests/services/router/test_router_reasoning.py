"""A reasoning model's answers through every door, with the official clients: the chat
``reasoning`` field (whole and streamed, ``include_reasoning``), a Responses ``reasoning`` item, an
Anthropic ``thinking`` block, the router's gRPC ``reasoning_delta``; with tools, the reasoning
comes first and the calls after it. A real router process over a real sim worker started with a
reasoning parser: the sim splits its answer by position (``kvmesh.worker.engine.sim.reasoning``:
the first ``--sim-reasoning-tokens`` output tokens are the reasoning), so each test checks the
split against the answer's own token ids. A vLLM worker's parse (vLLM's own parsers) is in
``tests/services/router/test_router_vllm_reasoning.py``."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import grpc
import httpx
import openai
import pytest

from kvmesh_api.router.v1 import router_pb2
from tests.fixtures.router import MODEL, RouterStack, one_worker_stack

pytestmark = pytest.mark.timeout(240)

THINK = 6   # --sim-reasoning-tokens
ASK = [{"role": "user", "content": "Why does the test in utils_test.py fail?"}]
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                            "parameters": {"type": "object", "properties": {
                                                "path": {"type": "string"}}, "required": ["path"]}}}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> Iterator[RouterStack]:
    with one_worker_stack(tmp_path_factory.mktemp("router-reasoning"), tiny_model_dir,
                          ["--tokenizer", str(tiny_model_dir), "--max-model-len", "2048",
                           "--reasoning-parser", "deepseek_r1", "--sim-reasoning-tokens", str(THINK)]) as st:
        yield st


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_base + "/v1", api_key="k", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(tiny_hf_tokenizer):
    return tiny_hf_tokenizer


def _split(tok, ids: list[int]) -> tuple[str, str]:
    """What the sim's reasoning mode makes of an answer's token ids."""
    return tok.decode(ids[:THINK], skip_special_tokens=True), tok.decode(ids[THINK:], skip_special_tokens=True)


def test_chat_answer_carries_its_reasoning_apart(client, tok) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, seed=3, extra_body={"ignore_eos": True})
    msg = r.choices[0].message
    ids = r.choices[0].model_extra["token_ids"]
    reasoning, content = _split(tok, ids)
    assert msg.model_extra["reasoning"] == reasoning and reasoning
    assert msg.content == content
    assert r.usage.completion_tokens_details.reasoning_tokens == THINK


def test_chat_stream_adds_up_to_the_whole_answer(client) -> None:
    kw = dict(model=MODEL, messages=ASK, max_tokens=16, seed=5, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0].message
    reasoning, content = [], []
    for c in client.chat.completions.create(stream=True, **kw):
        if c.choices:
            d = c.choices[0].delta
            reasoning.append((d.model_extra or {}).get("reasoning") or "")
            content.append(d.content or "")
    assert "".join(reasoning) == whole.model_extra["reasoning"]
    assert "".join(content) == whole.content


def test_include_reasoning_false_drops_it(client) -> None:
    kw = dict(model=MODEL, messages=ASK, max_tokens=16, seed=3)
    full = client.chat.completions.create(extra_body={"ignore_eos": True}, **kw).choices[0].message
    bare = client.chat.completions.create(extra_body={"ignore_eos": True, "include_reasoning": False}, **kw)
    assert "reasoning" not in (bare.choices[0].message.model_extra or {})
    assert bare.choices[0].message.content == full.content
    streamed = client.chat.completions.create(stream=True, extra_body={"ignore_eos": True, "include_reasoning": False},
                                              **kw)
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert not any((d.model_extra or {}).get("reasoning") for d in deltas)
    assert "".join(d.content or "" for d in deltas) == full.content


def test_completions_are_not_parsed(client, tok) -> None:
    r = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=12, seed=1,
                                  extra_body={"ignore_eos": True})
    ids = r.choices[0].model_extra["token_ids"]
    assert r.choices[0].text == tok.decode(ids, skip_special_tokens=True)


def test_tool_call_after_reasoning(client) -> None:
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=32, seed=2, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.tool_calls and msg.tool_calls[0].function.name == "read_file"
    assert msg.model_extra["reasoning"]
    reasoning, names, args = [], [], []
    for c in client.chat.completions.create(stream=True, **kw):
        if not c.choices:
            continue
        d = c.choices[0].delta
        reasoning.append((d.model_extra or {}).get("reasoning") or "")
        for tc in d.tool_calls or []:
            assert not "".join(args) or not reasoning[-1], "reasoning after a call began"
            names.append(tc.function.name or "")
            args.append(tc.function.arguments or "")
    assert "".join(reasoning) == msg.model_extra["reasoning"]
    assert "".join(names) == "read_file"
    assert json.loads("".join(args)) == json.loads(msg.tool_calls[0].function.arguments)


def test_responses_reasoning_item_whole_and_streamed(client, stack) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, seed=4,
                                          extra_body={"ignore_eos": True}).choices[0].message
    kw = dict(model=MODEL, input=ASK, max_output_tokens=16, extra_body={"seed": 4, "ignore_eos": True})
    r = client.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == chat.model_extra["reasoning"]
    assert r.output_text == chat.content
    assert r.usage.output_tokens_details.reasoning_tokens == THINK
    kinds, deltas = [], []
    with client.responses.stream(**kw) as s:
        for e in s:
            kinds.append(e.type)
            if e.type == "response.reasoning_text.delta":
                deltas.append(e.delta)
        final = s.get_final_response()
    assert "".join(deltas) == chat.model_extra["reasoning"]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == chat.model_extra["reasoning"]
    # The next turn sends the reasoning item back, as Codex does: it is the assistant's reasoning.
    nxt = httpx.post(stack.http_base + "/v1/responses", json={
        "model": MODEL, "max_output_tokens": 4,
        "input": [*ASK, r.output[0].model_dump(exclude_none=True), r.output[1].model_dump(exclude_none=True),
                  {"role": "user", "content": "and now?"}]}, timeout=60)
    assert nxt.status_code == 200, nxt.text


def test_anthropic_thinking_block_whole_and_streamed(stack, client) -> None:
    # Temperature 0: the sim's answer is a function of the prompt, the same through both APIs.
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16,
                                          temperature=0).choices[0].message
    ac = anthropic.Anthropic(base_url=stack.http_base, api_key="k", max_retries=0, timeout=60)
    kw = dict(model=MODEL, messages=ASK, max_tokens=16, extra_body={"temperature": 0})
    m = ac.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == chat.model_extra["reasoning"] and m.content[0].signature
    assert m.content[1].text == chat.content
    with ac.messages.stream(**kw) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == m.content[0].thinking and final.content[0].signature
    assert final.content[1].text == m.content[1].text
    assert "thinking" in events and "signature" in events
    # The thinking block goes back in the next turn, as Claude Code sends it.
    nxt = ac.messages.create(model=MODEL, max_tokens=4, messages=[
        *ASK, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": "and now?"}])
    assert nxt.stop_reason in ("max_tokens", "end_turn")


def test_anthropic_thinking_then_tool_use(stack) -> None:
    ac = anthropic.Anthropic(base_url=stack.http_base, api_key="k", max_retries=0, timeout=60)
    tools = [{"name": "read_file", "description": "Read a file",
              "input_schema": TOOLS[0]["function"]["parameters"]}]
    m = ac.messages.create(model=MODEL, messages=ASK, tools=tools, max_tokens=32)
    assert [b.type for b in m.content][0] == "thinking"
    assert m.content[-1].type == "tool_use" and m.stop_reason == "tool_use"
    with ac.messages.stream(model=MODEL, messages=ASK, tools=tools, max_tokens=32) as s:
        final = s.get_final_message()
    assert final.content[0].type == "thinking" and final.content[-1].type == "tool_use"


def test_grpc_stream_carries_reasoning_deltas(stack, client) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, seed=7,
                                          extra_body={"ignore_eos": True}).choices[0].message
    req = router_pb2.GenerateRequest(model=MODEL, chat=router_pb2.ChatMessages(messages=[
        router_pb2.ChatMessage(role="user", content=ASK[0]["content"])]))
    req.sampling.max_tokens = 16
    req.sampling.seed = 7
    req.sampling.ignore_eos = True
    reasoning, content, final = [], [], None
    for msg in stack.stub.Generate(req, timeout=60):
        if msg.HasField("chunk") and msg.chunk.parsed:
            reasoning.append(msg.chunk.reasoning_delta)
            content.append(msg.chunk.content_delta)
        elif msg.HasField("final"):
            final = msg.final
    assert final is not None
    assert "".join(reasoning) == final.reasoning == chat.model_extra["reasoning"]
    assert "".join(content) == final.content == chat.content
    assert final.usage.reasoning_tokens == THINK
    # include_reasoning false (vLLM's flag, as the HTTP door takes it): the same answer without it.
    req.include_reasoning = False
    msgs = list(stack.stub.Generate(req, timeout=60))
    quiet = msgs[-1].final
    assert not any(m.chunk.reasoning_delta for m in msgs if m.HasField("chunk"))
    assert quiet.reasoning == "" and quiet.content == chat.content and quiet.usage.reasoning_tokens == THINK


def test_a_worker_without_a_tokenizer_refuses_the_setting(tmp_path) -> None:
    from kvmesh.config import ConfigError
    from kvmesh.worker.config import WorkerConfig

    with pytest.raises(ConfigError, match="tokenizer"):
        WorkerConfig(engine="sim", reasoning_parser="deepseek_r1").validate()


def test_grpc_errors_are_unchanged(stack) -> None:
    """A chat request without messages is still the gRPC contract's INVALID_ARGUMENT."""
    req = router_pb2.GenerateRequest(model=MODEL, chat=router_pb2.ChatMessages())
    with pytest.raises(grpc.RpcError) as e:
        list(stack.stub.Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_reasoning_effort_is_rendered_as_vllm_renders_it(client, stack) -> None:
    """vLLM's ``reasoning_effort`` (chat) and ``reasoning.effort`` (Responses) become the template
    keywords ``reasoning_effort`` / ``enable_thinking``; the tiny template reads neither, so the
    prompt is unchanged. A value vLLM does not know is a 400 naming the field."""
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    high = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, reasoning_effort="high")
    assert high.usage.prompt_tokens == plain.usage.prompt_tokens
    r = client.responses.create(model=MODEL, input=ASK, max_output_tokens=2, reasoning={"effort": "low"})
    assert r.usage.input_tokens == plain.usage.prompt_tokens and r.reasoning.effort == "low"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, extra_body={"reasoning_effort": "turbo"})
    assert e.value.body["param"] == "reasoning_effort"
    bad = httpx.post(stack.http_base + "/v1/responses", json={"model": MODEL, "input": "hi",
                                                             "reasoning": {"effort": "turbo"}}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning"


def test_a_thinking_budget_caps_the_reasoning(client, stack) -> None:
    """vLLM's ``thinking_token_budget`` (chat) and Anthropic's ``thinking`` ``enabled`` budget reach
    the worker: the sim's reasoning stops at the budget."""
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, seed=3,
                                       extra_body={"ignore_eos": True, "thinking_token_budget": 2})
    assert r.usage.completion_tokens_details.reasoning_tokens == 2
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                       extra_body={"thinking_token_budget": -5})
    assert e.value.body["param"] == "thinking_token_budget"
    ac = anthropic.Anthropic(base_url=stack.http_base, api_key="k", max_retries=0, timeout=60)
    m = ac.messages.create(model=MODEL, messages=ASK, max_tokens=16,
                           extra_body={"thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert m.content[0].type == "thinking"
    with pytest.raises(anthropic.BadRequestError):
        ac.messages.create(model=MODEL, messages=ASK, max_tokens=16,
                           extra_body={"thinking": {"type": "enabled", "budget_tokens": 10}})
