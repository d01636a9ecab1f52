"""Tokenize one long text as a few parts at once, spliced where the parts agree: the same ids.

Why: an agent turn's new text (1-5k tokens, the tail ``kvmesh.tokenization.incremental`` must
tokenize) costs ~80% of the router's render + tokenize, all of it in the ``tokenizers`` encode,
which runs on one core and holds the GIL. ``encode_batch`` runs its inputs on the library's
thread pool with the GIL released, so a tail cut into ``parts`` pieces takes about 1/``parts``
of the time on idle cores, and the event loop is free meanwhile.

Why the result equals one encode of the whole text: the same locality ``incremental`` relies on.
A part ends ``OVERLAP_CHARS`` past the next part's start ``m``, a line start whose line begins
with a non-space (where BPE pre-tokenizers start a pre-token). The splice is taken only when
``m`` is a token start in the earlier part and the next part's first tokens reproduce the earlier
part's tokens from ``m`` up to a few tokens before its cut end (``SYNC_TOKENS`` or more, the last
``CHANGE_SLACK_TOKENS`` excepted, as they may merge across the cut); from where two
tokenizations agree, both continue identically. Otherwise that text is encoded in one piece
(``fallbacks``); a tokenizer whose parts keep disagreeing stops being split.
"""

from __future__ import annotations

import bisect
import os
import re
from collections.abc import Callable

EncodeWithOffsets = Callable[[str], tuple[list[int], list[int]]]
EncodeBatch = Callable[[list[str]], list[tuple[list[int], list[int]]]]

PART_MIN_CHARS = 2048     # shorter parts cost more in hand-off than they save
OVERLAP_CHARS = 512       # a part reads this far into the next one (~100-250 tokens of text)
SYNC_TOKENS = 16
CHANGE_SLACK_TOKENS = 4
GIVE_UP_AFTER = 8         # splices refused in a row before splitting stops for good
_LINE_START = re.compile(r"\n(?=[^\s])")


class ParallelEncoder:
    """``encode(text) -> (ids, token start offsets)`` equal to ``single(text)``. Thread-safe."""

    def __init__(self, single: EncodeWithOffsets, batch: EncodeBatch, max_parts: int | None = None) -> None:
        self._single = single
        self._batch = batch
        self.max_parts = max(1, max_parts if max_parts is not None else min(4, os.cpu_count() or 1))
        self.splits = 0
        self.fallbacks = 0
        self._refused_in_a_row = 0

    def encode(self, text: str) -> tuple[list[int], list[int]]:
        parts = min(self.max_parts, len(text) // PART_MIN_CHARS)
        if parts < 2 or self._refused_in_a_row >= GIVE_UP_AFTER:
            return self._single(text)
        cuts = self._cuts(text, parts)
        if not cuts:
            return self._single(text)
        bounds = [0, *cuts, len(text)]
        pieces = [text[bounds[i]:min(len(text), bounds[i + 1] + OVERLAP_CHARS)] for i in range(len(bounds) - 1)]
        encoded = self._batch(pieces)
        ids, starts = list(encoded[0][0]), list(encoded[0][1])
        for i, m in enumerate(cuts):
            nxt_ids, nxt_starts = encoded[i + 1]
            if not self._splice(ids, starts, m, nxt_ids, nxt_starts):
                self.fallbacks += 1
                self._refused_in_a_row += 1
                return self._single(text)
        self.splits += 1
        self._refused_in_a_row = 0
        return ids, starts

    @staticmethod
    def _cuts(text: str, parts: int) -> list[int]:
        """Line starts near ``len(text) * i / parts``, each far enough from the last and the end."""
        cuts: list[int] = []
        for i in range(1, parts):
            hit = _LINE_START.search(text, len(text) * i // parts)
            if hit is None:
                break
            m = hit.end()
            if m + OVERLAP_CHARS >= len(text) or (cuts and m - cuts[-1] < PART_MIN_CHARS // 2):
                break
            cuts.append(m)
        return cuts

    @staticmethod
    def _splice(ids: list[int], starts: list[int], m: int, nxt_ids: list[int], nxt_starts: list[int]) -> bool:
        """``ids``/``starts`` (absolute offsets) cut at ``m`` and continued with the next part's
        tokens (offsets from ``m``), if they agree; False (unchanged) if not."""
        j = bisect.bisect_left(starts, m)
        if j == len(starts) or starts[j] != m:
            return False
        n_sync = len(ids) - j - CHANGE_SLACK_TOKENS
        if n_sync < SYNC_TOKENS or len(nxt_ids) < n_sync or nxt_ids[:n_sync] != ids[j:j + n_sync]:
            return False
        if any(nxt_starts[q] + m != starts[j + q] for q in range(n_sync)):
            return False
        del ids[j:], starts[j:]
        ids.extend(nxt_ids)
        starts.extend(s + m for s in nxt_starts)
        return True
