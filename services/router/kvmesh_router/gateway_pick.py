"""The gateway's pick: what the ext_proc endpoint picker asks of the router for one HTTP request.

Why it exists: behind an Envoy gateway (``kvmesh_router.extproc``) the gateway, not the router,
sends the client's body to the engine. The router still authenticates the key, salts the body
with the tenant's secret (so tenants stay apart in every engine's prefix cache), renders the
prompt as the engine will, and picks (``kvmesh_router.picker``).

A ``/v1/responses`` body may carry stored state (``previous_response_id``, ``conversation``,
``item_reference`` items): the router puts it back from the same store its own front door uses
(``kvmesh.responses_api.history``), so the engine gets a stateless body with ``store: false``
(the next turn may go to another engine), and the answer is kept as it passes back through
Envoy (the pick's ``tap``). A stored Responses conversation works the same through the gateway
as through the router.
"""

from __future__ import annotations

import json
from typing import Any

from kvmesh.openai.errors import OpenAIError
from kvmesh.responses_api.history import resolve, wants_store
from kvmesh.responses_api.output import ResponseHead
from kvmesh.responses_api.requests import parse_responses
from kvmesh.responses_api.store.base import ResponseStore
from kvmesh.tokenization.chat_render import ChatRenderError, ChatRequest, chat_request_from_body
from kvmesh_router import extproc
from kvmesh_router.errors import BadRequest, Overloaded, RouterError, Unavailable
from kvmesh_router.picker import pick
from kvmesh_router.request_scope import RequestScopes, Unauthenticated
from kvmesh_router.responses_keep import ResponseKeeper
from kvmesh_router.responses_tap import StoreTap
from kvmesh_router.service import RouterService

RESPONSES_PATH = "/v1/responses"


def _refused(exc: OpenAIError) -> extproc.PickError:
    """An OpenAI error as the picker's refusal, with its status (400, 404 for an unknown stored id, 503
    for a store that cannot answer)."""
    message = f"{exc.param}: {exc.message}" if exc.param else exc.message
    if exc.status == 400:
        return extproc.BadRequestError(message)
    err = extproc.PickError(message)
    err.http_status = exc.status
    return err


def gateway_pick_fn(service: RouterService, scopes: RequestScopes, store: ResponseStore | None = None
                    ) -> extproc.PickFn:
    """The ``pick`` callable of :func:`kvmesh_router.extproc.start_extproc_server`."""
    keeper = ResponseKeeper(store)

    async def responses(body: dict[str, Any], headers: dict[str, str], tenant: str
                        ) -> tuple[ChatRequest | None, str, dict[str, Any] | None, StoreTap | None]:
        """The chat request a Responses body renders (stored state put back), its session, the body to
        forward when it changed, and the tap that keeps its answer."""
        store_it = wants_store(body)
        res = await resolve(body, store, tenant, "the router runs with --responses-store off")
        rreq = parse_responses(res.body, headers, engine_renders=True)
        head = ResponseHead(rreq, str(body.get("model", service.cfg.model)),
                            previous_response_id=res.previous.id if res.previous else None,
                            store=store is not None and store_it, conversation=res.thread.id if res.thread else None)
        forward = dict(res.body)
        tap = keeper.engine_tap(tenant, head, res, forward)
        return rreq.chat.chat_request, rreq.chat.session_id, forward if tap or res.body is not body else None, tap

    async def pick_fn(preq: extproc.PickRequest) -> extproc.PickResult:
        try:
            # The same keys and tenants as the router's own front doors.
            principal = scopes.authenticate(preq.headers.get)
        except Unauthenticated as exc:
            raise extproc.UnauthenticatedError(str(exc)) from None
        body = preq.body or {}
        client_salt = body.get("cache_salt", "")
        if not isinstance(client_salt, str):
            raise extproc.BadRequestError("cache_salt: must be a string")
        tenant = scopes.tenant(principal, preq.headers.get(scopes.tenant_header, ""))
        # The worker behind Envoy hashes with the body's cache_salt: it gets the tenant's secret salt
        # (the client's mixed in), so tenants stay apart on this path too, and the prediction matches.
        salt = service.salts.salt(tenant, client_salt)
        prompt = body.get("prompt")
        tokens = prompt if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else None
        text = prompt if isinstance(prompt, str) else None
        session_id = str(body.get("session_id", ""))
        forward: dict[str, Any] | None = None
        tap = None
        try:
            # The chat request is rendered as the engine behind Envoy will render it (tools included);
            # a Responses body as vLLM's /v1/responses converts it.
            if preq.path.split("?", 1)[0] == RESPONSES_PATH:
                chat, session_id, forward, tap = await responses(body, preq.headers, tenant)
            else:
                chat = chat_request_from_body(body) if body.get("messages") is not None else None
        except ChatRenderError as exc:
            raise extproc.BadRequestError(f"{exc.param}: {exc.message}") from None
        except OpenAIError as exc:
            raise _refused(exc) from None
        if salt != client_salt and preq.body is not None:
            forward = {**(forward if forward is not None else body), "cache_salt": salt}
        try:
            picked = await pick(service, str(body.get("model", service.cfg.model)), tokens=tokens, text=text,
                                chat_request=chat, headers=preq.headers,
                                subset=set(preq.subset) if preq.subset is not None else None,
                                session_id=session_id, cache_salt=salt)
        except BadRequest as exc:
            raise extproc.BadRequestError(exc.message) from None
        except Unavailable as exc:
            raise extproc.NoEligibleEndpointError(exc.message) from None
        except Overloaded as exc:
            raise extproc.ShedLoadError(exc.message) from None
        except RouterError as exc:
            raise extproc.PickError(exc.message) from None
        return extproc.PickResult(address=picked.http_address or picked.grpc_address,
                                  endpoint_id=picked.endpoint_id,
                                  predicted_cached_tokens=picked.predicted_cached_tokens, reason=picked.reason,
                                  on_done=lambda _status: picked.done(),
                                  body=json.dumps(forward, ensure_ascii=False).encode() if forward is not None else None,
                                  extra_headers=picked.extra_headers, tap=tap)

    return pick_fn
