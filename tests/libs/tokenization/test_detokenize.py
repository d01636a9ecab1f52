"""The incremental detokenizer: its pieces add up to the whole decode, a piece never ends inside
a character (until the end), and each push decodes a short window, not the whole answer."""

from __future__ import annotations

import random

import pytest

from kvmesh.tokenization.detokenize import IncrementalDetokenizer
from tests.helpers.decoding import CountingDecoder


@pytest.fixture(scope="module")
def tok(tiny_hf_tokenizer):
    return tiny_hf_tokenizer


@pytest.mark.parametrize("seed", range(8))
def test_pieces_add_up_to_the_whole_decode(tok, seed) -> None:
    rng = random.Random(seed)
    ids = tok.encode("naïve café — 東京 🙂 " * 4, add_special_tokens=False)
    ids += [rng.randrange(0, 32000) for _ in range(60)]   # special tokens among them
    rng.shuffle(ids)
    d = IncrementalDetokenizer(tok)
    pieces, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        pieces.append(d.push(ids[i:i + n], final=i + n >= len(ids)))
        i += n
    assert "".join(pieces) == d.text == tok.decode(ids, skip_special_tokens=True)
    assert d.pending == 0


def test_a_cut_character_waits_for_its_last_byte(tok) -> None:
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1   # byte-level pieces of one character
    d = IncrementalDetokenizer(tok)
    assert d.push(ids[:1]) == "" and d.pending == 1
    assert d.push(ids[1:]) == "🙂" and d.pending == 0
    cut = IncrementalDetokenizer(tok)
    assert cut.push(ids[:1], final=True) == tok.decode(ids[:1])   # the answer ended there


def test_each_push_decodes_a_window(tok) -> None:
    counting = CountingDecoder(tok)
    d = IncrementalDetokenizer(counting)
    for i in range(3000):
        d.push([1000 + i % 700])
    assert max(counting.sizes) <= 4
    assert IncrementalDetokenizer(None).push([5, 6]) == ""
