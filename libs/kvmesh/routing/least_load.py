"""``least_load``: fewest running+waiting requests (incl. the router's in-flight), cache-blind."""

from __future__ import annotations

from kvmesh.routing.policy import Policy, RouteContext, register
from kvmesh.routing.types import Decision, RouteRequest


@register
class LeastLoadPolicy(Policy):
    name = "least_load"

    def choose(self, req: RouteRequest, ctx: RouteContext) -> Decision:
        cands = self._candidates(req, ctx)
        win = min(cands, key=lambda c: (c.queue, c.prefill_tokens, c.endpoint_id))
        return self._decision(req, win, f"least loaded (queue {win.queue:g})", cands)
