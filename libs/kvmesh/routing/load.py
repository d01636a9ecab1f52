"""The router's view of each endpoint's load: last reported values plus its own in-flight requests.

Workers report load (``GetLoad``) every few hundred milliseconds, but a burst of
sibling requests arrives within milliseconds. Without counting what the router
itself just sent, every request of a burst would see the same stale "idle"
endpoint and pile onto it. So the view is: the last report, if it is younger
than the staleness bound, plus the router's requests sent after that report
(optimistically assumed queued there). A report older than the bound is
ignored and only the router's own in-flight requests count.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvmesh.hashing.prefix import common_prefix, common_prefix_near


@dataclass
class LoadReport:
    """One ``GetLoad`` answer; ``received_at`` is on the router's clock."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    waiting_prefill_tokens: int = 0
    num_blocks: int = 0
    free_blocks: int = 0
    received_at: float = 0.0


@dataclass
class EffectiveLoad:
    """Load used for scoring: report (if fresh) + optimistic in-flight."""

    running: float = 0.0
    waiting: float = 0.0
    prefill_tokens: float = 0.0
    kv_usage: float = 0.0
    inflight: int = 0
    stale: bool = True
    # KV the running requests hold (vLLM's usage x blocks at the last report, in blocks) plus the
    # context tokens of the router's requests sent since: what every decode step must read there.
    active_blocks: float = 0.0
    inflight_ctx_tokens: float = 0.0
    # The endpoint's KV capacity (blocks that can hold KV: the last report's num_blocks minus vLLM's
    # null block, also after the report is stale or dropped; 0: unknown) and the
    # contexts of the sessions routed there within the reuse window (tokens): the KV likely to be
    # reused there soon (see :class:`WorkingSet`).
    capacity_blocks: float = 0.0
    resident_tokens: float = 0.0
    # Of ``resident_tokens``, what the offload store held of each session's prompt when it was
    # routed: displaced there, that part comes back by a restore rather than a recompute.
    stored_tokens: float = 0.0
    # How many sessions ``resident_tokens`` counts: the sessions whose next turns wait behind a
    # long prefill placed here (ScoringConfig.blocking_weight), and over which the working set's
    # mean context is taken (ScoringConfig.displace_attention).
    resident_sessions: float = 0.0
    # The mean context a queued prefill token attends to, over the router's in-flight requests
    # still prefilling there (their cached tokens plus half their own): a token of a 5k tail on
    # a 190k context costs its attention as well as its linear part (0: nothing queued).
    prefill_ctx_tokens: float = 0.0
    # The context tokens of every request the router has in flight there, reported or not: each
    # touches its blocks before a request queued behind it runs (ScoringConfig.gpu_survival).
    all_inflight_ctx_tokens: float = 0.0
    # How long a request has held its KV there after its first token, lately (an average of the
    # router's requests there; 0: none finished yet): how fast the running requests free the
    # cache for requests waiting for KV space (ScoringConfig.kv_wait_weight).
    residence_s: float = 0.0
    # The context tokens of the router's requests in flight there, each less what it shared with
    # those in flight there when it was sent: the KV they hold, a shared prefix counted once.
    inflight_kv_tokens: float = 0.0

    @property
    def queue(self) -> float:
        return self.running + self.waiting


@dataclass
class _InFlight:
    endpoint_id: str
    sent_at: float
    prefill_tokens: int
    prefilling: bool = True
    keys: list[int] | None = None     # the prompt's block keys (what its prefill computes)
    num_tokens: int = 0
    cached_tokens: int = 0            # predicted cached at send: its prefill starts there
    first_token_at: float | None = None
    kv_tokens: int = 0                # its context less the prefix it shares with those in flight there

    @property
    def queued_prefill(self) -> int:
        return self.prefill_tokens if self.prefilling else 0

    @property
    def queued_pairs2(self) -> int:
        """Twice the attention pairs of its queued prefill: tokens x (cached + tokens/2), doubled
        so that it stays an integer (sums of it are added and removed exactly)."""
        return self.prefill_tokens * (2 * self.cached_tokens + self.prefill_tokens) if self.prefilling else 0


