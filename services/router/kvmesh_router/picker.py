"""The router's endpoint picker for gateways (Envoy ext_proc): decide only, don't forward.

``pick(model, tokens or text or messages, headers, subset)`` runs exactly the
front door's pipeline (tokenize, hash, look up, score) and records the pick
(speculative entry, in-flight load), returning where the gateway should send
the request. ``done()`` on the result settles the in-flight bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvmesh.tokenization.chat_render import ChatRequest
from kvmesh_router.errors import BadRequest
from kvmesh_router.service import GenInput, RouterService


@dataclass
class Picked:
    endpoint_id: str
    grpc_address: str
    http_address: str
    predicted_cached_tokens: int
    reason: str
    request_id: str
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
    d, _split = await service.decide(p, "", set(), ids)
    service.record_routed(p, d)
    ep = service.core.endpoints[d.endpoint_id]
    return Picked(d.endpoint_id, ep.address, service.cluster.http_addresses.get(d.endpoint_id, ""),
                  d.predicted_cached_tokens, d.reason, p.request_id, service, p, d)
