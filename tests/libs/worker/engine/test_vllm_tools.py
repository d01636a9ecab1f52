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
