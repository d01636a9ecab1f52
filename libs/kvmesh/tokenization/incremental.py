"""Tokenize an agent's next turn from where its previous turn's text changed, not from the start.

An agent turn re-sends the whole conversation plus a few new messages: ~200k tokens of which
1-5k are new. Tokenizing all of it again costs about half a CPU-second per request. This cache
keeps, per conversation, the text last tokenized with its token ids and each token's start
offset, and on the next turn tokenizes only from a safe boundary before the first changed
character.

Why the result equals a full tokenization: BPE tokenizers split text into pre-tokens (words,
whitespace runs, punctuation) by a local rule and never merge across them, so from a point where
the cached tokenization and a fresh one agree again, both continue identically. The boundary is
a token start a little before the change (a line or word start where there is one); the fresh tail
must reproduce every cached token between that boundary and the change point (the "sync"
tokens), else the turn is tokenized in full. A text that differs from the cached one well before
its end (an edit in the middle, not an append) is tokenized in full too. Both fall-backs are
counted, and ``verify`` (``sampled``: every Nth incremental result, ``full``: every one, ``off``)
compares incremental results with a full tokenization and returns the full one on a mismatch.

Memory is bounded by bytes (ids and offsets as 4-byte arrays, the text at its size), LRU.
"""

from __future__ import annotations

import bisect
import logging
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.sequences import IdArray, common_prefix_len

log = logging.getLogger(__name__)

VERIFY_MODES = ("sampled", "full", "off")
# A change this close to the end of the cached text is still an append: chat templates often
# re-render the last few characters (a generation prompt, a closing tag).
APPEND_SLACK_CHARS = 256
SYNC_TOKENS = 16          # the boundary is at least this many tokens before the change point
CHANGE_SLACK_TOKENS = 4   # of which the last few need not match (they may merge across the change)
LINE_SEARCH_TOKENS = 256  # how far back a line start is looked for, before taking SYNC_TOKENS back

# (text) -> (token ids, start offset of each token in characters)
EncodeWithOffsets = Callable[[str], tuple[list[int], list[int]]]


@dataclass
class _Entry:
    text: str
    ids: array
    starts: array          # token starts plus a sentinel len(text) at the end

    @property
    def nbytes(self) -> int:
        return sys.getsizeof(self.text) + self.ids.itemsize * len(self.ids) + self.starts.itemsize * len(self.starts)


