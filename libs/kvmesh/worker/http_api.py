"""OpenAI-compatible HTTP API of a worker (``/v1/completions``, ``/v1/chat/completions``, and
``/v1/responses`` from ``responses_http``).

Why it exists: behind an Envoy gateway (Gateway API Inference Extension) the
workers are the InferencePool's endpoints, and the gateway forwards the
client's OpenAI request to the endpoint the kvmesh router picked. So a worker
must answer plain OpenAI HTTP itself, next to its gRPC ``Worker`` service.

It talks to the engine only through ``kvmesh.worker.engine.base.Engine`` (token ids in,
token deltas out). Text prompts and chat messages need a tokenizer (a
Hugging Face tokenizer directory, the same one the router uses); token-id
prompts work without one. Every answer carries ``x-kvmesh-endpoint`` so a
client or a test can see which worker served it. Request rules, the error
shape, SSE framing and response objects are the shared OpenAI layer
``kvmesh.openai`` (the router's HTTP front door uses the same).

Started by ``kvmesh.worker`` (``run_worker``) when ``http_port`` is set; it runs
a uvicorn server on the worker's own asyncio loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import propagate, trace
from prometheus_client import CONTENT_TYPE_LATEST

from kvmesh.http_tls import RequireRoles, ServerSsl, peer_aware
from kvmesh.openai import sse
from kvmesh.openai.errors import BadRequest, OpenAIError, install_error_handlers
from kvmesh.openai.requests import OpenAIRequest, parse_chat, parse_completion, read_json
from kvmesh.openai.responses import Answer, tool_calls
from kvmesh.openai.usage import usage
from kvmesh.request_ids import engine_request_id
from kvmesh.rpc.tls import TlsConfig
from kvmesh.tokenization.chat_render import ChatRenderer, ChatRenderError
from kvmesh.tokenization.detokenize import IncrementalDetokenizer
from kvmesh.worker.engine.base import Engine, EngineError, EngineOutput, EngineRequest
from kvmesh.worker.responses_http import WorkerResponses

log = logging.getLogger(__name__)
_tracer = trace.get_tracer(__name__)

ENDPOINT_HEADER = "x-kvmesh-endpoint"
# Who may call a worker's OpenAI API over HTTPS: the gateway forwarding clients' requests, routers, admins.
DEFAULT_CLIENT_ROLES = frozenset({"gateway", "router", "admin"})
MAX_BODY_BYTES = 8 * 1024 * 1024


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the API uses."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kw: Any) -> Any: ...


@dataclass
class HttpApiConfig:
    """Where the worker's OpenAI HTTP API listens and how it answers."""

    host: str = field(default="127.0.0.1", metadata={"help": "HTTP listen host"})
    port: int = field(default=0, metadata={"help": "HTTP listen port (0 = disabled)"})
    default_max_tokens: int = field(default=0, metadata={
        "help": "max_tokens when the request omits it (0 = what is left of max_model_len, as vLLM)"})
    tokenizer: str = field(default="", metadata={"help": "HF tokenizer dir for text/chat prompts ('' = token ids only)"})


def load_tokenizer(path: str) -> Tokenizer | None:
    """Load a HF tokenizer directory offline; '' means no tokenizer."""
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


# --------------------------------------------------------------------------- prompt -> token ids


def prompt_ids(req: OpenAIRequest, tokenizer: Tokenizer | None, renderer: ChatRenderer | None = None) -> list[int]:
    """The prompt of a validated request as token ids (text and chat need the tokenizer).

    Chat goes through ``kvmesh.tokenization.chat_render``, the renderer the router uses, so both
    compute the ids vLLM's OpenAI server would."""
    if req.prompt_ids is not None:
        return req.prompt_ids
    if tokenizer is None:
        if req.chat:
            raise BadRequest("this worker has no tokenizer: chat needs one (use /v1/completions with token ids)",
                             "messages")
        raise BadRequest("this worker has no tokenizer: send 'prompt' as a list of token ids", "prompt")
    if not req.chat:
        return list(tokenizer.encode(req.prompt_text or "", add_special_tokens=False))
    assert req.chat_request is not None
    try:
        return (renderer or ChatRenderer(hf_tokenizer=tokenizer)).render_ids(req.chat_request)
    except ChatRenderError as exc:
        raise BadRequest(exc.message, exc.param) from None


def _tools_active(req: OpenAIRequest) -> bool:
    return req.chat_request is not None and req.chat_request.tools_active


def _parallel(req: OpenAIRequest) -> bool:
    return req.chat_request is None or req.chat_request.parallel_tool_calls


def _engine_error(exc: EngineError) -> OpenAIError:
    return OpenAIError(str(exc), status=exc.http_status)


# --------------------------------------------------------------------------- app


