"""Admission control: under saturation, hold at the router a request that will recompute its
prompt anyway and has no room anywhere, instead of letting it evict reusable KV.

Why: with GPU cache scarce and every endpoint busy (a congested start, when many agent sessions
begin together), vLLM frees a finished request's blocks into an LRU queue and a waiting request
pins nothing. An endpoint whose sessions' contexts exceed its cache falls off the LRU cliff:
each returning turn finds its context evicted by the turns in between, recomputes it, and
evicts the next one's. A recompute placed where its prompt does not fit beside the contexts of
the sessions recently served there (the cost's ``displace`` term is positive) is what pushes an
endpoint over that cliff. Such a request gains nothing by going now (it recomputes wherever it
goes, and its own prefill dominates its time to first token); held at the router and decided
again every ``admit_recheck_s``, it goes as soon as some endpoint has room for it (a session
leaves the working set window) or an endpoint has no prefill queued, and never waits more than
``admit_max_hold_s`` in all. Gateway API Inference Extension's flow control queues requests at
the gateway for the same reason while the pool is saturated; SGLang's LPM and vLLM's priority
schedulers reorder the engine's own queue so cache hits run first.

The rule is one function shared by the live router (``RouterService.decide``) and the cluster
simulator, both through ``RouterCore.decide``; off by default (``admit_miss_ratio`` 0).
"""

from __future__ import annotations

from kvmesh.routing.load import LoadView
from kvmesh.routing.scoring import ScoringConfig, max_hit_blocks, saturation
from kvmesh.routing.types import Decision, RouteRequest


def hold_reason(req: RouteRequest, decision: Decision, load: LoadView, ids: list[str], now: float,
                held_s: float, cfg: ScoringConfig) -> str:
    """Why ``decision`` should wait at the router ("" = send it now).

    Held when all of these hold: admission control is on; the request has waited less than
    ``admit_max_hold_s``; its predicted hit on the chosen endpoint (GPU or restorable) is below
    ``admit_miss_ratio`` of its prompt, so it is recomputed wherever it goes; every endpoint in
    ``ids`` has prefill queued (as for the cost's ``work`` term); and the chosen endpoint, the
    cheapest, has no room for it: its ``displace`` term is positive, i.e. the prompt does not fit
    beside the contexts of the other sessions that used the endpoint within the reuse window.
    """
    ratio = cfg.admit_miss_ratio
    if ratio <= 0 or held_s >= cfg.admit_max_hold_s:
        return ""
    cap = max_hit_blocks(req.num_tokens, req.block_size)
    if cap <= 0 or decision.predicted_cached_tokens >= ratio * cap * req.block_size:
        return ""
    win = decision.chosen()
    if win is None or win.displace_s <= 0:
        return ""
    if not ids or saturation(float(load.columns(ids, now).prefill_tokens.min()), cfg) <= 0:
        return ""
    return (f"held {held_s:.0f}s: {req.num_tokens - decision.predicted_cached_tokens} tokens to recompute and no "
            f"room beside the working set on {decision.endpoint_id} (displaces {win.displace_s:.1f}s of KV)")
