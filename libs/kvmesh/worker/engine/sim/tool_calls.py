"""The sim engine's deterministic tool calls, so tool round trips can be tested without a model.

Why it exists: the sim generates token ids, not text, so it cannot "write" a tool call for a
parser to find. When a request offers tools and ``tool_choice`` is not "none", the sim answers
with one call instead: to the named tool (``tool_choice`` = {"function": {"name": ...}}) or the
first one, with arguments built from the tool's JSON schema so that they validate against it
(required properties, the first ``enum`` value, numbers within their bounds). The id is a
function of the request id, so a retried request gives the same call. Streamed, the call goes out
as deltas, as vLLM's streaming parsers send them: the first output carries its id, name and the
first piece of its arguments, each later output the next piece, the final output the rest.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kvmesh.worker.engine.base import ParsedDelta, ToolCall, ToolCallDelta
from kvmesh.worker.engine.tool_stream import DeltaLedger

MAX_DEPTH = 8
PIECE_CHARS = 16   # of the arguments per streamed output


def example_value(schema: Any, depth: int = 0) -> Any:
    """A value valid for the JSON schema ``schema`` (the common keywords; unknown ones are ignored)."""
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return None
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    if "default" in schema:
        return schema["default"]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return example_value(schema[key][0], depth + 1)
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        props = schema.get("properties") or {}
        return {k: example_value(props.get(k, {}), depth + 1) for k in schema.get("required", [])}
    if kind == "array":
        item = example_value(schema.get("items", {}), depth + 1)
        return [item] * int(schema.get("minItems", 0))
    if kind in ("integer", "number"):
        cast = int if kind == "integer" else float
        lo = schema.get("minimum")
        if lo is None and "exclusiveMinimum" in schema:
            lo = schema["exclusiveMinimum"] + 1
        v = cast(lo) if lo is not None else cast(1)
        return min(v, cast(schema["maximum"])) if "maximum" in schema else v
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    text = "kvmesh"
    if schema.get("format") == "date":
        text = "2026-01-01"
    n = int(schema.get("minLength", 0))
    return (text * (n // len(text) + 1))[:max(n, len(text))][:schema.get("maxLength", 1 << 30)]


def sim_tool_call(request_id: str, tools: list[dict[str, Any]], tool_choice: Any) -> ToolCall | None:
    """The call the sim makes for this request, or None when tools may not be called."""
    if not tools or tool_choice == "none":
        return None
    fn = tools[0]["function"]
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        fn = next((t["function"] for t in tools if t["function"]["name"] == name), fn)
    args = example_value(fn.get("parameters") or {"type": "object"})
    call_id = "call_" + hashlib.sha256(request_id.encode()).hexdigest()[:24]
    return ToolCall(id=call_id, name=fn["name"], arguments=json.dumps(args if isinstance(args, dict) else {}))


class SimToolStream:
    """The deltas of the sim's one call, an output at a time; ``finish`` sends what is left."""

    def __init__(self, call: ToolCall) -> None:
        self.call = call
        self.sent = 0
        self.ledger = DeltaLedger()

    def next(self) -> ParsedDelta:
        piece = self.call.arguments[self.sent:self.sent + PIECE_CHARS]
        first = self.sent == 0 and not self.ledger.calls
        self.sent += len(piece)
        if not first and not piece:
            return ParsedDelta()
        head = (self.call.id, self.call.name) if first else ("", "")
        return self.ledger.record(ParsedDelta(tool_calls=[ToolCallDelta(0, *head, arguments=piece)]))

    def finish(self, request_id: str) -> ParsedDelta:
        return self.ledger.completion([self.call], "", request_id)
