"""``dynamo``: NVIDIA Dynamo's KV router cost, as a comparison policy.

It exists so that kvmesh's own policies are measured against Dynamo's KV-aware
router on the same simulated or live cluster. The facts come from Dynamo's
public sources; docs/router.md ("Peer policies: dynamo") cites the files. Per
decode worker, lower is better::

    logit = overlap_score_weight · prefill_blocks + decode_blocks
    prefill_blocks = (prefill tokens still queued there + this prompt's tokens − overlap · block_size)
                     / block_size
    decode_blocks  = KV blocks the worker's running requests hold + this prompt's blocks

``overlap`` is the worker's leading blocks of the prompt in its GPU cache, from the
engine's KV events (Dynamo's event-driven indexer; the shared offload store is not
a worker's overlap). Defaults: weight 1.0, temperature 0, so the least logit wins.
Dynamo picks among tied workers at random; here a stable hash of the session (or
prefix) does, so a seeded simulation repeats.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from kvmesh.routing.candidate_table import MatchColumns
from kvmesh.routing.policy import NoEndpointError, Policy, RouteContext
from kvmesh.routing.scoring import ScoringConfig, spread_key
from kvmesh.routing.types import Decision, RouteRequest

OVERLAP_SCORE_WEIGHT = 1.0   # KvRouterConfig's default (--kv-overlap-score-weight)


def logits(num_tokens: int, request_blocks: int, block_size: int, overlap: np.ndarray,
           prefill_tokens: np.ndarray, active_blocks: np.ndarray, weight: float = OVERLAP_SCORE_WEIGHT) -> np.ndarray:
    """Dynamo's worker cost for a prompt of ``num_tokens`` (``request_blocks`` full blocks)."""
    new_tokens = np.maximum(num_tokens - np.minimum(overlap, request_blocks) * block_size, 0)
    prefill_blocks = (prefill_tokens + new_tokens) / block_size
    decode_blocks = active_blocks + request_blocks
    return weight * prefill_blocks + decode_blocks


class DynamoPolicy(Policy):
    name = "dynamo"
    uses_index = True

    def __init__(self, scoring: ScoringConfig | None = None, *,
                 overlap_score_weight: float = OVERLAP_SCORE_WEIGHT, **options: Any) -> None:
        super().__init__(scoring, **options)
        self.overlap_score_weight = overlap_score_weight

    def logits(self, req: RouteRequest, ctx: RouteContext, m: MatchColumns) -> np.ndarray:
        """The cost per endpoint, in ``ctx.ids`` order."""
        if not ctx.endpoints:
            raise NoEndpointError(f"no live endpoint for model {req.model!r}")
        bs = req.block_size
        lc = ctx.load.columns(ctx.ids, ctx.now)
        # Blocks held by the running requests: the last report's, plus those sent since (their contexts).
        active = lc.active_blocks + lc.inflight_ctx_tokens / bs
        return logits(req.num_tokens, len(req.keys), bs, m.array("gpu"), lc.prefill_tokens, active,
                      self.overlap_score_weight)

    def choose(self, req: RouteRequest, ctx: RouteContext) -> Decision:
        m = MatchColumns(ctx.pos)
        if ctx.matches:
            m.put_matches(ctx.matches)
        cost = self.logits(req, ctx, m)
        best = np.flatnonzero(cost == cost.min())
        key = spread_key(req)[0]
        win = int(min(best.tolist(), key=lambda i: (zlib.crc32(f"{key}\x00{ctx.ids[i]}".encode()), ctx.ids[i])))
        table = self._table(req, ctx, m)
        return self._decision(req, win, f"dynamo least logit {cost[win]:.1f} of {len(best)} tied", table)
