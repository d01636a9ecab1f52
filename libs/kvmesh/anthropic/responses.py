"""Anthropic's message object: content blocks, stop reason, usage; and tool calls turned into ``tool_use``.

Why it exists: both the complete answer and the stream's ``message_start`` /
``message_delta`` events carry the same usage and stop-reason rules, and an
engine's tool calls arrive in OpenAI's shape (``{id, function: {name,
arguments}}``, arguments as JSON text) but must leave as ``tool_use`` blocks
(``{id, name, input}``, input as an object).

Usage follows Anthropic's accounting: ``input_tokens`` are the prompt tokens
*not* read from cache, ``cache_read_input_tokens`` those the engine served from
its prefix cache (GPU or offload), so their sum is the prompt; the engine's
automatic prefix cache has no separate cache-write charge, so
``cache_creation_input_tokens`` is 0. (This is also vLLM's mapping.)
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One tool call of the engine, in OpenAI's terms: ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def tool_calls_from(raw: Any) -> list[ToolCall]:
    """Normalize tool calls given as OpenAI ``tool_calls`` entries or flat ``{id, name, arguments}``."""
    out = []
    for call in raw or ():
        fn = _get(call, "function")
        src = fn if fn is not None else call
        args = _get(src, "arguments")
        if not isinstance(args, str):
            args = json.dumps(args if args is not None else {})
        out.append(ToolCall(id=str(_get(call, "id") or ""), name=str(_get(src, "name") or ""), arguments=args))
    return out


def tool_use_id(call: ToolCall) -> str:
    return call.id or "toolu_" + uuid.uuid4().hex[:24]


def tool_input(call: ToolCall) -> dict[str, Any] | None:
    """The call's arguments as the ``input`` object, or None when they are not a JSON object
    (a call cut short must not run: it is returned as text instead)."""
    try:
        value = json.loads(call.arguments) if call.arguments.strip() else {}
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, int]:
    cached = min(cached_tokens, prompt_tokens)
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def stop_reason(finish: str, matched_stop: str | None, tool_use: bool) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) from the engine's finish reason (``stop``/``length``/...),
    the stop sequence that ended the text (if any) and whether ``tool_use`` blocks were produced."""
    if matched_stop is not None:
        return "stop_sequence", matched_stop
    if finish == "length":
        return "max_tokens", None
    if tool_use:
        return "tool_use", None
    return "end_turn", None


def new_id(request_id: str = "") -> str:
    return "msg_" + (request_id or uuid.uuid4().hex)


def content_blocks(text: str, calls: list[ToolCall], reasoning: str | None = None) -> list[dict[str, Any]]:
    """A reasoning model's thinking first (if any), then the text (if any), then one ``tool_use`` per
    complete call; never empty. The thinking block's signature is a random id, as vLLM's server
    gives it: nothing here signs thinking."""
    blocks: list[dict[str, Any]] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": uuid.uuid4().hex})
    tools: list[dict[str, Any]] = []
    for call in calls:
        args = tool_input(call)
        if args is None:
            text += call.arguments
        else:
            tools.append({"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": args})
    if text or not (tools or blocks):
        blocks.append({"type": "text", "text": text})
    return blocks + tools


def message(msg_id: str, model: str, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
            use: dict[str, int], **extra: Any) -> dict[str, Any]:
    """The message object; ``extra`` adds top-level keys (e.g. ``kvmesh``)."""
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": use, **extra}
