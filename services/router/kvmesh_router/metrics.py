"""Prometheus metrics of the router (names prefixed ``kvmesh_router_``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

DECISIONS = Counter("kvmesh_router_decisions_total", "routing decisions", ["policy", "endpoint", "split"])
LOOKUPS = Counter("kvmesh_router_lookups_total",
                  "indexer lookups by outcome (ok: in time; ok_loop_lag: in time once the router's own event-loop "
                  "lag is not charged to the indexer; local: past the deadline, answered from the router's "
                  "local view; late_merged: an answer that came after the deadline, merged into the local view)",
                  ["outcome"])
LOOP_LAG = Histogram("kvmesh_router_loop_lag_seconds",
                     "how late the router's event loop ran a periodic wake-up (a busy or blocked loop)",
                     buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
OFFLOAD_ENABLED = Gauge("kvmesh_router_offload_enabled",
                        "1 while the cost prices a shared offload store (--offload-enabled; auto: a live store is "
                        "registered with the indexer)")
FALLBACKS = Counter("kvmesh_router_policy_fallbacks_total", "precise fell back to approx", ["reason"])
CACHED_DIFF = Histogram("kvmesh_router_cached_tokens_diff", "engine-reported minus predicted cached tokens",
                        buckets=(-65536, -4096, -512, -64, -1, 0, 1, 64, 512, 4096, 65536))
MISMATCHES = Counter("kvmesh_router_cached_tokens_mismatch_total", "predicted != engine-reported cached tokens")
MISPREDICTIONS = Counter("kvmesh_router_mispredictions_total",
                         "requests whose predicted cached tokens differ from the engine's, by cause "
                         "(kvmesh.routing.fidelity: evicted, filled, lag, speculative, lookup_timeout, view_bug, "
                         "no_index, split, unknown)", ["cause"])
HIT_SURVIVAL = Gauge("kvmesh_router_hit_survival",
                     "share of the router's predicted cached tokens the endpoint's engine lately found, requests "
                     "without a split (kvmesh.routing.survival; below --split-survival-floor the split rule counts "
                     "the rest as uncached)", ["endpoint"])
PROMPT_TOKENS = Counter("kvmesh_router_prompt_tokens_total", "prompt tokens routed")
CACHED_TOKENS = Counter("kvmesh_router_cached_tokens_total",
                        "prompt tokens no worker computed for the request, by tier (a split's: its prefill "
                        "endpoint's hit, less what its decode endpoint computed again)", ["tier"])
TRANSFERRED_TOKENS = Counter("kvmesh_router_transferred_tokens_total",
                             "prompt tokens a split's decode endpoint restored from what its prefill endpoint "
                             "computed (engine-reported as cached, but computed for the request)")
SPLIT_LOST_TOKENS = Counter("kvmesh_router_split_lost_tokens_total",
                            "prompt tokens a split's prefill endpoint found cached that its decode endpoint "
                            "computed again: the store evicted them before the decode endpoint restored them "
                            "(kvmesh.routing.split_reuse)")
MOVED_REQUESTS = Counter("kvmesh_router_moved_requests_total",
                         "requests sent to another endpoint than their session's previous turn (kvmesh.routing.moves)")
MOVED_PROMPT_TOKENS = Counter("kvmesh_router_moved_prompt_tokens_total", "prompt tokens of the moved requests")
MOVED_CACHED_TOKENS = Counter("kvmesh_router_moved_cached_tokens_total",
                              "of the moved requests' prompt tokens, those no worker computed for them (as "
                              "kvmesh_router_cached_tokens_total counts them)")
MOVED_GIVEN_UP_TOKENS = Counter("kvmesh_router_moved_given_up_tokens_total",
                                "of the moved requests, the cached tokens their session's previous endpoint was "
                                "predicted to hold beyond the chosen endpoint's prediction (the reuse the moves gave up)")
PREDICTED_TOKENS = Counter("kvmesh_router_predicted_cached_tokens_total", "predicted cached prompt tokens")
OVERHEAD = Histogram("kvmesh_router_routing_overhead_seconds", "tokens in -> decision out",
                     buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0))
DECISION = Histogram("kvmesh_router_decision_seconds",
                     "request in -> decision out at the front door (body, parse, render, tokenize, hash, lookup, "
                     "score)", buckets=(0.001, 0.002, 0.005, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0))
TOKENIZE = Histogram("kvmesh_router_tokenize_seconds", "tokenization time",
                     buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0))
HOLDS = Counter("kvmesh_router_admission_holds_total",
                "times admission control held a request at the router (kvmesh.routing.admission)")
HELD = Histogram("kvmesh_router_admission_held_seconds", "time a request held by admission control waited",
                 buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300))
RETRIES = Counter("kvmesh_router_retries_total", "attempts on another endpoint after a failure", ["reason"])
TOKENIZE_CACHE = Counter("kvmesh_router_tokenize_cache_total",
                         "incremental tokenization outcomes (hit: tail only; miss, edit, resync: full; "
                         "verified: checked against a full tokenization; mismatch: the check failed)",
                         ["outcome"])
STALLS = Counter("kvmesh_router_stalls_total", "worker streams cancelled for silence (first token or idle)",
                 ["stage"])
REQUESTS = Counter("kvmesh_router_requests_total", "requests by outcome", ["api", "outcome"])
RESPONSES_STORED = Counter("kvmesh_router_responses_stored_total",
                           "answered Responses API responses offered to the response store, by outcome "
                           "(stored, too_large, error)", ["outcome"])
HASH_BLOCKS = Counter("kvmesh_router_hash_blocks_total", "blocks hashed vs reused from the hash cache", ["kind"])
HEDGES = Counter("kvmesh_router_hedges_total",
                 "hedged first tokens (sent: a second copy went out; won: the copy answered first; lost: the "
                 "first try did; denied: the hedge budget was spent; no_endpoint: no other endpoint could take it)",
                 ["event"])


def forget_endpoint(endpoint_id: str) -> None:
    """Drop an endpoint's per-endpoint series when it leaves (pods come and go under new names)."""
    try:
        HIT_SURVIVAL.remove(endpoint_id)
    except KeyError:
        pass
