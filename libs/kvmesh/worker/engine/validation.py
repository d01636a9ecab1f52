"""Request checks every engine applies before a request reaches its scheduler.

Why it exists: the sim engine stands in for vLLM, so both must turn away the
same bad requests with the same error types (the worker maps each to a gRPC
status) and messages that name the problem. Engine-specific limits (the sim's
KV block capacity, vLLM's clamping of ``max_tokens``) stay in the engines.
"""

from __future__ import annotations

from collections.abc import Collection, Container, Sequence

from kvmesh.sampling import KNOBS, first_error
from kvmesh.worker.engine.base import (
    BadSamplingError,
    DuplicateRequestError,
    EmptyPromptError,
    EngineRequest,
    InvalidRequestError,
    PromptTooLongError,
    QueueFullError,
    TokenOutOfVocabError,
    UnknownLoraError,
)

MAX_REQUEST_ID_BYTES = 128
MAX_CACHE_SALT_BYTES = 256


def first_out_of_vocab(ids: Sequence[object], vocab_size: int) -> tuple[int, object] | None:
    """(position, id) of the first id that is not an int in ``[0, vocab_size)``, else None."""
    try:
        if min(ids) >= 0 and max(ids) < vocab_size:  # type: ignore[type-var,operator]  # C-speed scan
            return None
    except TypeError:
        pass
    return next(((i, t) for i, t in enumerate(ids)
                 if not isinstance(t, int) or t < 0 or t >= vocab_size), None)


def validate_request(req: EngineRequest, *, vocab_size: int, max_model_len: int, lora_names: Collection[str],
                     in_flight: Container[str], queued: int, max_queued: int, queued_what: str = "waiting",
                     allow_block_hashes: bool = False, reasoning: bool = False) -> None:
    """Raise the matching ``InvalidRequestError`` subclass (or ``QueueFullError``) for a bad request.

    ``allow_block_hashes``: a request may carry precomputed ``block_hashes`` and
    ``num_prompt_tokens`` instead of token ids (the sim's virtual-time path).
    ``queued``/``max_queued`` (0 = unbounded) is the engine's admission queue.
    ``reasoning``: the engine splits reasoning off (a reasoning parser), so it takes a thinking budget.
    """
    if not req.request_id:
        raise InvalidRequestError("request_id is required")
    if len(req.request_id.encode()) > MAX_REQUEST_ID_BYTES:
        raise InvalidRequestError(f"request_id longer than {MAX_REQUEST_ID_BYTES} bytes")
    ids = req.prompt_token_ids
    if not ids:
        if not allow_block_hashes:
            raise EmptyPromptError("prompt is empty: prompt_token_ids must hold at least one token")
        if req.block_hashes is None or req.prompt_len <= 0:
            raise EmptyPromptError("prompt is empty: give prompt_token_ids (or block_hashes with num_prompt_tokens)")
    bad = first_out_of_vocab(ids, vocab_size) if ids else None
    if bad is not None:
        raise TokenOutOfVocabError(f"prompt token id {bad[1]} at position {bad[0]} is outside the vocabulary "
                                   f"[0, {vocab_size})")
    n = req.prompt_len
    if n >= max_model_len:
        raise PromptTooLongError(f"prompt has {n} tokens; max_model_len is {max_model_len} "
                                 f"(prompt must leave room for at least one output token)")
    if req.max_tokens <= 0:
        raise BadSamplingError(f"max_tokens must be > 0, got {req.max_tokens}")
    if req.temperature < 0:
        raise BadSamplingError(f"temperature must be >= 0, got {req.temperature}")
    if not 0.0 < req.top_p <= 1.0:
        raise BadSamplingError(f"top_p must be in (0, 1], got {req.top_p}")
    bad_knob = first_error({name: getattr(req, name) for name in KNOBS})
    if bad_knob is not None:
        raise BadSamplingError(bad_knob[1])
    if req.thinking_token_budget >= 0 and not reasoning and not req.prefill_only:   # vLLM's rule
        raise BadSamplingError("thinking_token_budget needs a worker with a reasoning parser (--reasoning-parser)")
    bad_stop = first_out_of_vocab(req.stop_token_ids, vocab_size) if req.stop_token_ids else None
    if bad_stop is not None:
        raise TokenOutOfVocabError(f"stop token id {bad_stop[1]} is outside the vocabulary [0, {vocab_size})")
    if req.lora_name and req.lora_name not in lora_names:
        known = ", ".join(sorted(lora_names)) or "none"
        raise UnknownLoraError(f"unknown LoRA adapter {req.lora_name!r} (loaded: {known})")
    if len(req.cache_salt.encode()) > MAX_CACHE_SALT_BYTES:
        raise InvalidRequestError(f"cache_salt longer than {MAX_CACHE_SALT_BYTES} bytes")
    if req.request_id in in_flight:
        raise DuplicateRequestError(f"request_id {req.request_id!r} is already in flight")
    if 0 < max_queued <= queued:
        raise QueueFullError(f"waiting queue is full: {queued} requests {queued_what} (max {max_queued})")
