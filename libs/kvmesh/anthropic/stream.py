"""The event sequence of a streamed Anthropic message.

Why it exists: the ``anthropic`` client rebuilds the message from a strict
sequence of named server-sent events::

    message_start            the message with empty content and the usage known so far
    ping
    content_block_start      per block, indexed from 0: thinking, text, then tool_use blocks
    content_block_delta      thinking_delta and, last, signature_delta (a reasoning model's thinking) /
                             text_delta (text) / input_json_delta (a tool's input as JSON text)
    content_block_stop
    message_delta            stop_reason, stop_sequence and the final usage (cumulative)
    message_stop

and an ``error`` event if the stream fails after it started. ``MessageStream``
keeps the block index and which block is open, so a front door only says
"text", "tool call", "finished".
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from kvmesh.anthropic.errors import error_body
from kvmesh.anthropic.responses import ToolCall, tool_input, tool_use_id


def event(kind: str, doc: dict[str, Any]) -> bytes:
    """One SSE event: ``event: <kind>`` and the JSON document (whose ``type`` is ``kind``)."""
    return b"event: " + kind.encode() + b"\ndata: " + json.dumps({"type": kind, **doc}).encode() + b"\n\n"


def error_event(status: int, message: str, etype: str | None = None) -> bytes:
    body = error_body(status, message, etype)
    return event("error", {"error": body["error"]})


class MessageStream:
    """Builds the events of one streamed message, in order."""

    def __init__(self, msg_id: str, model: str) -> None:
        self.msg_id = msg_id
        self.model = model
        self.blocks = 0           # content blocks started so far
        self.text_open = False
        self.thinking_open = False
        self.tool_open: int | None = None           # the open tool_use block (streamed calls)
        self.tool_blocks: dict[int, int] = {}       # streamed call index -> its block
        self._pending: dict[int, list[str]] = {}    # a call's id and arguments until its name comes

    def start(self, use: dict[str, int], **extra: Any) -> list[bytes]:
        msg = {"id": self.msg_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": use, **extra}
        return [event("message_start", {"message": msg}), event("ping", {})]

    def _open_text(self) -> list[bytes]:
        self.text_open = True
        self.blocks += 1
        return [event("content_block_start", {"index": self.blocks - 1,
                                              "content_block": {"type": "text", "text": ""}})]

    def _close_text(self) -> list[bytes]:
        out = []
        if self.thinking_open:
            # As vLLM's server: the block's signature (a random id: nothing here signs thinking) goes last.
            self.thinking_open = False
            out += [event("content_block_delta", {"index": self.blocks - 1, "delta": {
                        "type": "signature_delta", "signature": uuid.uuid4().hex}}),
                    event("content_block_stop", {"index": self.blocks - 1})]
        if self.tool_open is not None:
            out.append(event("content_block_stop", {"index": self.tool_open}))
            self.tool_open = None
        if not self.text_open:
            return out
        self.text_open = False
        return [*out, event("content_block_stop", {"index": self.blocks - 1})]

    def text(self, delta: str) -> list[bytes]:
        if not delta:
            return []
        out = [] if self.text_open else [*self._close_text(), *self._open_text()]
        out.append(event("content_block_delta", {"index": self.blocks - 1,
                                                 "delta": {"type": "text_delta", "text": delta}}))
        return out

    def thinking(self, delta: str) -> list[bytes]:
        """More of a reasoning model's thinking, in a ``thinking`` block of its own."""
        if not delta:
            return []
        out = []
        if not self.thinking_open:
            out = self._close_text()
            self.thinking_open = True
            self.blocks += 1
            out.append(event("content_block_start", {"index": self.blocks - 1, "content_block": {
                "type": "thinking", "thinking": "", "signature": ""}}))
        out.append(event("content_block_delta", {"index": self.blocks - 1,
                                                 "delta": {"type": "thinking_delta", "thinking": delta}}))
        return out

    def tool_use(self, call: ToolCall) -> list[bytes]:
        """One complete tool call as its own block; its input goes out as one JSON delta."""
        if tool_input(call) is None:   # not a JSON object: a cut-short call is text, never run
            return self.text(call.arguments)
        out = self._close_text()
        idx = self.blocks
        self.blocks += 1
        out.append(event("content_block_start", {"index": idx, "content_block": {
            "type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": {}}}))
        if call.arguments.strip():
            out.append(event("content_block_delta", {"index": idx, "delta": {
                "type": "input_json_delta", "partial_json": call.arguments}}))
        out.append(event("content_block_stop", {"index": idx}))
        return out

    def tool_delta(self, index: int, call_id: str, name: str, arguments: str) -> list[bytes]:
        """A piece of streamed tool call ``index``: the piece that names it opens its tool_use block,
        every piece's arguments go out as an ``input_json_delta``."""
        block = self.tool_blocks.get(index)
        if block is None:
            pend = self._pending.setdefault(index, ["", "", ""])
            pend[0], pend[1], pend[2] = pend[0] + call_id, pend[1] + name, pend[2] + arguments
            if not pend[1]:
                return []
            call_id, name, arguments = self._pending.pop(index)
            out = self._close_text()
            block = self.tool_blocks[index] = self.tool_open = self.blocks
            self.blocks += 1
            out.append(event("content_block_start", {"index": block, "content_block": {
                "type": "tool_use", "id": call_id or tool_use_id(ToolCall("", name, "")), "name": name, "input": {}}}))
        else:
            out = []
        if arguments:
            out.append(event("content_block_delta", {"index": block, "delta": {
                "type": "input_json_delta", "partial_json": arguments}}))
        return out

    def finish(self, stop: tuple[str | None, str | None], use: dict[str, int]) -> list[bytes]:
        """Close the open block (a message always has one), then ``message_delta`` and ``message_stop``."""
        out = self._open_text() if self.blocks == 0 else []
        out += self._close_text()
        out.append(event("message_delta", {"delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                                           "usage": use}))
        out.append(event("message_stop", {}))
        return out
