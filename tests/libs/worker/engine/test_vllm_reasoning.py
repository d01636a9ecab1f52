"""vLLM's own reasoning parser (deepseek_r1), composed with its tool parser (hermes), splits a vLLM
worker's chat answer as vLLM's server does: streamed a few tokens at a time and whole, with the
deltas adding up to the whole parse. The tokenizer is the tiny model's with ``<think>`` markers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.worker.engine.base import EngineRequest
from tests.helpers.chat_cases import TOOLS

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def hf(tiny_think_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_think_model_dir), local_files_only=True)


def _think(hf, tool_parser: str = "", parser: str = "deepseek_r1"):
    from kvmesh.worker.engine.vllm_reasoning import VllmReasoning
    from kvmesh.worker.engine.vllm_tools import VllmToolCalls

    return VllmReasoning(parser, VllmToolCalls(tool_parser, hf if tool_parser else None, bool(tool_parser)), hf)


def _replay(think, req: EngineRequest, ids: list[int], step: int):
    """The answer through ``parse_delta`` ``step`` tokens an output; what a client rebuilds, and the parse."""
    stream = think.stream(req)
    cut = max(0, len(ids) - step)
    deltas = [stream.push(ids[i:min(i + step, cut)]) for i in range(0, cut, step)]
    last, parsed = stream.finish(ids[cut:])
    deltas.append(last)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for c in d.tool_calls:
            have = calls.setdefault(c.index, ["", "", ""])
            have[0], have[1], have[2] = have[0] + c.id, have[1] + c.name, have[2] + c.arguments
    return ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas), calls), parsed


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])   # a classic parser, an engine-based one
@pytest.mark.parametrize("step", [1, 3, 64])
def test_reasoning_then_content(hf, step, parser) -> None:
    think = _think(hf, parser=parser)
    ids = hf.encode("<think>The test fails on line 3.</think>Fix the import.", add_special_tokens=False)
    req = EngineRequest("r", [1, 2], reasoning=True)
    (reasoning, content, _), (whole_r, whole_c, calls, n) = _replay(think, req, ids, step)
    assert (reasoning, content) == (whole_r, whole_c) == ("The test fails on line 3.", "Fix the import.")
    assert calls is None
    assert n == len(hf.encode("The test fails on line 3.", add_special_tokens=False))


def test_unclosed_reasoning_is_all_reasoning(hf) -> None:
    """deepseek_r1's rule: an answer cut before ``</think>`` (its template opens the tag) is reasoning."""
    think = _think(hf)
    ids = hf.encode("still thinking about it", add_special_tokens=False)
    (reasoning, content, _), parsed = _replay(think, EngineRequest("r", [1, 2], reasoning=True), ids, 2)
    assert reasoning == parsed[0] == "still thinking about it"
    assert content == parsed[1] == ""


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_a_prompt_that_closed_the_reasoning_gets_content_only(hf, parser) -> None:
    """A template that closes the reasoning in the prompt (thinking off) leaves the answer content,
    streamed and whole (vLLM's whole-answer parse does not see the prompt; the stream's reading is
    the answer's)."""
    think = _think(hf, parser=parser)
    prompt = hf.encode("<think></think>", add_special_tokens=False)
    ids = hf.encode("Plain answer.", add_special_tokens=False)
    (reasoning, content, _), whole = _replay(think, EngineRequest("r", prompt, reasoning=True), ids, 2)
    assert (reasoning, content) == whole[:2] == ("", "Plain answer.")


@pytest.mark.parametrize("step", [1, 5])
def test_tool_call_after_the_reasoning(hf, step) -> None:
    think = _think(hf, "hermes")
    answer = ('<think>I should read it.</think><tool_call>{"name": "read_file", "arguments": '
              '{"path": "README.md"}}</tool_call>')
    ids = hf.encode(answer, add_special_tokens=False)
    req = EngineRequest("r", [1, 2], reasoning=True, tools=TOOLS, tool_choice="auto")
    (reasoning, _, streamed), (whole_r, _, calls, _) = _replay(think, req, ids, step)
    assert reasoning == whole_r == "I should read it."
    assert calls is not None and [c.name for c in calls] == ["read_file"]
    assert json.loads(calls[0].arguments) == {"path": "README.md"}
    assert streamed[0][1] == "read_file" and json.loads(streamed[0][2]) == {"path": "README.md"}
    assert streamed[0][0] == calls[0].id


def test_tool_markup_inside_the_reasoning_is_not_a_call(hf) -> None:
    think = _think(hf, "hermes")
    answer = '<think>maybe <tool_call>{"name": "read_file", "arguments": {}}</tool_call>?</think>No call.'
    ids = hf.encode(answer, add_special_tokens=False)
    req = EngineRequest("r", [1, 2], reasoning=True, tools=TOOLS, tool_choice="auto")
    _, (reasoning, content, calls, _) = _replay(think, req, ids, 4)
    assert calls is None and content == "No call." and "tool_call" in reasoning
