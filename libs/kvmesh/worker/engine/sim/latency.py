"""Latency model of one engine step (chunked prefill + decode sharing a batch).

Why it exists: the sim engine and the cluster simulator need step times that
react the way a real GPU engine does — prefill cost grows with *uncached*
tokens and, through attention, with the context those tokens attend to; decode
is paid per step and grows with the KV it must read. Pure functions, no I/O.

Step time::

    t = step_overhead_s                                   (if the step has any work)
      + prefill_s_per_token   * prefill_tokens            (linear layers)
      + attn_s_per_token_pair * sum_chunks(chunk * (ctx_before + chunk/2))
      + itl_s                                             (if any sequence decodes)
      + decode_s_per_seq      * decode_seqs
      + decode_s_per_ctx_token * sum(decode context lengths)   (KV reads)

and a request's restore from the offload store costs
``restore_overhead_s + bytes / h2d_bytes_per_s`` (plus the measured transfer).

Defaults: an H100-class engine serving a ~32B dense model (Qwen3-32B-like:
64 layers, 8 KV heads, head dim 128, bf16), aligned with llm-d's inference
simulator profile for H100 (ITL 12 ms, 250 us per prefill token, 3 us per token
KV transfer) — see docs/workers.md for the sources and derivations:

- ``prefill_s_per_token = 250e-6`` — llm-d inference-sim H100 example profile.
- ``step_overhead_s = 0.004`` — scheduling + launch per step; llm-d's 30 ms
  "overhead" is per *request* (TTFT floor) and is ``request_overhead_s`` here.
- ``attn_s_per_token_pair = 3.3e-9`` — attention FLOPs per (query, key) pair
  = 4 * layers * n_heads * head_dim = 4*64*64*128 ≈ 2.1 MFLOP, at ~640 TFLOP/s
  effective FlashAttention throughput on H100 (bf16 dense peak 989 TFLOP/s).
- ``itl_s = 0.012`` — llm-d H100 profile inter-token latency.
- ``decode_s_per_ctx_token = 7.8e-8`` — reading 2*64*8*128*2 = 262 KB of KV
  per context token at H100 HBM3 ~3.35 TB/s.
- ``h2d_bytes_per_s = 38e9`` — ~26 ms/GB host-to-device restore measured by
  llm-d's CPU-offload results (anchors.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class LatencyParams:
    """Cost coefficients (seconds). Defaults: H100-class, ~32B dense model."""

    step_overhead_s: float = field(default=0.004, metadata={"help": "fixed cost of a non-empty step"})
    request_overhead_s: float = field(default=0.030, metadata={
        "help": "per-request TTFT floor (tokenize/schedule/first sample; llm-d: 30 ms)"})
    prefill_s_per_token: float = field(default=250e-6, metadata={"help": "linear prefill cost per uncached token"})
    attn_s_per_token_pair: float = field(default=3.3e-9, metadata={
        "help": "attention cost per (new token, context token) pair"})
    itl_s: float = field(default=0.012, metadata={"help": "decode step base latency (inter-token latency)"})
    decode_s_per_seq: float = field(default=5e-5, metadata={"help": "extra decode cost per running sequence"})
    decode_s_per_ctx_token: float = field(default=7.8e-8, metadata={
        "help": "KV read cost per context token per decode step"})
    h2d_bytes_per_s: float = field(default=38e9, metadata={"help": "host-to-device restore bandwidth"})
    restore_overhead_s: float = field(default=0.002, metadata={"help": "fixed cost of one restore"})
    transfer_s_per_token: float = field(default=3e-6, metadata={
        "help": "modelled KV transfer per token when no real store is used (llm-d: 3 us)"})

    def validate(self) -> None:
        for name, value in self.__dict__.items():
            if value < 0:
                raise ValueError(f"latency parameter {name} must be >= 0, got {value}")
        if self.h2d_bytes_per_s <= 0:
            raise ValueError("latency parameter h2d_bytes_per_s must be > 0")


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
