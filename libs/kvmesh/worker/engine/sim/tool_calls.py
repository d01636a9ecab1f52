"""The sim engine's deterministic tool calls, so tool round trips can be tested without a model.

Why it exists: the sim generates token ids, not text, so it cannot "write" a tool call for a
parser to find. When a request offers tools and ``tool_choice`` is not "none", the sim answers
with calls instead: to the named tool (``tool_choice`` = {"function": {"name": ...}}) or the
first one, with arguments built from the tool's JSON schema so that they validate against it
(required properties, the first ``enum`` value, numbers within their bounds). The ids are a
function of the request id, so a retried request gives the same calls. One call by default;
``calls`` > 1 (the worker's ``--sim-tool-calls``) makes that many parallel calls (the next tools
in order, cycling; a named tool each time), so that ``parallel_tool_calls`` false can be seen
cutting them to one, as vLLM's grammar stops after the first call. Streamed, the calls go out as
deltas, as vLLM's streaming parsers send them: the first output of a call carries its id, name
and the first piece of its arguments, each later output the next piece, the final output the rest.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from kvmesh.worker.engine.base import ParsedDelta, ToolCall, ToolCallDelta
from kvmesh.worker.engine.tool_stream import DeltaLedger

MAX_DEPTH = 8
MAX_ITEMS = 64       # per array
MAX_CHARS = 4096     # per string
MAX_NODES = 4096     # values in all (a string counts one per 64 characters)
PIECE_CHARS = 16   # of the arguments per streamed output


def _num(v: Any) -> float | None:
    """A schema keyword's number, or None when it is not one (a client's schema is not trusted)."""
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def example_value(schema: Any, depth: int = 0, root: Any = None, budget: list[int] | None = None) -> Any:
    """A value valid for the JSON schema ``schema`` (the common keywords, and local ``$ref``s such as
    pydantic's ``#/$defs/Model``; unknown ones are ignored). The schema is the client's: malformed
    keywords are skipped, and the value is bounded (``MAX_ITEMS`` per array, ``MAX_CHARS`` per string,
    ``MAX_NODES`` in all), so that nested ``minItems`` cannot make it grow without end."""
    root = schema if root is None else root
    budget = [MAX_NODES] if budget is None else budget
    budget[0] -= 1
    if not isinstance(schema, dict) or depth > MAX_DEPTH or budget[0] < 0:
        return None
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        target: Any = root
        for part in filter(None, ref[1:].split("/")):
            target = target.get(part) if isinstance(target, dict) else None
        return example_value(target, depth + 1, root, budget)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    if "default" in schema:
        return schema["default"]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return example_value(schema[key][0], depth + 1, root, budget)
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        props = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        required = schema.get("required")
        required = [k for k in required if isinstance(k, str)] if isinstance(required, list) else []
        return {k: example_value(props.get(k, {}), depth + 1, root, budget) for k in required}
    if kind == "array":
        before = budget[0]
        item = example_value(schema.get("items", {}), depth + 1, root, budget)
        cost = max(before - budget[0], 1)   # what one item took; each copy costs as much again
        n = int(min(max(_num(schema.get("minItems")) or 0, 0), MAX_ITEMS, max(budget[0], 0) // cost + 1))
        budget[0] -= cost * max(n - 1, 0)
        return [item] * n
    if kind in ("integer", "number"):
        cast = int if kind == "integer" else float
        lo = _num(schema.get("minimum"))
        if lo is None and _num(schema.get("exclusiveMinimum")) is not None:
            lo = schema["exclusiveMinimum"] + 1
        v = cast(lo) if lo is not None else cast(1)
        hi = _num(schema.get("maximum"))
        return min(v, cast(hi)) if hi is not None else v
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    text = "kvmesh"
    if schema.get("format") == "date":
        text = "2026-01-01"
    n = int(min(max(_num(schema.get("minLength")) or 0, 0), MAX_CHARS))
    hi_len = _num(schema.get("maxLength"))
    cap = MAX_CHARS if hi_len is None else int(max(hi_len, 0))
    budget[0] -= n // 64   # long strings count against the budget too
    return (text * (n // len(text) + 1))[:max(n, len(text))][:cap]


def calls_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> bool:
    """Whether the sim answers with tool calls (then nothing else shapes the answer)."""
    return bool(tools) and tool_choice != "none"


def sim_tool_calls(request_id: str, tools: list[dict[str, Any]], tool_choice: Any, calls: int = 1,
                   parallel: bool = True) -> list[ToolCall]:
    """The calls the sim makes for this request (none when tools may not be called): ``calls`` of
    them, or one when ``parallel`` (OpenAI's ``parallel_tool_calls``) is false."""
    if not calls_tools(tools, tool_choice):
        return []
    named = None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        named = next((t["function"] for t in tools if t["function"]["name"] == name), None)
    out = []
    for i in range(max(1, calls) if parallel else 1):
        fn = named or tools[i % len(tools)]["function"]
        args = example_value(fn.get("parameters") or {"type": "object"})
        call_id = "call_" + hashlib.sha256(f"{request_id}/{i}".encode() if i else request_id.encode()).hexdigest()[:24]
        out.append(ToolCall(id=call_id, name=fn["name"], arguments=json.dumps(args if isinstance(args, dict) else {})))
    return out


def sim_tool_call(request_id: str, tools: list[dict[str, Any]], tool_choice: Any) -> ToolCall | None:
    """The sim's one call for this request, or None when tools may not be called."""
    calls = sim_tool_calls(request_id, tools, tool_choice)
    return calls[0] if calls else None


class SimToolStream:
    """The deltas of the sim's calls, an output at a time (a call after the one before it);
    ``finish`` sends what is left."""

    def __init__(self, calls: ToolCall | list[ToolCall]) -> None:
        self.calls = [calls] if isinstance(calls, ToolCall) else list(calls)
        self.call = self.calls[0]
        self.current = 0
        self.sent = 0
        self.ledger = DeltaLedger()

    def next(self) -> ParsedDelta:
        if self.sent >= len(self.call.arguments) and self.current + 1 < len(self.calls) \
                and self.current in self.ledger.calls:
            self.current += 1
            self.call, self.sent = self.calls[self.current], 0
        piece = self.call.arguments[self.sent:self.sent + PIECE_CHARS]
        first = self.current not in self.ledger.calls
        self.sent += len(piece)
        if not first and not piece:
            return ParsedDelta()
        head = (self.call.id, self.call.name) if first else ("", "")
        return self.ledger.record(ParsedDelta(tool_calls=[ToolCallDelta(self.current, *head, arguments=piece)]))

    def finish(self, request_id: str) -> ParsedDelta:
        return self.ledger.completion(self.calls, "", request_id)
