"""The sim's reasoning mode splits an answer by position: what it streams adds up to the split of
the whole answer, whatever the tokens (bytes of one character cut across outputs included), and
a long answer is decoded incrementally."""

from __future__ import annotations

import random

import pytest

from kvmesh.worker.engine.sim.reasoning import SimReasoningStream
from tests.helpers.decoding import CountingDecoder


@pytest.fixture(scope="module")
def tok(tiny_hf_tokenizer):
    return tiny_hf_tokenizer


@pytest.mark.parametrize("seed", range(6))
def test_streamed_pieces_add_up_to_the_split(tok, seed) -> None:
    rng = random.Random(seed)
    limit = rng.choice([0, 1, 5, 8])
    text = "Let me think: naïve café — 東京 " * 3 + "done"   # multi-byte characters split across tokens
    ids = tok.encode(text, add_special_tokens=False) + [rng.randrange(4, 32000) for _ in range(40)]
    s = SimReasoningStream(tok, limit)
    pieces, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        pieces.append(s.push(ids[i:i + n], final=i + n >= len(ids)))
        i += n
    reasoning, content = s.result()
    assert reasoning == tok.decode(ids[:limit], skip_special_tokens=True)
    assert content == tok.decode(ids[limit:], skip_special_tokens=True)
    assert "".join(p.reasoning for p in pieces) == reasoning
    assert "".join(p.content for p in pieces) == content


def test_a_long_answer_decodes_a_window_per_output(tok) -> None:
    """Each output decodes a few tokens, not the whole answer so far."""
    counting = CountingDecoder(tok)
    s = SimReasoningStream(counting, 4)
    for i in range(2000):
        s.push([1000 + i % 500])
    assert max(counting.sizes) <= 8