class MetricsPage(Protocol):
    """The worker's Prometheus page (``kvmesh.worker.metrics.WorkerMetrics``)."""

    def render(self) -> str: ...


class WorkerHttpApi:
    """The FastAPI app over one engine; request rules and answer shapes come from ``kvmesh.openai``."""

    def __init__(self, engine: Engine, *, model: str = "", tokenizer: Tokenizer | None = None,
                 endpoint_id: str = "", default_max_tokens: int = 0, metrics: MetricsPage | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        info = engine.info()
        self.model = model or info.model
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(hf_tokenizer=tokenizer) if tokenizer is not None else None
        self.endpoint_id = endpoint_id or "worker"
        self.default_max_tokens = default_max_tokens
        self.max_body_bytes = MAX_BODY_BYTES
        self.app = self._build()

    def prompt_ids(self, req: OpenAIRequest) -> list[int]:
        return prompt_ids(req, self.tokenizer, self.renderer)

    @staticmethod
    def engine_error(exc: EngineError) -> OpenAIError:
        return _engine_error(exc)

    def _headers(self) -> dict[str, str]:
        return {ENDPOINT_HEADER: self.endpoint_id}

    def _build(self) -> FastAPI:
        app = FastAPI(title="kvmesh worker", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self.model_card, methods=["GET"])   # ids may hold "/"
        if self.metrics is not None:
            # Where vLLM serves it: scrapers pointed at a vLLM pod's serving port find the same page.
            app.add_api_route("/metrics", self.metrics_page, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        WorkerResponses(self).mount(app)   # /v1/responses
        install_error_handlers(app, headers=self._headers())
        return app

    # -- handlers
    async def metrics_page(self) -> Response:
        assert self.metrics is not None
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def health(self) -> JSONResponse:
        ok = self.engine.healthy
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503,
                            headers=self._headers())

    def _card(self) -> dict[str, Any]:
        return {"id": self.model, "object": "model", "created": 0, "owned_by": "kvmesh",
                "max_model_len": self.engine.info().max_model_len}

    async def models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._card()]}, headers=self._headers())

    async def model_card(self, model_id: str) -> JSONResponse:
        """``GET /v1/models/{id}``: the served model's card, or 404."""
        self._check_model(model_id)
        return JSONResponse(self._card(), headers=self._headers())

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    # -- generation
    def _check_model(self, model: str) -> None:
        if model != self.model:
            raise OpenAIError(f"model {model!r} is not served here (serving {self.model!r})", "model",
                              status=404, etype="model_not_found")

    def _engine_request(self, req: OpenAIRequest, ids: list[int], request_id: str) -> EngineRequest:
        return EngineRequest(
            request_id=request_id, prompt_token_ids=ids,
            max_tokens=req.max_tokens if req.max_tokens is not None else (
                self.default_max_tokens or max(1, self.engine.info().max_model_len - len(ids))),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed, stop_token_ids=req.stop_token_ids,
            ignore_eos=bool(req.ignore_eos), cache_salt=req.cache_salt, session_id=req.session_id,
            tools=req.chat_request.tools if _tools_active(req) else None,
            tool_choice=req.chat_request.effective_tool_choice if _tools_active(req) else None,
            parallel_tool_calls=_parallel(req), structured_outputs=req.structured_outputs, **req.knobs,
            # A chat answer: an engine with a reasoning parser splits off its reasoning.
            reasoning=req.chat,
            chat_template_kwargs=(req.chat_request.rendered_kwargs or None) if req.chat_request else None,
        )

    async def _handle(self, request: Request, chat: bool) -> Response:
        body = await read_json(request, MAX_BODY_BYTES)
        req = parse_chat(body, request.headers) if chat else parse_completion(body, request.headers)
        self._check_model(req.model)
        ids = prompt_ids(req, self.tokenizer, self.renderer)
        if req.stop and self.tokenizer is None:
            raise BadRequest("'stop' strings need a tokenizer on this worker; use 'stop_token_ids'", "stop")
        answer = Answer(chat=chat, model=self.model, id=request.headers.get("x-request-id", ""))
        # The engine knows the request by an id of its own (kvmesh.request_ids): a client may
        # reuse an x-request-id, and a gateway retries a dropped try under the same one.
        ereq = self._engine_request(req, ids, engine_request_id(answer.id))
        if req.stream:
            agen = self._run(ereq, req.stop)
            # Pull the first item before answering, so validation errors become
            # a 4xx status instead of an error inside a 200 event stream.
            try:
                first = await agen.__anext__()
            except StopAsyncIteration:
                first = None
            except EngineError as exc:
                raise _engine_error(exc) from None
            return sse.sse_response(self._events(agen, first, answer, len(ids), req.include_usage,
                                                 hold=_tools_active(req), parallel=_parallel(req),
                                                 engine_id=ereq.request_id, reasoning=req.include_reasoning),
                                    headers=self._headers())
        parent = propagate.extract(dict(request.headers))
        return JSONResponse(await self._collect(ereq, req.stop, answer, parent, _parallel(req), req.include_reasoning),
                            headers=self._headers())

    async def _run(self, req: EngineRequest, stops: list[str]) -> AsyncIterator[tuple[list[int], str, EngineOutput]]:
        """Yield (new token ids, new text, output); applies ``stop`` strings on the decoded text."""
        ids: list[int] = []
        detok = IncrementalDetokenizer(self.tokenizer)
        longest = max((len(s) for s in stops), default=0)
        gen = self.engine.generate(req)
        try:
            async for out in gen:
                ids.extend(out.new_token_ids)
                delta = detok.push(out.new_token_ids, final=out.finished)
                if stops and delta:
                    # A stop string may start in text sent before: look back its length, no further.
                    sent = len(detok.text) - len(delta)
                    start = max(0, sent - longest + 1)
                    cut = min((i for i in (detok.text.find(s, start) for s in stops) if i >= 0), default=-1)
                    if cut >= 0:
                        out.finished = True
                        out.finish_reason = "stop"
                        if out.num_output_tokens == 0:
                            out.num_output_tokens = len(ids)
                        await self.engine.abort(req.request_id)
                        yield out.new_token_ids, detok.text[sent:cut] if cut > sent else "", out
                        return
                yield out.new_token_ids, delta, out
                if out.finished:
                    return
        finally:
            aclose = getattr(gen, "aclose", None)
            if aclose is not None:
                await aclose()

    @staticmethod
    def _usage(out: EngineOutput, n_prompt: int, n_out: int) -> dict[str, Any]:
        return usage(out.num_prompt_tokens or n_prompt, out.num_output_tokens or n_out, out.num_cached_tokens)

    async def _collect(self, ereq: EngineRequest, stops: list[str], answer: Answer, parent: Any = None,
                       parallel: bool = True, include_reasoning: bool = True) -> dict[str, Any]:
        t0 = time.perf_counter()
        ids: list[int] = []
        text = ""
        last: EngineOutput | None = None
        ttft: float | None = None
        # The span continues the caller's trace (e.g. the gateway's request, whose
        # traceparent the endpoint picker set).
        with _tracer.start_as_current_span("worker.http " + answer.object, context=parent,
                                           kind=trace.SpanKind.SERVER) as span:
            try:
                async for new_ids, delta, out in self._run(ereq, stops):
                    ids.extend(new_ids)
                    text += delta
                    last = out
                    if ttft is None and out.ttft_s is not None:
                        ttft = out.ttft_s
            except EngineError as exc:
                raise _engine_error(exc) from None
            assert last is not None
            use = self._usage(last, len(ereq.prompt_token_ids), len(ids))
            span.set_attribute("gen_ai.request.model", self.model)
            span.set_attribute("gen_ai.request.id", answer.id)
            span.set_attribute("gen_ai.usage.input_tokens", use["prompt_tokens"])
            span.set_attribute("gen_ai.usage.output_tokens", use["completion_tokens"])
            span.set_attribute("gen_ai.usage.cached_tokens", last.num_cached_tokens)
            span.set_attribute("kvmesh.endpoint_id", self.endpoint_id)
            if ttft is not None:
                span.set_attribute("gen_ai.latency.time_to_first_token", ttft)
        log.debug("http request done", extra={"request_id": answer.id,
                                              "ms": round(1000 * (time.perf_counter() - t0), 2)})
        if last.tool_calls or last.reasoning is not None:   # the engine's parse: text that is not a call
            text = last.content or ""
        if last.reasoning is not None:   # as vLLM's server with a reasoning parser
            use["completion_tokens_details"] = {"reasoning_tokens": last.num_reasoning_tokens}
        return answer.response(text, ids, last.finish_reason or "stop", use, tool_calls=tool_calls(last.tool_calls or [], parallel),
                               reasoning=last.reasoning if include_reasoning else None,
                               kvmesh={"endpoint": self.endpoint_id})

    async def _events(self, agen: AsyncIterator[tuple[list[int], str, EngineOutput]],
                      first: tuple[list[int], str, EngineOutput] | None, answer: Answer, n_prompt: int,
                      include_usage: bool, hold: bool = False, parallel: bool = True,
                      engine_id: str = "", reasoning: bool = True) -> AsyncIterator[bytes]:
        """``hold``: the answer may be a tool call, so its text is sent once the engine has parsed it.
        An engine with a reasoning parser sends its chat answers parsed (``out.reasoning`` at the end,
        ``out.delta`` as it streams): the reasoning goes out as ``reasoning`` deltas (unless
        ``reasoning`` is false, vLLM's ``include_reasoning``), the text as the parse's content."""
        n_out = 0
        held: list[str] = []
        last: EngineOutput | None = None
        try:
            items = [first] if first is not None else []
            first_chunk = True
            while True:
                for new_ids, delta, out in items:
                    n_out += len(new_ids)
                    last = out
                    finish = (out.finish_reason or "stop") if out.finished else None
                    if out.delta is not None and reasoning and out.delta.reasoning:
                        yield sse.event(answer.reasoning_chunk(out.delta.reasoning, first_chunk))
                        first_chunk = False
                    if out.delta is not None and not hold:
                        delta = out.delta.content   # a reasoning parser's reading, not the decoded tokens
                    if hold:
                        held.append(delta)
                        if not finish:
                            continue
                        text = (out.content or "") if out.tool_calls or out.reasoning is not None else "".join(held)
                        if text:
                            yield sse.event(answer.chunk(text, None, None, first_chunk))
                            first_chunk = False
                        if out.tool_calls:
                            yield sse.event(answer.tool_calls_chunk(tool_calls(out.tool_calls or [], parallel), first_chunk))
                            first_chunk = False
                        yield sse.event(answer.chunk("", new_ids, finish, first_chunk))
                        continue
                    if new_ids or delta or finish:
                        yield sse.event(answer.chunk(delta, new_ids, finish, first_chunk))
                        first_chunk = False
                if last is not None and last.finished:
                    break
                try:
                    items = [await agen.__anext__()]
                except StopAsyncIteration:
                    break
            if include_usage and last is not None:
                yield sse.event(answer.usage_chunk(self._usage(last, n_prompt, n_out)))
        except EngineError as exc:
            yield sse.event(_engine_error(exc).body())
        except asyncio.CancelledError:
            await self.engine.abort(engine_id or answer.id)   # the engine knows it by its own id
            raise
        yield sse.DONE


