"""The discrete-event loop: requests released by the agent schedule, routed by the
real router core, served by simulated workers, in virtual time.

Event kinds (one heap, ordered by time then insertion):
- RELEASE: a request is sent (its dependencies finished + think time);
  the router decides (precise: index lookup, and the store's tier), maybe
  splits to a prefill worker, and dispatches.
- RESTORED: a queued request's KV restore from the offload store is done. A
  request joins its worker's scheduler queue when it is sent; when the scheduler
  first reaches it (its ``ready`` check, as vLLM's scheduler asks its KV connector
  in ``schedule()``), the blocks the store has beyond the worker's own cache start
  to load (time from the latency model). The request keeps its place in the queue
  and is skipped while they load, as vLLM parks it (``WAITING_FOR_REMOTE_KVS``);
  the scheduler takes it at its first step after the load.
- STEP: a worker's engine step finishes; outputs are applied, first tokens and
  completions recorded, the next step is planned at once if work remains.

Only time is virtual: caching, eviction, step durations, routing decisions and
store contents all come from the shared components (see ``parts``).
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvmesh.index.memory import MemoryIndex
from kvmesh.routing.endpoint_columns import ColumnLayout, EndpointColumns
from kvmesh.routing.fidelity import ViewAtDecision, classify, count, split_predicted_blocks
from kvmesh.routing.load import LoadReport
from kvmesh.routing.pd_split import SplitConfig
from kvmesh.routing.router import RouterCore, RouterCoreConfig, prefill_request_id
from kvmesh.routing.scoring import ScoringConfig
from kvmesh.routing.split_reuse import split_reuse
from kvmesh.routing.types import COST_TERMS, Decision, EndpointView, Matches, RouteRequest, TierMatch
from kvmesh.worker.engine.sim.latency import LatencyParams
from kvmesh.worker.engine.sim.scheduler import ReadyCheck, SchedulerConfig, Seq
from kvmesh_tools.clustersim.config import SimConfig
from kvmesh_tools.clustersim.parts import SimOffload, SimWorker, WorkerSpec
from kvmesh_tools.moves_report import moved_metrics
from kvmesh_tools.traffic.model import Request, Trace
from kvmesh_tools.traffic.schedule import Schedule, ScheduleRunner

log = logging.getLogger(__name__)

RELEASE, RESTORED, STEP, MACRO, BOUNDARY, HOLD = 0, 1, 2, 3, 4, 5


@dataclass(slots=True)
class Job:
    """One request's life in the simulation."""

    node: int
    req: Request
    route: RouteRequest
    release: float
    decision: Decision | None = None
    split: bool = False
    prefill_ep: int = -1
    decode_ep: int = -1
    first_token: float | None = None
    finish: float | None = None
    cached_gpu: int = 0
    cached_offload: int = 0
    gpu_hit_blocks: int = 0          # on the computing worker at dispatch
    external: int = 0                # tokens the store held for it at dispatch (its restore's end)
    store_hit: int = 0               # leading blocks present in the store at dispatch
    planned_restore: int = 0         # tokens whose restore the latest phase waited for in the queue
    admitted: bool = True            # the latest dispatch's sequence has been scheduled
    error: str = ""
    view: ViewAtDecision | None = None   # the router's view and the truth at decision time
    decided_gpu: int = -1            # the decode worker's GPU hit found at decision, for the dispatch right after
    holds: int = 0                   # times admission control held it at the router
    decode_cached: int = -1          # a split's decode phase: tokens it reused (the prefill's KV from the store)
    split_lost: int = 0              # a split's prefill-phase hit that its decode phase computed again
    restore_delay: float = 0.0       # the compute phase's restore while it waited in the worker's queue (s)
    scheduled: float | None = None   # when the compute phase first left the worker's waiting queue
    moved: bool = False              # routed to another endpoint than the session's previous turn
    given_up: int = 0                # of a moved turn: cached tokens predicted there beyond here (Decision.given_up_tokens)
    free_at_dispatch: int = -1       # the compute worker's free (or evictable) KV tokens when it was sent there
    # The key list the next dispatch's sequence owns (its outputs' keys are appended to it).
    # The decision's lookups use it too: the GPU's and the store's remembered scans are per
    # list, so the worker's scheduler then goes on from what the decision found.
    keys: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.keys = list(self.req.keys)


@dataclass
class PolicyResult:
    policy: str
    metrics: dict[str, Any]
    ttfts: list[float] = field(default_factory=list)
    hit_series: list[tuple[float, float]] = field(default_factory=list)   # (time s, hit rate in bucket)
    records: list[dict[str, Any]] = field(default_factory=list)            # per request, in release order


