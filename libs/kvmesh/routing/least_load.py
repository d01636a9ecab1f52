"""``least_load``: fewest running+waiting requests (incl. the router's in-flight), cache-blind."""

from __future__ import annotations

from kvmesh.routing.policy import Policy, RouteContext
from kvmesh.routing.types import Decision, RouteRequest


class LeastLoadPolicy(Policy):
    name = "least_load"
    predicts = False

    def choose(self, req: RouteRequest, ctx: RouteContext) -> Decision:
        table = self._table(req, ctx)
        win = table.least_loaded()
        return self._decision(req, win, f"least loaded (queue {table.loads.queue[win]:g})", table)
