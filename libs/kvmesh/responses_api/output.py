"""Builders of OpenAI Responses answers: the ``response`` object, its output items and usage.

Why it exists: a non-streamed answer and the first and last events of a stream carry the
same ``response`` object, and the items a stream announces one by one must equal the ones in
its final ``response.completed``; both paths build them here. The shapes are OpenAI's
(``openai.types.responses.Response``): ``message`` items with ``output_text`` parts,
``function_call`` items whose ``call_id`` the client answers with a ``function_call_output``
(``custom_tool_call`` items, with the freeform ``input``, for custom tools),
``status`` ``incomplete`` with ``incomplete_details.reason`` ``max_output_tokens`` when the
token limit ended the answer, and ``usage`` with ``input_tokens_details.cached_tokens`` (the
prefix-cache hit kvmesh exists for).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvmesh.responses_api.requests import ResponsesRequest, shim_payload


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int = 0,
          **details: int) -> dict[str, Any]:
    """The Responses ``usage``; ``details`` (kvmesh's GPU/offload split) go beside ``cached_tokens``."""
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens, **details},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A reasoning model's thinking as vLLM's server returns it: its text as ``reasoning_text``
    content, no summary."""
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [reasoning_part(text)] if status == "completed" else []}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [text_part(text)] if text or status == "completed" else []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed",
                       namespaced: dict[str, tuple[str, str]] | None = None) -> dict[str, Any]:
    """A ``function_call`` item; a call of a namespace's function (by its flat name, a key of
    ``namespaced``) carries its own name and its ``namespace``, as vLLM reports it."""
    item = {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}
    if namespaced and name in namespaced:
        item["namespace"], item["name"] = namespaced[name]
    return item


def custom_call_item(item_id: str, call_id: str, name: str, payload: str) -> dict[str, Any]:
    return {"type": "custom_tool_call", "id": item_id, "call_id": call_id, "name": name, "input": payload}


def call_item(call_id: str, name: str, arguments: str, req: ResponsesRequest) -> dict[str, Any]:
    """A finished tool call's item: ``custom_tool_call`` (its input unwrapped from vLLM's shim) for one
    of ``req``'s custom tools, else ``function_call``."""
    if name in req.custom_tools:
        return custom_call_item(new_id("ctc"), call_id, name, shim_payload(arguments))
    return function_call_item(new_id("fc"), call_id, name, arguments, namespaced=req.namespaced)


def output_items(text: str, calls: list[Any], req: ResponsesRequest, reasoning: str | None = None
                 ) -> list[dict[str, Any]]:
    """The output of a whole answer to ``req``: a reasoning model's thinking as a reasoning item (when
    there is some), its text as one message (when there is text), then its tool calls (objects with
    ``id``, ``name`` and ``arguments``)."""
    out = [reasoning_item(new_id("rs"), reasoning)] if reasoning else []
    out += [message_item(new_id("msg"), text)] if text else []
    out += [call_item(c.id, c.name, c.arguments, req) for c in calls]
    return out


def _reasoning_echo(body: dict[str, Any]) -> dict[str, Any]:
    r = body.get("reasoning") if isinstance(body.get("reasoning"), dict) else {}
    return {"effort": r.get("effort"), "summary": r.get("summary")}


@dataclass
class ResponseHead:
    """One answer's identity and the request fields every ``response`` object of it echoes."""

    req: ResponsesRequest
    model: str
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    previous_response_id: str | None = None
    store: bool = False   # whether the answer is kept (the server stores, and the request asked it to)
    conversation: str | None = None   # the Conversations API object the answer is added to
    background: bool = False   # answered at once as ``queued``, run on, and polled with GET

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 **extra: Any) -> dict[str, Any]:
        """The ``response`` object; ``status`` ``incomplete`` means the token limit ended it."""
        req, chat = self.req, self.req.chat
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "model": self.model, "output": output,
            "parallel_tool_calls": chat.chat_request.parallel_tool_calls if chat.chat_request else True,
            "temperature": chat.temperature, "top_p": chat.top_p, "max_output_tokens": chat.max_tokens,
            "tool_choice": req.tool_choice, "tools": req.tools,
            "previous_response_id": self.previous_response_id, "reasoning": _reasoning_echo(req.body),
            "store": self.store, "background": self.background, "conversation": {"id": self.conversation} if self.conversation else None,
            "text": {"format": req.body["text"].get("format") or {"type": "text"}} if isinstance(
                req.body.get("text"), dict) else {"format": {"type": "text"}}, "truncation": "disabled", "metadata": req.metadata,
            "user": req.user, "usage": usage, **extra,
        }
