"""The router's decision pipeline without I/O: tokens → block keys → endpoint (+ split).

The live service wraps this with gRPC calls (indexer lookup, worker load,
forwarding); the cluster simulator drives it in virtual time with its own
index. Keeping the pipeline here guarantees both make the same decisions.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmesh.hashing import BlockHasher, ExtraKeys
from kvmesh.routing.admission import hold_reason
from kvmesh.routing.hash_cache import ChainResult, ConcatTokens, HashCache, HashCacheConfig
from kvmesh.routing.load import EffectiveLoad, LoadView
from kvmesh.routing.moves import SessionMoves
from kvmesh.routing.pd_split import SplitConfig, SplitDecision, decide_split
from kvmesh.routing.policy import NoEndpointError, Policy, RouteContext
from kvmesh.routing.registry import make_policy
from kvmesh.routing.scoring import ScoringConfig, max_hit_blocks, split_extra_s
from kvmesh.routing.survival import HitSurvival
from kvmesh.routing.types import Candidate, Decision, EndpointView, Matches, RouteRequest

log = logging.getLogger(__name__)


def prefill_request_id(request_id: str) -> str:
    """In-flight id of a split request's prefill half (the live service sends it under this id)."""
    return request_id + "-prefill"


@dataclass
class RouterCoreConfig:
    policy: str = "precise"
    block_size: int = 64
    hash_algo: str = "sha256_cbor"
    hash_seed: str | None = None
    load_staleness_s: float = 2.0
    speculative_ttl_s: float = 2.0
    approx_capacity_blocks: int = 100_000
    offload_enabled: bool = True
    # Candidates kept on each decision for traces and logs (the winner first); the simulator
    # keeps only the winner, since building the others is most of a decision at fleet scale.
    report_candidates: int = 16
    # Keep ``precise``'s approx fallback trained on every decision, for when the indexer is
    # unreachable; off where the index always answers (the simulator).
    warm_fallback: bool = True
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    split: SplitConfig = field(default_factory=SplitConfig)
    hash_cache: HashCacheConfig = field(default_factory=HashCacheConfig)
    # Extra options for one policy's constructor, by policy name, e.g. ``{"random": {"seed": 0}}``
    # (a reproducible simulation); they override the shared options above.
    policy_options: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Eligible:
    """The live endpoints of one role and model, their ids and positions (read-only, shared)."""

    endpoints: list[EndpointView]
    ids: list[str]
    pos: dict[str, int]


