"""The sim engine's reasoning mode: a chat answer split into reasoning and content.

Why it exists: a reasoning model's answer starts with its thinking, and vLLM's server (with
``--reasoning-parser``) returns that part as ``reasoning``, apart from the answer's ``content``.
The kvmesh doors turn it into each API's shape (the chat ``reasoning`` field, a Responses
``reasoning`` item, an Anthropic ``thinking`` block). The sim samples pseudo-random tokens and
has no thinking markers to parse, so a sim worker started with a reasoning parser splits its
answer by position instead: the first ``reasoning_tokens`` output tokens of a chat answer are its
reasoning, the rest its content, both decoded with the worker's tokenizer. The router and the
doors then see what a vLLM worker's parser sends: parsed deltas while it streams, and the whole
reasoning and content when it ends.

A tool-calling answer (the sim's tool mode) reasons first too; its calls follow. A structured
answer (``sim.structured``) is all content: its scripted text is what must match the constraint.
"""

from __future__ import annotations

from typing import Any

from kvmesh.worker.engine.base import ParsedDelta


class SimReasoningStream:
    """One answer's reasoning and content deltas, an engine output at a time. The content is
    decoded incrementally (a window of the last tokens, as vLLM's detokenizer), so a long answer
    costs what its tokens cost."""

    def __init__(self, tokenizer: Any, reasoning_tokens: int) -> None:
        self.tok = tokenizer
        self.limit = max(0, reasoning_tokens)
        self.ids: list[int] = []
        self.sent_reasoning = ""
        self.content = ""
        self._prefix = self._read = 0   # the content's decoding window, in content tokens

    def _text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True) if ids else ""

    @property
    def reasoning_done(self) -> bool:
        return len(self.ids) > self.limit

    def push(self, new_ids: list[int], final: bool = False) -> ParsedDelta:
        """The new reasoning and content text of ``new_ids``. A piece that ends inside a character
        waits for the next output, unless the answer ends here."""
        self.ids.extend(new_ids)
        out = ParsedDelta()
        if len(self.sent_reasoning) == 0 or len(self.ids) - len(new_ids) < self.limit:
            reasoning = self._text(self.ids[:self.limit])
            if (final or len(self.ids) >= self.limit or not reasoning.endswith("\ufffd")) \
                    and reasoning.startswith(self.sent_reasoning):
                out.reasoning, self.sent_reasoning = reasoning[len(self.sent_reasoning):], reasoning
        body = self.ids[self.limit:]
        before = self._text(body[self._prefix:self._read])
        now = self._text(body[self._prefix:])
        if (final or not now.endswith("\ufffd")) and now.startswith(before) and len(body) > self._read:
            out.content = now[len(before):]
            self.content += out.content
            self._prefix, self._read = self._read, len(body)
        return out

    def result(self) -> tuple[str, str]:
        """The whole answer's reasoning and content (as streamed)."""
        return self.sent_reasoning, self.content
