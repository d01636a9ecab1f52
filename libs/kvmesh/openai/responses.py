"""Builders of OpenAI completion/chat responses and stream chunks.

Why it exists: ``text_completion`` and ``chat.completion`` answers and their
chunks differ only in where the text goes (``text`` / ``message`` /
``delta``) and the object name; both HTTP apps build them here so the shape
(ids, ``created``, ``token_ids`` next to the text, role only in the first
chat delta, the usage-only last chunk) is the same everywhere.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """OpenAI's ``tool_calls[i]`` object."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_calls(calls: list[Any], parallel: bool = True) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` of calls with ``id``/``name``/``arguments``; ``parallel=False`` (the
    request's ``parallel_tool_calls``) keeps the first only."""
    out = [tool_call(c.id, c.name, c.arguments) for c in calls]
    return out if parallel else out[:1]


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


@dataclass
class Answer:
    """One answer's identity: the same id/object/created/model in every chunk of a stream."""

    chat: bool
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or new_id(self.chat)

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, text: str, token_ids: list[int], finish: str, usage: dict[str, Any],
                 tool_calls: list[dict[str, Any]] | None = None, reasoning: str | None = None,
                 **extra: Any) -> dict[str, Any]:
        """The non-streaming answer; ``extra`` adds top-level keys (e.g. ``kvmesh``). With
        ``tool_calls`` (``tool_call``), ``text`` is the answer's other text (null when empty). A
        reasoning model's answer (``reasoning`` not None) carries it as vLLM's chat message does
        (``reasoning``, null when empty)."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None, "token_ids": token_ids}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            if tool_calls:
                choice["message"] = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
            if reasoning is not None:
                choice["message"]["reasoning"] = reasoning or None
        else:
            choice["text"] = text
        return {**self._head(self.object), "choices": [choice], "usage": usage, **extra}

    def chunk(self, text: str, token_ids: list[int] | None, finish: str | None, first: bool,
              **extra: Any) -> dict[str, Any]:
        """A stream chunk; chat deltas carry ``role`` only in the first chunk, as OpenAI's do."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        return {**self._head(self.chunk_object), "choices": [choice], **extra}

    def reasoning_chunk(self, reasoning: str, first: bool) -> dict[str, Any]:
        """A chat chunk carrying more of a reasoning model's reasoning (vLLM's ``delta.reasoning``)."""
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        delta["reasoning"] = reasoning
        return {**self._head(self.chunk_object),
                "choices": [{"index": 0, "finish_reason": None, "logprobs": None, "delta": delta}]}

    def tool_calls_chunk(self, tool_calls: list[dict[str, Any]], first: bool) -> dict[str, Any]:
        """A chat chunk carrying whole tool calls as deltas (each with its ``index``)."""
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(tool_calls)]
        return {**self._head(self.chunk_object),
                "choices": [{"index": 0, "finish_reason": None, "logprobs": None, "delta": delta}]}

    def tool_call_deltas_chunk(self, deltas: list[Any], first: bool) -> dict[str, Any]:
        """A chat chunk carrying pieces of tool calls (``index``, ``id``, ``name``, ``arguments``), as
        OpenAI streams them: a call's first piece has its id, type and name, each piece more arguments."""
        out = []
        for d in deltas:
            fn: dict[str, Any] = {"arguments": d.arguments}
            if d.name:
                fn = {"name": d.name, **fn}
            call: dict[str, Any] = {"index": d.index}
            if d.id:
                call |= {"id": d.id, "type": "function"}
            out.append({**call, "function": fn})
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        delta["tool_calls"] = out
        return {**self._head(self.chunk_object),
                "choices": [{"index": 0, "finish_reason": None, "logprobs": None, "delta": delta}]}

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The last chunk of a stream asked with ``stream_options.include_usage``: no choices, the usage."""
        return {**self._head(self.chunk_object), "choices": [], "usage": usage}
