"""``approx``: the router remembers only its own past decisions (no engine events).

This is the baseline other routers ship (vLLM production-stack, SGLang's
gateway): a per-endpoint LRU of the block keys it has sent there, assuming
nothing is evicted below a capacity. It is also ``precise``'s fallback when
the indexer is unreachable.
"""

from __future__ import annotations

from typing import Any

from kvmesh.routing.candidate_table import MatchColumns
from kvmesh.routing.policy import Policy, RouteContext
from kvmesh.routing.prefix_memory import ApproxIndex, SessionAffinity, SpeculativeIndex
from kvmesh.routing.scoring import ScoringConfig
from kvmesh.routing.types import Decision, RouteRequest


class ApproxPolicy(Policy):
    name = "approx"

    def __init__(self, scoring: ScoringConfig | None = None, *, capacity_blocks: int = 100_000,
                 session_ttl_s: float = 600.0, speculative_ttl_s: float = 2.0, **options: Any) -> None:
        super().__init__(scoring, **options)
        self.index = ApproxIndex(capacity_blocks)
        self.sessions = SessionAffinity(ttl_s=session_ttl_s)
        # Split requests still prefilling: their decode endpoints hold the prefix only after that
        # prefill (pending, see precise); their prefill endpoints are computing it.
        self.pending = SpeculativeIndex(ttl_s=speculative_ttl_s)
        self.prefilling = SpeculativeIndex(ttl_s=speculative_ttl_s)

    def choose(self, req: RouteRequest, ctx: RouteContext) -> Decision:
        seen = self.index.match(req.keys)
        pending = self.pending.match(req.keys, ctx.now)
        # When the only reason to believe the prefix is there is a split still in flight,
        # it is there only after that prefill: pending, not a hit.
        split = {ep: p for ep, p in pending.items() if p >= seen.get(ep, 0) > 0}
        matches = (MatchColumns(ctx.pos).raise_to("gpu", {ep: n for ep, n in seen.items() if ep not in split})
                   .raise_to("pending", split))
        return self._scored_choice(req, ctx, matches, self.sessions.get(req.session_id, ctx.now))

    def on_routed(self, req: RouteRequest, decision: Decision, now: float, prefill_endpoint: str = "") -> None:
        self.index.insert(decision.endpoint_id, req.keys)
        self.sessions.set(req.session_id, decision.endpoint_id, now)
        if prefill_endpoint:
            ttl = self.pending.ttl_after(decision.score)
            self.pending.put(decision.endpoint_id, req.keys, now, ttl)
            self.prefilling.put(prefill_endpoint, req.keys, now, ttl)

    def speculative_blocks(self, req: RouteRequest, now: float) -> dict[str, int]:
        return self.prefilling.match(req.keys, now)

    def on_completed(self, req: RouteRequest, endpoint_id: str, cached_keys: list[int], now: float) -> None:
        if len(cached_keys) > len(req.keys):
            self.index.insert(endpoint_id, cached_keys)

    def forget_endpoint(self, endpoint_id: str) -> None:
        self.index.forget_endpoint(endpoint_id)
        self.sessions.forget_endpoint(endpoint_id)
        self.pending.forget_endpoint(endpoint_id)
        self.prefilling.forget_endpoint(endpoint_id)
