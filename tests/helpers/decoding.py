"""A tokenizer that records how many tokens each ``decode`` call was given: tests of incremental
detokenization assert that a long answer is decoded a short window at a time."""

from __future__ import annotations

from typing import Any


class CountingDecoder:
    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.sizes: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
