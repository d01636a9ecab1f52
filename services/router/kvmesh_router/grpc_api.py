"""gRPC ``kvmesh.router.v1.Router``: Generate (server-streaming) and ListModels.

Both need an API key in the metadata (``authorization: Bearer <key>`` or ``x-api-key``)
unless the router runs with ``--auth off``: ``AuthInterceptor`` refuses a call without a
valid one as ``UNAUTHENTICATED`` before its request message is parsed; the servicer then
takes the request scope (tenant from the key; the ``tenant`` field only from a trusted
gateway key) exactly as the HTTP front door does (``request_scope``)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import grpc

from kvmesh.api_keys import key_from_headers
from kvmesh.rpc.authz import peer_identity
from kvmesh_api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh_router import metrics
from kvmesh_router.errors import BadRequest, RouterError
from kvmesh_router.request_scope import (
    RequestScopes,
    Scope,
    Unauthenticated,
    metadata_getter,
    scopes_from_config,
)
from kvmesh_router.service import GenInput, RouterService

log = logging.getLogger(__name__)


# Calls of these services are not authenticated (probes and tooling).
PUBLIC_SERVICE_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuse calls without a valid API key in their metadata, before their message is parsed."""

    def __init__(self, scopes: RequestScopes) -> None:
        self.scopes = scopes

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(PUBLIC_SERVICE_PREFIXES) or not self.scopes.enabled:
            return handler
        get = metadata_getter(details.invocation_metadata)
        if self.scopes.gateways and not key_from_headers(get):
            # Maybe a trusted gateway (no key): only the call's context shows its certificate,
            # so the servicer's scope check decides (every Router method starts with it).
            return handler
        try:
            self.scopes.authenticate(get)
        except Unauthenticated as exc:
            metrics.REQUESTS.labels(api="grpc", outcome="unauthenticated").inc()
            return _refusal(handler, str(exc))
        return handler


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that aborts UNAUTHENTICATED; the message stays unparsed."""

    async def abort(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def abort_stream(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - a generator, never reached

    ser = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort_stream, None, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort, None, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort_stream, None, ser)
    return grpc.unary_unary_rpc_method_handler(abort, None, ser)


def to_input(req: router_pb2.GenerateRequest, deadline: float | None, tenant: str) -> GenInput:
    inp = GenInput(model=req.model, request_id=req.request_id, cache_salt=req.cache_salt,
                   session_id=req.session_id, lora_name=req.lora_name, tenant=tenant, policy=req.policy,
                   deadline=deadline)
    inp.sampling.CopyFrom(req.sampling)
    inp.include_reasoning = req.include_reasoning if req.HasField("include_reasoning") else True
    which = req.WhichOneof("input")
    if which == "tokens":
        # Kept as the protobuf field: copying 200k ids into a list costs ~10 ms, while the
        # hash cache slices it and the worker request copies it in C.
        inp.tokens = req.tokens.ids  # type: ignore[assignment]
    elif which == "text":
        inp.text = req.text
    elif which == "chat":
        inp.chat = [_message(m) for m in req.chat.messages]
        # An explicit false is the client's; unset is OpenAI's default, true.
        agp = req.chat.add_generation_prompt if req.chat.HasField("add_generation_prompt") else None
        inp.add_generation_prompt = True if agp is None else agp
        if not inp.chat:
            inp.chat = None
        elif req.chat.tools_json or req.chat.tool_choice_json or req.chat.chat_template_kwargs_json:
            inp.chat_request = _chat_request(req.chat, inp.chat, agp)
    return inp


def _message(m: router_pb2.ChatMessage) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name:
        msg["name"] = m.name
    if m.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
        msg["content"] = m.content or None   # an assistant turn of calls only has no text, as in OpenAI's API
    if m.tool_call_id:
        msg["tool_call_id"] = m.tool_call_id
    return msg


def _chat_request(chat: router_pb2.ChatMessages, messages: list[dict[str, Any]],
                  add_generation_prompt: bool | None = None) -> Any:
    """A chat with tools or template keywords as the HTTP front door reads one (OpenAI's body fields,
    ``chat_request_from_body``): the same rendering and the same refusals, as INVALID_ARGUMENT."""
    from kvmesh.tokenization.chat_render import ChatRenderError, chat_request_from_body

    body: dict[str, Any] = {"messages": messages}
    if add_generation_prompt is not None:
        body["add_generation_prompt"] = add_generation_prompt
    if chat.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = chat.parallel_tool_calls
    for name, raw in (("tools", chat.tools_json), ("tool_choice", chat.tool_choice_json),
                      ("chat_template_kwargs", chat.chat_template_kwargs_json)):
        if raw:
            try:
                body[name] = json.loads(raw)
            except ValueError as exc:
                raise BadRequest(f"{name}: chat.{name}_json is not JSON: {exc}", name) from None
    try:
        return chat_request_from_body(body)
    except ChatRenderError as exc:
        msg = exc.message if exc.param in exc.message else f"{exc.param}: {exc.message}"
        raise BadRequest(msg, exc.param) from None


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, service: RouterService, scopes: RequestScopes | None = None) -> None:
        self.service = service
        self.scopes = scopes or scopes_from_config(service.cfg)

    async def _scope(self, context: grpc.aio.ServicerContext, claimed_tenant: str = "") -> Scope:
        rem = context.time_remaining()
        try:
            return self.scopes.scope(metadata_getter(context.invocation_metadata()), claimed_tenant,
                                     deadline_s=rem if rem is not None and rem < 1e9 else 0.0,
                                     peer=peer_identity(context))
        except Unauthenticated as exc:   # the interceptor refused it already unless it was not installed
            metrics.REQUESTS.labels(api="grpc", outcome="unauthenticated").inc()
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            raise

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        received = time.perf_counter()
        # A trusted gateway's claimed tenant: the request field, else the tenant header in the metadata.
        claimed = request.tenant or (metadata_getter(context.invocation_metadata())(self.scopes.tenant_header) or "")
        sc = await self._scope(context, claimed)
        which = request.WhichOneof("input")
        if which is None or (which == "chat" and not request.chat.messages):
            metrics.REQUESTS.labels(api="grpc", outcome="bad_request").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "input: one of tokens, text or chat (with messages) is required")
        try:
            inp = to_input(request, sc.deadline, sc.tenant)
            inp.received = received
            pending: router_pb2.GenerateResponse | None = None   # a parsed chunk goes after its tokens
            async for kind, item in self.service.generate(inp):
                if kind == "chunk":
                    yield router_pb2.GenerateResponse(chunk=router_pb2.Chunk(
                        token_ids=item, text=self._text(request, item)))
                elif kind == "parsed":
                    # The worker's deltas are common.v1.ToolCallDelta, as the router's.
                    pending = router_pb2.GenerateResponse(chunk=router_pb2.Chunk(
                        parsed=True, content_delta=item.content, tool_call_deltas=item.tool_calls,
                        reasoning_delta=item.reasoning))
                    continue
                elif kind == "final":
                    if pending is not None:
                        yield pending
                        pending = None
                    fin = router_pb2.Final(
                        usage=item.usage, finish_reason=item.finish_reason, routing=item.routing,
                        request_id=item.request_id, ttft_s=item.ttft_s,
                        tool_calls=item.tool_calls)
                    if item.parsed_text is not None and item.content is not None:
                        fin.content = item.content
                    if item.reasoning is not None:
                        fin.reasoning = item.reasoning
                    yield router_pb2.GenerateResponse(final=fin)
                if pending is not None:
                    yield pending
                    pending = None
            metrics.REQUESTS.labels(api="grpc", outcome="ok").inc()
        except RouterError as exc:
            metrics.REQUESTS.labels(api="grpc", outcome=type(exc).__name__).inc()
            await context.abort(exc.grpc_code, exc.message)

    def _text(self, request: router_pb2.GenerateRequest, ids: list[int]) -> str:
        tok = self.service.tokenizer
        if not request.return_text or tok is None:
            return ""
        return tok.decode(ids)

    async def ListModels(self, request: router_pb2.ListModelsRequest, context: grpc.aio.ServicerContext):
        await self._scope(context)
        cfg = self.service.cfg
        eps = [e.endpoint_id for e in self.service.core.decode_endpoints(cfg.model)]
        return router_pb2.ListModelsResponse(models=[router_pb2.ModelInfo(
            id=cfg.model, max_model_len=self.service.max_model_len(), block_size=cfg.block_size, endpoints=eps)])
