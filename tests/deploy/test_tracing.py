"""One request, one trace: the span tree across real processes.

The stack (router, indexer, offload store, prefill and decode sim workers) runs as
child processes exporting OTLP/gRPC to an in-process receiver. A request long
enough to be split goes router -> indexer lookup -> prefill -> offload put ->
decode -> offload get; the test rebuilds the span tree of its trace and checks
every hop is there, parented correctly, in the right service, with the
``gen_ai.*`` attributes (model, input/output/cached tokens, TTFT).
"""

from __future__ import annotations

import httpx
import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _ancestors(span, by_id):
    out = []
    while span.parent_id and span.parent_id in by_id:
        span = by_id[span.parent_id]
        out.append(span)
    return out


def test_one_trace_per_request_across_all_services(deploy_stack, otlp_receiver) -> None:
    # Fresh tokens (no cache anywhere) and longer than the split threshold (256).
    prompt = [7000 + i for i in range(640)]
    r = httpx.post(f"http://127.0.0.1:{deploy_stack.router_http}/v1/completions",
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 6}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    rid = None

    def root_done(spans):
        nonlocal rid
        roots = [s for s in spans if s.name == "router.generate"
                 and s.attributes.get("gen_ai.usage.input_tokens") == len(prompt)]
        if not roots:
            return False
        rid = roots[-1].attributes["kvmesh.request_id"]
        trace = [s for s in spans if s.trace_id == roots[-1].trace_id]
        names = {s.name for s in trace}
        # Each process exports on its own batch schedule, so the store's server spans can
        # arrive after the clients' spans: wait for them too, children of a put or a get.
        client_ids = {s.span_id for s in trace if s.name in ("offload.put", "offload.get")}
        store_joined = any(s.parent_id in client_ids for s in trace if s.service == "kvmesh-offload")
        return store_joined and {"kvmesh.worker.Generate", "kvmesh.worker.Prefill", "offload.put",
                                 "offload.get", "indexer.lookup"} <= names

    spans = otlp_receiver.wait_for(root_done, timeout_s=30)
    (root,) = [s for s in spans if s.name == "router.generate" and s.attributes.get("kvmesh.request_id") == rid]
    trace = [s for s in spans if s.trace_id == root.trace_id]
    by_id = {s.span_id: s for s in trace}
    assert not root.parent_id or root.parent_id not in by_id, "router.generate is the root of its trace"

    def one(name: str, service: str):
        found = [s for s in trace if s.name == name and s.service == service]
        assert found, f"no {name} span from {service}; have {sorted({(s.service, s.name) for s in trace})}"
        return found[0]

    lookup = one("indexer.lookup", "kvmesh-indexer")
    prefill = one("kvmesh.worker.Prefill", "kvmesh-prefill")
    put = one("offload.put", "kvmesh-prefill")
    decode = one("kvmesh.worker.Generate", "kvmesh-decode")
    get = one("offload.get", "kvmesh-decode")
    # Every hop descends from the router's request span, across process boundaries.
    for span in (lookup, prefill, put, decode, get):
        assert root in _ancestors(span, by_id), f"{span.service}/{span.name} is not under router.generate"
    assert prefill in _ancestors(put, by_id), "offload put happens inside the prefill"
    assert decode in _ancestors(get, by_id), "offload get (restore) happens inside the decode"
    # The store's own server spans joined the trace (context went over gRPC metadata).
    store_spans = [s for s in trace if s.service == "kvmesh-offload"]
    assert {s.parent_id for s in store_spans} & {put.span_id, get.span_id}, "offload server spans not in trace"
    # Ordering: prefill's put finished before the decode's restore started.
    assert put.end_ns <= get.start_ns
    # gen_ai attributes: on the decode span and on the router's root span.
    usage = body["usage"]
    for span in (decode, root):
        a = span.attributes
        assert a["gen_ai.request.model"] == "tiny"
        assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] == len(prompt)
        assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 6
        assert a["gen_ai.usage.cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
        assert a["gen_ai.latency.time_to_first_token"] > 0
    # The decode restored the prefill's KV: its cached tokens are the prefill's full blocks.
    assert decode.attributes["kvmesh.kv_from_prefill"] is True
    # (the last prompt token is always recomputed, as in vLLM, so the last full block may not count)
    assert decode.attributes["gen_ai.usage.cached_tokens"] == ((len(prompt) - 1) // 32) * 32
    assert prefill.attributes["gen_ai.request.model"] == "tiny"


def test_separate_requests_get_separate_traces(deploy_stack, otlp_receiver) -> None:
    ids = []
    for n in range(2):
        r = httpx.post(f"http://127.0.0.1:{deploy_stack.router_http}/v1/completions",
                       json={"model": "tiny", "prompt": [9000 + 100 * n + i for i in range(40)], "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    spans = otlp_receiver.wait_for(
        lambda ss: sum(1 for s in ss if s.name == "router.generate"
                       and s.attributes.get("gen_ai.usage.input_tokens") == 40) >= 2, timeout_s=30)
    roots = [s for s in spans if s.name == "router.generate" and s.attributes.get("gen_ai.usage.input_tokens") == 40]
    assert len({s.trace_id for s in roots[-2:]}) == 2
