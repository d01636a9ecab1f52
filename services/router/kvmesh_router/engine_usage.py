"""An external engine's usage, read from its answer: what the router counts for requests it
passes through to vLLM's own APIs, and what a split's prefill engine found cached.

OpenAI's ``usage`` has ``prompt_tokens`` and ``prompt_tokens_details.cached_tokens``;
Anthropic's has ``input_tokens`` (the uncached part), ``cache_read_input_tokens`` and
``cache_creation_input_tokens``; a Responses answer's has ``input_tokens`` (all of the prompt)
and ``input_tokens_details.cached_tokens``, inside its ``response``. A count that is not a
non-negative integer is taken as not reported: it goes to counters, which refuse negatives.
"""

from __future__ import annotations

import json
from typing import Any


def _count(n: Any) -> int | None:
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


class EngineUsage:
    """The usage of a JSON answer, or of the last SSE event that carries one."""

    def __init__(self) -> None:
        self.doc: dict[str, Any] | None = None
        self._tail = b""

    def from_json(self, raw: bytes) -> None:
        try:
            doc = json.loads(raw)
        except ValueError:
            return
        if isinstance(doc, dict) and isinstance(doc.get("response"), dict):
            doc = doc["response"]   # a Responses event (response.completed) carries the response
        if isinstance(doc, dict) and isinstance(doc.get("usage"), dict):
            self.doc = doc["usage"]

    def feed(self, chunk: bytes) -> None:
        lines = (self._tail + chunk).split(b"\n")
        self._tail = lines.pop()
        if len(self._tail) > 16 << 20:   # no newline for 16 MiB: not SSE; stop looking
            self._tail = b""
        for line in lines:
            if line.startswith(b"data: {") and b'"usage"' in line:
                self.from_json(line[6:])

    @property
    def cached_tokens(self) -> int | None:
        doc = self.doc or {}
        n = doc.get("cache_read_input_tokens")
        if n is None:
            details = doc.get("prompt_tokens_details") or doc.get("input_tokens_details")
            n = details.get("cached_tokens") if isinstance(details, dict) else None
        return _count(n)

    @property
    def prompt_tokens(self) -> int | None:
        doc = self.doc or {}
        n = doc.get("prompt_tokens")
        if n is None and _count(doc.get("input_tokens")) is not None:
            n = sum(v for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
                    if (v := _count(doc.get(k))) is not None)
        return _count(n)
