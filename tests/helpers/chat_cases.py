"""Varied OpenAI chat requests for the renderer's tests: tools with real JSON schemas, tool calls and
results, multi-part content, system and developer prompts, template keywords, multi-turn.

Deterministic (a seeded ``random.Random``), so a failing case can be named by its index.
"""

from __future__ import annotations

import json
import random
from typing import Any

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string", "description": "City and country, e.g. Paris, France"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["location"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file from the workspace.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "offset": {"type": "integer", "minimum": 0},
            "limit": {"type": "integer", "minimum": 1, "maximum": 2000}},
            "required": ["path"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "bash", "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string"}, "timeout": {"type": "number"},
            "env": {"type": "object", "additionalProperties": {"type": "string"}}},
            "required": ["command"]}, "strict": True}},
    {"type": "function", "function": {
        "name": "edit", "description": "Replace text in a file (ünïcödé ok).",
        "parameters": {"type": "object", "properties": {
            "file_path": {"type": "string"}, "old_string": {"type": "string"}, "new_string": {"type": "string"},
            "replace_all": {"type": "boolean", "default": False}},
            "required": ["file_path", "old_string", "new_string"]}}},
    {"type": "function", "function": {
        "name": "search", "parameters": {"type": "object", "properties": {
            "query": {"type": "string"},
            "filters": {"type": "object", "properties": {"lang": {"type": "array", "items": {"type": "string"}},
                                                         "since": {"type": "string", "format": "date"}}}},
            "required": ["query"]}}},
    {"type": "function", "function": {"name": "noop"}},
]

SNIPPETS = ["Hello!", "What's the weather in Paris?", "def f(x):\n    return x * 2\n", "  leading spaces",
            "émoji 🚀 and 中文", "line1\nline2\n\nline4", "<b>markup</b> & \"quotes\"", "trailing newline\n",
            "Please read src/main.py and fix the bug.", "{\"json\": [1, 2, 3]}", "a" * 300, "tab\tseparated"]


def _text(rng: random.Random) -> str:
    return rng.choice(SNIPPETS) + (" " + rng.choice(SNIPPETS) if rng.random() < 0.3 else "")


def _content(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.6:
        return _text(rng)
    return [{"type": "text", "text": _text(rng)} for _ in range(rng.randint(1, 3))]


def _call(rng: random.Random, n: int) -> dict[str, Any]:
    fn = rng.choice(TOOLS[:5])["function"]
    args: Any = {"location": "Paris"} if fn["name"] == "get_weather" else {"path": f"src/f{n}.py", "limit": 10}
    style = rng.random()   # OpenAI sends arguments as a JSON string; clients sometimes send junk
    if style < 0.8:
        args = json.dumps(args)
    elif style < 0.9:
        args = "{not json"
    else:
        args = ""
    return {"id": f"call_{n}", "type": "function", "function": {"name": fn["name"], "arguments": args}}


def make_case(i: int, *, kwargs_keys: dict[str, list[Any]] | None = None) -> dict[str, Any]:
    """Request number ``i``; ``kwargs_keys`` are chat_template_kwargs values the template reads."""
    rng = random.Random(i)
    msgs: list[dict[str, Any]] = []
    if rng.random() < 0.6:
        msgs.append({"role": "system", "content": _content(rng)})
    if rng.random() < 0.08:
        msgs.append({"role": "developer", "content": _text(rng)})
    turns = rng.randint(1, 4)
    n_call = 0
    for t in range(turns):
        msgs.append({"role": "user", "content": _content(rng)})
        if t == turns - 1:
            break
        if rng.random() < 0.5:
            calls = [_call(rng, n_call + k) for k in range(rng.randint(1, 2))]
            n_call += len(calls)
            asst: dict[str, Any] = {"role": "assistant", "tool_calls": calls}
            asst["content"] = _text(rng) if rng.random() < 0.3 else None
            msgs.append(asst)
            for c in calls:
                res = _content(rng)
                msgs.append({"role": "tool", "tool_call_id": c["id"], "content": res})
            msgs.append({"role": "assistant", "content": _text(rng)})
        else:
            msgs.append({"role": "assistant", "content": _content(rng) if rng.random() < 0.8 else _text(rng)})
    body: dict[str, Any] = {"model": "tiny-llama", "messages": msgs}
    if rng.random() < 0.6:
        body["tools"] = rng.sample(TOOLS, rng.randint(1, len(TOOLS)))
        r = rng.random()
        if r < 0.2:
            body["tool_choice"] = "required"
        elif r < 0.35:
            body["tool_choice"] = {"type": "function", "function": {"name": body["tools"][0]["function"]["name"]}}
        elif r < 0.5:
            body["tool_choice"] = "none"
        elif r < 0.7:
            body["tool_choice"] = "auto"
    if rng.random() < 0.15:
        msgs.append({"role": "assistant", "content": "Sure, the answer starts with"})
        body["add_generation_prompt"] = False
        body["continue_final_message"] = True
    elif rng.random() < 0.15:
        body["add_generation_prompt"] = False
    if rng.random() < 0.1:
        body["documents"] = [{"title": "README", "text": "kvmesh routes requests."}]
    if kwargs_keys and rng.random() < 0.5:
        body["chat_template_kwargs"] = {k: rng.choice(vs) for k, vs in kwargs_keys.items()}
    return body
