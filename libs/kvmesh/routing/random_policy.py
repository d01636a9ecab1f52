"""``random``: a uniformly random endpoint (seedable, for reproducible simulations)."""

from __future__ import annotations

import random
from typing import Any

from kvmesh.routing.policy import Policy, RouteContext
from kvmesh.routing.scoring import ScoringConfig
from kvmesh.routing.types import Decision, RouteRequest


class RandomPolicy(Policy):
    name = "random"
    predicts = False

    def __init__(self, scoring: ScoringConfig | None = None, *, seed: int | None = None, **options: Any) -> None:
        super().__init__(scoring, **options)
        self._rng = random.Random(seed)

    def choose(self, req: RouteRequest, ctx: RouteContext) -> Decision:
        table = self._table(req, ctx)
        order = sorted(range(len(ctx.ids)), key=ctx.ids.__getitem__)
        return self._decision(req, self._rng.choice(order), "random", table)
