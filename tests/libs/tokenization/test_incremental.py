"""Incremental tokenization equals full tokenization, on append-only and mid-edit conversations."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.tokenization import load_tokenizer
from kvmesh.tokenization.incremental import APPEND_SLACK_CHARS, IncrementalTokenizer

# Agent-like text: code, prose, whitespace runs, newlines, unicode, the template's special tokens.
PIECES = ["def f(x):\n", "    return x + 1\n", "\n\n", "  ", "\t", "hello", " world", "é", "数据", "🙂",
          "<|user|>", "<|assistant|>", "</s>", "{\"a\": [1, 2]}", "   \n", "x" * 40, "\r\n", "-->", "."]
chunk = st.lists(st.sampled_from(PIECES) | st.text(max_size=12), min_size=1, max_size=30).map("".join)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def _full(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(base=st.lists(chunk, min_size=20, max_size=40).map("".join), turns=st.lists(chunk, min_size=1, max_size=6))
def test_append_only_turns_equal_full_tokenization(tok, base: str, turns: list[str]) -> None:
    inc = IncrementalTokenizer(tok.encode_with_offsets, verify="off")
    text = base
    assert inc.encode("s", text) == _full(tok, text)
    for t in turns:
        text += t
        assert inc.encode("s", text) == _full(tok, text)
    assert inc.stats.counts["mismatch"] == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(base=st.lists(chunk, min_size=20, max_size=40).map("".join), edit=chunk, data=st.data())
def test_mid_edits_equal_full_tokenization(tok, base: str, edit: str, data) -> None:
    inc = IncrementalTokenizer(tok.encode_with_offsets, verify="off")
    inc.encode("s", base)
    at = data.draw(st.integers(0, len(base)))
    cut = data.draw(st.integers(0, min(50, len(base) - at)))
    text = base[:at] + edit + base[at + cut:]
    assert inc.encode("s", text) == _full(tok, text)


def test_a_long_conversation_reuses_its_prefix_and_a_middle_edit_is_counted(tok) -> None:
    seen: list[str] = []
    inc = IncrementalTokenizer(tok.encode_with_offsets, verify="full", on_outcome=seen.append)
    text = "".join(f"<|user|>\nstep {i}: def f{i}(x):\n    return x * {i}\n<|assistant|>\n" for i in range(300))
    first = len(inc.encode("s", text))
    for i in range(5):
        text += f"<|user|>\nturn {i} adds more code\n    y = {i}\n"
        assert inc.encode("s", text) == _full(tok, text)
    assert inc.stats.counts["hit"] == 5 and inc.stats.counts["mismatch"] == 0
    assert inc.stats.tokens_reused > 50 * (inc.stats.tokens_encoded - first)   # each turn: the tail only
    edited = text[:100] + "EDIT" + text[100:]
    assert inc.encode("s", edited) == _full(tok, edited)
    assert seen[-1] == "edit" and inc.stats.counts["verified"] == 5
    near_end = edited[: len(edited) - APPEND_SLACK_CHARS // 2] + " and a new ending"
    assert inc.encode("s", near_end) == _full(tok, near_end) and seen[-2:] == ["hit", "verified"]


def test_memory_is_bounded_by_bytes_lru(tok) -> None:
    inc = IncrementalTokenizer(tok.encode_with_offsets, max_bytes=200_000, verify="off")
    for s in range(20):
        inc.encode(s, f"session {s} " * 2000)
        assert inc.nbytes <= 200_000
    assert 0 < len(inc) < 20
    inc.encode(19, "session 19 " * 2000 + "more")
    assert inc.stats.counts["hit"] == 1     # the most recent session was kept


def test_verify_catches_a_tokenizer_that_breaks_locality() -> None:
    # A toy "tokenizer" whose ids depend on the whole text: an incremental result cannot match.
    def encode(text: str) -> tuple[list[int], list[int]]:
        return [ord(c) + len(text) for c in text], list(range(len(text)))

    inc = IncrementalTokenizer(encode, verify="full")
    base = "abc\n" * 50
    inc.encode("s", base)
    out = inc.encode("s", base + "d")
    assert out == encode(base + "d")[0]
    assert inc.stats.counts["resync"] + inc.stats.counts["mismatch"] == 1


def test_bad_verify_mode_is_refused(tok) -> None:
    with pytest.raises(ValueError, match="verify"):
        IncrementalTokenizer(tok.encode_with_offsets, verify="sometimes")
