"""Run several policies over one trace and cluster, side by side, and collect the report.

Policies are independent simulations, so they run in parallel processes: this
one and a pool of the rest (each pool process receives the parsed trace and its
precomputed key chains once). The ceilings the report divides by run as tasks
too, queued after the simulations, so they fill the tail instead of adding
serial time. Each simulation is deterministic, so the report does not depend on
the process count.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import multiprocessing as mp
import os
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from kvmesh.routing.scoring import ScoringConfig
from kvmesh_tools.clustersim.config import SimConfig
from kvmesh_tools.clustersim.sim import ClusterSim, PolicyResult
from kvmesh_tools.traffic.ceilings import ceiling_infinite, ceiling_pooled
from kvmesh_tools.traffic.model import Trace, share_chain_keys
from kvmesh_tools.traffic.schedule import Schedule, ScheduleOptions, build_schedule, recorded_order

log = logging.getLogger(__name__)

_STATE: dict[str, Any] = {}


def schedule_for(trace: Trace, cfg: SimConfig) -> Schedule:
    window = cfg.start_window_s
    if window is None and trace.fmt in ("weka", "claude-code"):
        window = 600.0   # claude-code files all start at t=0; agents don't start in lockstep
    return build_schedule(trace, ScheduleOptions(mode=cfg.mode, start_window_s=window, think_scale=cfg.think_scale,
                                                 max_think_s=cfg.max_think_s, seed=cfg.seed))


def _init_state(trace: Trace, schedule: Schedule, cfg: SimConfig, scoring: ScoringConfig | None) -> None:
    _STATE.update(trace=trace, schedule=schedule, cfg=cfg, scoring=scoring)


def _init_worker(trace: Trace, schedule: Schedule, cfg: SimConfig, scoring: ScoringConfig | None) -> None:
    """A pool process's start: its state lives as long as it does, so the collector that each
    simulation runs first (to free the previous one) need not walk the trace again."""
    _init_state(trace, schedule, cfg, scoring)
    gc.freeze()


# A pool task: ("sim", policy, store capacity or None for the config's), or ("ceiling", "",
# pooled capacity in tokens, or None for the infinite cache's ceiling).
Task = tuple[str, str, "int | None"]


def _run_task(task: Task) -> PolicyResult | float:
    kind, policy, cap = task
    if kind == "ceiling":
        order = _STATE.get("order")
        if order is None:
            order = _STATE["order"] = recorded_order(_STATE["schedule"])
        return round(ceiling_infinite(order) if cap is None else ceiling_pooled(order, cap), 4)
    return _run_one(policy, cap)


def _run_one(policy: str, offload: int | None) -> PolicyResult:
    """One policy's simulation; ``offload`` (if not None) replaces the config's store capacity."""
    cfg: SimConfig = _STATE["cfg"]
    if offload is not None:
        cfg = dataclasses.replace(cfg, offload_capacity_tokens=offload)
    sim = ClusterSim(_STATE["trace"], _STATE["schedule"], cfg, policy, scoring=_STATE.get("scoring"))
    res = sim.run()
    log.info("policy done", extra={"policy": policy, "offload_capacity_tokens": cfg.offload_capacity_tokens,
                                   "wall_s": res.metrics["wall_s"]})
    return res


def _pooled_capacity(cfg: SimConfig) -> int:
    """The cluster's GPU and store tokens, as one cache (``ceiling_pooled``)."""
    return cfg.decode_workers * cfg.kv_capacity_tokens + max(0, cfg.offload_capacity_tokens)


