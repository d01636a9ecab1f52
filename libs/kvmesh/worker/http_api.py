"""OpenAI-compatible HTTP API of a worker (``/v1/completions``, ``/v1/chat/completions``).

Why it exists: behind an Envoy gateway (Gateway API Inference Extension) the
workers are the InferencePool's endpoints, and the gateway forwards the
client's OpenAI request to the endpoint the kvmesh router picked. So a worker
must answer plain OpenAI HTTP itself, next to its gRPC ``Worker`` service.

It talks to the engine only through ``kvmesh.worker.engine.base.Engine`` (token ids in,
token deltas out). Text prompts and chat messages need a tokenizer (a
Hugging Face tokenizer directory, the same one the router uses); token-id
prompts work without one. Every answer carries ``x-kvmesh-endpoint`` so a
client or a test can see which worker served it.

Started by ``kvmesh.worker`` (``run_worker``) when ``http_port`` is set; it runs
a uvicorn server on the worker's own asyncio loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import propagate, trace

from kvmesh.worker.engine.base import Engine, EngineError, EngineOutput, EngineRequest

log = logging.getLogger(__name__)
_tracer = trace.get_tracer(__name__)

ENDPOINT_HEADER = "x-kvmesh-endpoint"
SESSION_HEADER = "x-session-id"
MAX_BODY_BYTES = 8 * 1024 * 1024


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the API uses."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kw: Any) -> Any: ...


@dataclass
class HttpApiConfig:
    """Where the worker's OpenAI HTTP API listens and how it answers."""

    host: str = field(default="0.0.0.0", metadata={"help": "HTTP listen host"})
    port: int = field(default=0, metadata={"help": "HTTP listen port (0 = disabled)"})
    default_max_tokens: int = field(default=16, metadata={"help": "max_tokens when the request omits it"})
    tokenizer: str = field(default="", metadata={"help": "HF tokenizer dir for text/chat prompts ('' = token ids only)"})


class ApiError(Exception):
    """An OpenAI-style error answer: HTTP status, message naming the problem, error type."""

    def __init__(self, status: int, message: str, etype: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.etype = etype
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.etype, "param": self.param,
                          "code": self.status}}


def load_tokenizer(path: str) -> Tokenizer | None:
    """Load a HF tokenizer directory offline; '' means no tokenizer."""
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


# --------------------------------------------------------------------------- request parsing


def _num(body: dict[str, Any], key: str, kind: type, default: Any, *, lo: float | None = None,
         hi: float | None = None, lo_open: bool = False) -> Any:
    val = body.get(key)
    if val is None:
        return default
    if isinstance(val, bool) or not isinstance(val, (int, float)) or (kind is int and not isinstance(val, int)):
        raise ApiError(400, f"'{key}' must be {'an integer' if kind is int else 'a number'}, got {val!r}", param=key)
    if lo is not None and (val <= lo if lo_open else val < lo):
        raise ApiError(400, f"'{key}' must be {'>' if lo_open else '>='} {lo}, got {val}", param=key)
    if hi is not None and val > hi:
        raise ApiError(400, f"'{key}' must be <= {hi}, got {val}", param=key)
    return kind(val)


@dataclass
class ParsedRequest:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stream: bool
    include_usage: bool
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    cache_salt: str
    session_id: str


def _parse_common(body: dict[str, Any], prompt_ids: list[int], default_max_tokens: int,
                  session_header: str) -> ParsedRequest:
    max_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _num(body, max_key, int, default_max_tokens, lo=1)
    n = _num(body, "n", int, 1, lo=1)
    if n != 1:
        raise ApiError(400, "'n' must be 1: one completion per request", param="n")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stops = list(stop)
    else:
        raise ApiError(400, "'stop' must be a string or a list of at most 4 strings", param="stop")
    stops = [s for s in stops if s]
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise ApiError(400, "'stop_token_ids' must be a list of integers", param="stop_token_ids")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    salt = body.get("cache_salt", "")
    if not isinstance(salt, str):
        raise ApiError(400, "'cache_salt' must be a string", param="cache_salt")
    user = body.get("user", "")
    session = session_header or (user if isinstance(user, str) else "")
    return ParsedRequest(
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        temperature=_num(body, "temperature", float, 1.0, lo=0.0, hi=2.0),
        top_p=_num(body, "top_p", float, 1.0, lo=0.0, hi=1.0, lo_open=True),
        seed=_num(body, "seed", int, None),
        stream=stream,
        include_usage=bool(opts.get("include_usage", False)),
        stop=stops,
        stop_token_ids=list(stop_ids),
        ignore_eos=bool(body.get("ignore_eos", False)),
        cache_salt=salt,
        session_id=session,
    )