class RouterCore:
    """Hash cache + policies + load view + endpoint table + split rule."""

    def __init__(self, cfg: RouterCoreConfig | None = None, hasher: BlockHasher | None = None) -> None:
        self.cfg = cfg or RouterCoreConfig()
        self.hasher = hasher or BlockHasher(self.cfg.hash_algo, self.cfg.block_size, self.cfg.hash_seed)
        self.hash_cache = HashCache(self.hasher, self.cfg.hash_cache)
        self.load = LoadView(staleness_s=self.cfg.load_staleness_s, reuse_window_s=self.cfg.scoring.reuse_window_s)
        self.survival = HitSurvival(self.cfg.split.survival_decay, self.cfg.split.survival_floor)
        self.moves = SessionMoves()
        self.endpoints: dict[str, EndpointView] = {}
        self._eligible: dict[tuple[str, str, frozenset[str], int], _Eligible] = {}
        self._policies: dict[str, Policy] = {}
        self.default_policy = self.policy(self.cfg.policy)

    @property
    def block_size(self) -> int:
        return self.hasher.block_size

    def policy(self, name: str) -> Policy:
        """The (stateful, shared) instance of a policy; created on first use."""
        p = self._policies.get(name)
        if p is None:
            options = dict(speculative_ttl_s=self.cfg.speculative_ttl_s,
                           approx_capacity_blocks=self.cfg.approx_capacity_blocks,
                           capacity_blocks=self.cfg.approx_capacity_blocks,
                           report_candidates=self.cfg.report_candidates, warm_fallback=self.cfg.warm_fallback)
            options.update(self.cfg.policy_options.get(name, {}))
            p = make_policy(name, self.cfg.scoring, **options)
            self._policies[name] = p
        return p

    # -- endpoints -------------------------------------------------------------
    def set_endpoint(self, ep: EndpointView) -> None:
        self.endpoints[ep.endpoint_id] = ep
        self._eligible.clear()

    def set_alive(self, endpoint_id: str, alive: bool) -> bool:
        """Mark an endpoint up or down; True if that changed anything."""
        ep = self.endpoints.get(endpoint_id)
        if ep is None or ep.alive == alive:
            return False
        ep.alive = alive
        self._eligible.clear()
        return True

    def remove_endpoint(self, endpoint_id: str) -> None:
        self._eligible.clear()
        if self.endpoints.pop(endpoint_id, None) is not None:
            self.load.forget(endpoint_id)
            self.load.working_set.forget_endpoint(endpoint_id)
            self.survival.forget(endpoint_id)
            for p in self._policies.values():
                p.forget_endpoint(endpoint_id)

    def decode_endpoints(self, model: str, exclude: set[str] | frozenset[str] = frozenset()) -> list[EndpointView]:
        """Live decode endpoints for ``model``."""
        return list(self._eligible_set("decode", model, exclude).endpoints)

    def _eligible_set(self, role: str, model: str, exclude: set[str] | frozenset[str]) -> _Eligible:
        # Kept until an endpoint is added, removed or marked up or down (through this class),
        # since every decision asks and fleets are large; the same ids and positions objects
        # across decisions also let per-endpoint arrays be aligned once.
        key = (role, model, frozenset(exclude), len(self.endpoints))
        got = self._eligible.get(key)
        if got is None:
            if len(self._eligible) > 256:
                self._eligible.clear()
            eps = [e for e in self.endpoints.values()
                   if e.alive and (e.decodes if role == "decode" else e.role == "prefill")
                   and (not e.model or e.model == model) and e.endpoint_id not in exclude]
            ids = [e.endpoint_id for e in eps]
            got = self._eligible[key] = _Eligible(eps, ids, {e: i for i, e in enumerate(ids)})
        return got

    def prefill_endpoints(self, model: str, exclude: set[str] | frozenset[str] = frozenset()) -> list[EndpointView]:
        return list(self._eligible_set("prefill", model, exclude).endpoints)

    # -- pipeline --------------------------------------------------------------
    def chain(self, tokens: Sequence[int], extra: ExtraKeys | None = None, session_id: str = "") -> ChainResult:
        return self.hash_cache.chain(tokens, extra, session_id)

    def decide(self, req: RouteRequest, matches: Matches | None, now: float, policy: str = "",
               exclude: set[str] | frozenset[str] = frozenset(), held_s: float = 0.0) -> Decision:
        """The policy's choice. For a policy with admission control (``Policy.admits``) the
        decision may say ``hold`` (kvmesh.routing.admission): the caller then sends nothing and
        decides again after ``admit_recheck_s``, passing the time the request has waited so far."""
        pol = self.policy(policy) if policy else self.default_policy
        ctx = self._context(req, matches, now, exclude)
        d = pol.choose(req, ctx)
        if pol.admits and self.cfg.scoring.admit_miss_ratio > 0:
            d.hold = hold_reason(req, d, self.load, ctx.ids, now, held_s, self.cfg.scoring)
        return d

    def _context(self, req: RouteRequest, matches: Matches | None, now: float,
                 exclude: set[str] | frozenset[str]) -> RouteContext:
        eps = self._eligible_set("decode", req.model, exclude)
        if not eps.endpoints:
            raise NoEndpointError(f"no live endpoint for model {req.model!r}")
        return RouteContext(endpoints=list(eps.endpoints), load=self.load, now=now, matches=matches,
                            offload_enabled=self.cfg.offload_enabled, ids=eps.ids, pos=eps.pos,
                            previous=self.moves.previous(req.session_id))

    def split_reads_index(self, policy: str = "") -> bool:
        """Whether the split rule reads the index for ``policy``'s decisions although the policy
        does not (``Policy.predicts`` false, ``SplitConfig.read_index``, the split on)."""
        pol = self.policy(policy) if policy else self.default_policy
        s = self.cfg.split
        return not pol.predicts and s.enabled and s.read_index

    def split_lookup(self, req: RouteRequest, policy: str = "") -> bool:
        """Whether to look ``req`` up for the split rule alone (:meth:`split_reads_index`): the
        caller passes the matches to :meth:`decide_split`, not to :meth:`decide` (the choice stays
        the policy's). A prompt below the threshold never splits, so it needs no lookup."""
        return req.num_tokens >= self.cfg.split.threshold_tokens and self.split_reads_index(policy)

    def _split_view(self, decision: Decision, req: RouteRequest, now: float, exclude: set[str] | frozenset[str],
                    matches: Matches | None) -> tuple[Candidate | None, int, int, bool]:
        """The chosen endpoint's evaluation, uncached and predicted cached tokens the split rule
        reads, and whether they are the index's: the decision's own, or for a policy that predicts
        nothing (given the index's matches), the index's."""
        own = decision.chosen(), decision.uncached_tokens, decision.predicted_cached_tokens, False
        if matches is None or not self.split_reads_index(decision.policy):
            return own
        try:
            ctx = self._context(req, matches, now, exclude)
        except NoEndpointError:
            return own
        i = ctx.pos.get(decision.endpoint_id)
        if i is None:
            return own
        win = self.policy(decision.policy).evaluate_on(req, ctx, i)
        return win, win.uncached_tokens, (win.gpu_blocks + win.offload_blocks) * req.block_size, True

    def decide_split(self, decision: Decision, req: RouteRequest, now: float,
                     exclude: set[str] | frozenset[str] = frozenset(),
                     matches: Matches | None = None) -> SplitDecision:
        """Split rule over the prefill endpoints.

        A prefill endpoint's own cache counts: what the index (``matches``) says it holds,
        or what requests just split there are computing (the policy's speculative blocks;
        its queued prefill of them is not a wait this request would avoid elsewhere). So a
        burst's siblings follow the first one's prefill, and a prefix that survives only on
        one prefill endpoint is reused there.
        """
        win, uncached, predicted, from_index = self._split_view(decision, req, now, exclude, matches)
        split = self._split_rule(decision, req, now, exclude, matches, win, uncached, predicted)
        if from_index:
            # The policy predicted nothing; the survival rule learns from what the index showed.
            split.inputs["cached_from"] = "index"
            decision.split_view_cached_tokens = predicted
        return split

    def _split_rule(self, decision: Decision, req: RouteRequest, now: float, exclude: set[str] | frozenset[str],
                    matches: Matches | None, win: Candidate | None, uncached: int, predicted: int) -> SplitDecision:
        pre = self.prefill_endpoints(req.model, exclude)
        # Blocks credited only as a split sibling's pending prefill are not there to reuse
        # without a split: they count as uncached for the threshold.
        uncached += win.pending_blocks * req.block_size if win is not None else 0
        # What the chosen endpoint's engine has lately not found of its predicted hits is likely
        # recomputed there too: a split restores it from the store now instead.
        lost = self.survival.expected_loss(decision.endpoint_id, predicted)
        uncached += lost
        if not self.cfg.split.enabled or uncached < self.cfg.split.threshold_tokens:
            # The rule stops before it looks at any prefill endpoint (most requests).
            return decide_split(uncached, req.num_tokens, pre, {}, self.cfg.split)
        loads = {e.endpoint_id: self.load.effective(e.endpoint_id, now) for e in pre}
        if win is None:
            return decide_split(uncached, req.num_tokens, pre, loads, self.cfg.split)
        cap = max_hit_blocks(req.num_tokens, req.block_size)
        pol = self.policy(decision.policy)

        @functools.cache
        def in_flight() -> tuple[dict[str, int], dict[str, int]]:
            # Only needed once the threshold passes, which most requests never do.
            return pol.speculative_blocks(req, now), self.load.pending_overlap(req.keys, req.block_size)

        def remote(ep: str) -> tuple[int, int]:
            """(leading blocks cached on ``ep``, its queued prefill tokens that compute them)."""
            spec, overlap = in_flight()
            gpu = max(matches.get(ep).gpu if matches is not None else 0, spec.get(ep, 0))
            return min(gpu, cap), overlap.get(ep, 0)

        def extra(ep: str, ld: EffectiveLoad) -> float:
            gpu, shared = remote(ep)
            return split_extra_s(win, req.num_tokens, req.block_size, max(ld.prefill_tokens - shared, 0.0),
                                 self.cfg.scoring, gpu, lost)

        def remote_uncached(ep: str) -> int:
            return max(0, req.num_tokens - max(win.store_blocks, remote(ep)[0]) * req.block_size)
        return decide_split(uncached, req.num_tokens, pre, loads, self.cfg.split, extra, remote_uncached)

    def on_routed(self, req: RouteRequest, decision: Decision, now: float,
                  split: SplitDecision | None = None) -> None:
        """The request was sent: count it on its endpoint (its prefill only where it runs)."""
        local_prefill = decision.uncached_tokens
        prefill_ep = ""
        # Shared prefixes are found (a scan of the endpoint's in-flight requests) only for the cost that reads them.
        bs = req.block_size if self.cfg.scoring.kv_wait_w(self.cfg.offload_enabled) > 0.0 else 0
        if split is not None and split.split:
            # The prefill runs on the prefill endpoint (the live service records it there under
            # the same id); the decode endpoint only restores the result.
            local_prefill = 0
            prefill_ep = split.prefill_endpoint
            todo = split.prefill_uncached_tokens
            self.load.on_sent(prefill_ep, prefill_request_id(req.request_id), todo, now, keys=req.keys,
                              num_tokens=req.num_tokens, cached_tokens=req.num_tokens - todo,
                              block_size=bs)
        self.load.on_sent(decision.endpoint_id, req.request_id, local_prefill, now, keys=req.keys,
                          num_tokens=req.num_tokens, cached_tokens=decision.predicted_cached_tokens,
                          block_size=bs)
        # What the store held of the prompt (the same on every endpoint): displaced from this
        # endpoint later, that part comes back by a restore (ScoringConfig.displace_store_price).
        win = decision.chosen()
        stored = win.store_blocks if win is not None else 0
        if self.cfg.scoring.store_keep and self.cfg.offload_enabled and win is not None:
            self._observe_store(req, win, now)
        self.load.working_set.touch(req.session_id, decision.endpoint_id, req.num_tokens, now,
                                    stored * req.block_size)
        decision.moved = self.moves.observe(req.session_id, decision.endpoint_id)
        self.policy(decision.policy).on_routed(req, decision, now, prefill_ep)

    def _observe_store(self, req: RouteRequest, win: Candidate, now: float) -> None:
        """What the store kept of the session's previous prompt since that turn ended
        (``LoadView.store_horizon``, for ``ScoringConfig.store_keep``). The previous prompt is
        only expected as far as some tier still shows this prompt extends it (the GPU hit here,
        or the store's own match): a prompt that was rewritten says nothing about evictions."""
        last = self.load.working_set.last(req.session_id)
        if last is None:
            return
        tokens, at = last
        expected = min(tokens // req.block_size, max(win.gpu_blocks - win.speculative_blocks, win.store_blocks))
        self.load.store_horizon.observe(now - at, expected, min(win.store_blocks, expected))

    def on_engine_cached(self, endpoint_id: str, predicted_tokens: int, actual_tokens: int) -> None:
        """The engine's cached tokens for a request that ran on ``endpoint_id`` without a split,
        against the router's prediction (``kvmesh.routing.survival``)."""
        self.survival.observe(endpoint_id, predicted_tokens, actual_tokens)

    def on_first_token(self, req: RouteRequest, now: float | None = None) -> None:
        """``now`` times the request's decode on its endpoint (``EffectiveLoad.residence_s``)."""
        self.load.on_first_token(req.request_id, now)

    def on_finished(self, req: RouteRequest, decision: Decision, now: float,
                    prompt_tokens: Sequence[int] | None = None, output_tokens: list[int] | None = None,
                    extra: ExtraKeys | None = None) -> None:
        """Release in-flight counts; if the output is known, remember the blocks the engine now holds."""
        self.load.on_finished(req.request_id, now)
        self.load.working_set.refresh(req.session_id, decision.endpoint_id, now)
        self.hash_cache.release()
        if prompt_tokens is None or not output_tokens:
            return
        # The engine caches full blocks of prompt + output, except the last sampled token (never computed).
        full = ConcatTokens(prompt_tokens, output_tokens[:-1])
        n = len(full) // self.block_size
        if n <= len(req.keys):
            return
        res = self.hash_cache.chain(full, extra, req.session_id)
        self.hash_cache.release()
        self.policy(decision.policy).on_completed(req, decision.endpoint_id, res.keys, now)