def _run_all(trace: Trace, schedule: Schedule, cfg: SimConfig, scoring: ScoringConfig,
             sims: list[tuple[str, int | None]], pooled_caps: list[int],
             jobs: int | None) -> tuple[list[PolicyResult], float, dict[int, float]]:
    """The simulations ``sims`` ((policy, store capacity)) in order, the infinite cache's
    ceiling, and the pooled ceiling of each capacity in ``pooled_caps``."""
    _init_state(trace, schedule, cfg, scoring)
    caps = list(dict.fromkeys(pooled_caps))
    tasks: list[Task] = [("sim", p, c) for p, c in sims]
    tasks += [("ceiling", "", None)] + [("ceiling", "", c) for c in caps]
    jobs = jobs if jobs is not None else min(len(sims), os.cpu_count() or 1)
    if jobs > 1 and len(sims) > 1:
        out = _run_shared(tasks, _longest_first(tasks, cfg), jobs, (trace, schedule, cfg, scoring))
    else:
        out = [_run_task(t) for t in tasks]
    _STATE.pop("order", None)
    n = len(sims)
    results: list[PolicyResult] = out[:n]   # type: ignore[assignment]
    return results, out[n], dict(zip(caps, out[n + 1:], strict=True))   # type: ignore[arg-type]


def _longest_first(tasks: list[Task], cfg: SimConfig) -> list[int]:
    """The order to start ``tasks`` in: simulations with an offload store, then those without, then
    the ceilings. A store's simulations take about twice as long (its puts, restores and evictions),
    and the process that finishes last waits for nothing but its own last task, so the short tasks
    go last and the processes finish close together."""
    def rank(i: int) -> int:
        kind, _, cap = tasks[i]
        if kind == "ceiling":
            return 2
        return 0 if (cfg.offload_capacity_tokens if cap is None else cap) > 0 else 1
    return sorted(range(len(tasks)), key=rank)


def _run_shared(tasks: list[Task], order: list[int], jobs: int,
                initargs: tuple[Any, ...]) -> list[PolicyResult | float]:
    """``_run_task`` of every task on ``jobs`` processes, this one among them, started in ``order``
    (indices into ``tasks``); results in task order.

    This process holds the state already, while a pool process first receives it (the pickled
    trace is about 150 MB: seconds to send and load), so this one starts at once and the pool's
    ``jobs - 1`` processes join when ready. Whichever process is free takes the next task.
    """
    out: list[PolicyResult | float | None] = [None] * len(tasks)
    errors: list[BaseException] = []
    cond = threading.Condition(threading.RLock())   # re-entrant: a done callback may run inside submit
    nxt = 0
    in_pool = 0

    def claim() -> int | None:
        nonlocal nxt
        with cond:
            if nxt >= len(order) or errors:
                return None
            nxt += 1
            return order[nxt - 1]

    # spawn, not fork: forking a process that already runs threads (gRPC, logging, a test
    # runner) can copy a held lock into the child and hang it.
    with ProcessPoolExecutor(max_workers=jobs - 1, mp_context=mp.get_context("spawn"), initializer=_init_worker,
                             initargs=initargs) as ex:

        def feed() -> None:
            nonlocal in_pool
            with cond:
                i = claim()
                if i is None:
                    return
                try:
                    fut = ex.submit(_run_task, tasks[i])
                except BaseException as exc:   # a broken pool: nothing would ever land
                    errors.append(exc)
                    cond.notify_all()
                    return
                in_pool += 1
                fut.add_done_callback(lambda done, i=i: landed(i, done))

        def landed(i: int, fut: Future[PolicyResult | float]) -> None:
            nonlocal in_pool
            with cond:
                in_pool -= 1
                try:
                    out[i] = fut.result()
                except BaseException as exc:   # re-raised below, in this thread
                    errors.append(exc)
                feed()
                cond.notify_all()

        for _ in range(jobs - 1):
            feed()
        while (i := claim()) is not None:
            try:
                out[i] = _run_task(tasks[i])
            except BaseException as exc:
                with cond:
                    errors.append(exc)
        with cond:
            cond.wait_for(lambda: in_pool == 0)
    if errors:
        raise errors[0]
    return out   # type: ignore[return-value]


