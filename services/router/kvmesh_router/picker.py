"""The router's endpoint picker for gateways (Envoy ext_proc): decide only, don't forward.

``pick(model, tokens or text or messages, headers, subset)`` runs exactly the
front door's pipeline (tokenize, hash, look up, score) and records the pick
(speculative entry, in-flight load), returning where the gateway should send
the request. ``done()`` on the result settles the in-flight bookkeeping.

Gateway semantics (Gateway API Inference Extension / llm-d): the request names its
``InferenceObjective`` in ``x-gateway-inference-objective``; a negative priority is
sheddable, refused (``Overloaded``, 429) while every live endpoint is saturated (waiting
queue or KV usage at the configured thresholds), so critical traffic keeps the pool.
When the router's P/D split rule picks a prefill endpoint, its host:port rides in
``gateway_prefill_header`` (llm-d's ``x-prefiller-host-port``) to the decode pod's sidecar.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvmesh.tokenization.chat_render import ChatRequest
from kvmesh_router.errors import BadRequest, Overloaded
from kvmesh_router.service import GenInput, RouterService


@dataclass
class Picked:
    endpoint_id: str
    grpc_address: str
    http_address: str
    predicted_cached_tokens: int
    reason: str
    request_id: str
    extra_headers: dict[str, str] = field(default_factory=dict)   # e.g. the P/D prefill header
    _service: RouterService | None = None
    _prepared: Any = None
    _decision: Any = None

    def done(self) -> None:
        if self._service is not None:
            self._service.settle(self._prepared, self._decision)
            self._service = None


async def pick(service: RouterService, model: str, *, tokens: list[int] | None = None, text: str | None = None,
               messages: list[dict[str, Any]] | None = None, headers: dict[str, str] | None = None,
               subset: set[str] | None = None, session_id: str = "", cache_salt: str = "",
               chat_request: ChatRequest | None = None) -> Picked:
    """Choose a decode endpoint; ``subset`` restricts to these endpoint ids or HTTP/gRPC addresses."""
    headers = {k.lower(): v for k, v in (headers or {}).items()}
    priority = objective_priority(service, headers)
    if priority < 0 and saturated(service, time.monotonic()):
        raise Overloaded(f"every endpoint is saturated; sheddable request (objective "
                         f"{headers.get(OBJECTIVE_HEADER, '')!r}, priority {priority}) refused")
    if chat_request is not None:
        messages = chat_request.messages
    if tokens is None and text is None and not messages:
        raise BadRequest("one of prompt tokens, prompt text or messages is required", "prompt")
    # Behind Envoy the worker hashes with the body's cache_salt as sent, so the prediction does too.
    inp = GenInput(model=model, tokens=tokens, text=text, chat=messages or None, chat_request=chat_request,
                   session_id=session_id or headers.get("x-session-id", ""),
                   cache_salt=cache_salt, salt_verbatim=True,
                   request_id=headers.get("x-request-id", ""))
    p = await service.prepare(inp)
    ids = None
    if subset is not None:
        http = service.cluster.http_addresses
        ids = {eid for eid, ep in service.core.endpoints.items()
               if eid in subset or ep.address in subset or http.get(eid, "") in subset}
    d, split = await service.decide(p, "", set(), ids)
    header = service.cfg.gateway_prefill_header
    prefill = service.cluster.http_addresses.get(split.prefill_endpoint, "") if split.split and header else ""
    # Without a prefill address to hand over, the decode endpoint prefills itself: no split.
    service.record_routed(p, d, split if prefill else None)
    ep = service.core.endpoints[d.endpoint_id]
    # A data-parallel pod's rank is pinned as on the router's own path (vLLM's X-data-parallel-rank).
    extra = {**({header: prefill} if prefill else {}), **service.cluster.external.rank_headers(d.endpoint_id)}
    return Picked(d.endpoint_id, ep.address, service.cluster.http_addresses.get(d.endpoint_id, ""),
                  d.predicted_cached_tokens, d.reason, p.request_id, extra, service, p, d)


OBJECTIVE_HEADER = "x-gateway-inference-objective"


def objective_priority(service: RouterService, headers: dict[str, str]) -> int:
    """The priority of the request's InferenceObjective (none or unknown: 0, as the EPP)."""
    return service.cluster.objective_priority(headers.get(OBJECTIVE_HEADER, ""))


def saturated(service: RouterService, now: float) -> bool:
    """Every live endpoint has a full queue or a full KV cache (none live: not saturated, 503 elsewhere)."""
    cfg = service.cfg
    eps = service.core.decode_endpoints(cfg.model)
    return bool(eps) and all(
        (ld := service.core.load.effective(e.endpoint_id, now)).waiting >= cfg.shed_queue_depth
        or ld.kv_usage >= cfg.shed_kv_usage for e in eps)
