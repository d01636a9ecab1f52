"""The router's Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Why it exists: Claude Code and other Anthropic clients speak the Messages API.
A request is converted to the chat conversation the model's template renders
(``kvmesh.anthropic.requests``, the same conversion as vLLM's ``/v1/messages``),
rendered with the router's chat template, then routed exactly like a chat
completion: ``RouterService.generate`` with the same request scope (the tenant of
the API key from ``x-api-key`` / ``Authorization: Bearer``, and the deadline), session
(``x-session-id``, else ``metadata.user_id``), policy and incremental
tokenization. The token stream comes back as an Anthropic message or event
stream; every error has Anthropic's shape (``kvmesh.anthropic.errors``).

With external OpenAI engines (``vllm serve``, ``Cluster.external_mode``) the request
goes to the engine's own ``/v1/messages`` instead (``passthrough``): vLLM parses tool
calls, applies stop sequences and writes the answer. ``output_config`` is read as for the
workers (``format`` is structured output; ``effort`` is the template keyword
``reasoning_effort``, in the prediction as vLLM renders it).

Stop sequences are found in the decoded text here (the workers' token streams
carry no stop strings); on a match the worker call is cancelled, so the engine
stops too. The usage of such a message comes from the router's own count of
the prompt and its predicted cache hit, since the engine never sends its final
report.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import propagate

from kvmesh import structured_outputs
from kvmesh.anthropic import responses as R
from kvmesh.anthropic.errors import OVERLOADED, AnthropicError, bad_request
from kvmesh.anthropic.requests import (
    MessagesRequest,
    disabled_thinking_effort,
    merge_inline_system,
    needs_system_first,
    parse_count_tokens,
    parse_messages,
)
from kvmesh.anthropic.stops import StopMatcher
from kvmesh.anthropic.stream import MessageStream, error_event
from kvmesh.openai import sse
from kvmesh.openai.errors import OpenAIError
from kvmesh.openai.requests import reasoning_kwargs
from kvmesh.tokenization.chat_render import ChatRenderError, ChatRequest, chat_request_from_body
from kvmesh_api.common.v1 import common_pb2
from kvmesh_router import metrics
from kvmesh_router.errors import RouterError
from kvmesh_router.passthrough import Shape, engine_body
from kvmesh_router.service import FinalInfo, GenInput

if TYPE_CHECKING:
    from kvmesh_router.http_api import RouterHttpApi

log = logging.getLogger(__name__)

API = "messages"
PREFIX = "/v1/messages"


def from_router_error(exc: RouterError) -> AnthropicError:
    """The Anthropic error for a routing/validation error of the router service."""
    status = OVERLOADED if exc.http_status == 503 else exc.http_status
    field = {"prompt": "messages"}.get(exc.param or "", exc.param or "")
    return AnthropicError(f"{field}: {exc.message}" if field and status < 500 else exc.message, status)


class _AnthropicShape(Shape):
    """The errors the router itself answers on the pass-through path, in Anthropic's shape."""

    def error(self, status: int, message: str, etype: str) -> Response:
        return AnthropicError(message, status).response()

    def router_error(self, exc: RouterError) -> Response:
        return from_router_error(exc).response()

    def stream_error(self, message: str) -> bytes:
        return error_event(502, message)


ANTHROPIC = _AnthropicShape()
# What vLLM's /v1/messages honours that does not change the prompt: left out of the copy of the
# body the router validates and renders, forwarded to the engine as sent.
_ENGINE_ONLY = ("top_k",)


def _finish(fin: FinalInfo) -> str:
    return "length" if fin.finish_reason == common_pb2.FINISH_REASON_LENGTH else "stop"


def _tool_calls(fin: FinalInfo | None) -> list[R.ToolCall]:
    # The engines' tool calls, when the router's final report carries them (OpenAI ``tool_calls``
    # shape: ``{id, function: {name, arguments}}``); a final report without them has none.
    return R.tool_calls_from(getattr(fin, "tool_calls", None)) if fin is not None else []