def _moved_metrics(done: list[Job], prompt: int) -> dict[str, Any]:
    """The moved turns' figures (:func:`kvmesh_tools.moves_report.moved_metrics`). What the moves
    gave up is what they chose to leave; their hit rate also depends on what their sessions had
    already lost everywhere."""
    return moved_metrics(((j.req.input_tokens, j.cached_gpu + j.cached_offload, j.given_up)
                          for j in done if j.moved), prompt)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * (len(s) - 1)))))
    return s[k]


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Run without the cyclic garbage collector.

    A fleet's block managers, index and store hold millions of long-lived objects, and each
    full collection walks all of them: about a fifth of a 544-worker run's wall time. The loop
    makes no reference cycles that matter (measured: the same peak RSS with the collector off).
    """
    was = gc.isenabled()
    gc.collect()   # the previous run's garbage, before this run's objects join it
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class ClusterSim:
    """One policy over one schedule on one simulated cluster."""

    def __init__(self, trace: Trace, schedule: Schedule, cfg: SimConfig, policy: str,
                 latency: LatencyParams | None = None, scoring: ScoringConfig | None = None) -> None:
        self.trace = trace
        self.schedule = schedule
        self.cfg = cfg
        self.policy_name = policy
        self.bs = trace.block_size
        if cfg.block_size and cfg.block_size != self.bs:
            raise ValueError(f"--block-size {cfg.block_size} differs from the trace's {self.bs}: the simulator "
                             "runs at the trace's block size (hash ids are per trace block)")
        self.now = 0.0
        core_cfg = RouterCoreConfig(policy=policy, block_size=self.bs, speculative_ttl_s=cfg.speculative_ttl_s,
                                    approx_capacity_blocks=max(1, cfg.kv_capacity_tokens // self.bs),
                                    offload_enabled=cfg.offload_capacity_tokens > 0, report_candidates=1,
                                    warm_fallback=False,   # its index always answers
                                    scoring=scoring or cfg.scoring,
                                    # The prefill's KV reaches the decode worker through the
                                    # store: without one there is no split (prefill workers idle).
                                    split=SplitConfig(enabled=cfg.prefill_workers > 0 and cfg.offload_capacity_tokens > 0,
                                                      threshold_tokens=cfg.split_threshold_tokens,
                                                      survival_floor=cfg.split_survival_floor,
                                                      survival_decay=cfg.split_survival_decay,
                                                      read_index=cfg.split_read_index),
                                    # RouterCore builds policies unseeded; a simulation must be reproducible.
                                    policy_options={"random": {"seed": cfg.seed}})
        self.core = RouterCore(core_cfg)
        self.policy = self.core.default_policy
        self.uses_index = bool(getattr(self.policy, "uses_index", False))
        # A policy that predicts nothing has its split decided from the index (RouterCore.split_lookup).
        self.split_reads_index = self.core.split_reads_index()
        # Only an index-driven policy (or such a split) needs KV events; the others skip that work.
        self.index = MemoryIndex(now=lambda: self.now) if self.uses_index or self.split_reads_index else None
        sched_cfg = SchedulerConfig(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                                    max_model_len=cfg.max_model_len, max_waiting=0)
        lat = latency or LatencyParams()
        self.lat = lat
        nblocks = max(2, cfg.kv_capacity_tokens // self.bs)
        self.workers: list[SimWorker] = []
        for i in range(cfg.decode_workers):
            self.workers.append(SimWorker(WorkerSpec(f"decode-{i}", "decode", nblocks, self.bs), lat, sched_cfg,
                                          self.index, cfg.model))
        for i in range(cfg.prefill_workers):
            self.workers.append(SimWorker(WorkerSpec(f"prefill-{i}", "prefill", nblocks, self.bs), lat, sched_cfg,
                                          self.index, cfg.model))
        self.by_id = {w.id: i for i, w in enumerate(self.workers)}
        for w in self.workers:
            self.core.set_endpoint(EndpointView(endpoint_id=w.id, model=cfg.model, role=w.role, block_size=self.bs))
        self.store = (SimOffload(cfg.offload_capacity_tokens // self.bs, cfg.offload_eviction, clock=lambda: self.now)
                      if cfg.offload_capacity_tokens > 0 else None)
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        # Workers by the time of their last load report, oldest first. A poll sets that time to
        # the decision's, so workers polled together stay together: a decision pops the due
        # groups instead of visiting every worker of a large fleet.
        self._polls: deque[tuple[float, list[int]]] = deque([(-1e18, list(range(len(self.workers))))])
        # Workers whose engine changed since their last report; the others report the same again.
        self._changed = [True] * len(self.workers)
        self._layout = ColumnLayout([w.id for w in self.workers])
        self._rows_version = -1
        self._worker_rows = np.zeros(0, dtype=np.intp)
        self.jobs: list[Job] = []
        self.errors = 0
        # A queued sequence's restore: False while its KV loads, True once loaded (until scheduled).
        self._restore: dict[Seq, bool] = {}
        self._loading = [0] * len(self.workers)   # sequences loading per worker
        # Per worker, sequences whose load is done, holding blocks, not yet scheduled: vLLM
        # schedules these first (``kv_holding_waiting``); behind a request that cannot get
        # blocks they would hold them with nothing running to free any.
        self._loaded: list[list[Seq]] = [[] for _ in self.workers]
        if self.store is not None:
            for i, w in enumerate(self.workers):
                w.sched.ready = self._ready_check(i)

    # ------------------------------------------------------------------ events
    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    def run(self) -> PolicyResult:
        wall0 = time.perf_counter()
        self.runner = ScheduleRunner(self.schedule)
        for t, idx in self.runner.initial():
            self._push(t, RELEASE, idx)
        with _no_cyclic_gc():
            self._loop()
        wall = time.perf_counter() - wall0
        return self._result(wall)

    def _loop(self) -> None:
        heap = self._heap
        pop = heapq.heappop
        while heap:
            t, _, kind, payload = pop(heap)
            self.now = t
            if kind == STEP:
                self._on_step(payload)
            elif kind == MACRO:
                self._on_macro(*payload)
            elif kind == BOUNDARY:
                self._on_boundary(*payload)
            elif kind == RELEASE:
                self._on_release(payload)
            elif kind == HOLD:
                self._route(payload)
            else:
                self._on_restored(*payload)

    # ------------------------------------------------------------------ routing
    def _refresh_load(self) -> None:
        now = self.now
        poll = self.cfg.load_poll_s
        polls = self._polls
        if not polls or now - polls[0][0] < poll:
            return
        due: list[int] = []
        while polls and now - polls[0][0] >= poll:
            due.extend(polls.popleft()[1])
        view = self.core.load
        changed = self._changed
        same: list[str] = []
        for i in due:
            w = self.workers[i]
            if not changed[i]:
                same.append(w.id)
                continue
            changed[i] = False
            s = w.sched
            bm = w.bm
            view.update(w.id, LoadReport(running=s.num_running, waiting=s.num_waiting, kv_usage=bm.usage,
                                         waiting_prefill_tokens=s.waiting_prefill_tokens(),
                                         num_blocks=bm.num_blocks, free_blocks=bm.num_free_blocks,
                                         received_at=now))
        view.reconfirm(same, now)
        polls.append((now, due))

    def _matches(self, keys: list[int]) -> Matches:
        assert self.index is not None
        rows = self.index.lookup_rows(self.cfg.model, keys)
        if self._rows_version != self.index.slots_version:
            # Each worker's row (or the zero row past the end while it has none).
            slot_of = self.index.slot_of
            self._worker_rows = np.asarray([-1 if (r := slot_of(w.id)) is None else r for w in self.workers],
                                           dtype=np.intp)
            self._rows_version = self.index.slots_version
        rows = np.concatenate((rows, np.zeros((1, rows.shape[1]), dtype=rows.dtype)))
        mine = rows[self._worker_rows]
        # The store's row, as the indexer (which mirrors the store) would give it.
        store = TierMatch(0, self.store.leading(keys, len(keys)), 0) if self.store is not None else TierMatch()
        return Matches(store=store,
                       columns=EndpointColumns(self._layout, mine[:, 1], mine[:, 2], mine[:, 3]))

    def _on_release(self, node_idx: int) -> None:
        req = self.schedule.nodes[node_idx].req
        route = RouteRequest(request_id=req.uid, model=self.cfg.model, keys=req.keys, num_tokens=req.input_tokens,
                             block_size=self.bs, session_id=f"{req.session}/{req.agent}")
        job = Job(node=node_idx, req=req, route=route, release=self.now)
        self.jobs.append(job)
        self._route(job)

    def _route(self, job: Job) -> None:
        """Decide and dispatch; a held decision (admission control) is decided again later,
        as the live router does (``RouterService.decide``)."""
        route = job.route
        self._refresh_load()
        matches = self._matches(job.keys) if self.uses_index else None
        decision = self.core.decide(route, matches, self.now, held_s=self.now - job.release)
        if decision.hold:
            job.holds += 1
            self._push(self.now + self.core.cfg.scoring.admit_recheck_s, HOLD, job)
            return
        split_matches = matches
        if self.split_reads_index and self.core.split_lookup(route):
            split_matches = self._matches(job.keys)
        job.decision = decision
        job.decode_ep = self.by_id[decision.endpoint_id]
        job.view = self._view_at_decision(job, decision, matches)
        split = self.core.decide_split(decision, route, self.now, matches=split_matches)
        self.core.on_routed(route, decision, self.now, split)
        job.moved = decision.moved
        job.given_up = decision.given_up_tokens
        if split.split:
            job.split = True
            job.prefill_ep = self.by_id[split.prefill_endpoint]
            self._dispatch(job, job.prefill_ep, prefill_only=True)
        else:
            self._dispatch(job, job.decode_ep, prefill_only=False)

    def _view_at_decision(self, job: Job, decision: Decision, matches: Matches | None) -> ViewAtDecision:
        """The decision's prediction next to what the engine, the store and the index held then."""
        req = job.req
        w = self.workers[job.decode_ep]
        cap = max(0, (req.input_tokens - 1) // self.bs)
        # The engine's own lookup (it leaves one token to compute); the dispatch that follows
        # at once, to the same worker, reuses it.
        gpu = job.decided_gpu = w.gpu_hit_blocks(job.keys, req.input_tokens)
        store = self.store.leading(job.keys, cap) if self.store is not None else 0
        win = decision.candidates[0] if decision.candidates else None
        return ViewAtDecision(
            predicted=decision.predicted_cached_tokens // self.bs, truth=max(gpu, store), engine_gpu=gpu,
            index_gpu=min(matches.get(decision.endpoint_id).gpu, cap) if matches is not None else -1,
            speculative=(win.speculative_blocks + win.pending_blocks) if win is not None else 0,
            lag=w.bm.has_pending_events() if matches is not None else False)

    # ------------------------------------------------------------------ workers
    def _dispatch(self, job: Job, widx: int, prefill_only: bool) -> None:
        """Send to a worker: it joins the scheduler queue at once; a restore from the store
        starts when the scheduler first reaches it (``_ready_check``)."""
        w = self.workers[widx]
        req = job.req
        cap = max(0, (req.input_tokens - 1) // self.bs)
        keys = job.keys
        if job.decided_gpu >= 0 and widx == job.decode_ep:
            gpu = job.decided_gpu   # looked up at the decision, nothing has run since
        else:
            gpu = w.gpu_hit_blocks(keys, req.input_tokens)
        job.decided_gpu = -1
        store_hit = self.store.leading(keys, cap) if self.store is not None else 0
        compute_phase = prefill_only or not job.split
        if compute_phase:
            job.restore_delay = 0.0
            job.free_at_dispatch = w.bm.num_free_blocks * self.bs
            job.gpu_hit_blocks = gpu
            job.external = store_hit * self.bs if store_hit > gpu else 0
            job.store_hit = store_hit
        # The store also backs the GPU hit: if the GPU evicts those blocks before the request
        # is scheduled, the restore at scheduling time loads them instead of the engine
        # recomputing them.
        seq = Seq(request_id=req.uid + ("#p" if prefill_only else ""), prompt_len=req.input_tokens,
                  max_tokens=1 if prefill_only else max(1, req.output_tokens), block_hashes=keys,
                  arrival=self.now, prefill_only=prefill_only, meta=job, external_cached=store_hit * self.bs)
        # A split's decode phase gets a list of its own; a finished request keeps none.
        job.keys = list(req.keys) if prefill_only else []
        job.planned_restore = 0
        job.admitted = False
        self._on_arrive(widx, seq)

    def _ready_check(self, widx: int) -> ReadyCheck:
        """The worker's scheduler asks this before it takes a waiting request, as vLLM's scheduler
        asks its KV connector (``get_num_new_matched_tokens``) when it reaches the request: the
        blocks the store holds beyond the GPU hit load asynchronously (vLLM's and kvmesh's
        offloading connectors both load async); the request is skipped, keeping its place, until
        the load is done."""
        w = self.workers[widx]
        store = self.store
        assert store is not None
        bs = self.bs

        def ready(seq: Seq, gpu_blocks: int) -> bool:
            state = self._restore.get(seq)
            if state is not None:
                return state
            if seq.num_cached_tokens >= 0:
                return True   # preempted: recomputed (its restored KV was freed with its blocks)
            job: Job = seq.meta
            keys = seq.block_hashes
            store_hit = store.leading(keys, max(0, (seq.prompt_len - 1) // bs))
            seq.external_cached = store_hit * bs
            if store_hit <= gpu_blocks:
                return True
            # vLLM allocates the request's blocks before the load (its GPU hit is then held, not
            # evictable) and admits no load whose blocks do not fit: it is asked again next step.
            bm = w.bm
            if not bm.allocate(seq.request_id, store_hit * bs, bm.find_longest_hit(keys, seq.num_tokens),
                               meta=job):
                return False
            n = store_hit - gpu_blocks
            store.touch(keys[gpu_blocks:store_hit], job.req.session)
            delay = w.latency.restore_time(n * bs * self.cfg.kv_bytes_per_token)
            job.planned_restore = n * bs
            if seq.prefill_only or not job.split:
                job.restore_delay = delay
            self._restore[seq] = False
            self._loading[widx] += 1
            self._push(self.now + delay, RESTORED, (widx, seq))
            return False

        return ready

    def _on_restored(self, widx: int, seq: Seq) -> None:
        self._restore[seq] = True
        self._loading[widx] -= 1
        self._loaded[widx].append(seq)
        self._wake(widx)

    def _loaded_first(self, widx: int) -> None:
        """Put the loaded sequences still waiting at the head of the queue, in load order."""
        waiting = self.workers[widx].sched.waiting
        loaded = self._loaded[widx] = [s for s in self._loaded[widx] if s.num_cached_tokens < 0 and s in waiting]
        for seq in reversed(loaded):
            if waiting[0] is not seq:
                waiting.remove(seq)
                waiting.appendleft(seq)

    def _on_arrive(self, widx: int, seq: Seq) -> None:
        self.workers[widx].sched.add(seq)
        self._wake(widx)

    def _wake(self, widx: int) -> None:
        """The worker's queue changed: plan now if idle, or cut a decode stretch at the end of
        the step in progress, where the step-by-step loop would plan next."""
        w = self.workers[widx]
        self._changed[widx] = True
        if w.macro is not None:
            self._truncate_macro(w, widx)
        elif w.plan is None:
            self._plan(widx)

    # -- decode fast-forward ---------------------------------------------------
    # A stretch of pure-decode steps (nothing waiting, every running sequence decoding, no
    # finish) changes nothing but counters, except at a block boundary: the step that fills
    # a block caches it (a Stored event) and the next one allocates a block (which may evict
    # a cached one). Its step times come from the same latency model. The stretch runs as
    # one event; each boundary step's block work runs as its own small event at that step's
    # start, exactly as plan() does it (sequences brought up to that step first), so the
    # engine and the index hold what they would step by step at every moment. An arrival
    # cuts the stretch at the end of the step in progress, where the step-by-step loop would
    # admit the newcomer; a boundary that would have to preempt ends it before that step.
    # Macro state: [start, n, d0, slope, applied] (``applied``: steps whose counters are in).
    @staticmethod
    def _macro_time(start: float, steps: int, d0: float, slope: float) -> float:
        """When ``steps`` steps of a stretch starting at ``start`` are done (step time is
        ``d0 + slope * step``)."""
        return start + steps * d0 + slope * steps * (steps - 1) / 2

    def _try_macro(self, w: SimWorker, widx: int) -> bool:
        s = w.sched
        # Waiting requests whose KV is loading are skipped by every step until it is loaded
        # (its RESTORED event cuts the stretch).
        if len(s.waiting) > self._loading[widx] or not s.running:
            return False
        max_len = self.cfg.max_model_len
        n = 1 << 30
        for seq in s.running:
            if seq.num_tokens - seq.num_computed != 1 or seq.num_computed < seq.prompt_len:
                return False
            n = min(n, seq.max_tokens - seq.num_output - 1, max_len - seq.num_tokens - 1)
        if n < 2:
            return False
        if not self._block_work(w):
            return False   # the first step must preempt: the step-by-step path does it
        ctx = [seq.num_computed for seq in s.running]
        d0 = w.latency.step_time((), ctx)
        slope = w.latency.step_time((), [c + 1 for c in ctx]) - d0   # step time is linear in context
        w.gen += 1
        w.macro = [self.now, n, d0, slope, 0]
        end = self._macro_time(self.now, n, d0, slope)
        w.busy_s += end - self.now
        self._push(end, MACRO, (widx, w.gen))
        self._push_boundary(w, widx, 0)
        return True

    def _next_boundary(self, w: SimWorker, after: int) -> int:
        """The first step after step ``after`` of the stretch that fills or starts a block of
        some running sequence (counters are at ``w.macro``'s applied step)."""
        bs = self.bs
        applied = w.macro[4]  # type: ignore[index]
        k = bs
        for seq in w.sched.running:
            r = (seq.num_computed + (after + 1 - applied)) % bs
            # Steps until the token computed starts a block (r == 0) or fills one (r == bs - 1).
            k = min(k, (bs - r) % bs, (bs - 1 - r) % bs)
        return after + 1 + k

    def _push_boundary(self, w: SimWorker, widx: int, after: int) -> None:
        start, n, d0, slope, _applied = w.macro  # type: ignore[misc]
        j = self._next_boundary(w, after)
        if j < n:
            self._push(self._macro_time(start, j, d0, slope), BOUNDARY, (widx, w.gen, j))

    def _advance(self, w: SimWorker, step: int) -> None:
        """Bring the running sequences' counters to the start of ``step`` of the stretch."""
        m = w.macro
        k = step - m[4]  # type: ignore[index]
        if k:
            for seq in w.sched.running:
                seq.num_computed += k
                seq.num_output += k
            m[4] = step  # type: ignore[index]

    def _block_work(self, w: SimWorker) -> bool:
        """One decode step's allocations and cached blocks, as plan() does them, or False
        (nothing changed) when some allocation would not fit and plan() would preempt."""
        s = w.sched
        bm = w.bm
        bs = self.bs
        # Only a sequence whose next token starts a block (allocation) or fills one (caching)
        # has work; plan() finds nothing to do for the others.
        at = [seq for seq in s.running if seq.num_computed % bs in (0, bs - 1)]
        if sum(bm.blocks_to_allocate(seq.request_id, seq.num_computed + 1) for seq in at) > bm.num_free_blocks:
            return False
        for seq in at:
            target = seq.num_computed + 1
            bm.allocate(seq.request_id, target)
            s.cache_computed(seq, target)
        w.publish()
        return True

    def _on_boundary(self, widx: int, gen: int, step: int) -> None:
        w = self.workers[widx]
        if gen != w.gen or w.macro is None:
            return   # the stretch was cut before this step
        self._changed[widx] = True
        self._advance(w, step)
        if self._block_work(w):
            self._push_boundary(w, widx, step)
            return
        # This step would preempt: the stretch ends at its start and the step runs for real.
        w.busy_s -= self._macro_time(*w.macro[:4]) - self.now
        w.steps += step
        w.gen += 1
        w.macro = None
        self._plan(widx)

    def _truncate_macro(self, w: SimWorker, widx: int) -> None:
        start, n, d0, slope, _applied = w.macro  # type: ignore[misc]
        m = 1
        while m < n and self._macro_time(start, m, d0, slope) < self.now:
            m += 1
        if m >= n:
            return
        end = self._macro_time(start, m, d0, slope)
        w.busy_s -= self._macro_time(start, n, d0, slope) - end
        w.gen += 1
        w.macro[1] = m  # type: ignore[index]
        self._push(end, MACRO, (widx, w.gen))

    def _on_macro(self, widx: int, gen: int) -> None:
        w = self.workers[widx]
        if gen != w.gen or w.macro is None:
            return   # superseded by a truncation
        n = w.macro[1]
        self._changed[widx] = True
        self._advance(w, n)
        w.steps += n
        w.macro = None
        self._plan(widx)

    def _plan(self, widx: int) -> None:
        w = self.workers[widx]
        self._changed[widx] = True
        if self.cfg.macro_steps and self._try_macro(w, widx):
            return
        while w.sched.has_work:
            if self._loaded[widx]:
                self._loaded_first(widx)
            plan = w.sched.plan(self.now)
            w.publish()
            if not plan.empty:
                if self.store is not None:
                    plan.duration += self._late_restores(w, plan)
                w.plan = plan
                w.busy_s += plan.duration
                w.steps += 1
                self._push(self.now + plan.duration, STEP, widx)
                return
            if w.sched.running or self._loading[widx]:
                break   # the running go on, or a restore in progress will wake the worker
            # Nothing running and the head of the queue cannot get blocks: it never will.
            head = w.sched.waiting[0]
            w.sched.abort(head.request_id)
            self._fail(head.meta, f"prompt of {head.prompt_len} tokens does not fit the KV cache of {w.id}")
        w.plan = None

    def _late_restores(self, w: SimWorker, plan: Any) -> float:
        """Restore time of requests first scheduled in ``plan`` whose GPU hit shrank after their
        restore was planned, so the store (which backed it) supplied more than the restore they
        waited for. A guard: a loading request holds its blocks, so none is lost while it loads."""
        extra = 0
        for seq, _n in plan.scheduled:
            job: Job = seq.meta
            if job.admitted or seq.num_cached_tokens < 0:
                continue
            job.admitted = True
            self._restore.pop(seq, None)
            restored = seq.num_cached_tokens - seq.num_cached_gpu
            if restored > job.planned_restore:
                self.store.touch(seq.block_hashes[seq.num_cached_gpu // self.bs:seq.num_cached_tokens // self.bs],  # type: ignore[union-attr]
                                 job.req.session)
                extra += restored - job.planned_restore
        return w.latency.restore_time(extra * self.cfg.kv_bytes_per_token) if extra else 0.0

    def _fail(self, job: Job, why: str) -> None:
        self.errors += 1
        job.error = why
        job.finish = self.now
        self.core.load.on_finished(job.route.request_id)
        self.core.load.on_finished(prefill_request_id(job.route.request_id))
        for t, idx in self.runner.complete(job.node, self.now):
            self._push(t, RELEASE, idx)

    def _on_step(self, widx: int) -> None:
        w = self.workers[widx]
        self._changed[widx] = True
        plan = w.plan
        assert plan is not None
        w.plan = None
        now = self.now
        res = w.sched.complete(plan, now)
        for seq, _tok in res.sampled:
            if seq.num_output != 1:
                continue
            job: Job = seq.meta
            if seq.prefill_only or not job.split:
                job.scheduled = seq.first_scheduled
                # Same accounting as the sim engine: the scheduler's own GPU hit, the rest restored.
                cached = max(0, seq.num_cached_tokens)
                job.cached_gpu = min(seq.num_cached_gpu, cached)
                job.cached_offload = cached - job.cached_gpu
                if not job.split and job.decision is not None:
                    self.core.on_engine_cached(job.decision.endpoint_id, job.decision.survival_predicted_tokens, cached)
            else:
                job.decode_cached = max(0, seq.num_cached_tokens)
                # What the store lost of the prefill's KV before this restore is computed again here.
                r = split_reuse(job.cached_gpu, job.cached_offload, job.decode_cached)
                job.cached_gpu, job.cached_offload, job.split_lost = r.gpu, r.offload, r.lost
            if not seq.prefill_only:
                job.first_token = now
                self.core.on_first_token(job.route, now)
        for seq in res.finished:
            job = seq.meta
            if self.store is not None:
                # Like the sim engine: on finish, save the computed blocks the store lacks (leading check).
                n = seq.num_computed // self.bs
                self.store.put(seq.block_hashes[:n], self.store.leading(seq.block_hashes, n), job.req.session)
            if seq.prefill_only:
                self.core.load.on_finished(prefill_request_id(job.route.request_id))
                self._dispatch(job, job.decode_ep, prefill_only=False)
                continue
            job.finish = now
            assert job.decision is not None
            self.core.on_finished(job.route, job.decision, now)
            self.policy.on_completed(job.route, job.decision.endpoint_id, job.req.keys, now)
            for t, idx in self.runner.complete(job.node, now):
                self._push(t, RELEASE, idx)
        self._plan(widx)

    # ------------------------------------------------------------------ results
    def _result(self, wall_s: float) -> PolicyResult:
        done = [j for j in self.jobs if not j.error and j.first_token is not None]
        prompt = sum(j.req.input_tokens for j in done)
        gpu = sum(j.cached_gpu for j in done)
        off = sum(j.cached_offload for j in done)
        ttfts = [j.first_token - j.release for j in done]  # type: ignore[operator]
        out_tokens = sum(j.req.output_tokens for j in done)
        t0 = min((j.release for j in self.jobs), default=0.0)
        t1 = max((j.finish or j.release for j in self.jobs), default=0.0)
        span = max(t1 - t0, 1e-9)
        decode = [w for w in self.workers if w.role == "decode"]
        busy = [w.busy_s for w in decode]
        mean_busy = sum(busy) / len(busy) if busy else 0.0
        metrics: dict[str, Any] = {
            "prefix_hit_rate": round((gpu + off) / prompt, 4) if prompt else 0.0,
            "gpu_hit_rate": round(gpu / prompt, 4) if prompt else 0.0,
            "offload_hit_rate": round(off / prompt, 4) if prompt else 0.0,
            "ttft_p50_s": round(_pct(ttfts, 50), 4),
            "ttft_p90_s": round(_pct(ttfts, 90), 4),
            "ttft_p99_s": round(_pct(ttfts, 99), 4),
            "output_tok_per_s": round(out_tokens / span, 2),
            "requests": len(done),
            "errors": self.errors,
            "load_imbalance": round(max(busy) / mean_busy, 4) if mean_busy > 0 else 0.0,
            "preemptions": sum(w.sched.num_preemptions for w in self.workers),
            "split_requests": sum(1 for j in done if j.split),
            # The prefill phases' hits that the decode phases computed again (the store evicted the
            # transfer before the restore); the hit rate already leaves them out (kvmesh.routing.split_reuse).
            "split_lost_share": round(sum(j.split_lost for j in done) / prompt, 4) if prompt else 0.0,
            # Turns routed away from their session's previous endpoint: what they carry of the
            # prompt and what they reused, beside the rest (a policy's moves trade reuse for wait).
            **_moved_metrics(done, prompt),
            # Admission control: requests held at the router at least once, and for how long in all.
            "held_requests": sum(1 for j in self.jobs if j.holds),
            "held_s_total": round(sum(j.holds for j in self.jobs) * self.core.cfg.scoring.admit_recheck_s, 1),
            # How hard the shared store churns: a store far smaller than the sessions' contexts
            # evicts about one block per block it stores.
            "offload_blocks_stored": self.store.puts if self.store is not None else 0,
            "offload_evictions": self.store.tier.evictions if self.store is not None else 0,
            "offload_refused_puts": self.store.refused if self.store is not None else 0,
            "prompt_tokens": prompt,
            "cached_tokens_gpu": gpu,
            "cached_tokens_offload": off,
            "output_tokens": out_tokens,
            "virtual_time_s": round(span, 3),
            "decode_busy_s": [round(b, 3) for b in busy],
            "prefill_busy_s": [round(w.busy_s, 3) for w in self.workers if w.role == "prefill"],
            "steps": sum(w.steps for w in self.workers),
            "wall_s": round(wall_s, 2),
        }
        classes = {id(j): self._mismatch(j) for j in done}
        metrics["mismatches"] = count(list(classes.values()))
        # ``predicted_cached`` / ``actual_cached`` are what the live router reports as predicted and
        # engine-reported cached tokens (a split's are its decode endpoint's, after the transfer);
        # ``cached_gpu`` / ``cached_offload`` are the compute phase's reuse (the hit rate's), a split's
        # cut to what its decode phase did not compute again (kvmesh.routing.split_reuse).
        records = [{"uid": j.req.uid, "endpoint": self.workers[j.decode_ep].id, "split": j.split,
                    "cached_gpu": j.cached_gpu, "cached_offload": j.cached_offload, "split_lost": j.split_lost,
                    "release_s": round(j.release, 6),
                    "predicted_cached": self._predicted(j), "actual_cached": self._actual(j),
                    "mismatch": classes.get(id(j), ""),
                    "ttft_s": None if j.first_token is None else round(j.first_token - j.release, 6),
                    "held_s": round(j.holds * self.core.cfg.scoring.admit_recheck_s, 6),
                    "error": j.error, **self._ttft_parts(j)} for j in self.jobs]
        return PolicyResult(self.policy_name, metrics, ttfts, self._series(done, t0, t1), records)

    def _ttft_parts(self, j: Job) -> dict[str, Any]:
        """The chosen endpoint's estimated TTFT terms next to the request's simulated TTFT parts
        (its restore while queued, the rest of its queue wait, then its own prefill among the others' steps), to
        check the cost model against the engine model: docs/bench-history.md, #18 TTFT."""
        win = j.decision.candidates[0] if j.decision is not None and j.decision.candidates else None
        out: dict[str, Any] = {"moved": j.moved, "given_up": j.given_up, "prompt": j.req.input_tokens,
                               "free_tokens": j.free_at_dispatch}
        if win is not None:
            out.update({f"est_{t}": round(getattr(win, t), 6) for t in COST_TERMS})
            out.update(est_queued_tokens=round(win.prefill_tokens), est_queue=win.queue)
        if j.scheduled is not None and j.first_token is not None and not j.split:
            queued = j.scheduled - j.release - j.restore_delay
            out.update(restore_s=round(j.restore_delay, 6), queue_s=round(queued, 6),
                       prefill_s=round(j.first_token - j.scheduled, 6))
        return out

    def _predicted(self, j: Job) -> int | None:
        """The prediction the live router reports: a split's is what its decode endpoint holds
        once the prefill endpoint's KV has arrived (``fidelity.split_predicted_blocks``), as
        ``RouterService._final`` predicts it; otherwise the decision's."""
        if j.decision is None:
            return None
        if j.split:
            return split_predicted_blocks(j.req.input_tokens, self.bs, j.decision.predicted_cached_tokens // self.bs
                                          ) * self.bs
        return j.decision.predicted_cached_tokens

    def _actual(self, j: Job) -> int:
        """The engine's cached tokens the live router compares with: a split's decode endpoint's."""
        return max(j.decode_cached, 0) if j.split else j.cached_gpu + j.cached_offload

    def _mismatch(self, j: Job) -> str:
        if j.view is None:
            return ""
        view = j.view
        if j.split:
            view = replace(view, predicted=(self._predicted(j) or 0) // self.bs)
        return classify(view, self._actual(j) // self.bs, uses_index=self.uses_index, split=j.split)

    def _series(self, done: list[Job], t0: float, t1: float) -> list[tuple[float, float]]:
        n = max(1, self.cfg.time_buckets)
        width = max((t1 - t0) / n, 1e-9)
        num = [0] * n
        den = [0] * n
        for j in done:
            b = min(n - 1, int((j.release - t0) / width))
            num[b] += j.cached_gpu + j.cached_offload
            den[b] += j.req.input_tokens
        return [(round(t0 + (i + 0.5) * width, 3), round(num[i] / den[i], 4)) for i in range(n) if den[i]]
