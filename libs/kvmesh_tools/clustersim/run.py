"""Run several policies over one trace and cluster, side by side, and collect the report.

Policies are independent simulations, so they run in parallel processes (fork:
the parsed trace and precomputed key chains are shared copy-on-write). Each
simulation is deterministic, so the report does not depend on the process count.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import time
from concurrent.futures import ProcessPoolExecutor
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


def _run_one(policy: str) -> PolicyResult:
    sim = ClusterSim(_STATE["trace"], _STATE["schedule"], _STATE["cfg"], policy, scoring=_STATE.get("scoring"))
    res = sim.run()
    log.info("policy done", extra={"policy": policy, "wall_s": res.metrics["wall_s"]})
    return res


def simulate_policies(trace: Trace, cfg: SimConfig, policies: list[str], jobs: int | None = None,
                      records: bool = False, scoring: ScoringConfig | None = None) -> dict[str, Any]:
    """Simulate every policy; returns the JSON-able report (``results`` keyed by policy).

    With ``records`` the report also holds every request's outcome under ``records[policy]``.
    """
    t0 = time.perf_counter()
    scoring = scoring or cfg.scoring
    share_chain_keys(trace.requests())   # once, before the workers start
    schedule = schedule_for(trace, cfg)
    order = recorded_order(schedule)
    bs = trace.block_size
    pooled_cap = cfg.decode_workers * cfg.kv_capacity_tokens + max(0, cfg.offload_capacity_tokens)
    ceil_inf = round(ceiling_infinite(order), 4)
    ceil_pool = round(ceiling_pooled(order, pooled_cap), 4)
    _init_state(trace, schedule, cfg, scoring)
    jobs = jobs if jobs is not None else min(len(policies), os.cpu_count() or 1)
    results: list[PolicyResult]
    if jobs > 1 and len(policies) > 1:
        # spawn, not fork: forking a process that already runs threads (gRPC, logging, a test
        # runner) can copy a held lock into the child and hang it.
        with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"), initializer=_init_state,
                                 initargs=(trace, schedule, cfg, scoring)) as ex:
            results = list(ex.map(_run_one, policies))
    else:
        results = [_run_one(p) for p in policies]
    out: dict[str, Any] = {
        "config": {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "scoring"},
        "scoring": {k: getattr(scoring, k) for k in ScoringConfig.__dataclass_fields__},
        "trace": {"format": trace.fmt, "sessions": len(trace.sessions), "requests": len(schedule),
                  "block_size": bs},
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
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out
