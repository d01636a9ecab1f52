"""``round_robin``: each endpoint in turn, cache-blind and load-blind."""

from __future__ import annotations

from typing import Any

from kvmesh.routing.policy import Policy, RouteContext
from kvmesh.routing.scoring import ScoringConfig
from kvmesh.routing.types import Decision, RouteRequest


class RoundRobinPolicy(Policy):
    name = "round_robin"
    predicts = False

    def __init__(self, scoring: ScoringConfig | None = None, **options: Any) -> None:
        super().__init__(scoring, **options)
        self._next = 0

    def choose(self, req: RouteRequest, ctx: RouteContext) -> Decision:
        table = self._table(req, ctx)
        order = sorted(range(len(ctx.ids)), key=ctx.ids.__getitem__)
        win = order[self._next % len(order)]
        self._next += 1
        return self._decision(req, win, "round robin", table)
