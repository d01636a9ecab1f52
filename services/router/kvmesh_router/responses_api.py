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

Answered responses are kept (``--responses-store``: in this process, or in Redis for every
replica) unless the request says ``store: false``, as OpenAI keeps them by default. A later
request's ``previous_response_id`` and ``item_reference`` items are put back into its input
before it is parsed (``kvmesh.responses_api.history``), so a chained turn renders, and is
routed on, exactly the prefix a client sending its whole history would have sent.
``GET``/``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items`` read and forget
them; ``conversation`` continues a Conversations API object (``conversations_api``). Everything is per tenant (the API key's): another tenant's id is not found. A response
is kept before its last event is sent, so a client that chains at once finds it. Codex sends
``store: false`` and the whole conversation every turn, and needs none of this.

With external OpenAI engines (``vllm serve``) the body goes to the engine's own
``/v1/responses`` (``passthrough``); the router predicts from the same conversion.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvmesh.openai import sse
from kvmesh.openai.errors import BadRequest, OpenAIError
from kvmesh.responses_api.conversations import page
from kvmesh.responses_api.history import Resolved, kept, resolve, unavailable, wants_store
from kvmesh.responses_api.output import ResponseHead, output_items, usage
from kvmesh.responses_api.requests import ResponsesRequest, parse_responses
from kvmesh.responses_api.store.base import RESPONSE, ResponseStore, StoredResponse, StoreError
from kvmesh.responses_api.store.registry import open_store
from kvmesh.responses_api.stream import ResponseEvents
from kvmesh_api.common.v1 import common_pb2
from kvmesh_router import metrics
from kvmesh_router.conversations_api import ConversationsApi
from kvmesh_router.errors import RouterError
from kvmesh_router.http_guard import request_scope_of
from kvmesh_router.http_outcome import answer_or_error, router_error_response, store_route
from kvmesh_router.passthrough import OPENAI, engine_body
from kvmesh_router.responses_background import LOG_KEEP_S, RUNNING, BackgroundResponses
from kvmesh_router.responses_keep import ResponseKeeper
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

    def __init__(self, api: RouterHttpApi, store: ResponseStore | None = None) -> None:
        self.api = api
        self.service = api.service
        cfg = api.cfg
        self.store = store if store is not None else open_store(
            cfg.responses_store, cfg.responses_store_ttl_s, cfg.responses_store_max_bytes,
            cfg.responses_store_tenant_max_bytes)
        self.keeper = ResponseKeeper(self.store)
        self.background = BackgroundResponses(
            self.store, self.keeper, cfg.http_deadline_s, cfg.responses_background_max,
            cfg.responses_background_tenant_max) if self.store is not None else None

    def mount(self, app: FastAPI) -> None:
        app.add_api_route(PATH, self.create, methods=["POST"])
        app.add_api_route(PATH + "/input_tokens", self.input_tokens, methods=["POST"])
        off = None if self.store is not None else lambda response_id, **_: OpenAIError(
            f"response {response_id[:64]!r} not found: this server does not store responses (--responses-store "
            "off; send the conversation as 'input')", "response_id", status=404)
        for path, method, fn, api in (
                (PATH + "/{response_id}", "GET", self.retrieve, "responses_retrieve"),
                (PATH + "/{response_id}", "DELETE", self.delete, "responses_delete"),
                (PATH + "/{response_id}/input_items", "GET", self.input_items, "responses_input_items"),
                (PATH + "/{response_id}/cancel", "POST", self.cancel, "responses_cancel")):
            app.add_api_route(path, store_route(api, fn, off), methods=[method])
        ConversationsApi(self.store, self.api.body, _page_params).mount(app)   # /v1/conversations

    # -- stored responses (``store_route`` answers what these raise)
    async def _stored(self, request: Request, response_id: str) -> StoredResponse:
        """The tenant's stored ``response_id``; 404 for an absent one or another tenant's."""
        assert self.store is not None
        return await kept(self.store, _tenant(request), response_id, RESPONSE, "Response", "response_id")

    async def retrieve(self, request: Request, response_id: str) -> Response:
        assert self.background is not None
        rec = await self._stored(request, response_id)
        q = request.query_params
        if q.get("stream") not in ("true", "1"):
            return JSONResponse(self.background.as_read(rec.response))
        # Resuming a streamed background response: its events after ``starting_after``, then the rest.
        try:
            after = int(q.get("starting_after", "-1"))
        except ValueError:
            raise BadRequest("'starting_after' must be an integer (a sequence number)", "starting_after") from None
        events = await self.background.follow(_tenant(request), response_id, after)
        if events is None:
            raise BadRequest(f"'stream': the events of {response_id!r} are not kept (only a streamed background "
                             f"response's, for {LOG_KEEP_S:.0f} s after its end: on the replica that ran it, or "
                             "in a shared Redis store); retrieve it without stream", "stream")
        return sse.sse_response(_while_connected(request, events))

    async def cancel(self, request: Request, response_id: str) -> Response:
        """``POST /v1/responses/{id}/cancel``: stop a background response (``queued`` or ``in_progress``)."""
        await self._stored(request, response_id)
        assert self.background is not None
        return JSONResponse(await self.background.cancel(_tenant(request), response_id))

    async def delete(self, request: Request, response_id: str) -> Response:
        rec = await self._stored(request, response_id)
        assert self.store is not None and self.background is not None
        if rec.response.get("background") and rec.response.get("status") in RUNNING:
            await self.background.cancel(_tenant(request), response_id)   # its generation stops too
        await self.store.delete(_tenant(request), response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, request: Request, response_id: str) -> Response:
        """``GET /v1/responses/{id}/input_items``: the conversation the response answered, a page at a
        time (``limit`` 1-100, default 20; ``order`` desc (default) or asc; ``after``/``before`` an item id)."""
        limit, order, after, before = _page_params(request)
        return JSONResponse(page((await self._stored(request, response_id)).input, limit, order, after, before))

    async def input_tokens(self, request: Request) -> Response:
        """``POST /v1/responses/input_tokens``: how many tokens the request's prompt is, rendered and
        tokenized as ``create`` would (no generation, no routing, so it works with no live endpoint)."""
        api = "responses_input_tokens"
        try:
            # A chained body counts what create would render: the stored conversation and its own input.
            res = await resolve(await self.api.body(request), self.store, _tenant(request))
            req = parse_responses(res.body, request.headers, engine_renders=self.api.passthrough.applies())
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
        tenant = _tenant(request)
        try:
            body = await self.api.body(request)
            store_it = wants_store(body)
            background = self._background_asked(body, store_it, external)
            if background:   # honoured here; the parser refuses it elsewhere
                body = {k: v for k, v in body.items() if k != "background"}
            res = await resolve(body, self.store, tenant)
            req = parse_responses(res.body, request.headers, engine_renders=external)
            inp = self.api.gen_input(req.chat, request)
        except OpenAIError as exc:
            metrics.REQUESTS.labels(api=API, outcome=type(exc).__name__).inc()
            return exc.response()
        head = ResponseHead(req, inp.model, previous_response_id=res.previous.id if res.previous else None,
                            store=self.store is not None and store_it,
                            conversation=res.thread.id if res.thread else None, background=background)
        if external:
            return await self._external(request, req, inp, head, res, tenant)
        inp.received = received
        if background:
            assert self.background is not None
            try:
                self.service.validate(inp)   # what a plain request would be refused for, refused now
            except RouterError as exc:
                return router_error_response(exc, API)
            try:
                if req.stream:   # its events go to a log that this answer, and resumptions, follow
                    events = await self.background.start_stream(tenant, head, res, lambda: self._events(
                        None, inp, self.service.generate(inp), None, head,
                        lambda r: self.keeper.settle(tenant, head, r, res)))
                    answer: Response = sse.sse_response(_while_connected(request, events.follow(-1)))
                else:
                    answer = JSONResponse(await self.background.start(tenant, head, res, lambda: self._final(
                        inp, self.service.generate(inp), head)))
            except OpenAIError as exc:
                return exc.response()
            except StoreError as exc:
                return unavailable(exc).response()
            metrics.REQUESTS.labels(api=API, outcome="background").inc()
            return answer
        gen = self.service.generate(inp)
        if not req.stream:
            return await answer_or_error(API, self.api.watch(request, inp), self._answer(inp, gen, head, res,
                                                                                         tenant))
        # Pull the first item before answering 200, so routing and validation errors keep their status.
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            first = None
        except RouterError as exc:
            return router_error_response(exc, API)
        return sse.sse_response(self._events(request, inp, gen, first, head, lambda r: self.keeper.keep(
            tenant, head, r, res)))

    async def _external(self, request: Request, req: ResponsesRequest, inp: GenInput, head: ResponseHead,
                        res: Resolved, tenant: str) -> Response:
        """Forward to an external engine's own /v1/responses: the body with stored state put back, plus the
        tenant's salt. A stored request's answer is kept on its way back (``responses_tap``); the engine
        is told not to keep it (the next turn may go to another engine)."""
        body = engine_body(req.body)
        tap = self.keeper.engine_tap(tenant, head, res, body)
        return await self.api.passthrough.forward(request, "passthrough-responses", PATH, inp, body, None, OPENAI,
                                                  tap)

    def _background_asked(self, body: dict[str, Any], store_it: bool, external: bool) -> bool:
        value = body.get("background")
        if value is not None and not isinstance(value, bool):
            raise BadRequest("'background' must be a boolean", "background")
        if not value:
            return False
        why = ("responses are not stored by this server (--responses-store off)" if self.store is None
               else "a background response is polled from the store: it needs store: true" if not store_it
               else "the endpoints are external engines; background responses run on the router's own workers"
               if external else "")
        if why:
            raise BadRequest(f"'background' is not supported here: {why}", "background")
        return True

    async def _final(self, inp: GenInput, gen: AsyncIterator[tuple[str, Any]], head: ResponseHead
                     ) -> dict[str, Any]:
        """The finished ``response`` of a generation."""
        ids: list[int] = []
        fin: FinalInfo | None = None
        try:
            async for kind, item in gen:
                if kind == "chunk":
                    ids.extend(item)
                elif kind == "final":
                    fin = item
        finally:
            await gen.aclose()   # a cancelled background response stops its generation
        assert fin is not None
        calls = fin.tool_calls   # RouterService.generate applied parallel_tool_calls
        tok = self.service.tokenizer
        text = fin.parsed_text
        if text is None:
            text = tok.decode(ids) if tok is not None else ""
        metrics.REQUESTS.labels(api=API, outcome="ok").inc()
        status = "incomplete" if _incomplete(fin) else "completed"
        return head.response(status, output_items(text, calls, head.req, fin.reasoning), _usage(fin),
                             kvmesh=fin.routing_doc())

    async def _answer(self, inp: GenInput, gen: AsyncIterator[tuple[str, Any]], head: ResponseHead,
                      res: Resolved, tenant: str) -> Response:
        response = await self._final(inp, gen, head)
        await self.keeper.keep(tenant, head, response, res)
        return JSONResponse(response)

    async def _events(self, request: Request | None, inp: GenInput, gen: Any, first: tuple[str, Any] | None,
                      head: ResponseHead, keep: Callable[[dict[str, Any]], Awaitable[None]]
                      ) -> AsyncIterator[bytes]:
        """The answer's events. ``keep`` gets the last event's response (completed or failed) before that
        event goes out. ``request`` None: a background response, which runs on when its client leaves."""
        ev = ResponseEvents(head)
        detok = self.api.detokenizer()
        watch = self.api.watch(request, inp) if request is not None else None
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
                    last = ev.finish(_incomplete(item), _usage(item), kvmesh=item.routing_doc())
                    assert ev.final is not None
                    await keep(ev.final)
                    yield last
            metrics.REQUESTS.labels(api=API, outcome="ok").inc()
        except RouterError as exc:
            metrics.REQUESTS.labels(api=API, outcome=type(exc).__name__).inc()
            last = ev.failed(exc.error_type, exc.message)
            await keep(ev.final)   # type: ignore[arg-type]  # failed() set it
            yield last
        except asyncio.CancelledError:
            if watch is None or not watch.gone:
                raise
            metrics.REQUESTS.labels(api=API, outcome="client_gone").inc()
        except Exception as exc:
            log.exception("responses stream failed")
            last = ev.failed("server_error", f"internal error: {type(exc).__name__}: {exc}")
            await keep(ev.final)   # type: ignore[arg-type]
            yield last
        finally:
            if watch is not None:
                watch.stop()
            await gen.aclose()


async def _while_connected(request: Request, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``events`` until the client leaves (a background response runs on; its reader need not)."""
    gone = asyncio.Event()

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone.set()

    task = asyncio.create_task(watch())
    try:
        async for event in events:
            if gone.is_set():
                return
            yield event
            await asyncio.sleep(0)   # a backlog replayed at once: let the loop see a closed connection
    finally:
        task.cancel()


def _tenant(request: Request) -> str:
    return request_scope_of(request).tenant


def _page_params(request: Request) -> tuple[int, str, str | None, str | None]:
    q = request.query_params
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise BadRequest("'limit' must be an integer from 1 to 100", "limit")
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("'order' must be asc or desc", "order")
    return limit, order, q.get("after") or None, q.get("before") or None   # an empty one: none
