"""The text of a growing answer, a few tokens at a time.

Why it exists: every door that streams an answer turns its token ids into text as they come,
and must not send half a character (a byte-level token may hold part of one). Decoding the
whole answer again at each chunk costs n^2 token decodes for n tokens: 45,000 for a typical
300-token answer and 8 million for a 4,000-token one, on the router's event loop. vLLM's
detokenizer decodes a short window instead (``detokenize_incrementally``): the text of the
tokens since the previous emission's start, minus the text it had already; a token's text
can depend on the one before it, so the window starts one emission back. This is that rule,
shared by the router's doors, the worker's HTTP API and the workers' reasoning streams.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """``push`` token ids, get the new text that is final (never ending inside a character,
    unless ``final``). ``text`` is all the text emitted so far."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0   # the window's start: the previous emission's first token
        self._read = 0     # tokens whose text was emitted

    def push(self, ids: list[int], final: bool = False) -> str:
        self.ids.extend(ids)
        if self.tok is None or len(self.ids) == self._read:
            return ""
        before = self.tok.decode(self.ids[self._prefix:self._read], skip_special_tokens=self.skip_special)
        now = self.tok.decode(self.ids[self._prefix:], skip_special_tokens=self.skip_special)
        if (now.endswith("\ufffd") and not final) or len(now) < len(before):
            return ""
        delta = now[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    @property
    def pending(self) -> int:
        """Tokens pushed whose text was not emitted yet (they end inside a character)."""
        return len(self.ids) - self._read
