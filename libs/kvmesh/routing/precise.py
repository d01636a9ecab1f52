"""``precise``: route by the engines' real cache contents (indexer matches per tier).

Matches come from the indexer (fed by the engines' KV events) and are merged
with the router's own speculative entries, which cover the gap between a pick
and the engine's events (sibling bursts). The cost function and overload guard
are in :mod:`kvmesh.routing.scoring`; session affinity breaks ties. Without an
index answer the policy falls back to ``approx`` (kept warm on every decision),
and says so on the decision.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvmesh.routing.approx import ApproxPolicy
from kvmesh.routing.candidate_table import MatchColumns
from kvmesh.routing.policy import Policy, RouteContext
from kvmesh.routing.prefix_memory import SessionAffinity, SpeculativeIndex
from kvmesh.routing.scoring import ScoringConfig
from kvmesh.routing.types import Decision, RouteRequest


class PrecisePolicy(Policy):
    name = "precise"
    uses_index = True
    admits = True

    def __init__(self, scoring: ScoringConfig | None = None, *, speculative_ttl_s: float = 2.0,
                 session_ttl_s: float = 600.0, approx_capacity_blocks: int = 100_000,
                 warm_fallback: bool = True, **options: Any) -> None:
        super().__init__(scoring, **options)
        # A caller that always has the index's answer (the cluster simulator) never falls
        # back, and keeping approx warm is then a chain insert per decision for nothing.
        self.warm_fallback = warm_fallback
        self.speculative = SpeculativeIndex(ttl_s=speculative_ttl_s)
        # Decode endpoints of split requests: they hold the prefix once its prefill is done.
        self.pending = SpeculativeIndex(ttl_s=speculative_ttl_s)
        self.sessions = SessionAffinity(ttl_s=session_ttl_s)
        # ScoringConfig.cold_first: the endpoints a request was placed on, and when this policy
        # first had endpoints to choose from (its warm-up runs cold_after_s from then).
        self.placed: set[str] = set()
        self.started: float | None = None
        self.fallback = ApproxPolicy(self.scoring, report_candidates=self.report_candidates,
                                     capacity_blocks=approx_capacity_blocks,
                                     session_ttl_s=session_ttl_s, speculative_ttl_s=speculative_ttl_s)

    def choose(self, req: RouteRequest, ctx: RouteContext) -> Decision:
        if ctx.matches is None:
            d = self.fallback.choose(req, ctx)
            d.policy = self.name
            d.fallback = "indexer unavailable; approx"
            d.reason = f"fallback to approx: {d.reason}"
            return d
        matches = MatchColumns(ctx.pos).put_matches(ctx.matches)
        gpu, pos = matches.array("gpu"), ctx.pos
        matches.raise_to("speculative", self.speculative.confirmed(
            req.keys, ctx.now, lambda ep: int(gpu[pos[ep]]) if ep in pos else 0))
        matches.raise_to("pending", self.pending.match(req.keys, ctx.now))
        affinity = self.sessions.get(req.session_id, ctx.now)
        cold = self._cold(ctx, matches) if self.scoring.cold_first and not affinity else None
        return self._scored_choice(req, ctx, matches, affinity, cold)

    def _cold(self, ctx: RouteContext, matches: MatchColumns) -> np.ndarray | None:
        """Endpoints no request went to, once the router has routed for ``cold_after_s``, and that
        the index shows holding none of the prompt (a restarted router's warm endpoints hold it).

        The delay is the router's warm-up, not each endpoint's: an endpoint that joins later (a
        fleet scaling out, an engine back after a restart) is empty, and is cold at once."""
        if self.started is None:
            self.started = ctx.now
        n = len(ctx.ids)
        if ctx.now - self.started < self.scoring.cold_after_s:
            return None   # still warming up: no endpoint counts as cold
        unused = (ep not in self.placed for ep in ctx.ids)
        return np.fromiter(unused, bool, n) & (matches.array("gpu") <= 0)

    def on_routed(self, req: RouteRequest, decision: Decision, now: float, prefill_endpoint: str = "") -> None:
        # A split request's blocks are computed on the prefill endpoint; the decode endpoint
        # holds them only after that prefill and a restore. Crediting the decode endpoint's
        # GPU now would send a sibling there to recompute the whole prefix itself; as pending
        # blocks they draw the sibling there and make it split to the same prefill endpoint.
        ttl = self.speculative.ttl_after(decision.score)
        # Nothing here is for the index to overrule: whatever of the prompt it evicts before this
        # request runs, the request computes again, and the engine then holds the whole chain.
        self.speculative.put(prefill_endpoint or decision.endpoint_id, req.keys, now, ttl)
        if prefill_endpoint:
            self.pending.put(decision.endpoint_id, req.keys, now, ttl)
        self.sessions.set(req.session_id, decision.endpoint_id, now)
        self.placed.add(decision.endpoint_id)
        if self.warm_fallback:
            self.fallback.on_routed(req, decision, now, prefill_endpoint)

    def speculative_blocks(self, req: RouteRequest, now: float) -> dict[str, int]:
        return self.speculative.match(req.keys, now)

    def on_completed(self, req: RouteRequest, endpoint_id: str, cached_keys: list[int], now: float) -> None:
        # The engine now holds prompt + output blocks; cover them until its events land.
        # The request is over: its prompt's blocks were reported when its prefill ended (only the
        # output's may lag), and from now on the engine may evict them (SpeculativeIndex.confirmed).
        self.speculative.put(endpoint_id, cached_keys, now, known=len(req.keys))
        if self.warm_fallback:
            self.fallback.on_completed(req, endpoint_id, cached_keys, now)

    def forget_endpoint(self, endpoint_id: str) -> None:
        self.speculative.forget_endpoint(endpoint_id)
        self.pending.forget_endpoint(endpoint_id)
        self.sessions.forget_endpoint(endpoint_id)
        self.placed.discard(endpoint_id)
        self.fallback.forget_endpoint(endpoint_id)
