"""Responses request bodies as agents send them, for the conversion's tests: Codex-style turns (developer
context, the whole history as input, function calls and their outputs), reasoning items, refusals, text parts."""

from __future__ import annotations

from typing import Any

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "name": "shell", "description": "Run a command.",
     "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}},
                                                     "workdir": {"type": "string"}},
                    "required": ["command"], "additionalProperties": False}, "strict": False},
    {"type": "function", "name": "update_plan", "parameters": {"type": "object", "properties": {}}},
    {"type": "function", "name": "read_file", "description": "Read ü ✓ \"quoted\".",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}, "strict": True},
]
CODEX_TURNS: list[dict[str, Any]] = [
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<permissions>ro</permissions>"}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<environment_context/>"}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix the bug in a.py"}]},
    {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look first."}]},
    {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
     "content": [{"type": "output_text", "text": "Reading a.py.", "annotations": []}]},
    {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "shell",
     "arguments": "{\"command\":[\"cat\",\"a.py\"]}", "status": "completed"},
    {"type": "function_call", "call_id": "call_2", "name": "update_plan", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "def f():\n    return 1/0\n"},
    {"type": "function_call_output", "call_id": "call_2",
     "output": [{"type": "input_text", "text": "Plan updated"}]},
    {"type": "function_call", "call_id": "call_3", "name": "read_file", "arguments": "not json"},
    {"type": "function_call_output", "call_id": "call_3", "output": ""},
    {"role": "assistant", "content": "Fixed."},
    {"role": "user", "content": "Thanks. Now b.py."},
]
BODIES: list[dict[str, Any]] = [
    {"input": "hi"},
    {"instructions": "You are Codex.", "input": "hi"},
    {"instructions": "You are Codex.", "input": CODEX_TURNS, "tools": TOOLS},
    {"input": CODEX_TURNS[:8], "tools": TOOLS, "tool_choice": "required"},
    {"input": CODEX_TURNS[2:6], "tools": TOOLS, "tool_choice": {"type": "function", "name": "shell"}},
    {"input": CODEX_TURNS, "tools": TOOLS, "tool_choice": "none"},
    {"input": CODEX_TURNS[:3] + [
        {"type": "custom_tool_call", "call_id": "call_p", "name": "apply_patch", "input": "*** Begin Patch\nü \"q\""},
        {"type": "custom_tool_call_output", "call_id": "call_p", "output": "Done!"}],
     "tools": [{"type": "custom", "name": "apply_patch", "description": "Apply a patch."}] + TOOLS},
    # Codex 0.171: sub-agent tools in a namespace, a call of one in the history, hosted web search.
    {"input": CODEX_TURNS[:3] + [
        {"type": "function_call", "call_id": "call_s", "name": "spawn_agent", "namespace": "multi_agent_v1",
         "arguments": "{\"task\": \"tests\"}"},
        {"type": "function_call_output", "call_id": "call_s", "output": "agent 7"}],
     "tools": TOOLS + [{"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
         {"type": "function", "name": "spawn_agent", "description": "Spawn one.", "strict": False,
          "parameters": {"type": "object", "properties": {"task": {"type": "string"}}, "required": ["task"]}}]},
         {"type": "web_search", "external_web_access": False}]},
    {"input": [{"role": "system", "content": "inline"}, {"role": "user", "content": "a"},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"},
                                                                    {"type": "output_text", "text": "c"}]},
               {"role": "user", "content": [{"type": "input_text", "text": "d"}, {"type": "input_text", "text": "e"}]}]},
]
