"""Every endpoint's cost for one request at once, as numpy arrays.

:func:`kvmesh.routing.scoring.evaluate`, :func:`~kvmesh.routing.scoring.mark_hot` and
:func:`~kvmesh.routing.scoring.pick` state the routing rule one endpoint at a time; they
are the reference. At fleet scale (hundreds of endpoints, and every one of them holds
the shared system prompt, so every one is a candidate) scoring endpoint by endpoint in
Python was most of a decision. This table applies the same rule to all endpoints at
once, with the same floating-point operations in the same order, so it reaches exactly
the same decision (``tests/libs/routing/test_candidate_table.py`` checks that on random
clusters). ``Candidate`` objects are built only for the endpoints a decision reports.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from kvmesh.routing.load import LoadColumns, LoadView
from kvmesh.routing.scoring import (
    ClusterState,
    ScoringConfig,
    evaluate,
    max_hit_blocks,
    pick_reason,
    saturation,
)
from kvmesh.routing.types import Candidate, Matches, RouteRequest, TierMatch

REPORTED_CANDIDATES = 16   # the winner and the cheapest others, kept on the decision for traces


class MatchColumns:
    """Per-endpoint matched blocks (the ``TierMatch`` fields), aligned with a list of endpoints."""

    FIELDS = ("gpu", "cpu", "disk", "speculative", "pending")

    def __init__(self, pos: Mapping[str, int]) -> None:
        self.pos = pos
        n = len(pos)
        self.cols: dict[str, np.ndarray] = {f: np.zeros(n, dtype=np.int64) for f in self.FIELDS}

    def put(self, per_endpoint: Mapping[str, TierMatch]) -> MatchColumns:
        pos = self.pos
        gpu, cpu, disk, spec, pend = (self.cols[f] for f in self.FIELDS)
        for ep, m in per_endpoint.items():
            i = pos.get(ep)
            if i is not None:
                gpu[i], cpu[i], disk[i], spec[i], pend[i] = m.gpu, m.cpu, m.disk, m.speculative, m.pending
        return self

    def put_matches(self, matches: Matches) -> MatchColumns:
        """The index's answer, as a dict or (the simulator's) as arrays."""
        c = matches.columns
        if c is None:
            return self.put(matches.per_endpoint)
        src, dst = c.align(self.pos)
        for f in ("gpu", "cpu", "disk"):
            self.cols[f][dst] = getattr(c, f)[src]
        return self

    def raise_to(self, name: str, blocks: Mapping[str, int]) -> MatchColumns:
        """Field ``name`` becomes at least ``blocks[ep]`` (a leading run known from another source)."""
        if not blocks:
            return self
        pos = self.pos
        idx: list[int] = []
        val: list[int] = []
        for ep, n in blocks.items():
            i = pos.get(ep)
            if i is not None:
                idx.append(i)
                val.append(n)
        if idx:
            col, at = self.cols[name], np.asarray(idx)
            col[at] = np.maximum(col[at], np.asarray(val, dtype=np.int64))
        return self

    def at(self, i: int) -> TierMatch:
        c = self.cols
        return TierMatch(int(c["gpu"][i]), int(c["cpu"][i]), int(c["disk"][i]), int(c["speculative"][i]),
                         int(c["pending"][i]))

    def array(self, name: str) -> np.ndarray:
        return self.cols[name]


def _prefill_s(tokens: np.ndarray, context: np.ndarray, cfg: ScoringConfig) -> np.ndarray:
    """``ScoringConfig.prefill_cost``, element-wise, with the same operations in the same order (the
    callers keep the ``tokens <= 0`` case out)."""
    return tokens * cfg.prefill_s_per_token + tokens * (context + tokens / 2.0) * cfg.attn_s_per_token_pair


@dataclass
class Choice:
    index: int
    reason: str


class CandidateTable:
    """Costs, tiers and overload flags of one request on every endpoint (numpy, endpoint order)."""

    def __init__(self, req: RouteRequest, ids: list[str], load: LoadView, now: float, matches: MatchColumns,
                 store: TierMatch, shared: Mapping[str, int], cfg: ScoringConfig,
                 offload_enabled: bool = True, previous: int = -1) -> None:
        self.req, self.ids, self.load, self.now = req, ids, load, now
        # The index of the endpoint the session's previous turn went to (-1: none; from
        # RouteContext.previous), read only to report what a move gave up.
        self.previous = previous
        self.matches, self.store, self.cfg, self.offload_enabled = matches, store, cfg, offload_enabled
        self.shared = shared
        self.cap = cap = max_hit_blocks(req.num_tokens, req.block_size)
        lc: LoadColumns = load.columns(ids, now)
        self.loads = lc
        bs = req.block_size
        g, sp = matches.array("gpu"), matches.array("speculative")
        # scoring.tier_split, element-wise.
        real_gpu = np.minimum(g, cap)
        gpu = np.minimum(np.maximum(g, sp), cap)
        if offload_enabled:
            real_cpu_end = np.maximum(gpu, np.minimum(np.maximum(matches.array("cpu"), store.cpu), cap))
            real_disk_end = np.minimum(np.maximum(matches.array("disk"), store.disk), cap)
            cpu_end = np.maximum(real_cpu_end, np.minimum(matches.array("pending"), cap))
            disk_end = np.maximum(cpu_end, real_disk_end)
            n_cpu, n_disk = cpu_end - gpu, disk_end - cpu_end
            pend = np.maximum(0, cpu_end - np.maximum(real_cpu_end, real_disk_end))
        else:
            n_cpu = n_disk = pend = np.zeros(len(ids), dtype=np.int64)
        self.gpu, self.speculative = gpu, gpu - real_gpu
        self.offload = n_cpu + n_disk
        # scoring.evaluate, element-wise.
        cached_tokens = (gpu + n_cpu + n_disk) * bs
        uncached = np.maximum(0, req.num_tokens - cached_tokens)
        restore = np.where(self.offload > 0, cfg.restore_overhead_s + (n_cpu * bs) * cfg.cpu_restore_s_per_token
                           + (n_disk * bs) * cfg.disk_restore_s_per_token, 0.0)
        compute = np.where(uncached > 0, _prefill_s(uncached, cached_tokens, cfg), 0.0)
        self.shared_arr = np.zeros(len(ids))
        for ep, n in shared.items():
            i = matches.pos.get(ep)
            if i is not None:
                self.shared_arr[i] = n
        queued = np.maximum(lc.prefill_tokens - self.shared_arr, 0.0)
        per_token = (cfg.prefill_s_per_token + cfg.attn_s_per_token_pair * lc.prefill_ctx_tokens
                     if cfg.queue_attention else cfg.prefill_s_per_token)   # scoring.queued_s_per_token
        self.wait = cfg.queue_weight * queued * per_token
        self.store_life = math.inf
        if cfg.store_keep and offload_enabled:
            self.store_life = load.store_life_s(req.session_id, now)
        if self.store_life != math.inf:   # scoring.store_kept, element-wise
            life, w = self.store_life, self.wait
            if life <= 0.0:
                kept = np.where(w <= 0.0, 1.0, 0.0)
            else:
                kept = np.where(w <= 0.0, 1.0, np.maximum(0.0, 1.0 - w / life))
            at_risk = (self.offload - pend) * bs
            lost = np.where((at_risk > 0) & (kept < 1.0), (1.0 - kept) * at_risk, 0.0)
            u, c = uncached + lost, cached_tokens - lost
            compute = np.where(lost > 0.0, _prefill_s(u, c, cfg), compute)
            restore = np.where(lost > 0.0, restore - lost * cfg.cpu_restore_s_per_token, restore)
        own = compute + restore
        ctx = lc.active_blocks * bs + lc.inflight_ctx_tokens
        horizon = cfg.decode_horizon(max(store.cpu, store.disk) if offload_enabled else 0, cap)
        self.decode = horizon * (lc.queue * cfg.decode_s_per_seq + ctx * cfg.decode_s_per_ctx_token)
        # scoring.cluster_state, then the cluster terms of scoring.evaluate.
        self.state = ClusterState(float(own.min()), saturation(float(lc.prefill_tokens.min()), cfg)) if len(ids) \
            else ClusterState()
        self.work = cfg.cluster_work_weight * self.state.saturation * np.maximum(own - self.state.best_own_s, 0.0)
        home, mine = load.working_set.home(req.session_id)
        self.own_resident = np.zeros(len(ids))
        self.own_stored = np.zeros(len(ids))
        if (h := matches.pos.get(home)) is not None:
            self.own_resident[h] = mine
            self.own_stored[h] = load.working_set.home_stored(req.session_id)
        room = lc.capacity_blocks * bs - (lc.resident_tokens - self.own_resident)
        fresh = -(-np.maximum(0, req.num_tokens - gpu * bs) // bs) * bs
        need = -(-req.num_tokens // bs) * bs
        cap_t, others = lc.capacity_blocks * bs, lc.resident_tokens - self.own_resident
        others_sessions = lc.resident_sessions - (self.own_resident > 0)
        if cfg.displace_attention:   # scoring.displaced_s_per_token, element-wise
            per_token = cfg.prefill_s_per_token + cfg.attn_s_per_token_pair * (
                np.maximum(others, 0.0) / np.maximum(others_sessions, 1.0)) / 2.0
        else:
            per_token = cfg.prefill_s_per_token
        # ScoringConfig.cliff on the whole column (a bool where it does not depend on the sessions):
        # the cliff where it applies, the overflow estimate elsewhere.
        cliff = np.zeros(len(ids), dtype=bool) | cfg.cliff(offload_enabled, others_sessions)
        displaced = np.minimum(fresh, np.maximum(need - np.maximum(room, 0.0), 0.0))
        if cliff.any():   # scoring.cliff_displaced, element-wise
            displaced = np.where(cliff, np.where(others + need <= cap_t, 0.0,
                                                 np.where(others <= cap_t, others + need, float(need))), displaced)
        if cfg.displace_store_price and offload_enabled:   # scoring.stored_displaced, element-wise
            own_st = min(max(store.cpu, store.disk), self.cap) * bs
            others_st = lc.stored_tokens - self.own_stored
            with np.errstate(divide="ignore", invalid="ignore"):
                stored = np.where(others <= 0.0, 0.0, displaced * (others_st / others))
            stored = np.where(cliff, np.where(others <= cap_t, others_st + own_st, float(own_st)), stored)
            stored = np.where(displaced <= 0.0, 0.0, stored)
            displace = cfg.displace_weight * ((displaced - stored) * per_token + stored * cfg.cpu_restore_s_per_token)
        else:
            displace = cfg.displace_weight * displaced * per_token
        self.displace = np.where(lc.capacity_blocks > 0, displace, 0.0)
        if cfg.displace_free_at > 1.0 and not cliff.all():   # scoring.kept_share, element-wise
            with np.errstate(divide="ignore", invalid="ignore"):
                over = ((lc.resident_tokens - self.own_resident) - cap_t) / ((cfg.displace_free_at - 1.0) * cap_t)
            kept = np.minimum(1.0, np.maximum(0.0, 1.0 - over))
            self.displace = np.where((lc.capacity_blocks > 0) & ~cliff, self.displace * kept, self.displace)
        # scoring.blocking_s, element-wise.
        w = cfg.blocking_w(offload_enabled)
        if w > 0.0 and cfg.turn_interval_s > 0.0:
            self.blocking = np.where((own > 0.0) & (others_sessions > 0.0), w * others_sessions
                                     * own * own / (2.0 * cfg.turn_interval_s), 0.0)
        else:
            self.blocking = np.zeros(len(ids))
        self.evicted = np.zeros(len(ids))
        if cfg.gpu_survival and not offload_enabled:   # the evicted term of scoring.evaluate, element-wise
            over = np.maximum(0.0, lc.all_inflight_ctx_tokens + req.num_tokens - lc.capacity_blocks * bs)
            gone = np.where(lc.capacity_blocks > 0, np.minimum(gpu * bs, over), 0.0)
            self.evicted = np.where(gone > 0.0, _prefill_s(uncached + gone, cached_tokens - gone, cfg) - own, 0.0)
        self.kv_wait = np.zeros(len(ids))
        kw = cfg.kv_wait_w(offload_enabled)
        if kw > 0.0:   # scoring.kv_wait_s, element-wise (cap_t: the capacity in tokens, above)
            over = lc.inflight_kv_tokens + (need - self.shared_arr) - cap_t
            with np.errstate(divide="ignore", invalid="ignore"):
                kvw = kw * over / cap_t * lc.residence_s
            kvw = np.where((lc.capacity_blocks > 0) & (lc.residence_s > 0.0) & (over > 0.0), kvw, 0.0)
            self.kv_wait = np.maximum(kvw - self.wait, 0.0)
        self.cost = (self.wait + own + self.decode + self.work + self.displace + self.blocking + self.evicted
                     + self.kv_wait)
        self.hot = np.zeros(len(ids), dtype=bool)
        self.excluded_inflight = np.zeros(len(ids), dtype=bool)
        self.excluded_hot = np.zeros(len(ids), dtype=bool)
        self.excluded_held = np.zeros(len(ids), dtype=bool)
        self.excluded_warm = np.zeros(len(ids), dtype=bool)
        self._built: dict[int, Candidate] = {}   # the winner is built for its reason, then reported

    # -- the overload guard (scoring.mark_hot) ---------------------------------
    def mark_hot(self) -> None:
        cfg, q = self.cfg, self.loads.queue
        if not len(q):
            return
        min_q = q.min()
        self.hot = ((q - min_q >= cfg.hot_abs) & (q >= cfg.hot_rel * (min_q + 1))) | (self.loads.kv_usage >= cfg.hot_kv_usage)
        if cfg.max_inflight:
            self.excluded_inflight = self.loads.inflight >= cfg.max_inflight
        credit = self.gpu + self.offload
        ratio = credit / self.cap if self.cap else np.zeros(len(q))
        self.excluded_hot = self.hot & ~self.excluded_inflight & (ratio < cfg.hot_min_hit_ratio)
        # scoring.holders, element-wise: under saturation only the prompt's holders may take it.
        if cfg.hold_min_ratio > 0 and self.cap > 0 and self.state.saturation > 0:
            held = credit >= cfg.hold_min_ratio * self.cap
            if held.any():
                self.excluded_hot &= ~held
                self.excluded_held = ~held & ~self.excluded_inflight & ~self.excluded_hot
        self._built.clear()   # their guard flags changed

    def _guarded(self) -> np.ndarray:
        """The endpoints the overload guard (:meth:`mark_hot`) leaves."""
        return ~(self.excluded_inflight | self.excluded_hot | self.excluded_held)

    def keep_cold(self, cold: np.ndarray) -> None:
        """``ScoringConfig.cold_first``: only the endpoints in ``cold`` with nothing queued may take the
        request, if there are any and they are not every endpoint the guard left."""
        ok = self._guarded()
        idle = cold & (self.loads.queue <= 0) & ok
        if idle.any() and not (idle == ok).all():
            self.excluded_warm = ok & ~idle
            self._built.clear()

    def excluded(self, i: int) -> str:
        if self.excluded_inflight[i]:
            return "max_inflight"
        if self.excluded_warm[i]:
            return "warm"
        return "hot" if self.excluded_hot[i] else "held" if self.excluded_held[i] else ""

    # -- the choice (scoring.pick) ---------------------------------------------
    def pick(self, affinity: str = "", spread: tuple[str, bool] = ("", False)) -> Choice:
        """Lowest cost among non-excluded endpoints; ties as in :func:`kvmesh.routing.scoring.pick`."""
        n = len(self.ids)
        pool = self._guarded() & ~self.excluded_warm
        skipped = n - int(pool.sum()) - int(self.excluded_warm.sum())
        if not pool.any():
            pool, skipped = np.ones(n, dtype=bool), 0
        best = self.cost[pool].min()
        tied = np.flatnonzero(pool & (self.cost <= best + self.cfg.tie_epsilon_s))
        aff = self.matches.pos.get(affinity) if affinity else None
        if aff is not None and bool((tied == aff).any()):
            win = aff
        else:
            win = self._break_tie(tied, spread)
        return Choice(win, pick_reason(self.candidate(win), len(tied) > 1 and win == aff, skipped))

    def _break_tie(self, tied: np.ndarray, spread: tuple[str, bool]) -> int:
        # Order of scoring.pick: most GPU blocks, then (hash, load) or (load, hash), then the id.
        if len(tied) > 1:
            g = self.gpu[tied]
            tied = tied[g == g.max()]
        if len(tied) == 1:
            return int(tied[0])
        key, hash_first = spread
        base = zlib.crc32(f"{key}\x00".encode())
        ids = self.ids

        def rank(i: int) -> int:   # == scoring._rank(key, ids[i])
            return zlib.crc32(ids[i].encode(), base)

        def load(i: int) -> float:
            return round(float(self.wait[i] + self.decode[i]), 4)

        idx = tied.tolist()
        if not hash_first:
            wd = self.wait[tied] + self.decode[tied]
            # round() is monotone, so only those within a rounding step of the least can tie on it.
            idx = tied[wd <= wd.min() + 2e-4].tolist()
            low = min(load(i) for i in idx)
            idx = [i for i in idx if load(i) == low]
            return min(idx, key=lambda i: (rank(i), ids[i]))
        ranks = {i: rank(i) for i in idx}
        low_r = min(ranks.values())
        idx = [i for i in idx if ranks[i] == low_r]
        return min(idx, key=lambda i: (load(i), ids[i]))

    def least_loaded(self) -> int:
        """Fewest running + waiting requests, then least queued prefill, then the id."""
        q, p = self.loads.queue, self.loads.prefill_tokens
        sel = np.flatnonzero(q == q.min())
        sel = sel[p[sel] == p[sel].min()]
        return min(sel.tolist(), key=self.ids.__getitem__)

    # -- Candidate objects -----------------------------------------------------
    def candidate(self, i: int) -> Candidate:
        """Endpoint ``i`` as :func:`kvmesh.routing.scoring.evaluate` scores it, with its guard flags."""
        c = self._built.get(i)
        if c is None:
            ep = self.ids[i]
            c = evaluate(ep, self.matches.at(i), self.store, self.load.effective(ep, self.now), self.req.num_tokens,
                         self.req.block_size, self.cfg, self.offload_enabled, self.shared.get(ep, 0), self.state,
                         int(self.own_resident[i]), int(self.own_stored[i]), self.store_life)
            c.hot = bool(self.hot[i])
            c.excluded = self.excluded(i)
            self._built[i] = c
        return c

    def predicted_cached_tokens(self, i: int) -> int:
        """Endpoint ``i``'s predicted cached tokens (GPU, speculative, restorable), as its
        :class:`Candidate` would say them."""
        return int(self.gpu[i] + self.offload[i]) * self.req.block_size

    def reported(self, win: int, k: int = REPORTED_CANDIDATES) -> list[Candidate]:
        """The winner, then the cheapest other endpoints by cost (at most ``k`` in all)."""
        if k <= 1:
            return [self.candidate(win)]   # the simulator's case: no ranking needed
        order = np.argsort(self.cost, kind="stable")[:k].tolist()
        rest = [i for i in order if i != win][: k - 1]
        return [self.candidate(i) for i in [win, *rest]]