@dataclass
class LoadColumns:
    """Every asked endpoint's effective load at once, as numpy arrays in the order asked.

    Element ``i`` equals the matching field of ``LoadView.effective(ids[i], now)``, computed
    with the same operations in the same order, so vectorized scoring decides exactly as
    scoring endpoint by endpoint does.
    """

    queue: np.ndarray
    prefill_tokens: np.ndarray
    waiting: np.ndarray          # the waiting part of ``queue`` (llm-d's queue scorer reads it alone)
    kv_usage: np.ndarray
    inflight: np.ndarray
    active_blocks: np.ndarray
    inflight_ctx_tokens: np.ndarray
    capacity_blocks: np.ndarray
    resident_tokens: np.ndarray
    stored_tokens: np.ndarray
    prefill_ctx_tokens: np.ndarray
    resident_sessions: np.ndarray
    all_inflight_ctx_tokens: np.ndarray
    residence_s: np.ndarray
    inflight_kv_tokens: np.ndarray


class _Sums:
    """Per-endpoint sums over the router's in-flight requests, kept as they change, with a
    numpy mirror (one slot per endpoint) so that a decision reads all endpoints at once.

    ``all_*`` cover every in-flight request; ``new_*`` those sent after the endpoint's last
    report (which that report cannot include yet).
    """

    FIELDS = ("has_report", "received_at", "running", "waiting", "report_prefill", "kv_usage", "report_blocks",
              "capacity", "resident", "stored", "sessions", "all_req", "all_prefill", "all_ctx", "new_req", "new_prefill", "new_ctx",
              "prefill_ctx", "residence", "all_kv")

    def __init__(self) -> None:
        self.slot: dict[str, int] = {}
        self.cols = {f: np.zeros(16) for f in self.FIELDS}
        # The same in-flight sums as Python ints: ``effective`` returns exactly what it did
        # when it summed the requests one by one.
        self.py: list[list[int]] = []
        self.pairs2: list[int] = []   # per slot: sum of the in-flight requests' ``queued_pairs2``
        self.kv: list[int] = []       # per slot: sum of the in-flight requests' ``kv_tokens``
        self._slots_cache: dict[tuple[str, ...], np.ndarray] = {}

    def slot_of(self, endpoint_id: str) -> int:
        i = self.slot.get(endpoint_id)
        if i is None:
            i = self.slot[endpoint_id] = len(self.slot)
            self.py.append([0] * 6)
            self.pairs2.append(0)
            self.kv.append(0)
            if i >= len(self.cols["all_req"]):
                self.cols = {f: np.concatenate([a, np.zeros(len(a))]) for f, a in self.cols.items()}
        return i

    def slots(self, endpoint_ids: list[str]) -> np.ndarray:
        """Slots of ``endpoint_ids`` in order; a decision asks for the same list again and again."""
        key = tuple(endpoint_ids)
        idx = self._slots_cache.get(key)
        if idx is None:
            if len(self._slots_cache) > 64:
                self._slots_cache.clear()
            idx = self._slots_cache[key] = np.fromiter((self.slot_of(e) for e in endpoint_ids), dtype=np.intp,
                                                       count=len(endpoint_ids))
        return idx

    def add(self, i: int, req: int, prefill: int, ctx: int, new: bool) -> None:
        py, cols = self.py[i], self.cols
        py[0] += req
        py[1] += prefill
        py[2] += ctx
        cols["all_req"][i], cols["all_prefill"][i], cols["all_ctx"][i] = py[0], py[1], py[2]
        if new:
            py[3] += req
            py[4] += prefill
            py[5] += ctx
            cols["new_req"][i], cols["new_prefill"][i], cols["new_ctx"][i] = py[3], py[4], py[5]

    def add_pairs(self, i: int, pairs2: int) -> None:
        """Keep the mean context of the queued prefill (``EffectiveLoad.prefill_ctx_tokens``)."""
        self.pairs2[i] += pairs2
        prefill = self.py[i][1]
        self.cols["prefill_ctx"][i] = self.pairs2[i] / (2.0 * prefill) if prefill > 0 else 0.0

    def add_kv(self, i: int, tokens: int) -> None:
        self.kv[i] += tokens
        self.cols["all_kv"][i] = self.kv[i]

    def observe_residence(self, i: int, seconds: float, rate: float) -> None:
        """A request held its KV on slot ``i`` for ``seconds`` after its first token: an average
        that moves ``rate`` of the way to each new sample (the first sample sets it)."""
        col = self.cols["residence"]
        col[i] = seconds if col[i] <= 0.0 else col[i] + rate * (seconds - col[i])

    def set_new(self, i: int, req: int, prefill: int, ctx: int) -> None:
        self.py[i][3:6] = [req, prefill, ctx]
        cols = self.cols
        cols["new_req"][i], cols["new_prefill"][i], cols["new_ctx"][i] = req, prefill, ctx

    def set_report(self, i: int, rep: LoadReport | None) -> None:
        cols = self.cols
        if rep is None:
            cols["has_report"][i] = 0.0
            return
        cols["has_report"][i] = 1.0
        cols["received_at"][i] = rep.received_at
        cols["running"][i] = rep.running
        cols["waiting"][i] = rep.waiting
        cols["report_prefill"][i] = rep.waiting_prefill_tokens
        cols["kv_usage"][i] = rep.kv_usage
        cols["report_blocks"][i] = max(rep.num_blocks, 0)
        # vLLM's num_gpu_blocks includes its null block, which never holds KV.
        cols["capacity"][i] = max(rep.num_blocks - 1, 0)


