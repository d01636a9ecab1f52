"""Configuration of one simulated cluster (flags of ``kvmesh simulate``, env ``KVMESH_SIM_*``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from kvmesh.routing.pd_split import SPLIT_FIELDS, SplitConfig
from kvmesh.routing.scoring import SCORING_METADATA, ScoringConfig


@dataclass
class SimConfig:
    ENV_PREFIX: ClassVar[str] = "KVMESH_SIM_"

    decode_workers: int = field(default=8, metadata={"help": "decode workers"})
    prefill_workers: int = field(default=2, metadata={
        "help": "prefill workers (0 = no P/D split; the split also needs the offload store, which carries the KV)"})
    kv_capacity_tokens: int = field(default=1_000_000, metadata={"help": "GPU KV capacity per worker (tokens)"})
    offload_capacity_tokens: int = field(default=32_000_000, metadata={
        "help": "shared offload store capacity (tokens; 0 = no offload)"})
    offload_eviction: str = field(default="agent", metadata={
        "help": "offload eviction policy: lru | agent (the offload service's default)"})
    block_size: int = field(default=0, metadata={"help": "engine block size (0 = the trace's block size)"})
    max_num_seqs: int = field(default=256, metadata={"help": "max running sequences per worker"})
    max_num_batched_tokens: int = field(default=8192, metadata={"help": "per-step token budget per worker"})
    max_model_len: int = field(default=1_048_576, metadata={"help": "max prompt + output tokens"})
    kv_bytes_per_token: int = field(default=262_144, metadata={
        "help": "KV bytes per token (restore time); default 2*64 layers*8 kv heads*128*bf16 (32B dense)"})
    load_poll_s: float = field(default=0.25, metadata={"help": "how often the router refreshes worker load"})
    split_threshold_tokens: int = field(default=2048, metadata={
        "help": "P/D split when uncached tokens on the chosen decode worker reach this"})
    split_read_index: bool = field(default=SplitConfig.read_index, metadata=SPLIT_FIELDS["read_index"].metadata)
    split_survival_floor: float = field(default=SplitConfig.survival_floor,
                                        metadata=SPLIT_FIELDS["survival_floor"].metadata)
    split_survival_decay: float = field(default=SplitConfig.survival_decay,
                                        metadata=SPLIT_FIELDS["survival_decay"].metadata)
    speculative_ttl_s: float = field(default=2.0, metadata={"help": "router speculative entry TTL"})
    model: str = field(default="sim-model", metadata={"help": "model name (index namespace)"})
    seed: int = field(default=0, metadata={"help": "seed (session starts, random policy)"})
    # Schedule
    mode: str = field(default="closed", metadata={"help": "closed (agent loop) | open (recorded times)"})
    start_window_s: float | None = field(default=None, metadata={
        "help": "spread session starts over this window (s); default: 600 for claude-code, recorded otherwise"})
    think_scale: float = field(default=1.0, metadata={"help": "multiply recorded think times"})
    max_think_s: float | None = field(default=3600.0, metadata={"help": "cap on one recorded gap (s)"})
    macro_steps: bool = field(default=True, metadata={
        "help": "run pure-decode stretches as one event (the same decisions and hits, times to float "
                "rounding; off = one event per engine step)"})
    time_buckets: int = field(default=60, metadata={"help": "points of the hit-rate-over-time series"})
    # The router's cost model, nested as in the router's config: the same flags (--queue-weight, ...);
    # env KVMESH_SIM_SCORING_<FIELD>.
    scoring: ScoringConfig = field(default_factory=ScoringConfig, metadata=SCORING_METADATA)
