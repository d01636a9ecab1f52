"""kvmesh.sampling: the rules every door applies to vLLM's penalties, top_k, min_p and thinking budget."""

from __future__ import annotations

import math

import pytest

from kvmesh.sampling import KNOBS, first_error, knob_error, knobs_of, normalized
from kvmesh.worker.engine.base import EngineRequest
from kvmesh_api.common.v1 import common_pb2


@pytest.mark.parametrize(("name", "value"), [
    ("presence_penalty", -2.0), ("presence_penalty", 2), ("frequency_penalty", 0.0), ("repetition_penalty", 1.05),
    ("repetition_penalty", 2.0), ("top_k", -1), ("top_k", 2**31 - 1), ("top_k", 0), ("top_k", 20), ("min_p", 0.0), ("min_p", 1.0),
    ("thinking_token_budget", -1), ("thinking_token_budget", 0), ("thinking_token_budget", 4096),
])
def test_values_vllm_takes_pass(name: str, value: float) -> None:
    assert knob_error(name, value) is None


@pytest.mark.parametrize(("name", "value", "words"), [
    ("presence_penalty", 2.01, "in [-2, 2]"), ("frequency_penalty", -2.5, "in [-2, 2]"),
    ("repetition_penalty", 0.0, "(0, 2]"), ("repetition_penalty", -1, "(0, 2]"), ("repetition_penalty", 1e39, "(0, 2]"),
    ("top_k", -2, "from 1 to"), ("top_k", 2**40, "from 1 to"), ("presence_penalty", math.inf, "[-2, 2]"),
    ("top_k", 2.5, "an integer"), ("top_k", True, "an integer"), ("min_p", 1.5, "in [0, 1]"),
    ("min_p", math.nan, "in [0, 1]"), ("min_p", "0.1", "a number"), ("presence_penalty", None, "a number"),
    ("thinking_token_budget", -2, "-1 (unlimited)"), ("thinking_token_budget", 2**31, "-1 (unlimited)"),
    ("thinking_token_budget", 1.5, "an integer"),
])
def test_bad_values_are_named_with_the_rule(name: str, value: object, words: str) -> None:
    why = knob_error(name, value)
    assert why is not None and why.startswith(f"'{name}' must be") and words in why


def test_the_engine_requests_defaults_pass() -> None:
    plain = EngineRequest("r", [1])
    assert all(knob_error(name, getattr(plain, name)) is None for name in KNOBS)


def test_proto_knobs_only_the_set_ones_and_top_k_minus_one_is_off() -> None:
    sp = common_pb2.SamplingParams(max_tokens=4, top_k=-1, repetition_penalty=1.5)
    assert knobs_of(sp) == {"top_k": 0, "repetition_penalty": 1.5}
    assert knobs_of(common_pb2.SamplingParams()) == {}
    assert normalized("top_k", -1) == 0 and normalized("min_p", 0.5) == 0.5


def test_an_integer_is_quoted_whole() -> None:
    assert knob_error("top_k", 2**40) == "'top_k' must be 0 or -1 (off), or from 1 to 2147483647, got 1099511627776"


def test_first_error_names_the_knob() -> None:
    assert first_error({"top_k": 5, "min_p": 2.0}) == ("min_p", "'min_p' must be in [0, 1], got 2")
    assert first_error({"top_k": 5}) is None
