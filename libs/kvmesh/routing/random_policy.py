"""``random``: a uniformly random endpoint (seedable, for reproducible simulations)."""

from __future__ import annotations

import random
from typing import Any

from kvmesh.routing.policy import Policy, RouteContext, register
from kvmesh.routing.scoring import ScoringConfig
from kvmesh.routing.types import Decision, RouteRequest


@register
class RandomPolicy(Policy):
    name = "random"

    def __init__(self, scoring: ScoringConfig | None = None, *, seed: int | None = None, **options: Any) -> None:
        super().__init__(scoring, **options)
        self._rng = random.Random(seed)

    def choose(self, req: RouteRequest, ctx: RouteContext) -> Decision:
        cands = sorted(self._candidates(req, ctx), key=lambda c: c.endpoint_id)
        return self._decision(req, self._rng.choice(cands), "random", cands)