class _Output:
    """Token chunks -> final text, with the stop sequences applied; counts output tokens."""

    def __init__(self, detok: Any, stops: list[str]) -> None:
        self.detok = detok
        self.stops = StopMatcher(stops)
        self.tokens = 0

    def push(self, ids: list[int]) -> str:
        self.tokens += len(ids)
        return self.stops.push(self.detok.push(ids))

    def count(self, ids: list[int]) -> None:
        """Tokens whose text comes parsed (the worker's parser): counted, not decoded."""
        self.tokens += len(ids)

    @property
    def matched(self) -> str | None:
        return self.stops.matched


class AnthropicApi:
    """The Messages handlers over the router's HTTP API object (its service, config and helpers)."""

    def __init__(self, api: RouterHttpApi) -> None:
        self.api = api
        self.service = api.service
        self.cfg = api.cfg
        self._system_first: bool | None = None   # the template's need, once known
        self._disabled: str | None = None        # the effort thinking "disabled" renders as, once known

    def mount(self, app: FastAPI) -> None:
        app.add_api_route(PREFIX, self.messages, methods=["POST"])
        app.add_api_route(PREFIX + "/count_tokens", self.count_tokens, methods=["POST"])
        # Unknown routes and wrong methods under /v1/messages answer in Anthropic's shape too.
        for status in (404, 405):
            app.add_exception_handler(status, self._wrap_status_handler(status, app.exception_handlers.get(status)))

    @staticmethod
    def _wrap_status_handler(status: int, other: Any) -> Any:
        async def handler(request: Request, exc: Exception) -> Response:
            if request.url.path.startswith(PREFIX) or other is None:
                why = "no route" if status == 404 else f"method {request.method} not allowed on"
                return AnthropicError(f"{why} {request.url.path}", status).response()
            return await other(request, exc)
        return handler

    # -- request -> GenInput -------------------------------------------------------------
    async def _body(self, request: Request) -> dict[str, Any]:
        try:
            return await self.api.body(request)
        except OpenAIError as exc:
            if exc.status != 400:   # 413 too large, 408 too slow
                raise AnthropicError(exc.message, exc.status) from None
            raise bad_request("", exc.message) from None

    def _chat_request(self, req: MessagesRequest) -> ChatRequest:
        """The chat request the conversation is: rendered, tokenized (incrementally) and hashed by the
        service like a chat completion, and its tools sent to the worker, which parses tool calls."""
        if self.service.tokenizer is None:
            raise bad_request("messages", "this router has no tokenizer (--tokenizer-path), so it cannot "
                                          "render messages")
        try:
            chat = chat_request_from_body({"messages": req.messages, "tools": req.tools,
                                           "tool_choice": req.tool_choice, "add_generation_prompt": True,
                                           "parallel_tool_calls": req.parallel_tool_calls})
            chat.engine_kwargs = self._engine_kwargs(req, None)   # as vLLM's /v1/messages renders them
            return chat
        except ChatRenderError as exc:
            raise bad_request("messages", exc.message) from None

    def _engine_kwargs(self, req: MessagesRequest, template_kwargs: Any) -> dict[str, Any]:
        """The template keywords vLLM's /v1/messages renders the request with: ``output_config.effort``,
        else for ``thinking`` ``disabled`` the effort ``_disabled_effort`` picks, as the chat
        ``reasoning_effort`` (with ``enable_thinking``, unless the client's own keywords set it)."""
        effort = req.template_kwargs.get("reasoning_effort")
        if effort is None and req.thinking_disabled:
            effort = self._disabled_effort()
        return reasoning_kwargs(effort, template_kwargs, "output_config.effort")

    def _disabled_effort(self) -> str:
        """vLLM's effort for ``thinking`` ``disabled`` under this router's template, found once."""
        if self._disabled is None:
            tok = self.service.tokenizer

            def render(kwargs: dict[str, Any]) -> str | None:
                if tok is None:
                    return None
                return tok.render(ChatRequest(messages=[{"role": "user", "content": "Hi"}], engine_kwargs=kwargs))

            self._disabled = disabled_thinking_effort(render)
        return self._disabled

    def _gen_input(self, req: MessagesRequest, request: Request) -> GenInput:
        h = request.headers
        inp = GenInput(model=req.model, chat_request=self._chat_request(req))
        s = inp.sampling
        if req.max_tokens is not None:
            s.max_tokens = req.max_tokens
        if req.temperature is not None:
            s.temperature = req.temperature
        if req.top_p is not None:
            s.top_p = req.top_p
        if req.top_k is not None:
            s.top_k = req.top_k
        if req.thinking_budget is not None:   # as vLLM's /v1/messages: a worker with a reasoning parser takes it
            s.thinking_token_budget = req.thinking_budget
        s.stop.extend(req.stop_sequences)
        s.structured_outputs_json = structured_outputs.to_json(req.structured_outputs)
        inp.session_id = req.session_id
        inp.cache_salt = _ext(req, "cache_salt")
        inp.lora_name = _ext(req, "lora_name")
        inp.policy = _ext(req, "kvmesh_policy") or h.get("x-kvmesh-policy", "")
        inp.request_id = h.get("x-request-id", "") or uuid.uuid4().hex
        inp.trace_context = propagate.extract(dict(h))
        self.api.apply_scope(inp, request)   # tenant from the credential, and the request deadline
        return inp

    # -- handlers ---------------------------------------------------------------------------
    async def count_tokens(self, request: Request) -> Response:
        try:
            req = parse_count_tokens(await self._body(request), request.headers)
            inp = self._gen_input(req, request)
            self.service.validate(inp)
            tokens = await self.service.tokenize(inp)
        except AnthropicError as exc:
            return self._failed(exc)
        except RouterError as exc:
            return self._failed(from_router_error(exc))
        except Exception as exc:   # never a plain 500
            log.exception("count_tokens failed")
            return self._failed(AnthropicError(f"internal error: {type(exc).__name__}: {exc}", 500))
        metrics.REQUESTS.labels(api="count_tokens", outcome="ok").inc()
        return JSONResponse({"input_tokens": len(tokens)})

    def _failed(self, exc: AnthropicError, api: str = "count_tokens") -> Response:
        metrics.REQUESTS.labels(api=api, outcome=exc.etype).inc()
        return exc.response()

    async def messages(self, request: Request) -> Response:
        if self.api.passthrough.applies():
            return await self._external(request)
        received = time.perf_counter()
        try:
            req = parse_messages(await self._body(request), request.headers)
            inp = self._gen_input(req, request)
            inp.received = received
        except AnthropicError as exc:
            return self._failed(exc, API)
        except Exception as exc:
            log.exception("messages request failed before routing")
            return self._failed(AnthropicError(f"internal error: {type(exc).__name__}: {exc}", 500), API)
        msg_id = R.new_id(inp.request_id)
        gen = self.service.generate(inp)
        out = _Output(self.api.detokenizer(), req.stop_sequences)
        if not req.stream:
            return await self._collect(request, req, inp, gen, out, msg_id)
        # Pull the first item before answering 200, so routing and validation errors keep their status.
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            first = None
        except RouterError as exc:
            return self._failed(from_router_error(exc), API)
        except Exception as exc:
            log.exception("messages request failed")
            await gen.aclose()
            return self._failed(AnthropicError(f"internal error: {type(exc).__name__}: {exc}", 500), API)
        return sse.sse_response(self._events(request, req, inp, gen, first, out, msg_id))

    async def _external(self, request: Request) -> Response:
        """Forward to an external engine's own /v1/messages: body as sent, plus the tenant's salt."""
        api = "passthrough-messages"
        try:
            body = await self._body(request)
            if not isinstance(body, dict):
                raise bad_request("", "the body must be a JSON object")
            top_k = body.get("top_k")
            if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
                raise bad_request("top_k", f"must be an integer >= 1, got {top_k!r}")
            ctk = body.get("chat_template_kwargs")
            view = {k: v for k, v in body.items() if k not in (*_ENGINE_ONLY, "chat_template_kwargs")}
            req = parse_messages(view, request.headers)
            if _ext(req, "lora_name"):
                raise bad_request("lora_name", "LoRA adapters are not routed to external engines")
            if self._system_first is None:
                tok = self.service.tokenizer
                tpl = getattr(tok, "chat_template", None)
                # A template per tool set is checked as vLLM checks both.
                self._system_first = any(needs_system_first(t) for t in (
                    tpl.values() if isinstance(tpl, dict) else [tpl]))
            if self._system_first:
                req.messages = merge_inline_system(req.messages)   # as vLLM's /v1/messages does
            try:
                chat = chat_request_from_body({"messages": req.messages, "tools": req.tools,
                                               "tool_choice": req.tool_choice, "chat_template_kwargs": ctk})
                chat.engine_kwargs = self._engine_kwargs(req, ctk)
            except ChatRenderError as exc:
                raise bad_request(exc.param or "messages", exc.message) from None
            inp = GenInput(model=req.model, chat_request=chat, session_id=req.session_id,
                           cache_salt=_ext(req, "cache_salt"),
                           policy=_ext(req, "kvmesh_policy") or request.headers.get("x-kvmesh-policy", ""),
                           request_id=request.headers.get("x-request-id", ""))
            self.api.apply_scope(inp, request)
        except AnthropicError as exc:
            return self._failed(exc, api)
        return await self.api.passthrough.forward(request, api, PREFIX, inp, engine_body(body), None, ANTHROPIC)

    def _usage(self, inp: GenInput, out: _Output, fin: FinalInfo | None) -> dict[str, int]:
        if fin is not None:
            u = fin.usage
            return R.usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
        # Ended here on a stop sequence: the engine never sent its report; the router's own count.
        return R.usage(inp.prompt_tokens, out.tokens, inp.predicted_cached_tokens)

    async def _collect(self, request: Request, req: MessagesRequest, inp: GenInput, gen: Any, out: _Output,
                       msg_id: str) -> Response:
        text: list[str] = []
        fin: FinalInfo | None = None
        watch = self.api.watch(request, inp)
        try:
            parsed = False
            reasoning: list[str] = []
            async for kind, item in gen:
                if kind == "chunk" and parsed:
                    out.count(item)
                elif kind == "chunk":
                    text.append(out.push(item))
                    if out.matched is not None:
                        break
                elif kind == "parsed":
                    # The worker's parser reads the text (tools, reasoning): its content, not the
                    # decoded chunks, is the answer's text, and the stop sequences apply to it.
                    parsed = True
                    reasoning.append(item.reasoning)
                    text.append(out.stops.push(item.content))
                    if out.matched is not None:
                        break
                elif kind == "final":
                    fin = item
        except RouterError as exc:
            return self._failed(from_router_error(exc), API)
        except asyncio.CancelledError:
            if not watch.gone:
                raise
            metrics.REQUESTS.labels(api=API, outcome="client_gone").inc()
            return AnthropicError("client closed the request", 499).response()
        except Exception as exc:
            log.exception("messages request failed")
            return self._failed(AnthropicError(f"internal error: {type(exc).__name__}: {exc}", 500), API)
        finally:
            watch.stop()
            await gen.aclose()
        text.append(out.stops.flush())
        calls = _tool_calls(fin)
        if calls:   # the worker's parse: the answer's text that is not a tool call
            text = [fin.content or ""] if fin is not None else []
        thought = fin.reasoning if fin is not None else ("".join(reasoning) if parsed else None)
        content = R.content_blocks("".join(text), calls, thought)
        tool_use = any(b["type"] == "tool_use" for b in content)
        stop = R.stop_reason(_finish(fin) if fin is not None else "stop", out.matched, tool_use)
        metrics.REQUESTS.labels(api=API, outcome="ok").inc()
        extra = {"kvmesh": fin.routing_doc()} if fin is not None else {}
        return JSONResponse(R.message(msg_id, req.model, content, stop, self._usage(inp, out, fin), **extra))

    async def _events(self, request: Request, req: MessagesRequest, inp: GenInput, gen: Any,
                      first: tuple[str, Any] | None, out: _Output, msg_id: str) -> AsyncIterator[bytes]:
        ms = MessageStream(msg_id, req.model)
        watch = self.api.watch(request, inp)
        fin: FinalInfo | None = None
        try:
            # message_start: the prompt as the router counted it, and its predicted cache hit;
            # message_delta at the end carries the engine's counts.
            for e in ms.start(R.usage(inp.prompt_tokens, 0, inp.predicted_cached_tokens)):
                yield e

            async def items() -> AsyncIterator[tuple[str, Any]]:
                if first is not None:
                    yield first
                async for it in gen:
                    yield it

            # With tools the text may be a tool call: the worker's parser reads it as it streams
            # ("parsed": text and tool-call pieces, sent as they come); a worker that does not
            # stream its parse gets the text held back until its final report.
            hold = inp.chat_request is not None and inp.chat_request.tools_active
            held: list[str] = []
            parsed = False
            chain = items()
            try:
                async for kind, item in chain:
                    if kind == "chunk" and parsed:
                        out.count(item)
                    elif kind == "chunk" and hold:
                        held.append(out.push(item))
                    elif kind == "chunk":
                        for e in ms.text(out.push(item)):
                            yield e
                    elif kind == "parsed":
                        parsed = True
                        for e in ms.thinking(item.reasoning):
                            yield e
                        for e in ms.text(out.stops.push(item.content)):
                            yield e
                        for d in item.tool_calls:
                            for e in ms.tool_delta(d.index, d.id, d.name, d.arguments):
                                yield e
                    else:
                        fin = item
                    if out.matched is not None:
                        break   # the worker call is cancelled below (gen.aclose)
            finally:
                await chain.aclose()
            calls = _tool_calls(fin) if not parsed else []
            rest = out.stops.flush()
            if hold and not parsed:
                rest = fin.parsed_text if fin is not None and fin.parsed_text is not None else "".join(held) + rest
            for e in ms.text(rest):
                yield e
            tool_use = bool(ms.tool_blocks)
            for call in calls:
                tool_use = tool_use or R.tool_input(call) is not None
                for e in ms.tool_use(call):
                    yield e
            stop = R.stop_reason(_finish(fin) if fin is not None else "stop", out.matched, tool_use)
            for e in ms.finish(stop, self._usage(inp, out, fin)):
                yield e
            metrics.REQUESTS.labels(api=API, outcome="ok").inc()
        except RouterError as exc:
            err = from_router_error(exc)
            metrics.REQUESTS.labels(api=API, outcome=err.etype).inc()
            yield error_event(err.status, err.message, err.etype)
        except asyncio.CancelledError:
            if not watch.gone:
                raise
            metrics.REQUESTS.labels(api=API, outcome="client_gone").inc()
        except Exception as exc:
            log.exception("messages stream failed")
            yield error_event(500, f"internal error: {type(exc).__name__}: {exc}")
        finally:
            watch.stop()
            await gen.aclose()


def _ext(req: MessagesRequest, name: str) -> str:
    v = req.body.get(name)
    if v is not None and not isinstance(v, str):
        raise bad_request(name, "must be a string")
    return v or ""
