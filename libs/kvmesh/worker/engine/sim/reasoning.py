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

from kvmesh.tokenization.detokenize import IncrementalDetokenizer
from kvmesh.worker.engine.base import ParsedDelta


class SimReasoningStream:
    """One answer's reasoning and content deltas, an engine output at a time; the content is
    decoded incrementally (``kvmesh.tokenization.detokenize``), so a long answer costs what its
    tokens cost."""

    def __init__(self, tokenizer: Any, reasoning_tokens: int) -> None:
        self.limit = max(0, reasoning_tokens)
        self.ids: list[int] = []
        self.reasoning = IncrementalDetokenizer(tokenizer)
        self.content = IncrementalDetokenizer(tokenizer)

    @property
    def reasoning_done(self) -> bool:
        return len(self.ids) > self.limit

    def push(self, new_ids: list[int], final: bool = False) -> ParsedDelta:
        """The new reasoning and content text of ``new_ids``. A piece that ends inside a character
        waits for the next output, unless the answer (or its reasoning) ends here."""
        head = max(0, min(len(new_ids), self.limit - len(self.ids)))
        self.ids.extend(new_ids)
        out = ParsedDelta()
        if head or final:
            out.reasoning = self.reasoning.push(new_ids[:head], final=final or len(self.ids) >= self.limit)
        if len(new_ids) > head or final:
            out.content = self.content.push(new_ids[head:], final=final)
        return out

    def result(self) -> tuple[str, str]:
        """The whole answer's reasoning and content (as streamed)."""
        return self.reasoning.text, self.content.text
