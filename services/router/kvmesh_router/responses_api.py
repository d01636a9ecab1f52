"""The router's OpenAI Responses API: ``POST /v1/responses`` and ``/v1/responses/input_tokens``.

Why it exists: OpenAI's Codex CLI (its default wire API) and the OpenAI Agents SDK send
``/v1/responses``, not chat completions; a 404 there is a client that cannot use kvmesh. A
request is turned into the chat request it renders to (``kvmesh.responses_api.requests``,
vLLM's own conversion) and then routed exactly like a chat completion:
``RouterService.generate`` with the same scope (the API key's tenant, the deadline), session
(``prompt_cache_key``, which is what OpenAI's own cache routing keys on, else ``session_id``,
``user`` or ``x-session-id``), policy and incremental tokenization, so a Codex session's
turns land where their prefix is cached. The answer is a ``response`` object or its event
stream (``kvmesh.responses_api``); errors have OpenAI's shape.

Nothing is stored: ``previous_response_id`` is a 400 and ``GET /v1/responses/{id}`` a 404
saying so. Clients that keep their own history (Codex sends ``store: false`` and the whole
conversation every turn) need nothing more, and a turn that repeats its history is exactly
the prefix the router routes on.

With external OpenAI engines (``vllm serve``) the body goes to the engine's own
``/v1/responses`` (``passthrough``); the router predicts from the same conversion.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvmesh.openai import sse
from kvmesh.openai.errors import OpenAIError, error_response
from kvmesh.responses_api.output import ResponseHead, output_items, usage
from kvmesh.responses_api.requests import ResponsesRequest, parse_responses
from kvmesh.responses_api.stream import ResponseEvents
from kvmesh_api.common.v1 import common_pb2
from kvmesh_router import metrics
from kvmesh_router.errors import RouterError
from kvmesh_router.http_outcome import answer_or_error, router_error_response
from kvmesh_router.passthrough import OPENAI, engine_body
from kvmesh_router.service import FinalInfo, GenInput

if TYPE_CHECKING:
    from kvmesh_router.http_api import RouterHttpApi

log = logging.getLogger(__name__)

API = "responses"
PATH = "/v1/responses"


def _usage(fin: FinalInfo) -> dict[str, Any]:
    u = fin.usage
    return usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.reasoning_tokens,
                 cached_tokens_gpu=u.cached_tokens_gpu, cached_tokens_offload=u.cached_tokens_offload)


def _incomplete(fin: FinalInfo) -> bool:
    return fin.finish_reason == common_pb2.FINISH_REASON_LENGTH


class ResponsesApi:
    """The Responses handlers over the router's HTTP API object (its service, config and helpers)."""

    def __init__(self, api: RouterHttpApi) -> None:
        self.api = api
        self.service = api.service

    def mount(self, app: FastAPI) -> None:
        app.add_api_route(PATH, self.create, methods=["POST"])
        app.add_api_route(PATH + "/input_tokens", self.input_tokens, methods=["POST"])
        app.add_api_route(PATH + "/{response_id}", self.retrieve, methods=["GET", "DELETE"])

    async def retrieve(self, response_id: str) -> Response:
        metrics.REQUESTS.labels(api=API, outcome="NotFound").inc()
        return error_response(404, f"response {response_id[:64]!r} not found: this server does not store "
                                   "responses (send the conversation as 'input')", "not_found_error", "response_id")

    async def input_tokens(self, request: Request) -> Response:
        """``POST /v1/responses/input_tokens``: how many tokens the request's prompt is, rendered and
        tokenized as ``create`` would (no generation, no routing, so it works with no live endpoint)."""
        api = "responses_input_tokens"
        try:
            req = parse_responses(await self.api.body(request), request.headers,
                                  engine_renders=self.api.passthrough.applies())
            inp = self.api.gen_input(req.chat, request)
            # No session: a count (often of a fragment) must not take the place of the session's
            # conversation in the router's per-session caches.
            inp.session_id = ""
            self.service.validate(inp)
            tokens = await self.service.tokenize(inp)
        except OpenAIError as exc:
            metrics.REQUESTS.labels(api=api, outcome=type(exc).__name__).inc()
            return exc.response()
        except RouterError as exc:
            return router_error_response(exc, api)
        metrics.REQUESTS.labels(api=api, outcome="ok").inc()
        return JSONResponse({"object": "response.input_tokens", "input_tokens": len(tokens)})

    async def create(self, request: Request) -> Response:
        received = time.perf_counter()
        external = self.api.passthrough.applies()
        try:
            req = parse_responses(await self.api.body(request), request.headers, engine_renders=external)
            inp = self.api.gen_input(req.chat, request)
        except OpenAIError as exc:
            metrics.REQUESTS.labels(api=API, outcome=type(exc).__name__).inc()
            return exc.response()
        if external:
            return await self._external(request, req, inp)
        inp.received = received
        head = ResponseHead(req, inp.model)
        gen = self.service.generate(inp)
        if not req.stream:
            return await answer_or_error(API, self.api.watch(request, inp), self._answer(inp, gen, head))
        # Pull the first item before answering 200, so routing and validation errors keep their status.
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            first = None
        except RouterError as exc:
            return router_error_response(exc, API)
        return sse.sse_response(self._events(request, inp, gen, first, head))

    async def _external(self, request: Request, req: ResponsesRequest, inp: GenInput) -> Response:
        """Forward to an external engine's own /v1/responses: the body as sent, plus the tenant's salt."""
        return await self.api.passthrough.forward(request, "passthrough-responses", PATH, inp, engine_body(req.body),
                                                  None, OPENAI)

    async def _answer(self, inp: GenInput, gen: AsyncIterator[tuple[str, Any]], head: ResponseHead) -> Response:
        ids: list[int] = []
        fin: FinalInfo | None = None
        async for kind, item in gen:
            if kind == "chunk":
                ids.extend(item)
            elif kind == "final":
                fin = item
        assert fin is not None
        calls = fin.tool_calls   # RouterService.generate applied parallel_tool_calls
        tok = self.service.tokenizer
        text = fin.parsed_text
        if text is None:
            text = tok.decode(ids) if tok is not None else ""
        metrics.REQUESTS.labels(api=API, outcome="ok").inc()
        status = "incomplete" if _incomplete(fin) else "completed"
        return JSONResponse(head.response(status, output_items(text, calls, head.req, fin.reasoning), _usage(fin),
                                          kvmesh=fin.routing_doc()))

    async def _events(self, request: Request, inp: GenInput, gen: Any, first: tuple[str, Any] | None,
                      head: ResponseHead) -> AsyncIterator[bytes]:
        ev = ResponseEvents(head)
        detok = self.api.detokenizer()
        watch = self.api.watch(request, inp)
        # With tools the text may be a tool call: the worker's parser reads it as it streams
        # ("parsed": text and tool-call pieces, sent as they come); a worker that does not stream
        # its parse gets the text held back until its final report.
        creq = inp.chat_request
        hold = creq is not None and creq.tools_active
        held: list[str] = []
        parsed = False
        try:
            yield ev.start()

            async def items() -> AsyncIterator[tuple[str, Any]]:
                if first is not None:
                    yield first
                async for it in gen:
                    yield it

            async for kind, item in items():
                if kind == "chunk" and parsed:
                    continue   # a parsed stream: its text comes in the "parsed" items
                if kind == "chunk" and hold:
                    held.append(detok.push(item))
                elif kind == "chunk":
                    yield ev.text(detok.push(item))
                elif kind == "parsed":
                    parsed = True
                    yield ev.reasoning(item.reasoning)
                    yield ev.text(item.content)
                    for d in item.tool_calls:   # RouterService.generate applied parallel_tool_calls
                        yield ev.call_delta(d.index, d.id, d.name, d.arguments)
                elif kind == "final":
                    if not parsed:
                        text = item.parsed_text
                        yield ev.text("".join(held) if text is None else text)
                        for c in item.tool_calls:
                            yield ev.call(c.id, c.name, c.arguments)
                    yield ev.finish(_incomplete(item), _usage(item), kvmesh=item.routing_doc())
            metrics.REQUESTS.labels(api=API, outcome="ok").inc()
        except RouterError as exc:
            metrics.REQUESTS.labels(api=API, outcome=type(exc).__name__).inc()
            yield ev.failed(exc.error_type, exc.message)
        except asyncio.CancelledError:
            if not watch.gone:
                raise
            metrics.REQUESTS.labels(api=API, outcome="client_gone").inc()
        except Exception as exc:
            log.exception("responses stream failed")
            yield ev.failed("server_error", f"internal error: {type(exc).__name__}: {exc}")
        finally:
            watch.stop()
            await gen.aclose()