class WorkingSet:
    """Per endpoint, the context of every session routed there within the last ``window_s``.

    That is the KV the endpoint is likely to be asked for again soon: an agent's next turn
    reuses its whole context. A placement whose new blocks exceed the endpoint's capacity
    minus this evicts some of it (vLLM evicts the least recently used cached blocks; those of
    sessions idle longer than the window go first and are not counted). A session counts at
    its latest endpoint only, with its latest prompt. Totals are kept per endpoint slot of the
    load view (``_Sums``), as floats holding integers, so per-endpoint and column reads agree.

    The window runs from the end of the session's last turn. While a turn is in flight the
    session stays counted, however long it waits (a recompute of an 800k-token context queues
    for longer than the window), up to ``inflight_s``: a request whose end the router never
    hears of must not hold its session's context in the count for ever.
    """

    def __init__(self, sums: _Sums, window_s: float, inflight_s: float = 3600.0) -> None:
        self.sums = sums
        self.window_s = window_s
        self.inflight_s = inflight_s
        # session -> (slot, endpoint, tokens, touched, stored, due): the window runs from ``due``
        # (the turn's end; while it is in flight, its routing time plus ``inflight_s``).
        self._where: dict[str, tuple[int, str, int, float, int, float]] = {}
        self._due: list[tuple[float, str]] = []   # a heap of (due, session); stale entries skipped

    def touch(self, session_id: str, endpoint_id: str, tokens: int, now: float, stored: int = 0) -> None:
        """``stored``: tokens of the prompt the offload store held when it was routed (at most ``tokens``)."""
        if not session_id or self.window_s <= 0:
            return
        self._drop(session_id)
        i = self.sums.slot_of(endpoint_id)
        stored = min(max(stored, 0), tokens)
        due = now + self.inflight_s
        self._where[session_id] = (i, endpoint_id, tokens, now, stored, due)
        heapq.heappush(self._due, (due, session_id))
        cols = self.sums.cols
        cols["resident"][i] += tokens
        cols["stored"][i] += stored
        cols["sessions"][i] += 1

    def refresh(self, session_id: str, endpoint_id: str, now: float) -> None:
        """A turn of the session ended on ``endpoint_id``: its context is reusable from now on,
        so the window runs from here (a turn can wait in a queue longer than the window)."""
        w = self._where.get(session_id) if session_id else None
        if w is not None and w[1] == endpoint_id and now >= w[3] and now != w[5]:
            self._where[session_id] = (w[0], w[1], w[2], now, w[4], now)
            heapq.heappush(self._due, (now, session_id))

    def home(self, session_id: str) -> tuple[str, int]:
        """(endpoint, tokens) where the session's context is counted, or ("", 0)."""
        w = self._where.get(session_id) if session_id else None
        return (w[1], w[2]) if w is not None else ("", 0)

    def last(self, session_id: str) -> tuple[int, float] | None:
        """(prompt tokens, time) of the session's last counted turn: when it was routed, or
        when it ended (:meth:`refresh`); None if the session is not counted."""
        w = self._where.get(session_id) if session_id else None
        return (w[2], w[3]) if w is not None else None

    def home_stored(self, session_id: str) -> int:
        """Of the session's counted context (:meth:`home`), the tokens the store held."""
        w = self._where.get(session_id) if session_id else None
        return w[4] if w is not None else 0

    def expire(self, now: float) -> None:
        due, where = self._due, self._where
        while due and due[0][0] < now - self.window_s:
            t, sid = heapq.heappop(due)
            w = where.get(sid)
            if w is not None and w[5] == t:
                self._drop(sid)

    def _drop(self, session_id: str) -> None:
        w = self._where.pop(session_id, None)
        if w is not None:
            cols = self.sums.cols
            cols["resident"][w[0]] -= w[2]
            cols["stored"][w[0]] -= w[4]
            cols["sessions"][w[0]] -= 1

    def forget_endpoint(self, endpoint_id: str) -> None:
        i = self.sums.slot.get(endpoint_id)
        if i is not None:
            for sid in [s for s, w in self._where.items() if w[0] == i]:
                self._drop(sid)


