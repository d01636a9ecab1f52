"""The routing-policy interface: what every policy implements, and its shared helpers.

A policy sees one tokenized, hashed request plus a snapshot of the cluster
(live endpoints, their load, the index matches if any) and returns a
``Decision``. It is told afterwards where the request went and what the
engine ended up holding, so policies that remember their own decisions
(``approx``, ``session``, the speculative entries of ``precise``) can learn.
Policies are picked by name through ``kvmesh.routing.registry``; this module
imports none of them.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvmesh.routing.candidate_table import REPORTED_CANDIDATES, CandidateTable, MatchColumns
from kvmesh.routing.load import LoadView
from kvmesh.routing.scoring import ScoringConfig, spread_key
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
    # Endpoint ids, and id -> index in ``endpoints`` (the order of every per-endpoint array).
    # Derived when not given; the router core passes the same (read-only) objects while its
    # endpoint set is unchanged.
    ids: list[str] = None  # type: ignore[assignment]
    pos: dict[str, int] = None  # type: ignore[assignment]
    # The endpoint the request's session last went to (RouterCore.moves; "" if none): a decision
    # that leaves it reports what that endpoint was predicted to hold (Decision.given_up_tokens).
    previous: str = ""

    def __post_init__(self) -> None:
        if self.ids is None:
            self.ids = [e.endpoint_id for e in self.endpoints]
        if self.pos is None:
            self.pos = {e: i for i, e in enumerate(self.ids)}


class Policy(abc.ABC):
    """Base class; subclasses set ``name`` and implement ``choose``."""

    name: str = ""
    uses_index: bool = False   # wants the indexer's matches in the context
    admits: bool = False       # its decisions go through admission control (kvmesh.routing.admission)
    # Its decisions predict the chosen endpoint's cached tokens (from the index or its own memory).
    # A policy that predicts nothing has its P/D split decided from the index's matches for the
    # endpoint it chose (SplitConfig.read_index), or every long prompt would split.
    predicts: bool = True

    def __init__(self, scoring: ScoringConfig | None = None, *, report_candidates: int = REPORTED_CANDIDATES,
                 **options: Any) -> None:
        self.scoring = scoring or ScoringConfig()
        self.report_candidates = report_candidates   # Candidate objects kept on a decision (traces)
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
    def _table(self, req: RouteRequest, ctx: RouteContext, matches: MatchColumns | None = None) -> CandidateTable:
        """Every endpoint scored for ``req`` (by default with the index's matches, if any)."""
        if not ctx.endpoints:
            raise NoEndpointError(f"no live endpoint for model {req.model!r}")
        if matches is None:
            matches = MatchColumns(ctx.pos)
            if ctx.matches:
                matches.put_matches(ctx.matches)
        store = ctx.matches.store if ctx.matches else TierMatch()
        return CandidateTable(req, ctx.ids, ctx.load, ctx.now, matches, store,
                              ctx.load.pending_overlap(req.keys, req.block_size), self.scoring, ctx.offload_enabled,
                              previous=ctx.pos.get(ctx.previous, -1))

    def evaluate_on(self, req: RouteRequest, ctx: RouteContext, i: int) -> Candidate:
        """Endpoint ``i`` of ``ctx`` scored for ``req`` with the context's matches (the split rule's
        view of a decision by a policy that predicts nothing)."""
        return self._table(req, ctx).candidate(i)

    def _scored_choice(self, req: RouteRequest, ctx: RouteContext, matches: MatchColumns,
                       affinity: str, cold: np.ndarray | None = None) -> Decision:
        """The cost rule of :mod:`kvmesh.routing.scoring`: overload guard, then the least
        estimated TTFT, ties to ``affinity`` and then as :func:`scoring.pick` says. ``cold``:
        the endpoints a new session goes to first (``ScoringConfig.cold_first``)."""
        table = self._table(req, ctx, matches)
        table.mark_hot()
        if cold is not None:
            table.keep_cold(cold)
        choice = table.pick(affinity, spread_key(req))
        reason = choice.reason
        if table.excluded_warm.any():
            reason += "; new session on a cold endpoint"
        return self._decision(req, choice.index, reason, table)

    def _decision(self, req: RouteRequest, win: int, reason: str, table: CandidateTable,
                  fallback: str = "") -> Decision:
        cands = table.reported(win, self.report_candidates)
        c = cands[0]
        prev = table.previous
        return Decision(endpoint_id=c.endpoint_id, policy=self.name,
                        predicted_cached_tokens_gpu=c.gpu_blocks * req.block_size,
                        predicted_cached_tokens_offload=c.offload_blocks * req.block_size,
                        uncached_tokens=c.uncached_tokens, score=c.cost, reason=reason,
                        fallback=fallback, candidates=cands,
                        previous_cached_tokens=table.predicted_cached_tokens(prev) if 0 <= prev != win else 0)