def _report(trace: Trace, schedule: Schedule, cfg: SimConfig, scoring: ScoringConfig, policies: list[str],
            results: list[PolicyResult], records: bool, ceil_inf: float, ceil_pool: float) -> dict[str, Any]:
    """The JSON-able report of one cluster (one store capacity) for ``results`` in policy order."""
    pooled_cap = _pooled_capacity(cfg)
    out: dict[str, Any] = {
        "config": {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "scoring"},
        "scoring": {k: getattr(scoring, k) for k in ScoringConfig.__dataclass_fields__},
        "trace": {"format": trace.fmt, "sessions": len(trace.sessions), "requests": len(schedule),
                  "block_size": trace.block_size},
        "ceiling_infinite": ceil_inf,
        "ceiling_pooled": ceil_pool,
        "pooled_capacity_tokens": pooled_cap,
        "policies": policies,
        "results": {},
        "series": {},
        "wall_s": 0.0,
    }
    for res in results:
        m = dict(res.metrics)
        m["ceiling_infinite"] = ceil_inf
        m["ceiling_pooled"] = ceil_pool
        m["share_of_ceiling_pooled"] = round(m["prefix_hit_rate"] / ceil_pool, 4) if ceil_pool else 0.0
        out["results"][res.policy] = m
        if records:
            out.setdefault("records", {})[res.policy] = res.records
        out["series"][res.policy] = {"hit_rate_over_time": res.hit_series, "ttft_s": sorted(round(x, 5) for x in res.ttfts)}
    return out


def simulate_policies(trace: Trace, cfg: SimConfig, policies: list[str], jobs: int | None = None,
                      records: bool = False, scoring: ScoringConfig | None = None) -> dict[str, Any]:
    """Simulate every policy; returns the JSON-able report (``results`` keyed by policy).

    With ``records`` the report also holds every request's outcome under ``records[policy]``.
    """
    t0 = time.perf_counter()
    scoring = scoring or cfg.scoring
    share_chain_keys(trace.requests())   # once, before the workers start
    schedule = schedule_for(trace, cfg)
    cap = _pooled_capacity(cfg)
    results, ceil_inf, pooled = _run_all(trace, schedule, cfg, scoring, [(p, None) for p in policies], [cap], jobs)
    out = _report(trace, schedule, cfg, scoring, policies, results, records, ceil_inf, pooled[cap])
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out


# What each regime's summary keeps of a policy's metrics (the figures the regimes are compared on).
SUMMARY_KEYS = ("prefix_hit_rate", "ceiling_pooled", "share_of_ceiling_pooled", "ttft_p50_s", "ttft_p90_s",
                "ttft_p99_s", "load_imbalance", "mismatches")


def simulate_regimes(trace: Trace, cfg: SimConfig, policies: list[str], regimes: list[tuple[str, int]],
                     jobs: int | None = None, records: bool = False,
                     scoring: ScoringConfig | None = None) -> dict[str, Any]:
    """Every policy in each regime (``(name, offload store capacity in tokens)``), same traces and schedule.

    Returns ``{"regimes": [{"regime", "offload_capacity_tokens", "summary", "report"}, ...], "wall_s"}``:
    each ``report`` is what :func:`simulate_policies` returns for that store; ``summary`` keeps per
    policy the figures the regimes are compared on (:data:`SUMMARY_KEYS`). All (regime, policy)
    simulations share one process pool.
    """
    t0 = time.perf_counter()
    scoring = scoring or cfg.scoring
    share_chain_keys(trace.requests())
    schedule = schedule_for(trace, cfg)
    rcfgs = [dataclasses.replace(cfg, offload_capacity_tokens=cap) for _, cap in regimes]
    results, ceil_inf, pooled = _run_all(trace, schedule, cfg, scoring,
                                         [(p, cap) for _, cap in regimes for p in policies],
                                         [_pooled_capacity(r) for r in rcfgs], jobs)
    out: dict[str, Any] = {"policies": policies, "regimes": [], "wall_s": 0.0}
    for i, ((name, cap), rcfg) in enumerate(zip(regimes, rcfgs, strict=True)):
        rep = _report(trace, schedule, rcfg, scoring, policies, results[i * len(policies):(i + 1) * len(policies)],
                      records, ceil_inf, pooled[_pooled_capacity(rcfg)])
        rep["wall_s"] = round(sum(m["wall_s"] for m in rep["results"].values()), 2)
        summary = {p: {k: m[k] for k in SUMMARY_KEYS if k in m} for p, m in rep["results"].items()}
        out["regimes"].append({"regime": name, "offload_capacity_tokens": cap, "summary": summary, "report": rep})
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out
