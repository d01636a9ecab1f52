"""The event stream of a streamed Responses answer.

Why it exists: a Responses stream is not a list of deltas but a sequence of typed events
that open and close output items, each numbered (``sequence_number``) and framed as
``event: <type>`` / ``data: <json>``. Clients rely on the order: Codex CLI acts on each
``response.output_item.done`` and ends the turn on ``response.completed``. ``ResponseEvents``
keeps that state so the HTTP handler only feeds it text and tool-call pieces:

``response.created``, ``response.in_progress``; for a reasoning model's thinking a reasoning item
(``output_item.added``, ``content_part.added``, ``reasoning_text.delta``..., ``reasoning_text.done``,
``content_part.done``, ``output_item.done``); per message item ``output_item.added``,
``content_part.added``, ``output_text.delta``..., ``output_text.done``, ``content_part.done``,
``output_item.done``; per function call ``output_item.added``,
``function_call_arguments.delta``..., ``function_call_arguments.done``, ``output_item.done`` (for a
custom tool ``custom_tool_call_input.delta`` and ``.done``, the input whole once the call is);
then ``response.completed`` (its ``status`` ``incomplete`` when the token limit ended the answer,
as vLLM reports it), or ``response.failed`` on an error, with the whole ``response``, whose items
are the streamed ones. The event sequence is vLLM's; there is no ``[DONE]`` line.
"""

from __future__ import annotations

import json
from typing import Any

from kvmesh.responses_api.output import (
    ResponseHead,
    custom_call_item,
    function_call_item,
    message_item,
    new_id,
    reasoning_item,
    reasoning_part,
    text_part,
)
from kvmesh.responses_api.requests import shim_payload

# Per streamed item kind: its item and part builders, its delta/done events, their extra fields.
_PARTS: dict[str, tuple[Any, Any, str, dict[str, Any]]] = {
    "message": (message_item, text_part, "response.output_text", {"logprobs": []}),
    "reasoning": (reasoning_item, reasoning_part, "response.reasoning_text", {}),
}
_ID_PREFIX = {"message": "msg", "reasoning": "rs"}


class ResponseEvents:
    """Builds the SSE bytes of one streamed answer; every method returns the events it adds."""

    def __init__(self, head: ResponseHead) -> None:
        self.head = head
        self.seq = 0
        self.output: list[dict[str, Any]] = []   # finished items, in order
        self._part: list[str] | None = None       # the open message or reasoning item: kind, id, text so far
        self._call: dict[str, Any] | None = None  # the open function_call item
        self._call_index: int | None = None       # its index in the engine's tool-call deltas
        self._whole = 0                           # whole calls seen (each its own item)
        self.final: dict[str, Any] | None = None  # the response of the last event (completed or failed)

    def _event(self, kind: str, **fields: Any) -> bytes:
        doc = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: ".encode() + json.dumps(doc, ensure_ascii=False).encode() + b"\n\n"

    @property
    def _index(self) -> int:
        return len(self.output)

    def start(self) -> bytes:
        r = self.head.response("in_progress", [])
        return self._event("response.created", response=r) + self._event("response.in_progress", response=r)

    # -- reasoning and text: an item with one text part, streamed as deltas
    def reasoning(self, delta: str) -> bytes:
        return self._part_delta("reasoning", delta)

    def text(self, delta: str) -> bytes:
        return self._part_delta("message", delta)

    def _part_delta(self, kind: str, delta: str) -> bytes:
        if not delta:
            return b""
        make_item, make_part, event, extra = _PARTS[kind]
        out = b"" if self._part is not None and self._part[0] == kind else self._close_part()
        out += self._close_call()
        if self._part is None:
            self._part = [kind, new_id(_ID_PREFIX[kind]), ""]
            out += self._event("response.output_item.added", output_index=self._index,
                               item=make_item(self._part[1], "", "in_progress"))
            out += self._event("response.content_part.added", item_id=self._part[1], output_index=self._index,
                               content_index=0, part=make_part(""))
        self._part[2] += delta
        return out + self._event(f"{event}.delta", item_id=self._part[1], output_index=self._index,
                                 content_index=0, delta=delta, **extra)

    def _close_part(self) -> bytes:
        if self._part is None:
            return b""
        (kind, item_id, text), i = self._part, self._index
        make_item, make_part, event, extra = _PARTS[kind]
        out = self._event(f"{event}.done", item_id=item_id, output_index=i, content_index=0, text=text, **extra)
        out += self._event("response.content_part.done", item_id=item_id, output_index=i, content_index=0,
                           part=make_part(text))
        item = make_item(item_id, text)
        out += self._event("response.output_item.done", output_index=i, item=item)
        self.output.append(item)
        self._part = None
        return out

    # -- function calls
    def call_delta(self, index: int, call_id: str, name: str, arguments: str) -> bytes:
        """A piece of the engine's tool call ``index``: its first piece has the id and name."""
        out = b""
        if self._call is None or index != self._call_index:
            out += self._close_part() + self._close_call()
            self._call_index = index
            if name in self.head.req.custom_tools:
                added = custom_call_item(new_id("ctc"), call_id, name, "")
                self._call = {**added, "arguments": ""}
            else:
                added = self._call = function_call_item(new_id("fc"), call_id, name, "", "in_progress",
                                                        self.head.req.namespaced)
            out += self._event("response.output_item.added", output_index=self._index, item=dict(added))
        if arguments:
            self._call["arguments"] += arguments
            if self._call["type"] == "function_call":
                out += self._event("response.function_call_arguments.delta", item_id=self._call["id"],
                                   output_index=self._index, delta=arguments)
        return out

    def call(self, call_id: str, name: str, arguments: str) -> bytes:
        """A whole tool call (an engine that reports its calls only at the end)."""
        self._whole += 1
        return self.call_delta(-self._whole, call_id, name, arguments)

    def _close_call(self) -> bytes:
        if self._call is None:
            return b""
        c, i = self._call, self._index
        if c["type"] == "custom_tool_call":
            # The shim's arguments are JSON around the input: the input goes out whole once complete.
            item = custom_call_item(c["id"], c["call_id"], c["name"], shim_payload(c.pop("arguments")))
            out = self._event("response.custom_tool_call_input.delta", item_id=c["id"], output_index=i,
                              delta=item["input"])
            out += self._event("response.custom_tool_call_input.done", item_id=c["id"], output_index=i,
                               input=item["input"])
        else:
            out = self._event("response.function_call_arguments.done", item_id=c["id"], output_index=i,
                              name=c["name"], arguments=c["arguments"])
            item = {**c, "status": "completed"}
        out += self._event("response.output_item.done", output_index=i, item=item)
        self.output.append(item)
        self._call = self._call_index = None
        return out

    # -- the end
    def finish(self, incomplete: bool, usage: dict[str, Any], **extra: Any) -> bytes:
        """The last event: ``response.completed`` whatever the status, as vLLM ends its streams. The
        ``openai`` SDK's stream helper needs that event for its final response, and some Responses
        clients take a ``response.incomplete`` event as a stream error; ``status`` and
        ``incomplete_details`` say whether the token limit ended the answer."""
        out = self._close_part() + self._close_call()
        status = "incomplete" if incomplete else "completed"
        self.final = self.head.response(status, self.output, usage, **extra)
        return out + self._event("response.completed", response=self.final)

    def failed(self, code: str, message: str) -> bytes:
        """The answer broke off: what was streamed, and the error (``response.failed``)."""
        out = self._close_part() + self._close_call()
        r = self.head.response("failed", self.output)
        r["error"] = {"code": code, "message": message}
        self.final = r
        return out + self._event("response.failed", response=r)
