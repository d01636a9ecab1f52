"""Latency model of one engine step (chunked prefill + decode sharing a batch).

Why it exists: the sim engine and the cluster simulator need step times that
react the way a real GPU engine does — prefill cost grows with *uncached*
tokens and, through attention, with the context those tokens attend to; decode
is paid per step and grows with the KV it must read. Pure functions, no I/O.

The coefficients (:class:`LatencyParams`, H100-class defaults and where they
come from) live in the neutral :mod:`kvmesh.perfmodel`, shared with the router's
cost model; this module turns them into step and restore times.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvmesh.perfmodel import LatencyParams

__all__ = ["LatencyModel", "LatencyParams", "PrefillChunk"]


@dataclass(slots=True)
class PrefillChunk:
    """``tokens`` new tokens computed on top of ``context`` already-present tokens."""

    tokens: int
    context: int


class LatencyModel:
    """Step and restore costs from ``LatencyParams``."""

    def __init__(self, params: LatencyParams | None = None) -> None:
        self.p = params or LatencyParams()
        self.p.validate()

    def prefill_cost(self, tokens: int, context: int) -> float:
        """Compute cost of ``tokens`` new prompt tokens after ``context`` present ones."""
        p = self.p
        pairs = tokens * (context + tokens / 2.0)
        return tokens * p.prefill_s_per_token + pairs * p.attn_s_per_token_pair

    def step_time(self, chunks: Iterable[PrefillChunk], decode_contexts: Iterable[int] = (),
                  num_new_requests: int = 0) -> float:
        """Duration of one step computing ``chunks`` and one token for each decoding sequence."""
        p = self.p
        t = 0.0
        busy = False
        for c in chunks:
            if c.tokens > 0:
                t += self.prefill_cost(c.tokens, c.context)
                busy = True
        n_dec = 0
        ctx_sum = 0
        for ctx in decode_contexts:
            n_dec += 1
            ctx_sum += ctx
        if n_dec:
            t += p.itl_s + n_dec * p.decode_s_per_seq + ctx_sum * p.decode_s_per_ctx_token
            busy = True
        if busy:
            t += p.step_overhead_s
        t += num_new_requests * p.request_overhead_s
        return t

    def restore_time(self, num_bytes: int, measured_s: float = 0.0) -> float:
        """Time to bring ``num_bytes`` of KV back: measured store transfer + modelled H2D copy."""
        if num_bytes <= 0:
            return measured_s
        return measured_s + self.p.restore_overhead_s + num_bytes / self.p.h2d_bytes_per_s

    def modelled_transfer_time(self, num_tokens: int) -> float:
        """Transfer estimate when no store is measured (llm-d's per-token transfer)."""
        return num_tokens * self.p.transfer_s_per_token

    def estimate_ttft(self, prompt_tokens: int, cached_tokens: int) -> float:
        """Isolated TTFT of one request (no queueing): overhead + uncached prefill."""
        u = max(prompt_tokens - cached_tokens, 0)
        return self.p.request_overhead_s + self.p.step_overhead_s + self.prefill_cost(u, cached_tokens)
