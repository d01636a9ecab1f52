"""Performance model of a GPU engine: the latency figures every part of kvmesh prices work with.

Why it exists: the router's cost model (:mod:`kvmesh.routing.scoring`) and the sim
engine (:mod:`kvmesh.worker.engine.sim.latency`) must weigh a prefill token, an
attention pair, a decode step and a restore with the *same* numbers, or the router
would optimise for a machine the simulator does not model. The numbers live here,
in the shared library, so the routing core depends on a neutral model and never
imports an engine. Data only, no I/O.

Step time of the model::

    t = step_overhead_s                                   (if the step has any work)
      + prefill_s_per_token   * prefill_tokens            (linear layers)
      + attn_s_per_token_pair * sum_chunks(chunk * (ctx_before + chunk/2))
      + itl_s                                             (if any sequence decodes)
      + decode_s_per_seq      * decode_seqs
      + decode_s_per_ctx_token * sum(decode context lengths)   (KV reads)

and a restore from the offload store costs
``restore_overhead_s + bytes / h2d_bytes_per_s`` (plus the measured transfer).

Defaults (:data:`H100`): an H100-class engine serving a ~32B dense model
(Qwen3-32B-like: 64 layers, 8 KV heads, head dim 128, bf16), aligned with llm-d's
inference simulator profile for H100 (ITL 12 ms, 250 us per prefill token, 3 us per
token KV transfer) — see docs/workers.md for the sources and derivations:

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
- :data:`KV_BYTES_PER_TOKEN` = 262_144 (2 * 64 layers * 8 KV heads * 128 * bf16) and
  :data:`DISK_BYTES_PER_S` = 5e9 (NVMe) price the offload tiers in the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KV_BYTES_PER_TOKEN = 262_144
"""KV bytes per token of the default model (2 * 64 layers * 8 KV heads * 128 * 2 bytes)."""

DISK_BYTES_PER_S = 5e9
"""Read bandwidth of the offload disk tier (NVMe ~5 GB/s)."""


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


H100 = LatencyParams()
"""The default figures: H100-class engine, ~32B dense model (see the module docstring)."""
