"""vLLM's sampling knobs beyond temperature and top_p: their names, defaults and ranges, in one place.

Why it exists: the same six values enter at four doors (the router's OpenAI and Anthropic HTTP
APIs, its gRPC ``Generate``, a worker's own OpenAI API) and reach vLLM's ``SamplingParams``. Coding
models ship recommended settings that use them (Qwen3-Coder's card: ``top_k`` 20 and
``repetition_penalty`` 1.05), so a request carrying them must be served, and each door must refuse
the same bad values with the same words. Ranges are vLLM's (``SamplingParams._verify_args``),
with upper bounds where vLLM has none, so that a value always fits the protocol's 32-bit field
(a float32 above 3.4e38 is infinite): ``repetition_penalty`` at most 2, as SGLang checks it,
``top_k`` at most 2^31 - 1. ``top_k`` -1 is vLLM's older spelling of "off" and is taken as 0.
``thinking_token_budget`` (a reasoning model's token budget for its thinking) is -1 for unlimited,
as in vLLM; only an engine with a reasoning parser takes another value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

INT32_MAX = 2**31 - 1

# name -> (a test of a valid value, the rule in words, int-valued). The values that change nothing
# are EngineRequest's defaults.
KNOBS: dict[str, tuple[Callable[[float], bool], str, bool]] = {
    "presence_penalty": (lambda v: -2.0 <= v <= 2.0, "in [-2, 2]", False),
    "frequency_penalty": (lambda v: -2.0 <= v <= 2.0, "in [-2, 2]", False),
    "repetition_penalty": (lambda v: 0.0 < v <= 2.0, "in (0, 2]", False),
    "top_k": (lambda v: -1 <= v <= INT32_MAX, "0 or -1 (off), or from 1 to 2147483647", True),
    "min_p": (lambda v: 0.0 <= v <= 1.0, "in [0, 1]", False),
    "thinking_token_budget": (lambda v: -1 <= v <= INT32_MAX, "-1 (unlimited) or from 0 to 2147483647", True),
}


def knob_error(name: str, value: Any) -> str | None:
    """Why ``value`` is not a valid ``name``, or None when it is."""
    ok, rule, integral = KNOBS[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integral and not isinstance(value, int)):
        return f"'{name}' must be {'an integer' if integral else 'a number'}, got {value!r}"
    if value != value or not ok(value):   # NaN fails every range
        return f"'{name}' must be {rule}, got {value if isinstance(value, int) else format(value, 'g')}"
    return None


def normalized(name: str, value: float) -> float:
    """The value vLLM is given (``top_k`` -1 is 0)."""
    return 0 if name == "top_k" and value == -1 else value


def knobs_of(sampling: Any) -> dict[str, float]:
    """The knobs set on a ``common.v1.SamplingParams`` message (unset ones are left out)."""
    return {name: normalized(name, getattr(sampling, name)) for name in KNOBS if sampling.HasField(name)}


def first_error(values: dict[str, Any]) -> tuple[str, str] | None:
    """``(name, message)`` of the first invalid knob in ``values``, or None."""
    for name, value in values.items():
        why = knob_error(name, value)
        if why is not None:
            return name, why
    return None
