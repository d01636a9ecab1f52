"""kvmesh's Messages conversion equals vLLM's own (``vllm/entrypoints/anthropic/serving.py``): the same
chat conversation and tools for the same request, and so the same prompt through the same template.
vLLM tier: importing vLLM's serving code takes a while."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvmesh.anthropic.requests import parse_messages
from kvmesh.tokenization import load_tokenizer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

SCHEMA = {"type": "object", "properties": {"path": {"type": "string", "description": "file"},
                                           "lines": {"type": "array", "items": {"type": "integer"}}},
          "required": ["path"]}
TOOLS = [{"name": "read_file", "description": "Read a file.", "input_schema": SCHEMA},
         {"name": "ls", "input_schema": {"properties": {}}, "cache_control": {"type": "ephemeral"}},
         {"name": "grep", "description": "Search.", "input_schema": {"type": "object"}, "strict": True}]
AGENT_TURNS = [
    {"role": "user", "content": [{"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                                 {"type": "text", "text": "Fix the bug in a.py", "cache_control": {"type": "ephemeral"}}]},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look first.", "signature": "sig"},
                                      {"type": "text", "text": "Reading a.py."},
                                      {"type": "tool_use", "id": "toolu_01", "name": "read_file",
                                       "input": {"path": "a.py", "lines": [1, 2]}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                  "content": [{"type": "text", "text": "def f():\n    return 1/0\n"}]}]},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_02", "name": "ls", "input": {}},
                                      {"type": "tool_use", "id": "toolu_03", "name": "grep",
                                       "input": {"q": "ü ✓ \"quoted\""}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_02", "content": "a.py\nb.py",
                                  "is_error": False},
                                 {"type": "tool_result", "tool_use_id": "toolu_03", "content": "",
                                  "is_error": True},
                                 {"type": "text", "text": "Go on."}]},
    {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "opaque"},
                                      {"type": "text", "text": ""}, {"type": "text", "text": "Done."}]},
]
BODIES = [
    {"messages": [{"role": "user", "content": "hi"}]},
    {"system": "You are terse.", "messages": [{"role": "user", "content": "hi"}]},
    {"system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=1a2b;"},
                {"type": "text", "text": "You are Claude Code. "},
                {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
     "messages": AGENT_TURNS, "tools": TOOLS},
    {"system": "S", "messages": AGENT_TURNS[:3], "tools": TOOLS, "tool_choice": {"type": "auto"}},
    {"messages": AGENT_TURNS[:2] + [{"role": "user", "content": "plain"}], "tools": TOOLS,
     "tool_choice": {"type": "none"}},
    {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "inline reminder"},
                  {"role": "user", "content": [{"type": "text", "text": "b"}, {"type": "text", "text": "c"}]},
                  {"role": "assistant", "content": "partial answer"}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                "content": [{"type": "text", "text": "x"},
                                                            {"type": "text", "text": "y"}]}]}],
     "tools": TOOLS[:1]},
]


def _vllm(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    req = AnthropicServingMessages.to_chat_completion_request(AnthropicMessagesRequest(**body))
    tools = None if req.tools is None else [t.model_dump() for t in req.tools]   # what vLLM's renderer passes
    return [dict(m) for m in req.messages], tools


@pytest.mark.parametrize("i", range(len(BODIES)))
def test_conversion_equals_vllms(i, tiny_model_dir):
    body = {"model": "m", "max_tokens": 16, **BODIES[i]}
    ours = parse_messages(json.loads(json.dumps(body)), {})
    messages, tools = _vllm(json.loads(json.dumps(body)))
    assert json.dumps(ours.messages) == json.dumps(messages)   # keys in the same order too
    assert json.dumps(ours.tools) == json.dumps(tools)
    tok = load_tokenizer(tiny_model_dir)
    assert tok.render_chat(ours.messages, tools=ours.tools) == tok.render_chat(messages, tools=tools)


QWEN_LIKE = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
             "{{ raise_exception('System message must be at the beginning.') }}{% endif %}{{ m.content }}{% endfor %}")


@pytest.mark.parametrize("i", range(len(BODIES)))
def test_merged_inline_system_equals_vllms(i):
    """For templates that want the system prompt first, vLLM merges inline system messages."""
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    from kvmesh.anthropic.requests import merge_inline_system, needs_system_first

    for tpl in (QWEN_LIKE, "{% for m in messages %}{{ m.content }}{% endfor %}", None):
        assert needs_system_first(tpl) == AnthropicServingMessages._detect_merge_inline_system(tpl)
    body = {"model": "m", "max_tokens": 16, **BODIES[i]}
    ours = merge_inline_system(parse_messages(json.loads(json.dumps(body)), {}).messages)
    req = AnthropicServingMessages.to_chat_completion_request(AnthropicMessagesRequest(**json.loads(json.dumps(body))),
                                                              merge_inline_system=True)
    assert json.dumps(ours) == json.dumps([dict(m) for m in req.messages])
