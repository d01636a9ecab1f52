"""``session``: stick each session to one endpoint; new sessions go to the least loaded."""

from __future__ import annotations

from typing import Any

from kvmesh.routing.policy import Policy, RouteContext, register
from kvmesh.routing.prefix_memory import SessionAffinity
from kvmesh.routing.scoring import ScoringConfig
from kvmesh.routing.types import Decision, RouteRequest


@register
class SessionPolicy(Policy):
    name = "session"

    def __init__(self, scoring: ScoringConfig | None = None, *, session_ttl_s: float = 3600.0,
                 **options: Any) -> None:
        super().__init__(scoring, **options)
        self.sessions = SessionAffinity(ttl_s=session_ttl_s)

    def choose(self, req: RouteRequest, ctx: RouteContext) -> Decision:
        cands = self._candidates(req, ctx)
        by_id = {c.endpoint_id: c for c in cands}
        sticky = self.sessions.get(req.session_id, ctx.now)
        if sticky in by_id:
            return self._decision(req, by_id[sticky], "session affinity", cands)
        win = min(cands, key=lambda c: (c.queue, c.prefill_tokens, c.endpoint_id))
        return self._decision(req, win, "new session; least loaded", cands)

    def on_routed(self, req: RouteRequest, decision: Decision, now: float, prefill_endpoint: str = "") -> None:
        self.sessions.set(req.session_id, decision.endpoint_id, now)

    def forget_endpoint(self, endpoint_id: str) -> None:
        self.sessions.forget_endpoint(endpoint_id)