# --------------------------------------------------------------------------- server


class HttpApiServer:
    """uvicorn serving a ``WorkerHttpApi`` on the current asyncio loop.

    ``tls``: serve HTTPS with that identity (``kvmesh.http_tls``); every path but ``/health``
    then needs a client certificate with a role in ``client_roles`` (``/metrics`` also ``monitor``).
    """

    def __init__(self, api: WorkerHttpApi, host: str, port: int, tls: TlsConfig | None = None,
                 client_roles: frozenset[str] = DEFAULT_CLIENT_ROLES) -> None:
        import uvicorn
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        self.api = api
        self.host = host
        self.https = tls is not None
        app: Any = api.app
        extra: dict[str, Any] = {}
        if tls is not None:
            ssl_ctx = ServerSsl(tls).ctx
            self.guard = RequireRoles(api.app, client_roles, tls.tls_trust_domain,
                                      extra={"/metrics": frozenset({"monitor"})})
            app = self.guard
            extra = {"http": peer_aware(HttpToolsProtocol), "ssl_context_factory": lambda _cfg, _default: ssl_ctx}
        self._config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                      lifespan="off", timeout_graceful_shutdown=5, **extra)
        self._server = uvicorn.Server(self._config)
        self._server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # the worker owns signals
        self._task: asyncio.Task[None] | None = None
        self.port = port

    async def start(self, timeout_s: float = 10.0) -> int:
        self._task = asyncio.create_task(self._server.serve())
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._task.done():
                exc = self._task.exception()
                raise RuntimeError(f"worker HTTP API failed to start on {self.host}:{self.port}: {exc}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker HTTP API not up on {self.host}:{self.port} after {timeout_s}s")
            await asyncio.sleep(0.02)
        servers = getattr(self._server, "servers", [])
        for srv in servers:
            for sock in srv.sockets:
                self.port = sock.getsockname()[1]
                break
        log.info("worker http api started", extra={"host": self.host, "port": self.port,
                                                   "endpoint": self.api.endpoint_id})
        return self.port

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, timeout=10)
        except (TimeoutError, asyncio.CancelledError):
            self._task.cancel()
        self._task = None


async def start_http_api(engine: Engine, *, host: str = "127.0.0.1", port: int = 0, model: str = "",
                         tokenizer: Tokenizer | str | None = None, endpoint_id: str = "",
                         default_max_tokens: int = 0, metrics: MetricsPage | None = None,
                         tls: TlsConfig | None = None,
                         client_roles: frozenset[str] = DEFAULT_CLIENT_ROLES) -> HttpApiServer:
    """Start the worker's OpenAI HTTP API; returns the running server (``.port``, ``.stop()``).

    ``tokenizer`` is a loaded tokenizer or a HF tokenizer directory ('' / None =
    token-id prompts only). ``port=0`` binds a free port.
    """
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    api = WorkerHttpApi(engine, model=model, tokenizer=tok, endpoint_id=endpoint_id,
                        default_max_tokens=default_max_tokens, metrics=metrics)
    server = HttpApiServer(api, host, port, tls, client_roles)
    await server.start()
    return server