def _is_token_list(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def completion_prompt_ids(body: dict[str, Any], tokenizer: Tokenizer | None) -> list[int]:
    """``prompt``: a string, a list of token ids, or a one-element list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _is_token_list(prompt[0])):
        prompt = prompt[0]
    if _is_token_list(prompt):
        return list(prompt)
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' is empty", param="prompt")
        if tokenizer is None:
            raise ApiError(400, "this worker has no tokenizer: send 'prompt' as a list of token ids",
                           param="prompt")
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    if prompt is None:
        raise ApiError(400, "'prompt' is required", param="prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt):
        raise ApiError(400, "batched prompts are not supported: send one prompt per request", param="prompt")
    raise ApiError(400, "'prompt' must be a non-empty string or list of token ids", param="prompt")


def chat_prompt_ids(body: dict[str, Any], tokenizer: Tokenizer | None) -> list[int]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of parts", param="messages")
    if tokenizer is None:
        raise ApiError(400, "this worker has no tokenizer: chat needs one (use /v1/completions with token ids)",
                       param="messages")
    tools = body.get("tools")
    kw: dict[str, Any] = {"add_generation_prompt": True, "tokenize": True}
    if tools:
        kw["tools"] = tools
    try:
        ids = tokenizer.apply_chat_template(msgs, **kw)
    except Exception as exc:  # the template rejects the conversation
        raise ApiError(400, f"cannot render the chat template: {exc}", param="messages") from exc
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


# --------------------------------------------------------------------------- app


class WorkerHttpApi:
    """The FastAPI app over one engine."""

    def __init__(self, engine: Engine, *, model: str = "", tokenizer: Tokenizer | None = None,
                 endpoint_id: str = "", default_max_tokens: int = 16) -> None:
        self.engine = engine
        info = engine.info()
        self.model = model or info.model
        self.tokenizer = tokenizer
        self.endpoint_id = endpoint_id or "worker"
        self.default_max_tokens = default_max_tokens
        self.app = self._build()

    # -- helpers
    def _headers(self) -> dict[str, str]:
        return {ENDPOINT_HEADER: self.endpoint_id}

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "'model' is required", param="model")
        if model != self.model:
            raise ApiError(404, f"model {model!r} is not served here (serving {self.model!r})",
                           etype="model_not_found", param="model")

    def _detok(self, ids: list[int]) -> str:
        if self.tokenizer is None or not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _engine_request(self, p: ParsedRequest, request_id: str) -> EngineRequest:
        return EngineRequest(
            request_id=request_id, prompt_token_ids=p.prompt_ids, max_tokens=p.max_tokens,
            temperature=p.temperature, top_p=p.top_p, seed=p.seed, stop_token_ids=p.stop_token_ids,
            ignore_eos=p.ignore_eos, cache_salt=p.cache_salt, session_id=p.session_id,
        )

    async def _run(self, req: EngineRequest, stops: list[str]) -> AsyncIterator[tuple[list[int], str, EngineOutput]]:
        """Yield (new token ids, new text, output); applies ``stop`` strings on the decoded text."""
        ids: list[int] = []
        sent_text = ""
        gen = self.engine.generate(req)
        try:
            async for out in gen:
                ids.extend(out.new_token_ids)
                text = self._detok(ids) if self.tokenizer is not None else ""
                if stops and text:
                    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
                    if cut >= 0:
                        delta = text[len(sent_text):cut] if cut > len(sent_text) else ""
                        out.finished = True
                        out.finish_reason = "stop"
                        if out.num_output_tokens == 0:
                            out.num_output_tokens = len(ids)
                        await self.engine.abort(req.request_id)
                        yield out.new_token_ids, delta, out
                        return
                delta = text[len(sent_text):]
                sent_text = text
                yield out.new_token_ids, delta, out
                if out.finished:
                    return
        finally:
            aclose = getattr(gen, "aclose", None)
            if aclose is not None:
                await aclose()

    @staticmethod
    def _usage(out: EngineOutput, n_prompt: int, n_out: int) -> dict[str, Any]:
        prompt = out.num_prompt_tokens or n_prompt
        completion = out.num_output_tokens or n_out
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}

    # -- app
    def _build(self) -> FastAPI:
        app = FastAPI(title="kvmesh worker", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(ApiError)
        async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
            return JSONResponse(exc.body(), status_code=exc.status, headers=self._headers())

        @app.get("/health")
        async def health() -> JSONResponse:
            ok = self.engine.healthy
            return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503,
                                headers=self._headers())

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            info = self.engine.info()
            return JSONResponse({"object": "list", "data": [{
                "id": self.model, "object": "model", "created": 0, "owned_by": "kvmesh",
                "max_model_len": info.max_model_len}]}, headers=self._headers())

        async def read_body(request: Request) -> dict[str, Any]:
            raw = await request.body()
            if len(raw) > MAX_BODY_BYTES:
                raise ApiError(413, f"request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}")
            try:
                body = json.loads(raw or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ApiError(400, f"request body is not valid JSON: {exc}") from None
            if not isinstance(body, dict):
                raise ApiError(400, "request body must be a JSON object")
            return body

        async def handle(request: Request, chat: bool) -> Any:
            body = await read_body(request)
            self._check_model(body)
            ids = chat_prompt_ids(body, self.tokenizer) if chat else completion_prompt_ids(body, self.tokenizer)
            parsed = _parse_common(body, ids, self.default_max_tokens, request.headers.get(SESSION_HEADER, ""))
            if parsed.stop and self.tokenizer is None:
                raise ApiError(400, "'stop' strings need a tokenizer on this worker; use 'stop_token_ids'",
                               param="stop")
            rid = request.headers.get("x-request-id") or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            ereq = self._engine_request(parsed, rid)
            kind = "chat.completion" if chat else "text_completion"
            if parsed.stream:
                agen = self._run(ereq, parsed.stop)
                # Pull the first item before answering, so validation errors become
                # a 4xx status instead of an error inside a 200 event stream.
                try:
                    first = await agen.__anext__()
                except StopAsyncIteration:
                    first = None
                except EngineError as exc:
                    raise ApiError(exc.http_status, str(exc), etype=type(exc).__name__) from None
                return StreamingResponse(self._sse(agen, first, rid, kind, parsed), media_type="text/event-stream",
                                         headers=self._headers())
            parent = propagate.extract(dict(request.headers))
            return JSONResponse(await self._collect(ereq, parsed, rid, kind, parent), headers=self._headers())

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Any:
            return await handle(request, chat=True)

        return app

    async def _collect(self, ereq: EngineRequest, p: ParsedRequest, rid: str, kind: str,
                       parent: Any = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        ids: list[int] = []
        text = ""
        last: EngineOutput | None = None
        ttft: float | None = None
        # The span continues the caller's trace (e.g. the gateway's request, whose
        # traceparent the endpoint picker set).
        with _tracer.start_as_current_span("worker.http " + kind, context=parent,
                                           kind=trace.SpanKind.SERVER) as span:
            try:
                async for new_ids, delta, out in self._run(ereq, p.stop):
                    ids.extend(new_ids)
                    text += delta
                    last = out
                    if ttft is None and out.ttft_s is not None:
                        ttft = out.ttft_s
            except EngineError as exc:
                raise ApiError(exc.http_status, str(exc), etype=type(exc).__name__) from None
            assert last is not None
            usage = self._usage(last, len(p.prompt_ids), len(ids))
            span.set_attribute("gen_ai.request.model", self.model)
            span.set_attribute("gen_ai.request.id", rid)
            span.set_attribute("gen_ai.usage.input_tokens", usage["prompt_tokens"])
            span.set_attribute("gen_ai.usage.output_tokens", usage["completion_tokens"])
            span.set_attribute("gen_ai.usage.cached_tokens", last.num_cached_tokens)
            span.set_attribute("kvmesh.endpoint_id", self.endpoint_id)
            if ttft is not None:
                span.set_attribute("gen_ai.latency.time_to_first_token", ttft)
        finish = last.finish_reason or "stop"
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None, "token_ids": ids}
        if kind == "chat.completion":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        log.debug("http request done", extra={"request_id": rid, "ms": round(1000 * (time.perf_counter() - t0), 2)})
        return {"id": rid, "object": kind, "created": int(time.time()), "model": self.model,
                "choices": [choice], "usage": usage, "kvmesh": {"endpoint": self.endpoint_id}}

    async def _sse(self, agen: AsyncIterator[tuple[list[int], str, EngineOutput]],
                   first: tuple[list[int], str, EngineOutput] | None, rid: str, kind: str,
                   p: ParsedRequest) -> AsyncIterator[bytes]:
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
        created = int(time.time())
        n_out = 0
        last: EngineOutput | None = None

        def event(doc: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps(doc).encode() + b"\n\n"

        def chunk(ids: list[int], delta: str, finish: str | None, first_chunk: bool) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None, "token_ids": ids}
            if chunk_kind == "chat.completion.chunk":
                d: dict[str, Any] = {"content": delta}
                if first_chunk:
                    d["role"] = "assistant"
                choice["delta"] = d
            else:
                choice["text"] = delta
            return {"id": rid, "object": chunk_kind, "created": created, "model": self.model, "choices": [choice]}

        try:
            items = [first] if first is not None else []
            first_chunk = True
            while True:
                for new_ids, delta, out in items:
                    n_out += len(new_ids)
                    last = out
                    finish = (out.finish_reason or "stop") if out.finished else None
                    if new_ids or delta or finish:
                        yield event(chunk(new_ids, delta, finish, first_chunk))
                        first_chunk = False
                if last is not None and last.finished:
                    break
                try:
                    items = [await agen.__anext__()]
                except StopAsyncIteration:
                    break
            if p.include_usage and last is not None:
                yield event({"id": rid, "object": chunk_kind, "created": created, "model": self.model,
                             "choices": [], "usage": self._usage(last, len(p.prompt_ids), n_out)})
        except EngineError as exc:
            yield event({"error": {"message": str(exc), "type": type(exc).__name__, "code": exc.http_status}})
        except asyncio.CancelledError:
            await self.engine.abort(rid)
            raise
        yield b"data: [DONE]\n\n"


# --------------------------------------------------------------------------- server


class HttpApiServer:
    """uvicorn serving a ``WorkerHttpApi`` on the current asyncio loop."""

    def __init__(self, api: WorkerHttpApi, host: str, port: int) -> None:
        import uvicorn

        self.api = api
        self.host = host
        self._config = uvicorn.Config(api.app, host=host, port=port, log_level="warning", access_log=False,
                                      lifespan="off", timeout_graceful_shutdown=5)
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


async def start_http_api(engine: Engine, *, host: str = "0.0.0.0", port: int = 0, model: str = "",
                         tokenizer: Tokenizer | str | None = None, endpoint_id: str = "",
                         default_max_tokens: int = 16) -> HttpApiServer:
    """Start the worker's OpenAI HTTP API; returns the running server (``.port``, ``.stop()``).

    ``tokenizer`` is a loaded tokenizer or a HF tokenizer directory ('' / None =
    token-id prompts only). ``port=0`` binds a free port.
    """
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    api = WorkerHttpApi(engine, model=model, tokenizer=tok, endpoint_id=endpoint_id,
                        default_max_tokens=default_max_tokens)
    server = HttpApiServer(api, host, port)
    await server.start()
    return server
