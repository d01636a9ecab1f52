"""``parallel_tool_calls`` false (OpenAI) and ``tool_choice.disable_parallel_tool_use`` (Anthropic):
at most one tool call, as vLLM's server answers. A sim worker in its tool mode makes two parallel
calls (``--sim-tool-calls 2``); the flag cuts the answer to the first, through the router with the
official ``openai`` (chat and Responses) and ``anthropic`` clients (streamed and not) and over gRPC,
and at the worker."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import grpc
import openai
import pytest

from tests.fixtures.router import MODEL, RouterStack, one_worker_stack
from tests.helpers.chat_cases import TOOLS

pytestmark = pytest.mark.timeout(180)

HISTORY = [{"role": "system", "content": "You are a coding agent."},
           {"role": "user", "content": "What's the weather in Paris? Then read the README."}]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                    "input_schema": t["function"].get("parameters") or {"type": "object"}} for t in TOOLS[:2]]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> Iterator[RouterStack]:
    with one_worker_stack(tmp_path_factory.mktemp("router-parallel-tools"), tiny_model_dir, ["--sim-tool-calls", "2"]) as st:
        yield st


@pytest.fixture(scope="module")
def oai(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_base + "/v1", api_key="k", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.http_base, api_key="k", max_retries=0, timeout=60)


def _names(calls) -> list[str]:  # noqa: ANN001
    return [c.function.name for c in calls or []]


def test_openai_parallel_tool_calls_false_keeps_one_call(oai) -> None:
    kw = {"model": MODEL, "messages": HISTORY, "tools": TOOLS, "max_tokens": 8}
    both = oai.chat.completions.create(**kw, extra_headers={"x-request-id": "par-1"})
    assert _names(both.choices[0].message.tool_calls) == [TOOLS[0]["function"]["name"], TOOLS[1]["function"]["name"]]
    one = oai.chat.completions.create(**kw, parallel_tool_calls=False, extra_headers={"x-request-id": "par-1"})
    [call] = one.choices[0].message.tool_calls
    first = both.choices[0].message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == (first.function.name, first.function.arguments)
    assert one.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("parallel", [True, False])
def test_openai_streamed_calls_follow_parallel_tool_calls(oai, parallel) -> None:
    with oai.chat.completions.stream(model=MODEL, messages=HISTORY, tools=TOOLS, max_tokens=8,
                                     parallel_tool_calls=parallel) as s:
        indexes = {d.index for ev in s if ev.type == "chunk" for c in ev.chunk.choices for d in c.delta.tool_calls or []}
        final = s.get_final_completion()
    want = 2 if parallel else 1
    assert indexes == set(range(want)) and len(final.choices[0].message.tool_calls) == want


@pytest.mark.parametrize("stream", [False, True])
def test_responses_parallel_tool_calls_false_keeps_one_call(oai, stream) -> None:
    tools = [{"type": "function", **t["function"]} for t in TOOLS]

    def ask(**flag):  # noqa: ANN003, ANN202
        kw = {"model": MODEL, "instructions": HISTORY[0]["content"], "input": HISTORY[1]["content"], "tools": tools,
              "max_output_tokens": 8, **flag}
        if not stream:
            return oai.responses.create(**kw)
        with oai.responses.stream(**kw) as s:
            return s.get_final_response()

    both, one = ask(), ask(parallel_tool_calls=False)
    names = [t["function"]["name"] for t in TOOLS[:2]]
    assert [o.name for o in both.output if o.type == "function_call"] == names
    assert [o.name for o in one.output if o.type == "function_call"] == names[:1]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["auto", "any"])
def test_anthropic_disable_parallel_tool_use_keeps_one_tool_use(claude, stream, kind) -> None:
    def ask(**choice):  # noqa: ANN003, ANN202
        kw = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": HISTORY[1]["content"]}],
              "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": kind, **choice}}
        if not stream:
            return claude.messages.create(**kw)
        with claude.messages.stream(**kw) as s:
            return s.get_final_message()

    both, one = ask(), ask(disable_parallel_tool_use=True)
    assert [b.name for b in both.content if b.type == "tool_use"] == [t["name"] for t in ANTHROPIC_TOOLS]
    [use] = [b for b in one.content if b.type == "tool_use"]
    assert use.name == ANTHROPIC_TOOLS[0]["name"] and one.stop_reason == "tool_use"
    allowed = ask(disable_parallel_tool_use=False)
    assert [b.name for b in allowed.content if b.type == "tool_use"] == [t["name"] for t in ANTHROPIC_TOOLS]


def test_grpc_parallel_tool_calls_false(stack) -> None:
    from kvmesh_api.common.v1 import common_pb2
    from kvmesh_api.router.v1 import router_pb2

    def ask(**kw):  # noqa: ANN003, ANN202
        chat = router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(**m) for m in HISTORY],
                                       tools_json=json.dumps(TOOLS), **kw)
        out = list(stack.stub.Generate(router_pb2.GenerateRequest(
            model=MODEL, chat=chat, sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0)), timeout=60))
        deltas = {d.index for r in out if r.HasField("chunk") for d in r.chunk.tool_call_deltas}
        return out[-1].final, deltas

    (both, both_idx), (one, one_idx) = ask(), ask(parallel_tool_calls=False)
    assert len(both.tool_calls) == 2 and both_idx == {0, 1}
    assert len(one.tool_calls) == 1 and one_idx == {0} and one.tool_calls[0].name == both.tool_calls[0].name


def test_worker_engine_honours_parallel_tool_calls(stack) -> None:
    """The worker's engine limits the answer itself (the sim here, vLLM's grammar there), so the
    flag the router forwards takes effect before the router's own filter."""
    from kvmesh_api.common.v1 import common_pb2
    from kvmesh_api.worker.v1 import worker_pb2, worker_pb2_grpc

    def calls(**kw) -> tuple[int, set[int]]:  # noqa: ANN003
        with grpc.insecure_channel(stack.workers["w1"].grpc_address) as ch:
            out = list(worker_pb2_grpc.WorkerStub(ch).Generate(worker_pb2.GenerateRequest(
                request_id=f"wk-{kw}", model=MODEL, prompt_token_ids=list(range(1, 100)), tools_json=json.dumps(TOOLS),
                tool_choice_json='"auto"', sampling=common_pb2.SamplingParams(max_tokens=8), **kw), timeout=60))
        return len(out[-1].tool_calls), {d.index for m in out for d in m.tool_call_deltas}

    assert calls() == (2, {0, 1})
    assert calls(parallel_tool_calls=True) == (2, {0, 1})
    assert calls(parallel_tool_calls=False) == (1, {0})
