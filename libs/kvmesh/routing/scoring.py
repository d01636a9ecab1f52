"""Cost of serving a request on an endpoint: uncached prefill work plus the endpoint's load.

The shape follows NVIDIA Dynamo's KV router (prefill scale × max(active prefill +
incoming − overlap credit, 0) + decode blocks), with changes that matter for
agent traffic:

* blocks are credited per tier and block by block, taking the best tier that
  holds each leading block. A block in the shared offload store is restorable by
  *every* decode endpoint, and restoring it costs only the copy (bytes over the
  host-to-device link, ~7 µs/token for a 32B model) against ~250 µs/token to
  recompute: its credit (0.95) is close to a GPU block's, so a session's home
  endpoint is only slightly cheaper than any other once its prefix is offloaded,
  and load decides where a long session runs next;
* the decode load is the KV blocks held by running requests (the engine's
  reported usage plus what the router sent since), because one long-context
  session decoding slows every step on its endpoint far more than a short one;
* the prefill already queued on an endpoint counts in full (``queue_weight`` 1,
  as Dynamo), minus the part that computes blocks this request will reuse (its
  overlap with what the router just sent there): a sub-agent waiting for its sibling's shared prefix
  loses nothing against recomputing it elsewhere, so bursts still co-locate.

An overload guard marks endpoints whose load is well above the mean (absolute
and relative bounds, in blocks, like SGLang's and AIBrix's balance thresholds)
or whose queue is far above the least-loaded one as *hot*. A hot endpoint keeps
a request only when its hit there is large *and* cannot be restored elsewhere:
misses never pile onto a busy endpoint (SGLang's "death spiral"), and with an
offload store a long session moves off its busy home for the price of a restore.

Ties (new sessions: no prefix anywhere) go to the session's last endpoint, then
the most credit, then the least load, then a stable hash of the session (or
request) id, so simultaneous new sessions spread instead of all taking the
first endpoint.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from kvmesh.routing.load import EffectiveLoad
from kvmesh.routing.types import Candidate, RouteRequest, TierMatch


@dataclass
class ScoringConfig:
    """Weights of the cost function; every one is configuration."""

    gpu_credit: float = field(default=1.0, metadata={"help": "credit per block in the engine's own cache"})
    cpu_credit: float = field(default=0.95, metadata={
        "help": "credit per block in the offload RAM tier: 1 - restore time / recompute time"})
    disk_credit: float = field(default=0.25, metadata={"help": "credit per block in the offload disk tier"})
    speculative_credit: float = field(default=1.0, metadata={"help": "credit per block of a speculative entry"})
    prefill_load_scale: float = field(default=1.0, metadata={"help": "weight of prefill work (blocks)"})
    queue_weight: float = field(default=1.0, metadata={"help": "weight of prefill already queued on the endpoint"})
    decode_load_scale: float = field(default=1.0, metadata={"help": "cost (in blocks) per running/waiting request"})
    decode_block_scale: float = field(default=0.1, metadata={
        "help": "cost per KV block held by running requests (decode load; Dynamo's decode blocks)"})
    tie_epsilon: float = field(default=0.5, metadata={"help": "costs within this many blocks tie"})
    hot_abs: float = field(default=4.0, metadata={"help": "hot if queue exceeds the minimum by this many"})
    hot_rel: float = field(default=2.0, metadata={"help": "... and is this many times (min+1)"})
    hot_load_abs_tokens: float = field(default=32768.0, metadata={
        "help": "hot if load (tokens of queued prefill + weighted decode) exceeds the mean by this"})
    hot_load_rel: float = field(default=1.5, metadata={"help": "... and is this many times the mean"})
    hot_kv_usage: float = field(default=0.98, metadata={"help": "hot if KV usage reaches this"})
    hot_min_hit_ratio: float = field(default=0.5, metadata={"help": "a hot endpoint only takes hits >= this"})
    hot_move_ratio: float = field(default=0.9, metadata={
        "help": "a hot endpoint loses a hit when a cooler one can get this share of it (offload restore)"})
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
             block_size: int, cfg: ScoringConfig, offload_enabled: bool = True,
             overlap_blocks: int = 0) -> Candidate:
    """Cost of one endpoint, in blocks of prefill-equivalent work (lower is better).

    ``overlap_blocks``: leading blocks of this prompt that requests the router just sent
    to the endpoint are computing (a sibling's shared prefix).
    """
    cap = max_hit_blocks(num_tokens, block_size)
    c = credit(match, store, cap, cfg, offload_enabled)
    bs = float(block_size)
    incoming = num_tokens / bs
    # Queued prefill that is computing blocks this request will reuse (a sibling's shared
    # prefix) is not extra delay: elsewhere this request would recompute those blocks.
    queued = cfg.queue_weight * max(load.prefill_tokens / bs - min(overlap_blocks, cap), 0.0)
    prefill = cfg.prefill_load_scale * max(queued + incoming - c.credit_blocks, 0.0)
    decode = cfg.decode_block_scale * (load.active_blocks + load.inflight_tokens / bs) + cfg.decode_load_scale * load.queue
    cached_tokens = (c.gpu_blocks + c.offload_blocks) * block_size
    return Candidate(endpoint_id=endpoint_id, cost=prefill + decode, credit_blocks=c.credit_blocks,
                     gpu_blocks=c.gpu_blocks, offload_blocks=c.offload_blocks, speculative_blocks=c.speculative_blocks,
                     uncached_tokens=max(0, num_tokens - cached_tokens), queue=load.queue,
                     prefill_tokens=load.prefill_tokens, load_blocks=cfg.prefill_load_scale * queued + decode)


def mark_hot(cands: list[Candidate], loads: dict[str, EffectiveLoad], cap_blocks: int, cfg: ScoringConfig,
             block_size: int = 0, offload_enabled: bool = False) -> None:
    """Flag overloaded endpoints and exclude them for requests that need not go there.

    Hot: the queue is far above the least-loaded endpoint's (``hot_abs``/``hot_rel``),
    or the load is far above the mean (``hot_load_abs_tokens``/``hot_load_rel``), or the
    KV cache is full. A hot endpoint is excluded when the request's hit there is small,
    or when a cooler endpoint gets nearly the same hit (from the offload store).
    """
    if not cands:
        return
    min_q = min(c.queue for c in cands)
    mean_load = sum(c.load_blocks for c in cands) / len(cands)
    abs_blocks = cfg.hot_load_abs_tokens / block_size if block_size > 0 else float("inf")
    for c in cands:
        ld = loads[c.endpoint_id]
        c.hot = ((c.queue - min_q >= cfg.hot_abs and c.queue >= cfg.hot_rel * (min_q + 1))
                 or (len(cands) > 1 and c.load_blocks - mean_load >= abs_blocks
                     and c.load_blocks >= cfg.hot_load_rel * mean_load)
                 or ld.kv_usage >= cfg.hot_kv_usage)
    cool_best = max((c.gpu_blocks + c.offload_blocks for c in cands if not c.hot), default=0)
    for c in cands:
        ld = loads[c.endpoint_id]
        if cfg.max_inflight and ld.inflight >= cfg.max_inflight:
            c.excluded = "max_inflight"
        elif c.hot:
            hit = c.gpu_blocks + c.offload_blocks
            ratio = hit / cap_blocks if cap_blocks else 0.0
            if ratio < cfg.hot_min_hit_ratio:
                c.excluded = "hot"
            elif offload_enabled and cool_best >= cfg.hot_move_ratio * hit:
                c.excluded = "hot; restorable elsewhere"


def spread_key(req: RouteRequest) -> tuple[str, bool]:
    """What a tie is hashed on, and whether that hash outranks load.

    A session's new turn: its session id, after load (spread new sessions over the least
    loaded). Without a session id: the prompt's first block key, *before* load — requests
    that share a prefix and are decided at the same moment (a burst, before any of it is
    recorded as speculative) must meet on one endpoint even if a load report lands between
    their decisions. Neither: the request id.
    """
    if req.session_id:
        return "s:" + req.session_id, False
    if req.keys:
        return f"k:{req.keys[0]}", True
    return "r:" + req.request_id, False


def _spread(key: str, endpoint_id: str) -> int:
    """Stable per-(key, endpoint) rank: rendezvous hashing, the same in every process."""
    return zlib.crc32(f"{key}\x00{endpoint_id}".encode())


def pick(cands: list[Candidate], cfg: ScoringConfig, affinity: str = "",
         spread: tuple[str, bool] = ("", False)) -> tuple[Candidate, str]:
    """Lowest cost among non-excluded candidates.

    Ties go to affinity, then reuse, then the least load, then a stable hash of
    ``spread`` (see :func:`spread_key`; a prefix hash outranks load) — never to the
    endpoint id, which would send every new session to the same first endpoint.
    """
    pool = [c for c in cands if not c.excluded] or list(cands)
    best_cost = min(c.cost for c in pool)
    tied = [c for c in pool if c.cost <= best_cost + cfg.tie_epsilon]
    key, hash_first = spread

    def order(c: Candidate) -> tuple:
        h = _spread(key, c.endpoint_id)
        load = (round(c.load_blocks, 3), c.queue)
        rest = (h, load) if hash_first else (load, h)
        return (c.endpoint_id != affinity, -round(c.credit_blocks, 3), *rest, c.endpoint_id)

    tied.sort(key=order)
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