class StoreHorizon:
    """How long the offload store keeps a context nobody touches, as the router sees it.

    An LRU store smaller than the sessions' contexts evicts about one block per block it stores,
    so a context survives there for roughly the time the store takes to fill with newer blocks:
    its horizon. The router sees it without asking the store: a session's turn shows what the
    store kept of the session's previous prompt after the time since that turn ended (its age).
    A loss at an age below the estimate pulls the estimate down toward that age, a context
    kept past the estimate pushes it up, each by ``rate`` of the difference; until the first
    loss the horizon is infinite (a store that has lost nothing). Used by
    ``ScoringConfig.store_keep`` (kvmesh.routing.scoring.store_kept).
    """

    def __init__(self, rate: float = 0.1, min_blocks: int = 16) -> None:
        self.rate = rate
        self.min_blocks = min_blocks   # smaller contexts say little (a sub-agent's first prompt)
        self.horizon_s = math.inf
        self.samples = 0
        self.losses = 0

    def observe(self, age_s: float, expected_blocks: int, kept_blocks: int) -> None:
        """The store held ``kept_blocks`` of ``expected_blocks`` it had been given ``age_s`` ago."""
        if expected_blocks < self.min_blocks or age_s < 0.0:
            return
        self.samples += 1
        h = self.horizon_s
        if kept_blocks < expected_blocks:
            self.losses += 1
            if h == math.inf:
                self.horizon_s = age_s
            elif age_s < h:
                self.horizon_s = h + self.rate * (age_s - h)
        elif h != math.inf and age_s > h:
            self.horizon_s = h + self.rate * (age_s - h)

    def life_s(self, age_s: float) -> float:
        """Time a context last touched ``age_s`` ago has left in the store (inf: no loss seen yet)."""
        return self.horizon_s - age_s if self.horizon_s != math.inf else math.inf


def _drop(index: dict[Any, dict[str, _InFlight]], key: Any, request_id: str) -> None:
    mine = index.get(key)
    if mine is not None:
        mine.pop(request_id, None)
        if not mine:
            del index[key]


