"""``llmd``: llm-d's inference scheduler with its precise-prefix-cache profile, as a comparison policy.

It exists so that kvmesh's own policies are measured against what a team would
deploy from llm-d's guide, on the same simulated or live cluster. The facts
(formulas, defaults) come from llm-d's public sources; docs/router.md ("Peer
policies: llmd") cites the file of each. In short, per decode endpoint::

    total = w_prefix · prefix + w_kv · (1 − kv_usage) + w_queue · queue
    prefix = min-max of the leading matched blocks over the endpoints that hold the
             prompt's first block (1 if they all match the same; 0 where no block matches)
    queue  = (max_waiting − waiting) / (max_waiting − min_waiting)   (1 if all equal)

and the endpoint with the highest total wins (max-score picker). Matched blocks
are the engine's per-endpoint cache as its KV events report it (GPU and the
endpoint's own CPU tier, not the shared offload store, which belongs to no pod)
plus llm-d's speculative entries: the prompt's blocks on the endpoint just
picked, kept for 30 s. llm-d breaks ties at random; here a stable hash of the
session (or prefix) breaks them, so a seeded simulation repeats.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from kvmesh.routing.candidate_table import MatchColumns
from kvmesh.routing.policy import NoEndpointError, Policy, RouteContext
from kvmesh.routing.prefix_memory import SpeculativeIndex
from kvmesh.routing.scoring import ScoringConfig, spread_key
from kvmesh.routing.types import Decision, RouteRequest

# The profile's weights (precise-prefix-cache-scorer, kv-cache-utilization-scorer, queue-scorer).
PREFIX_WEIGHT, KV_WEIGHT, QUEUE_WEIGHT = 2.0, 1.0, 1.0
SPECULATIVE_TTL_S = 30.0   # the precise scorer's defaultSpeculativeTTL


def prefix_scores(matched: np.ndarray) -> np.ndarray:
    """The precise prefix scorer's normalisation of leading matched blocks per endpoint."""
    out = np.zeros(len(matched))
    hit = matched > 0
    if not hit.any():
        return out
    lo, hi = matched[hit].min(), matched[hit].max()
    out[hit] = 1.0 if lo == hi else (matched[hit] - lo) / (hi - lo)
    return out


def queue_scores(waiting: np.ndarray) -> np.ndarray:
    """The queue scorer: fewer waiting requests score higher, min-max over the endpoints."""
    lo, hi = waiting.min(), waiting.max()
    if lo == hi:
        return np.ones(len(waiting))
    return (hi - waiting) / (hi - lo)


def kv_scores(kv_usage: np.ndarray) -> np.ndarray:
    """The KV-cache-utilization scorer: the free fraction of the endpoint's KV cache."""
    return 1.0 - kv_usage


class LlmdPolicy(Policy):
    name = "llmd"
    uses_index = True

    def __init__(self, scoring: ScoringConfig | None = None, *, prefix_weight: float = PREFIX_WEIGHT,
                 kv_weight: float = KV_WEIGHT, queue_weight: float = QUEUE_WEIGHT,
                 speculative_indexing: bool = True, llmd_speculative_ttl_s: float = SPECULATIVE_TTL_S,
                 **options: Any) -> None:
        super().__init__(scoring, **options)
        self.weights = (prefix_weight, kv_weight, queue_weight)
        self.speculative_indexing = speculative_indexing
        self.speculative = SpeculativeIndex(ttl_s=llmd_speculative_ttl_s)

    def matched_blocks(self, req: RouteRequest, ctx: RouteContext) -> MatchColumns:
        """What llm-d's index holds for the prompt, per endpoint (its events and its speculation)."""
        m = MatchColumns(ctx.pos)
        if ctx.matches:
            m.put_matches(ctx.matches)
        if self.speculative_indexing:
            m.raise_to("speculative", self.speculative.match(req.keys, ctx.now))
        return m

    def scores(self, req: RouteRequest, ctx: RouteContext, m: MatchColumns) -> np.ndarray:
        """The weighted total of the three scorers, per endpoint in ``ctx.ids`` order."""
        if not ctx.endpoints:
            raise NoEndpointError(f"no live endpoint for model {req.model!r}")
        # A pod's chain runs while each block is on it in any tier (a speculative entry included).
        matched = np.minimum(np.maximum.reduce([m.array(f) for f in ("gpu", "cpu", "disk", "speculative")]),
                             len(req.keys))
        lc = ctx.load.columns(ctx.ids, ctx.now)
        wp, wk, wq = self.weights
        return wp * prefix_scores(matched) + wk * kv_scores(lc.kv_usage) + wq * queue_scores(lc.waiting)

    def choose(self, req: RouteRequest, ctx: RouteContext) -> Decision:
        m = self.matched_blocks(req, ctx)
        total = self.scores(req, ctx, m)
        best = np.flatnonzero(total == total.max())
        key = spread_key(req)[0]
        win = int(min(best.tolist(), key=lambda i: (zlib.crc32(f"{key}\x00{ctx.ids[i]}".encode()), ctx.ids[i])))
        table = self._table(req, ctx, m)
        return self._decision(req, win, f"llm-d max score {total[win]:.3f} of {len(best)} tied", table)

    def on_routed(self, req: RouteRequest, decision: Decision, now: float, prefill_endpoint: str = "") -> None:
        # PreRequest: the prompt's blocks on the picked endpoint (and its prefill endpoint).
        if self.speculative_indexing:
            self.speculative.put(decision.endpoint_id, req.keys, now)
            if prefill_endpoint:
                self.speculative.put(prefill_endpoint, req.keys, now)

    def speculative_blocks(self, req: RouteRequest, now: float) -> dict[str, int]:
        return self.speculative.match(req.keys, now) if self.speculative_indexing else {}

    def forget_endpoint(self, endpoint_id: str) -> None:
        self.speculative.forget_endpoint(endpoint_id)
