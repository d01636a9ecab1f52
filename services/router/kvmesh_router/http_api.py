"""The router's OpenAI-compatible HTTP front door (FastAPI), served by uvicorn in the router's event loop.

``/v1/completions`` and ``/v1/chat/completions`` (streaming SSE ending in
``[DONE]``, and non-streaming), ``/v1/models`` (and one by id), ``/health``; the Anthropic
Messages API (``anthropic_api.py``) is mounted on the same app. Every generation request
has a total deadline (``http_deadline_s``): past it the client gets a 504 error. Request rules,
error shape, SSE framing, usage and response objects come from the shared
OpenAI layer ``kvmesh.openai`` (the worker's HTTP API uses the same); here a
parsed request becomes a ``GenInput`` for ``RouterService.generate`` and the
routing decision is added under a ``kvmesh`` key. When the router's endpoints are external
OpenAI servers (``vllm serve``), requests take ``passthrough`` instead: the body is forwarded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import propagate

from kvmesh import structured_outputs
from kvmesh.openai import sse
from kvmesh.openai.errors import OpenAIError, error_body, error_response, install_error_handlers
from kvmesh.openai.requests import OpenAIRequest, parse_chat, parse_completion, read_json, string
from kvmesh.openai.responses import Answer, tool_calls
from kvmesh.openai.usage import usage
from kvmesh.responses_api.store.base import ResponseStore
from kvmesh.tokenization.detokenize import IncrementalDetokenizer
from kvmesh_api.common.v1 import common_pb2
from kvmesh_router import metrics
from kvmesh_router.anthropic_api import AnthropicApi
from kvmesh_router.errors import RouterError, UnknownModel
from kvmesh_router.http_guard import ScopeMiddleware, request_scope_of
from kvmesh_router.http_outcome import answer_or_error, router_error_response
from kvmesh_router.passthrough import Passthrough
from kvmesh_router.request_scope import RequestScopes, scopes_from_config
from kvmesh_router.responses_api import ResponsesApi
from kvmesh_router.service import FinalInfo, GenInput, RouterService

log = logging.getLogger(__name__)

_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
           common_pb2.FINISH_REASON_ABORT: "abort", common_pb2.FINISH_REASON_ERROR: "error",
           common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls"}


def _usage(fin: FinalInfo) -> dict[str, Any]:
    u = fin.usage
    out = usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens,
                cached_tokens_gpu=u.cached_tokens_gpu, cached_tokens_offload=u.cached_tokens_offload)
    if fin.reasoning is not None:   # as vLLM's server with a reasoning parser
        out["completion_tokens_details"] = {"reasoning_tokens": u.reasoning_tokens}
    return out


def _finish(fin: FinalInfo) -> str:
    return _FINISH.get(fin.finish_reason, "stop")


def _tool_calls(fin: FinalInfo) -> list[dict[str, Any]]:
    # RouterService.generate already kept the first call only when parallel_tool_calls is false.
    return tool_calls(fin.tool_calls)


class _DisconnectWatch:
    """Cancel the worker calls when the HTTP client goes away (uvicorn does not cancel us)."""

    def __init__(self, request: Request, inp: GenInput) -> None:
        self.gone = False
        self._request = request
        self._inp = inp
        self._task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        # Wait for the server's disconnect message rather than poll ``is_disconnected``: a poll
        # every 0.1 s per request in flight took ~15 % of a loaded router's event loop (cProfile,
        # 100 soak sessions), and a busy loop is what made indexer lookups miss their deadline.
        # The body has been read by now; a stray body message is skipped.
        while (await self._request.receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        log.debug("client disconnected; cancelling the worker call", extra={"calls": len(self._inp.calls)})
        for call in list(self._inp.calls):
            call.cancel()

    def stop(self) -> None:
        self._task.cancel()


class RouterHttpApi:
    """The handlers of the router's HTTP API over one ``RouterService``."""

    def __init__(self, service: RouterService) -> None:
        self.service = service
        self.cfg = service.cfg
        self.passthrough = Passthrough(service, self.watch)

    # -- request -> GenInput
    def gen_input(self, req: OpenAIRequest, request: Request) -> GenInput:
        h = request.headers
        inp = GenInput(model=req.model)
        s = inp.sampling
        if req.max_tokens is not None:
            s.max_tokens = req.max_tokens
        if req.temperature is not None:
            s.temperature = req.temperature
        if req.top_p is not None:
            s.top_p = req.top_p
        if req.seed is not None:
            s.seed = req.seed
        s.stop.extend(req.stop)
        s.stop_token_ids.extend(req.stop_token_ids)
        inp.include_reasoning = req.include_reasoning
        if req.ignore_eos is not None:
            s.ignore_eos = req.ignore_eos
        for name, value in req.knobs.items():
            setattr(s, name, value)
        s.structured_outputs_json = structured_outputs.to_json(req.structured_outputs)
        inp.text = req.prompt_text
        inp.tokens = req.prompt_ids
        inp.chat = req.messages
        inp.chat_request = req.chat_request
        inp.add_generation_prompt = req.add_generation_prompt
        inp.cache_salt = req.cache_salt
        inp.session_id = req.session_id
        inp.lora_name = string(req.body, "lora_name")
        inp.policy = string(req.body, "kvmesh_policy") or h.get("x-kvmesh-policy", "")
        inp.request_id = h.get("x-request-id", "")
        inp.trace_context = propagate.extract(dict(h))
        self.apply_scope(inp, request)
        return inp

    def apply_scope(self, inp: GenInput, request: Request) -> None:
        """The request scope's tenant and deadline (every worker call inherits what is left of it)."""
        sc = request_scope_of(request)
        inp.tenant = sc.tenant
        inp.deadline = sc.deadline

    async def body(self, request: Request) -> dict[str, Any]:
        cfg = self.cfg
        return await read_json(request, cfg.max_text_bytes, cfg.http_body_timeout_s, cfg.max_json_depth)

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.service.tokenizer)

    def watch(self, request: Request, inp: GenInput) -> _DisconnectWatch:
        return _DisconnectWatch(request, inp)

    # -- handlers
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    def _card(self) -> dict[str, Any]:
        """The served model, in the fields of OpenAI's model object and of Anthropic's (one path
        serves both APIs' clients)."""
        cfg = self.cfg
        eps = [e.endpoint_id for e in self.service.core.decode_endpoints(cfg.model)]
        return {"id": cfg.model, "object": "model", "created": 0, "owned_by": "kvmesh",
                "type": "model", "display_name": cfg.model, "created_at": "1970-01-01T00:00:00Z",
                "max_model_len": self.service.max_model_len(), "endpoints": eps}

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._card()]}

    async def model_card(self, model_id: str) -> Response:
        """``GET /v1/models/{id}``: the served model's card, or 404 for any other id."""
        if model_id != self.cfg.model:
            exc = UnknownModel(model_id, self.cfg.model)
            return error_response(exc.http_status, exc.message, exc.error_type, exc.param)
        return JSONResponse(self._card())

    async def health(self) -> JSONResponse:
        n = self.service.cluster.live_decode_count()
        return JSONResponse(status_code=200 if n > 0 else 503,
                            content={"status": "ok" if n else "no live endpoint", "live_endpoints": n,
                                     "indexer_up": self.service.cluster.indexer_up})

    # -- generation
    async def _handle(self, request: Request, chat: bool) -> Response:
        received = time.perf_counter()
        api = "chat" if chat else "completions"
        if self.passthrough.applies():
            # External OpenAI engines get the client's body itself (with the tenant's salt).
            return await self.passthrough.handle(request, chat)
        try:
            body = await self.body(request)
            req = parse_chat(body, request.headers) if chat else parse_completion(body, request.headers)
        except OpenAIError as exc:
            metrics.REQUESTS.labels(api=api, outcome=type(exc).__name__).inc()
            return exc.response()
        inp = self.gen_input(req, request)
        inp.received = received
        answer = Answer(chat=chat, model=inp.model)
        gen = self.service.generate(inp)
        if not req.stream:
            return await self._collect(request, inp, gen, answer, api)
        # Pull the first item before answering 200 so that validation and
        # routing errors still get a proper status code and error body.
        first: tuple[str, Any] | None
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            first = None
        except RouterError as exc:
            return router_error_response(exc, api)
        return sse.sse_response(self._events(request, inp, gen, first, answer, api, req.include_usage))

    async def _collect(self, request: Request, inp: GenInput, gen: AsyncIterator[tuple[str, Any]],
                       answer: Answer, api: str) -> Response:
        return await answer_or_error(api, _DisconnectWatch(request, inp), self._answer(inp, gen, answer, api))

    async def _answer(self, inp: GenInput, gen: AsyncIterator[tuple[str, Any]], answer: Answer,
                      api: str) -> Response:
        ids: list[int] = []
        fin: FinalInfo | None = None
        async for kind, item in gen:
            if kind == "chunk":
                ids.extend(item)
            elif kind == "final":
                fin = item
        assert fin is not None
        metrics.REQUESTS.labels(api=api, outcome="ok").inc()
        tok = self.service.tokenizer
        text = fin.parsed_text
        if text is None:
            text = tok.decode(ids) if tok is not None else ""
        return JSONResponse(answer.response(text, ids, _finish(fin), _usage(fin), tool_calls=_tool_calls(fin),
                                            reasoning=fin.reasoning if inp.include_reasoning else None,
                                            kvmesh=fin.routing_doc()))

    async def _events(self, request: Request, inp: GenInput, gen: Any, first: tuple[str, Any] | None,
                      answer: Answer, api: str, include_usage: bool) -> AsyncIterator[bytes]:
        detok = IncrementalDetokenizer(self.service.tokenizer)
        watch = _DisconnectWatch(request, inp)
        first_chunk = True
        # With tools the answer's text may be a tool call: the worker's tool parser reads it as it
        # streams ("parsed" items: content and tool-call deltas, sent as they come). A worker that
        # does not stream its parse gets the text held back until its final report. A worker with a
        # reasoning parser sends every chat answer parsed (reasoning and content), its "parsed" item
        # before the chunk of the same tokens: from then on, chunks are not shown.
        creq = inp.chat_request
        hold = creq is not None and creq.tools_active
        held: list[str] = []
        parsed = False
        try:
            async def items() -> AsyncIterator[tuple[str, Any]]:
                if first is not None:
                    yield first
                async for it in gen:
                    yield it

            async for kind, item in items():
                if kind == "chunk" and parsed:
                    continue
                if kind == "chunk" and hold:
                    held.append(detok.push(item))
                elif kind == "chunk":
                    yield sse.event(answer.chunk(detok.push(item), item, None, first_chunk))
                    first_chunk = False
                elif kind == "parsed":
                    parsed = True
                    if item.reasoning:
                        yield sse.event(answer.reasoning_chunk(item.reasoning, first_chunk))
                        first_chunk = False
                    if item.content:
                        yield sse.event(answer.chunk(item.content, None, None, first_chunk))
                        first_chunk = False
                    if item.tool_calls:   # parallel_tool_calls applied by RouterService.generate
                        yield sse.event(answer.tool_call_deltas_chunk(item.tool_calls, first_chunk))
                        first_chunk = False
                else:
                    text = item.parsed_text
                    text = "".join(held) if text is None else text
                    if text and not parsed:
                        yield sse.event(answer.chunk(text, item.output_ids, None, first_chunk))
                        first_chunk = False
                    if item.tool_calls and not parsed:
                        yield sse.event(answer.tool_calls_chunk(_tool_calls(item), first_chunk))
                        first_chunk = False
                    yield sse.event(answer.chunk("", None, _finish(item), first_chunk, kvmesh=item.routing_doc()))
                    if include_usage:
                        yield sse.event(answer.usage_chunk(_usage(item)))
            metrics.REQUESTS.labels(api=api, outcome="ok").inc()
        except RouterError as exc:
            metrics.REQUESTS.labels(api=api, outcome=type(exc).__name__).inc()
            yield sse.event(error_body(exc.http_status, exc.message, exc.error_type, exc.param))
        except asyncio.CancelledError:
            if not watch.gone:
                raise
            metrics.REQUESTS.labels(api=api, outcome="client_gone").inc()
            return
        finally:
            watch.stop()
            await gen.aclose()
        yield sse.DONE


def build_app(service: RouterService, scopes: RequestScopes | None = None,
              store: ResponseStore | None = None) -> FastAPI:
    """The FastAPI app of the router's HTTP front door over ``service``; ``scopes`` default to the config's,
    the Responses ``store`` to one opened from it (``--responses-store``)."""
    api = RouterHttpApi(service)
    app = FastAPI(title="kvmesh router", docs_url=None, redoc_url=None)
    app.add_middleware(ScopeMiddleware, scopes=scopes or scopes_from_config(service.cfg))
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", api.model_card, methods=["GET"])   # ids may hold "/"
    app.add_api_route("/health", api.health, methods=["GET"])
    install_error_handlers(app)
    AnthropicApi(api).mount(app)   # /v1/messages, /v1/messages/count_tokens
    ResponsesApi(api, store).mount(app)   # /v1/responses
    return app