@dataclass
class IncrementalStats:
    """Counts by outcome: ``hit`` (tail only), ``miss`` (no entry), ``edit`` (changed before the
    end), ``resync`` (the tail did not reproduce the sync tokens), ``mismatch`` (verify caught a
    difference; always 0 unless a tokenizer breaks the locality this relies on)."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("hit", "miss", "edit", "resync", "mismatch", "verified"), 0))
    tokens_reused: int = 0
    tokens_encoded: int = 0


class IncrementalTokenizer:
    """A byte-bounded LRU of conversations' last tokenization. Thread-safe."""

    def __init__(self, encode: EncodeWithOffsets, *, max_bytes: int = 256 << 20, verify: str = "sampled",
                 sample_every: int = 64, on_outcome: Callable[[str], None] | None = None,
                 encode_tail: EncodeWithOffsets | None = None) -> None:
        """``encode_tail`` (default ``encode``) tokenizes a turn's new tail, e.g. a
        ``ParallelEncoder``'s; full tokenizations and ``verify`` use ``encode``."""
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        self._encode = encode
        self._encode_tail = encode_tail or encode
        self.max_bytes = max_bytes
        self.verify = verify
        self.sample_every = max(1, sample_every)
        self._on_outcome = on_outcome
        self._entries: OrderedDict[object, _Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._incremental = 0
        self.stats = IncrementalStats()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def encode(self, key: object, text: str) -> list[int]:
        """Token ids of ``text``, equal to a full tokenization; ``key`` names the conversation."""
        return self.encode_ids(key, text).array.tolist()

    def encode_ids(self, key: object, text: str) -> IdArray:
        """``encode`` without making a list of 200k ints: the ids as an ``IdArray`` view."""
        with self._lock:
            old = self._entries.get(key)
            if old is not None:
                self._entries.move_to_end(key)
        entry, outcome = self._tokenize(old, text)
        if outcome == "hit" and self._should_verify():
            full = self._full(text, count=False)
            self._count("verified")
            if full.ids != entry.ids:
                log.error("incremental tokenization differed from a full one; using the full one",
                          extra={"tokens": len(full.ids)})
                self._count("mismatch")
                entry = full
        self._store(key, entry)
        return IdArray(entry.ids)

    # ------------------------------------------------------------------ internals

    def _tokenize(self, old: _Entry | None, text: str) -> tuple[_Entry, str]:
        if old is None:
            return self._full(text), self._count("miss")
        p = common_prefix_len(old.text, text)
        if len(old.text) - p > APPEND_SLACK_CHARS:
            return self._full(text), self._count("edit")
        k = bisect.bisect_right(old.starts, p) - 1   # tokens [0, k) end at or before p
        if k <= SYNC_TOKENS:
            return self._full(text), self._count("miss")
        b_tok = self._boundary(old, text, k)
        b = old.starts[b_tok]
        tail_ids, tail_starts = self._encode_tail(text[b:])
        # The last tokens before the change may merge with what follows it (" " + "more"), so
        # they are re-tokenized, not required to match.
        n_sync = k - b_tok - CHANGE_SLACK_TOKENS
        if len(tail_ids) < n_sync or tail_ids[:n_sync] != old.ids[b_tok:b_tok + n_sync].tolist():
            return self._full(text), self._count("resync")
        # Array slices and extends are memcpy-speed: no Python loop over the reused 200k tokens.
        ids = old.ids[:b_tok]
        ids.extend(array("I", tail_ids))
        starts = old.starts[:b_tok]
        starts.extend(array("I", [s + b for s in tail_starts]))
        starts.append(len(text))
        self.stats.tokens_reused += b_tok
        self.stats.tokens_encoded += len(tail_ids)
        return _Entry(text, ids, starts), self._count("hit")

    @staticmethod
    def _boundary(old: _Entry, text: str, k: int) -> int:
        """A token index at least SYNC_TOKENS before ``k`` where a pre-token surely starts: a line
        start, else a word start (a space after a non-space), else just SYNC_TOKENS back."""
        last = k - SYNC_TOKENS
        word = -1
        for i in range(last, max(0, last - LINE_SEARCH_TOKENS), -1):
            s = old.starts[i]
            if s == 0:
                break
            if text[s - 1] == "\n":
                return i
            if word < 0 and text[s] == " " and not text[s - 1].isspace():
                word = i
        return word if word >= 0 else last

    def _full(self, text: str, count: bool = True) -> _Entry:
        ids, starts = self._encode(text)
        if count:
            self.stats.tokens_encoded += len(ids)
        return _Entry(text, array("I", ids), array("I", [*starts, len(text)]))

    def _should_verify(self) -> bool:
        if self.verify == "off":
            return False
        self._incremental += 1
        return self.verify == "full" or self._incremental % self.sample_every == 1

    def _count(self, outcome: str) -> str:
        self.stats.counts[outcome] += 1
        if self._on_outcome is not None:
            self._on_outcome(outcome)
        return outcome

    def _store(self, key: object, entry: _Entry) -> None:
        if entry.nbytes > self.max_bytes:
            return
        with self._lock:
            prev = self._entries.pop(key, None)
            if prev is not None:
                self._bytes -= prev.nbytes
            self._entries[key] = entry
            self._bytes += entry.nbytes
            while self._bytes > self.max_bytes and self._entries:
                _, gone = self._entries.popitem(last=False)
                self._bytes -= gone.nbytes
