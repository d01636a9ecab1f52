"""``kvmesh analyze``: what a trace looks like and how much of it a cache could serve.

Why it exists: before simulating or buying GPUs, a platform team wants the
shape of its agent traffic — input/output sizes, how much each turn reuses of
the previous one, how bursty the sub-agents are — and the two ceilings every
measured hit rate is compared with.
"""

from __future__ import annotations

import statistics
from typing import Any

from kvmesh_tools.traffic.ceilings import ceiling_infinite, ceiling_pooled
from kvmesh_tools.traffic.model import Agent, Request, Trace, common_len
from kvmesh_tools.traffic.schedule import ScheduleOptions, build_schedule, recorded_order


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * (len(s) - 1)))))
    return float(s[k])


def distribution(values: list[float]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    return {"count": len(values), "mean": round(statistics.fmean(values), 3), "p10": _pct(values, 10),
            "p50": _pct(values, 50), "p90": _pct(values, 90), "p99": _pct(values, 99),
            "max": float(max(values)), "total": float(sum(values))}


def turn_reuse(agent: Agent) -> list[float]:
    """For each request after the first of an agent: reused share of the previous input."""
    out: list[float] = []
    prev: Request | None = None
    for it in agent.items:
        if isinstance(it, Request):
            if prev is not None and prev.input_tokens > 0:
                shared = common_len(prev.keys, it.keys) * it.block_size
                out.append(min(1.0, shared / prev.input_tokens))
            prev = it
        else:
            out.extend(turn_reuse(it))
    return out


def burst_sizes(agent: Agent) -> list[int]:
    """Sizes of sub-agent groups: consecutive sub-agents with no parent request between them."""
    sizes: list[int] = []
    run = 0
    for it in agent.items:
        if isinstance(it, Agent):
            run += 1
            sizes.extend(burst_sizes(it))
        else:
            if run:
                sizes.append(run)
            run = 0
    if run:
        sizes.append(run)
    return sizes


def analyze(trace: Trace, pooled_capacity_tokens: int = 40_000_000,
            schedule: ScheduleOptions | None = None) -> dict[str, Any]:
    reqs = trace.requests()
    reuse: list[float] = []
    bursts: list[int] = []
    for s in trace.sessions:
        reuse.extend(turn_reuse(s.root))
        bursts.extend(burst_sizes(s.root))
    sub_reqs = [r for r in reqs if r.agent != "main"]
    order = recorded_order(build_schedule(trace, schedule or ScheduleOptions()))
    return {
        "format": trace.fmt,
        "block_size": trace.block_size,
        "sessions": len(trace.sessions),
        "requests": len(reqs),
        "main_requests": len(reqs) - len(sub_reqs),
        "subagent_requests": len(sub_reqs),
        "input_tokens": distribution([r.input_tokens for r in reqs]),
        "output_tokens": distribution([r.output_tokens for r in reqs]),
        "reuse": {
            "turns": len(reuse),
            "share_reusing_ge_90pct": round(sum(1 for x in reuse if x >= 0.9) / len(reuse), 4) if reuse else 0.0,
            "median_reuse": round(statistics.median(reuse), 4) if reuse else 0.0,
        },
        "subagent_bursts": {
            "groups": len(bursts),
            "sizes": distribution([float(b) for b in bursts]),
            "share_of_requests_in_subagents": round(len(sub_reqs) / len(reqs), 4) if reqs else 0.0,
        },
        "pooled_capacity_tokens": pooled_capacity_tokens,
        "ceiling_infinite": round(ceiling_infinite(order), 4),
        "ceiling_pooled": round(ceiling_pooled(order, pooled_capacity_tokens), 4),
    }