@dataclass
class LoadView:
    """Per-endpoint load with a staleness bound and optimistic in-flight counting."""

    staleness_s: float = 2.0
    reuse_window_s: float = 600.0
    reports: dict[str, LoadReport] = field(default_factory=dict)
    _inflight: dict[str, _InFlight] = field(default_factory=dict)
    # The same requests by endpoint, and those still queued for prefill by first block key:
    # at fleet scale, a scan of all in-flight requests per endpoint or per decision would
    # dominate the decision.
    _by_endpoint: dict[str, dict[str, _InFlight]] = field(default_factory=dict)
    _prefilling_by_head: dict[int, dict[str, _InFlight]] = field(default_factory=dict)
    _by_endpoint_head: dict[tuple[str, int], dict[str, _InFlight]] = field(default_factory=dict)
    _sums: _Sums = field(default_factory=_Sums)
    _version: int = 0   # bumped by every change to the in-flight requests
    _overlap_memo: tuple[list[int], int, int, dict[str, int]] | None = None
    working_set: WorkingSet = field(init=False)
    store_horizon: StoreHorizon = field(default_factory=StoreHorizon)
    residence_rate: float = 0.05   # the weight of each new sample in ``EffectiveLoad.residence_s``

    def __post_init__(self) -> None:
        self.working_set = WorkingSet(self._sums, self.reuse_window_s)

    def store_life_s(self, session_id: str, now: float) -> float:
        """Time the offload store likely keeps the session's context untouched from ``now``
        (:class:`StoreHorizon`; the age is 0 for a session not in the working set)."""
        if self.store_horizon.horizon_s == math.inf:
            return math.inf
        last = self.working_set.last(session_id)
        return self.store_horizon.life_s(now - last[1] if last is not None else 0.0)

    def update(self, endpoint_id: str, report: LoadReport) -> None:
        self.reports[endpoint_id] = report
        i = self._sums.slot_of(endpoint_id)
        self._sums.set_report(i, report)
        self._sums.set_new(i, *self._new_since(self._by_endpoint.get(endpoint_id, {})))

    def _new_since(self, inflight: dict[str, _InFlight]) -> tuple[int, int, int]:
        """(requests, queued prefill, context tokens) sent after their endpoint's current report."""
        req = prefill = ctx = 0
        for f in inflight.values():
            if self._after_report(f):
                req += 1
                prefill += f.queued_prefill
                ctx += f.num_tokens
        return req, prefill, ctx

    def reconfirm(self, endpoint_ids: list[str], received_at: float) -> None:
        """These endpoints reported the same figures as last time, now at ``received_at``. A
        simulator whose engines did not change uses it instead of building every report again."""
        sums, reports, by_ep, slot = self._sums, self.reports, self._by_endpoint, self._sums.slot
        slots = []
        for e in endpoint_ids:
            rep = reports.get(e)
            if rep is None:
                continue
            rep.received_at = received_at
            slots.append(slot[e])
            # Without requests in flight the sums of requests sent since the report are zero.
            if e in by_ep:
                sums.set_new(slot[e], *self._new_since(by_ep[e]))
        sums.cols["received_at"][slots] = received_at

    def forget(self, endpoint_id: str) -> None:
        if self.reports.pop(endpoint_id, None) is not None:
            i = self._sums.slot_of(endpoint_id)
            self._sums.set_report(i, None)
            self._sums.set_new(i, *self._sums.py[i][:3])   # without a report, every request is new

    def _after_report(self, f: _InFlight) -> bool:
        """Sent after its endpoint's last report, so the report cannot include it."""
        rep = self.reports.get(f.endpoint_id)
        return rep is None or f.sent_at > rep.received_at

    def on_sent(self, endpoint_id: str, request_id: str, prefill_tokens: int, now: float,
                keys: list[int] | None = None, num_tokens: int = 0, cached_tokens: int = 0,
                block_size: int = 0) -> None:
        """``block_size``: the keys' block size, to count a prefix shared with requests in flight on the
        endpoint once (:attr:`EffectiveLoad.inflight_kv_tokens`; 0: every context whole)."""
        self.on_finished(request_id)
        self._version += 1
        f = _InFlight(endpoint_id, now, max(0, int(prefill_tokens)), True, keys, max(0, int(num_tokens)),
                      max(0, int(cached_tokens)))
        self._inflight[request_id] = f
        self._by_endpoint.setdefault(endpoint_id, {})[request_id] = f
        f.kv_tokens = f.num_tokens
        if keys and block_size > 0:
            # Blocks it shares with a request in flight there are held once: vLLM's prefix cache
            # gives both the same blocks. (If that one finishes first, they stay uncounted.)
            peers = self._by_endpoint_head.setdefault((endpoint_id, keys[0]), {})
            shared = 0
            for g in peers.values():
                shared = max(shared, min(common_prefix(g.keys, keys) * block_size, g.num_tokens))  # type: ignore[arg-type]
            f.kv_tokens = max(0, f.num_tokens - shared)
            peers[request_id] = f
        if keys and f.prefill_tokens > 0:
            self._prefilling_by_head.setdefault(keys[0], {})[request_id] = f
        i = self._sums.slot_of(endpoint_id)
        self._sums.add(i, 1, f.prefill_tokens, f.num_tokens, self._after_report(f))
        self._sums.add_pairs(i, f.queued_pairs2)
        self._sums.add_kv(i, f.kv_tokens)

    def pending_overlap(self, keys: list[int], block_size: int) -> dict[str, int]:
        """Per endpoint: queued prefill tokens (of the router's in-flight requests) that compute
        leading blocks of ``keys``.

        A sibling sub-agent sent right after the first one of its burst shares its prefix. The
        first one's prefill, still queued where it went, computes exactly what the sibling will
        reuse there: waiting for it is no extra delay compared with recomputing it elsewhere.
        """
        memo = self._overlap_memo
        if memo is not None and memo[0] is keys and memo[1] == block_size and memo[2] == self._version:
            return dict(memo[3])
        out: dict[str, int] = {}
        if not keys or block_size <= 0:
            return out
        near = far = 0
        for f in self._prefilling_by_head.get(keys[0], {}).values():
            c = common_prefix_near(f.keys, keys, near, far)  # type: ignore[arg-type]
            if c != near:
                near, far = c, near
            shared = min(c * block_size, f.num_tokens or 1 << 62)
            n = min(max(0, shared - f.cached_tokens), f.prefill_tokens)
            if n > out.get(f.endpoint_id, 0):
                out[f.endpoint_id] = n
        # A decision asks twice (scoring, then the split rule) with nothing sent in between.
        self._overlap_memo = (keys, block_size, self._version, dict(out))
        return out

    def on_first_token(self, request_id: str, now: float | None = None) -> None:
        """``now``: when the first token came, so that :meth:`on_finished` times the request's
        decode (:attr:`EffectiveLoad.residence_s`); None leaves it untimed."""
        f = self._inflight.get(request_id)
        if f is None or not f.prefilling:
            return
        f.first_token_at = now
        self._version += 1
        i = self._sums.slot_of(f.endpoint_id)
        pairs2 = f.queued_pairs2
        self._sums.add(i, 0, -f.prefill_tokens, 0, self._after_report(f))
        self._sums.add_pairs(i, -pairs2)
        f.prefilling = False
        _drop(self._prefilling_by_head, f.keys[0] if f.keys else None, request_id)
        # A report taken since the request was sent still counts its prefill as queued; left
        # as it is, the endpoint would look busy with work that is done until the next poll,
        # and a burst's late siblings would leave the endpoint that holds their prefix.
        rep = self.reports.get(f.endpoint_id)
        if rep is not None and rep.received_at >= f.sent_at and f.prefill_tokens:
            rep.waiting_prefill_tokens = max(0, rep.waiting_prefill_tokens - f.prefill_tokens)
            self._sums.set_report(self._sums.slot_of(f.endpoint_id), rep)

    def on_finished(self, request_id: str, now: float | None = None) -> None:
        f = self._inflight.pop(request_id, None)
        if f is None:
            return
        self._version += 1
        _drop(self._by_endpoint, f.endpoint_id, request_id)
        _drop(self._prefilling_by_head, f.keys[0] if f.keys else None, request_id)
        if f.keys:
            _drop(self._by_endpoint_head, (f.endpoint_id, f.keys[0]), request_id)
        i = self._sums.slot_of(f.endpoint_id)
        self._sums.add_kv(i, -f.kv_tokens)
        if now is not None and f.first_token_at is not None and now >= f.first_token_at:
            self._sums.observe_residence(i, now - f.first_token_at, self.residence_rate)
        self._sums.add(i, -1, -f.queued_prefill, -f.num_tokens, self._after_report(f))
        self._sums.add_pairs(i, -f.queued_pairs2)

    def inflight_count(self, endpoint_id: str) -> int:
        return len(self._by_endpoint.get(endpoint_id, ()))

    def effective(self, endpoint_id: str, now: float) -> EffectiveLoad:
        rep = self.reports.get(endpoint_id)
        i = self._sums.slot.get(endpoint_id)
        total, all_prefill, all_ctx, new_req, new_prefill, new_ctx = self._sums.py[i] if i is not None else [0] * 6
        self.working_set.expire(now)
        # Capacity is the last one reported, also after the report itself is dropped or stale.
        resident = float(self._sums.cols["resident"][i]) if i is not None else 0.0
        capacity = float(self._sums.cols["capacity"][i]) if i is not None else 0.0
        stored = float(self._sums.cols["stored"][i]) if i is not None else 0.0
        sessions = float(self._sums.cols["sessions"][i]) if i is not None else 0.0
        pctx = float(self._sums.cols["prefill_ctx"][i]) if i is not None else 0.0
        res = float(self._sums.cols["residence"][i]) if i is not None else 0.0
        kv = float(self._sums.kv[i]) if i is not None else 0.0
        if rep is not None and (now - rep.received_at) <= self.staleness_s:
            return EffectiveLoad(running=rep.running, waiting=rep.waiting + new_req,
                                 prefill_tokens=rep.waiting_prefill_tokens + new_prefill,
                                 kv_usage=rep.kv_usage, inflight=total, stale=False,
                                 active_blocks=rep.kv_usage * max(rep.num_blocks, 0), inflight_ctx_tokens=new_ctx,
                                 capacity_blocks=capacity, resident_tokens=resident, stored_tokens=stored,
                                 resident_sessions=sessions, prefill_ctx_tokens=pctx, all_inflight_ctx_tokens=all_ctx,
                                 residence_s=res, inflight_kv_tokens=kv)
        return EffectiveLoad(running=0, waiting=total, prefill_tokens=all_prefill, inflight=total, stale=True,
                             inflight_ctx_tokens=all_ctx, capacity_blocks=capacity, resident_tokens=resident,
                             stored_tokens=stored, resident_sessions=sessions, prefill_ctx_tokens=pctx,
                             all_inflight_ctx_tokens=all_ctx, residence_s=res, inflight_kv_tokens=kv)

    def columns(self, endpoint_ids: list[str], now: float) -> LoadColumns:
        """``effective`` for every endpoint in ``endpoint_ids`` at once (see :class:`LoadColumns`)."""
        self.working_set.expire(now)
        idx = self._sums.slots(endpoint_ids)
        c = {f: a[idx] for f, a in self._sums.cols.items()}
        fresh = (c["has_report"] > 0) & ((now - c["received_at"]) <= self.staleness_s)
        running = np.where(fresh, c["running"], 0.0)
        waiting = np.where(fresh, c["waiting"] + c["new_req"], c["all_req"])
        kv = np.where(fresh, c["kv_usage"], 0.0)
        return LoadColumns(queue=running + waiting, waiting=waiting,
                           prefill_tokens=np.where(fresh, c["report_prefill"] + c["new_prefill"], c["all_prefill"]),
                           kv_usage=kv, inflight=c["all_req"],
                           active_blocks=np.where(fresh, c["kv_usage"] * c["report_blocks"], 0.0),
                           inflight_ctx_tokens=np.where(fresh, c["new_ctx"], c["all_ctx"]),
                           capacity_blocks=c["capacity"],
                           resident_tokens=c["resident"], stored_tokens=c["stored"],
                           resident_sessions=c["sessions"], prefill_ctx_tokens=c["prefill_ctx"],
                           all_inflight_ctx_tokens=c["all_ctx"], residence_s=c["residence"],
                           inflight_kv_tokens=c["all_kv"])
