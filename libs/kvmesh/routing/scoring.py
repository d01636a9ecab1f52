"""Cost of serving a request on an endpoint: uncached prefill work plus queued load.

The shape follows NVIDIA Dynamo's KV router (prefill scale × max(active prefill +
incoming − overlap credit, 0) + decode load, in blocks), with two changes that
matter for agent traffic:

* blocks are credited per tier (GPU 1.0, offload RAM 0.75, disk 0.25 by default)
  and block by block, taking the best tier that holds each leading block;
* the prefill already queued on an endpoint is weighted by ``queue_weight``
  (< 1), because a sibling that shares that queued prefill's prefix will reuse
  it instead of recomputing it elsewhere — with weight 1 a burst of sub-agents
  would scatter and each recompute the shared context.

An overload guard marks endpoints whose queue is far above the least-loaded
one as hot; a hot endpoint only takes requests with a large hit there, so
misses never pile onto one busy endpoint (SGLang's "death spiral").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.routing.load import EffectiveLoad
from kvmesh.routing.types import Candidate, TierMatch


@dataclass
class ScoringConfig:
    """Weights of the cost function; every one is configuration."""

    gpu_credit: float = field(default=1.0, metadata={"help": "credit per block in the engine's own cache"})
    cpu_credit: float = field(default=0.75, metadata={"help": "credit per block in the offload RAM tier"})
    disk_credit: float = field(default=0.25, metadata={"help": "credit per block in the offload disk tier"})
    speculative_credit: float = field(default=1.0, metadata={"help": "credit per block of a speculative entry"})
    prefill_load_scale: float = field(default=1.0, metadata={"help": "weight of prefill work (blocks)"})
    queue_weight: float = field(default=0.25, metadata={"help": "weight of prefill already queued on the endpoint"})
    decode_load_scale: float = field(default=1.0, metadata={"help": "cost (in blocks) per running/waiting request"})
    tie_epsilon: float = field(default=0.5, metadata={"help": "costs within this many blocks tie"})
    hot_abs: float = field(default=4.0, metadata={"help": "hot if queue exceeds the minimum by this many"})
    hot_rel: float = field(default=2.0, metadata={"help": "... and is this many times (min+1)"})
    hot_kv_usage: float = field(default=0.98, metadata={"help": "hot if KV usage reaches this"})
    hot_min_hit_ratio: float = field(default=0.5, metadata={"help": "a hot endpoint only takes hits >= this"})
    max_inflight: int = field(default=0, metadata={"help": "per-endpoint in-flight cap (0 = none)"})


def max_hit_blocks(num_tokens: int, block_size: int) -> int:
    """vLLM never reports the prompt's last token as cached (it must compute one)."""
    return max(0, (num_tokens - 1) // block_size) if block_size > 0 else 0


@dataclass
class Credit:
    credit_blocks: float
    gpu_blocks: int        # predicted engine-cache hit (incl. speculative)
    offload_blocks: int    # predicted restore from offload beyond the gpu hit
    speculative_blocks: int


def credit(match: TierMatch, store: TierMatch, cap_blocks: int, cfg: ScoringConfig,
           offload_enabled: bool = True) -> Credit:
    """Credited leading blocks, each block counted at the best tier that holds it."""
    gpu = min(max(match.gpu, match.speculative), cap_blocks)
    spec_only = max(0, min(match.speculative, cap_blocks) - min(match.gpu, cap_blocks))
    tiers: list[tuple[int, float]] = [(min(match.gpu, cap_blocks), cfg.gpu_credit),
                                      (min(match.speculative, cap_blocks), cfg.speculative_credit)]
    if offload_enabled:
        tiers += [(min(max(match.cpu, store.cpu), cap_blocks), cfg.cpu_credit),
                  (min(max(match.disk, store.disk), cap_blocks), cfg.disk_credit)]
    # Walk the tier boundaries from the longest coverage down; between boundaries the
    # best credit is the max over tiers that still cover that stretch.
    bounds = sorted({n for n, _ in tiers if n > 0})
    total = 0.0
    prev = 0
    for b in bounds:
        best = max(c for n, c in tiers if n >= b)
        total += (b - prev) * best
        prev = b
    offload = max(0, prev - gpu) if offload_enabled else 0
    return Credit(total, gpu, offload, spec_only)


def evaluate(endpoint_id: str, match: TierMatch, store: TierMatch, load: EffectiveLoad, num_tokens: int,
             block_size: int, cfg: ScoringConfig, offload_enabled: bool = True) -> Candidate:
    """Cost of one endpoint, in blocks of prefill-equivalent work (lower is better)."""
    cap = max_hit_blocks(num_tokens, block_size)
    c = credit(match, store, cap, cfg, offload_enabled)
    bs = float(block_size)
    incoming = num_tokens / bs
    prefill = cfg.prefill_load_scale * max(cfg.queue_weight * load.prefill_tokens / bs + incoming - c.credit_blocks,
                                           0.0)
    cost = prefill + cfg.decode_load_scale * load.queue
    cached_tokens = (c.gpu_blocks + c.offload_blocks) * block_size
    return Candidate(endpoint_id=endpoint_id, cost=cost, credit_blocks=c.credit_blocks, gpu_blocks=c.gpu_blocks,
                     offload_blocks=c.offload_blocks, speculative_blocks=c.speculative_blocks,
                     uncached_tokens=max(0, num_tokens - cached_tokens), queue=load.queue,
                     prefill_tokens=load.prefill_tokens)


def mark_hot(cands: list[Candidate], loads: dict[str, EffectiveLoad], cap_blocks: int,
             cfg: ScoringConfig) -> None:
    """Flag overloaded endpoints and exclude them for requests with a small hit there."""
    if not cands:
        return
    min_q = min(c.queue for c in cands)
    for c in cands:
        ld = loads[c.endpoint_id]
        c.hot = ((c.queue - min_q >= cfg.hot_abs and c.queue >= cfg.hot_rel * (min_q + 1))
                 or ld.kv_usage >= cfg.hot_kv_usage)
        if cfg.max_inflight and ld.inflight >= cfg.max_inflight:
            c.excluded = "max_inflight"
        elif c.hot:
            ratio = (c.gpu_blocks + c.offload_blocks) / cap_blocks if cap_blocks else 0.0
            if ratio < cfg.hot_min_hit_ratio:
                c.excluded = "hot"


def pick(cands: list[Candidate], cfg: ScoringConfig, affinity: str = "") -> tuple[Candidate, str]:
    """Lowest cost among non-excluded candidates; ties go to affinity, then reuse, then queue."""
    pool = [c for c in cands if not c.excluded] or list(cands)
    best_cost = min(c.cost for c in pool)
    tied = [c for c in pool if c.cost <= best_cost + cfg.tie_epsilon]
    tied.sort(key=lambda c: (c.endpoint_id != affinity, -c.credit_blocks, c.queue, c.cost, c.endpoint_id))
    win = tied[0]
    if len(tied) > 1 and affinity and win.endpoint_id == affinity:
        why = "tie broken by session affinity"
    elif win.credit_blocks > 0:
        why = f"best cost with {win.credit_blocks:.1f} credited blocks"
    else:
        why = "no prefix anywhere; least loaded"
    if len(pool) < len(cands):
        why += f"; {len(cands) - len(pool)} overloaded endpoint(s) skipped"
    return win, why
