"""vLLM's own tool parser (hermes) turns a vLLM worker's answer into tool calls; vLLM's refusals hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.worker.engine.base import EngineRequest, InvalidRequestError
from tests.helpers.chat_cases import TOOLS

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)


def _req(choice: object = "auto") -> EngineRequest:
    return EngineRequest(request_id="r", prompt_token_ids=[1, 2], tools=TOOLS, tool_choice=choice)


def test_hermes_answer_becomes_tool_calls(hf) -> None:
    from kvmesh.worker.engine.vllm_tools import VllmToolCalls

    tools = VllmToolCalls("hermes", hf, enable_auto_tool_choice=True)
    answer = ('Let me check.<tool_call>{"name": "get_weather", "arguments": {"location": "Paris"}}</tool_call>'
              '<tool_call>{"name": "read_file", "arguments": {"path": "README.md"}}</tool_call>')
    ids = hf.encode(answer, add_special_tokens=False)
    parsed = tools.parse(_req(), ids)
    assert parsed is not None
    calls, content = parsed
    assert [c.name for c in calls] == ["get_weather", "read_file"]
    assert json.loads(calls[0].arguments) == {"location": "Paris"} and calls[0].id
    assert content.strip() == "Let me check."
    assert tools.parse(_req(), hf.encode("Just text.", add_special_tokens=False)) is None
    assert tools.parse(_req("none"), ids) is None


def test_vllm_refusals_without_a_parser(hf) -> None:
    from kvmesh.worker.engine.vllm_tools import VllmToolCalls

    with pytest.raises(InvalidRequestError, match="enable-auto-tool-choice"):
        VllmToolCalls("hermes", hf, enable_auto_tool_choice=False).check(_req("auto"))
    VllmToolCalls("hermes", hf, enable_auto_tool_choice=False).check(_req("required"))
    with pytest.raises(InvalidRequestError, match="tool-call-parser"):
        VllmToolCalls("", None, enable_auto_tool_choice=False).check(_req("required"))
    VllmToolCalls("", None, enable_auto_tool_choice=False).check(_req("none"))


def _replay(tools, req: EngineRequest, ids: list[int], step: int):
    """The answer through the streaming parser ``step`` tokens an output, as the engine streams it:
    the content and each call (id, name, arguments) a client rebuilds from the deltas, and the final parse."""
    stream = tools.stream(req)
    deltas = [stream.push(ids[i:i + step]) for i in range(0, len(ids) - step, step)]
    last, parsed = stream.finish(ids[len(ids) - (len(ids) - 1) % step - 1:])
    deltas.append(last)
    content, calls = "", {}
    for d in deltas:
        content += d.content
        for c in d.tool_calls:
            have = calls.setdefault(c.index, ["", "", ""])
            have[0], have[1], have[2] = have[0] + c.id, have[1] + c.name, have[2] + c.arguments
    return content, calls, parsed, deltas


@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_deltas_add_up_to_the_final_tool_calls(hf, step: int) -> None:
    from kvmesh.worker.engine.vllm_tools import VllmToolCalls

    tools = VllmToolCalls("hermes", hf, enable_auto_tool_choice=True)
    answer = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris", "unit": "c"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "read_file", "arguments": {"path": "src/a b.py"}}\n</tool_call>')
    ids = hf.encode(answer, add_special_tokens=False)
    content, calls, parsed, deltas = _replay(tools, _req(), ids, step)
    assert parsed is not None
    final, final_content = parsed
    assert sorted(calls) == list(range(len(final))) == [0, 1]
    for i, call in enumerate(final):
        assert calls[i] == [call.id, call.name, call.arguments]    # the final calls took the streamed ids
        assert json.loads(calls[i][2]) == json.loads(call.arguments)
    assert content.strip() == final_content.strip() == "Let me check."
    # The calls really streamed: the first call's pieces arrived before the answer ended.
    assert any(c.index == 0 for d in deltas[:-1] for c in d.tool_calls)


def test_streamed_text_without_a_call_is_the_whole_answer(hf) -> None:
    from kvmesh.worker.engine.vllm_tools import VllmToolCalls

    tools = VllmToolCalls("hermes", hf, enable_auto_tool_choice=True)
    answer = "No tool is needed: the answer is 42, café."
    content, calls, parsed, _ = _replay(tools, _req(), hf.encode(answer, add_special_tokens=False), 2)
    assert parsed is None and not calls
    assert content == hf.decode(hf.encode(answer, add_special_tokens=False), skip_special_tokens=True)
    assert tools.stream(_req("none")) is None


def test_forced_tool_choice_gets_vllms_constraint_and_parse(hf) -> None:
    """``required`` and a named tool get the structured output vLLM's server puts on them (its unified
    parser's), ``auto``/``none`` none; a forced answer is read by that parser, its EOS not part of it."""
    from kvmesh.worker.engine.vllm_tools import VllmToolCalls

    tools = VllmToolCalls("hermes", hf, enable_auto_tool_choice=True)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        so = tools.structured_outputs(_req(choice))
        assert so is not None and (so.structural_tag or so.json), choice
    assert tools.structured_outputs(_req("auto")) is None and tools.structured_outputs(_req("none")) is None
    assert VllmToolCalls("", None, enable_auto_tool_choice=False).structured_outputs(_req("required")) is None
    answer = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>'
    ids = hf.encode(answer, add_special_tokens=False) + [hf.eos_token_id]
    parsed = tools.parse(_req(named), ids)
    assert parsed is not None
    [call] = parsed[0]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"location": "Paris"} and call.id


def test_structured_outputs_with_tools_follow_vllms_server(hf) -> None:
    """A request's own structured outputs with tools: under ``auto`` vLLM's unified parser combines
    them with the call format (one structural tag holding both), a forced call's format replaces them
    (``required`` and a named tool get exactly what they get without one), and without tools they
    are the engine's constraint as they are."""
    from kvmesh.worker.engine.vllm_tools import VllmToolCalls

    tools = VllmToolCalls("hermes", hf, enable_auto_tool_choice=True)
    schema = {"type": "object", "properties": {"verdict": {"enum": ["yes", "no"]}}, "required": ["verdict"]}

    def req(choice: object) -> EngineRequest:
        return EngineRequest(request_id="r", prompt_token_ids=[1, 2], tools=TOOLS, tool_choice=choice,
                             structured_outputs={"json": schema})

    auto = tools.structured_outputs(req("auto"))
    assert auto is not None and auto.structural_tag and "verdict" in auto.structural_tag
    assert "get_weather" in auto.structural_tag
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        forced = tools.structured_outputs(req(choice))
        assert forced == tools.structured_outputs(_req(choice)) and "verdict" not in str(forced), choice
