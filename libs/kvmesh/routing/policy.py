"""The routing-policy interface and the registry that picks a policy by name.

A policy sees one tokenized, hashed request plus a snapshot of the cluster
(live endpoints, their load, the index matches if any) and returns a
``Decision``. It is told afterwards where the request went and what the
engine ended up holding, so policies that remember their own decisions
(``approx``, ``session``, the speculative entries of ``precise``) can learn.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvmesh.routing.load import EffectiveLoad, LoadView
from kvmesh.routing.scoring import ScoringConfig, evaluate
from kvmesh.routing.types import Candidate, Decision, EndpointView, Matches, RouteRequest, TierMatch


class NoEndpointError(RuntimeError):
    """No live endpoint can take the request."""


@dataclass
class RouteContext:
    """A snapshot of the cluster for one decision."""

    endpoints: list[EndpointView]        # live decode-capable endpoints for the model
    load: LoadView
    now: float
    matches: Matches | None = None       # None: no index answer (unavailable or not asked)
    offload_enabled: bool = True
    _loads: dict[str, EffectiveLoad] | None = field(default=None, repr=False)

    def loads(self) -> dict[str, EffectiveLoad]:
        """Every endpoint's effective load, computed once per decision (scoring and the overload
        guard both read it; at fleet scale it is the decision's main cost)."""
        if self._loads is None:
            self._loads = {e.endpoint_id: self.load.effective(e.endpoint_id, self.now) for e in self.endpoints}
        return self._loads


class Policy(abc.ABC):
    """Base class; subclasses set ``name`` and implement ``choose``."""

    name: str = ""
    uses_index: bool = False   # wants the indexer's matches in the context

    def __init__(self, scoring: ScoringConfig | None = None, **options: Any) -> None:
        self.scoring = scoring or ScoringConfig()
        self.options = options

    @abc.abstractmethod
    def choose(self, req: RouteRequest, ctx: RouteContext) -> Decision:
        """Pick an endpoint; raise ``NoEndpointError`` if there is none."""

    def on_routed(self, req: RouteRequest, decision: Decision, now: float, prefill_endpoint: str = "") -> None:
        """The request was sent to ``decision.endpoint_id`` (its prefill to ``prefill_endpoint`` if split)."""
        return None

    def speculative_blocks(self, req: RouteRequest, now: float) -> dict[str, int]:
        """Per endpoint, leading blocks of ``req`` that requests just sent there are computing
        (known before the engine's events say so); empty for policies that do not track them."""
        return {}

    def on_completed(self, req: RouteRequest, endpoint_id: str, cached_keys: list[int], now: float) -> None:
        """The request finished; ``cached_keys`` are the full blocks the engine now holds for it."""
        return None

    def forget_endpoint(self, endpoint_id: str) -> None:
        """The endpoint left (deregistered or dead): drop what is remembered about it."""
        return None

    # Shared helpers ------------------------------------------------------
    def _candidates(self, req: RouteRequest, ctx: RouteContext,
                    match_of: Callable[[str], TierMatch] | None = None) -> list[Candidate]:
        if not ctx.endpoints:
            raise NoEndpointError(f"no live endpoint for model {req.model!r}")
        store = ctx.matches.store if ctx.matches else TierMatch()
        if match_of is None:
            match_of = (ctx.matches.get if ctx.matches else (lambda _e: TierMatch()))
        shared = ctx.load.pending_overlap(req.keys, req.block_size)
        loads = ctx.loads()
        out = []
        for e in ctx.endpoints:
            ld = loads[e.endpoint_id]
            out.append(evaluate(e.endpoint_id, match_of(e.endpoint_id), store, ld, req.num_tokens,
                                req.block_size, self.scoring, ctx.offload_enabled, shared.get(e.endpoint_id, 0)))
        return out

    def _decision(self, req: RouteRequest, win: Candidate, reason: str, cands: list[Candidate],
                  fallback: str = "") -> Decision:
        return Decision(endpoint_id=win.endpoint_id, policy=self.name,
                        predicted_cached_tokens_gpu=win.gpu_blocks * req.block_size,
                        predicted_cached_tokens_offload=win.offload_blocks * req.block_size,
                        uncached_tokens=win.uncached_tokens, score=win.cost, reason=reason,
                        fallback=fallback, candidates=cands)


_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy available by its ``name``."""
    _REGISTRY[cls.name] = cls
    return cls


def _load_builtin() -> None:
    # Imported for their @register side effect.
    from kvmesh.routing import (  # noqa: F401
        approx,
        least_load,
        precise,
        random_policy,
        round_robin,
        session,
    )


def available_policies() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def make_policy(name: str, scoring: ScoringConfig | None = None, **options: Any) -> Policy:
    """Instantiate a registered policy; ``ValueError`` names the choices for an unknown name."""
    _load_builtin()
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(sorted(_REGISTRY))}")
    return cls(scoring, **options)
