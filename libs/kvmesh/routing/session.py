"""``session``: stick each session to one endpoint; new sessions go to the least loaded."""

from __future__ import annotations

from typing import Any

from kvmesh.routing.policy import Policy, RouteContext
from kvmesh.routing.prefix_memory import SessionAffinity
from kvmesh.routing.scoring import ScoringConfig
from kvmesh.routing.types import Decision, RouteRequest


class SessionPolicy(Policy):
    name = "session"
    predicts = False

    def __init__(self, scoring: ScoringConfig | None = None, *, session_ttl_s: float = 3600.0,
                 **options: Any) -> None:
        super().__init__(scoring, **options)
        self.sessions = SessionAffinity(ttl_s=session_ttl_s)

    def choose(self, req: RouteRequest, ctx: RouteContext) -> Decision:
        table = self._table(req, ctx)
        sticky = ctx.pos.get(self.sessions.get(req.session_id, ctx.now))
        if sticky is not None:
            return self._decision(req, sticky, "session affinity", table)
        return self._decision(req, table.least_loaded(), "new session; least loaded", table)

    def on_routed(self, req: RouteRequest, decision: Decision, now: float, prefill_endpoint: str = "") -> None:
        self.sessions.set(req.session_id, decision.endpoint_id, now)

    def forget_endpoint(self, endpoint_id: str) -> None:
        self.sessions.forget_endpoint(endpoint_id)
