"""A text tokenized as parts at once (``ParallelEncoder``) gives the ids and offsets of one encode."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.tokenization import load_tokenizer
from kvmesh.tokenization import parallel_encode as pe
from kvmesh.tokenization.incremental import IncrementalTokenizer

PIECES = ["def f(x):\n", "    return x + 1\n", "\n\n", "  ", "\t", "hello", " world", "é", "数据", "🙂",
          "<|user|>", "<|assistant|>", "</s>", "{\"a\": [1, 2]}", "   \n", "x" * 40, "\r\n", "-->", ".",
          "\nclass A:\n", "\nimport os\n"]
chunk = st.lists(st.sampled_from(PIECES) | st.text(max_size=12), min_size=1, max_size=30).map("".join)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def small_parts(monkeypatch):
    """Parts of a few hundred characters, so short generated texts are split too."""
    monkeypatch.setattr(pe, "PART_MIN_CHARS", 200)
    monkeypatch.setattr(pe, "OVERLAP_CHARS", 120)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.lists(chunk, min_size=10, max_size=60).map("".join), parts=st.integers(2, 4))
def test_parts_equal_one_encode(tok, small_parts, text: str, parts: int) -> None:
    enc = pe.ParallelEncoder(tok.encode_with_offsets, tok.encode_with_offsets_batch, parts)
    assert enc.encode(text) == tok.encode_with_offsets(text)


def test_agent_text_is_split_and_equal(tok) -> None:
    lines = [("    " * (i % 3)) + f"step {i}: call tool_{i % 7}(path='src/f{i}.py') -> ok" for i in range(600)]
    text = "\n".join(lines)
    enc = pe.ParallelEncoder(tok.encode_with_offsets, tok.encode_with_offsets_batch, 4)
    assert enc.encode(text) == tok.encode_with_offsets(text)
    assert enc.splits == 1 and enc.fallbacks == 0
    # as the incremental tokenizer's tail encoder: every turn equal to a full tokenization
    inc = IncrementalTokenizer(tok.encode_with_offsets, verify="full", encode_tail=enc.encode)
    inc.encode("s", text)
    for turn in range(3):
        text += "\n" + "\n".join(f"turn {turn} line {j}: value = {j * turn}" for j in range(300))
        assert inc.encode("s", text) == tok.encode(text)
    assert inc.stats.counts["hit"] == 3 and inc.stats.counts["mismatch"] == 0 and enc.splits == 4


def test_a_tokenizer_without_locality_falls_back_then_stops_splitting(small_parts) -> None:
    # ids depend on the whole text: no two parts ever agree with the whole.
    def single(text: str) -> tuple[list[int], list[int]]:
        return [ord(c) + len(text) for c in text], list(range(len(text)))

    enc = pe.ParallelEncoder(single, lambda texts: [single(t) for t in texts], 2)
    text = "abc\ndef\n" * 200
    for _ in range(pe.GIVE_UP_AFTER + 2):
        assert enc.encode(text) == single(text)
    assert enc.splits == 0 and enc.fallbacks == pe.GIVE_UP_AFTER
