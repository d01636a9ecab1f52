"""OpenAI-compatible HTTP front door (FastAPI), served by uvicorn in the router's event loop.

``/v1/completions`` and ``/v1/chat/completions`` (streaming SSE ending in
``[DONE]``, and non-streaming), ``/v1/models``, ``/health``. Usage carries
``prompt_tokens_details.cached_tokens``; the routing decision is added under
a ``kvmesh`` key. Errors use OpenAI's body shape
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from google.protobuf.json_format import MessageToDict
from opentelemetry import propagate

from kvmesh_api.common.v1 import common_pb2
from kvmesh_router import metrics
from kvmesh_router.errors import BadRequest, RouterError
from kvmesh_router.service import FinalInfo, GenInput, RouterService

log = logging.getLogger(__name__)

_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
           common_pb2.FINISH_REASON_ABORT: "abort", common_pb2.FINISH_REASON_ERROR: "error"}


def error_body(status: int, message: str, etype: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": etype, "param": param, "code": status}})


def _err(exc: RouterError) -> JSONResponse:
    return error_body(exc.http_status, exc.message, exc.error_type, exc.param)


def _num(body: dict[str, Any], name: str, kind: type = float) -> Any:
    v = body.get(name)
    if v is None:
        return None
    ok = isinstance(v, int) if kind is int else isinstance(v, (int, float))
    if not ok or isinstance(v, bool):
        raise BadRequest(f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {v!r}", name)
    return v


def _str(body: dict[str, Any], name: str) -> str:
    v = body.get(name)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise BadRequest(f"'{name}' must be a string", name)
    return v


def _sampling(body: dict[str, Any], inp: GenInput) -> None:
    s = inp.sampling
    mt = _num(body, "max_tokens", int)
    if mt is None:
        mt = _num(body, "max_completion_tokens", int)
    if mt is not None:
        if mt < 1:
            raise BadRequest(f"'max_tokens' must be >= 1, got {mt}", "max_tokens")
        s.max_tokens = mt
    t = _num(body, "temperature")
    if t is not None:
        s.temperature = float(t)
        if not 0 <= t <= 2:
            raise BadRequest(f"'temperature' must be in [0, 2], got {t}", "temperature")
    tp = _num(body, "top_p")
    if tp is not None:
        if not 0 < tp <= 1:
            raise BadRequest(f"'top_p' must be in (0, 1], got {tp}", "top_p")
        s.top_p = float(tp)
    seed = _num(body, "seed", int)
    if seed is not None:
        s.seed = seed
    n = _num(body, "n", int)
    if n is not None and n != 1:
        raise BadRequest("'n' must be 1 (one choice per request)", "n")
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
            raise BadRequest("'stop' must be a string or a list of strings", "stop")
        s.stop.extend(stops)
    if body.get("ignore_eos") is not None:
        if not isinstance(body["ignore_eos"], bool):
            raise BadRequest("'ignore_eos' must be a boolean", "ignore_eos")
        s.ignore_eos = body["ignore_eos"]
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be a boolean", "stream")


class _Detok:
    """Incremental detokenization: emit only text that is final (no half UTF-8 sequence)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.sent = 0

    def push(self, ids: list[int]) -> str:
        if self.tok is None:
            return ""
        self.ids.extend(ids)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta = text[self.sent:]
        self.sent = len(text)
        return delta


def build_app(service: RouterService) -> FastAPI:
    cfg = service.cfg
    app = FastAPI(title="kvmesh router", docs_url=None, redoc_url=None)

    async def read_json(request: Request) -> dict[str, Any]:
        clen = request.headers.get("content-length")
        if clen and clen.isdigit() and int(clen) > cfg.max_text_bytes:
            raise BadRequest(f"request body over {cfg.max_text_bytes} bytes", "body")
        raw = await request.body()
        if len(raw) > cfg.max_text_bytes:
            raise BadRequest(f"request body over {cfg.max_text_bytes} bytes", "body")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(f"malformed JSON body: {exc}", "body") from None
        if not isinstance(body, dict):
            raise BadRequest("the JSON body must be an object", "body")
        return body

    def common(body: dict[str, Any], request: Request) -> GenInput:
        if "model" not in body:
            raise BadRequest("'model' is required", "model")
        inp = GenInput(model=_str(body, "model"))
        _sampling(body, inp)
        inp.cache_salt = _str(body, "cache_salt")
        inp.session_id = _str(body, "session_id") or request.headers.get("x-session-id", "")
        inp.lora_name = _str(body, "lora_name")
        inp.policy = _str(body, "kvmesh_policy") or request.headers.get("x-kvmesh-policy", "")
        inp.request_id = request.headers.get("x-request-id", "")
        inp.trace_context = propagate.extract(dict(request.headers))
        inp.tenant = request.headers.get(cfg.tenant_header, "")
        auth = request.headers.get("authorization", "")
        inp.api_key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        return inp

    def usage_dict(fin: FinalInfo) -> dict[str, Any]:
        u = fin.usage
        return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                "total_tokens": u.prompt_tokens + u.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": u.cached_tokens,
                                          "cached_tokens_gpu": u.cached_tokens_gpu,
                                          "cached_tokens_offload": u.cached_tokens_offload}}

    def routing_dict(fin: FinalInfo) -> dict[str, Any]:
        return MessageToDict(fin.routing, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)

    def watch_disconnect(request: Request, inp: GenInput) -> tuple[asyncio.Task, dict[str, bool]]:
        """Cancel the worker call when the HTTP client goes away (uvicorn does not cancel us)."""
        state = {"gone": False}

        async def watch() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(0.1)
            state["gone"] = True
            log.debug("client disconnected; cancelling the worker call", extra={"calls": len(inp.calls)})
            for call in list(inp.calls):
                call.cancel()

        return asyncio.create_task(watch()), state

    async def run(request: Request, inp: GenInput, chat: bool, stream: bool, include_usage: bool):
        api = "chat" if chat else "completions"
        oid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        gen = service.generate(inp)
        detok = _Detok(service.tokenizer)

        def choice(text: str, finish: str | None, final: bool) -> dict[str, Any]:
            if chat:
                key = "message" if final else "delta"
                return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish,
                        "logprobs": None}
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

        if not stream:
            ids: list[int] = []
            fin: FinalInfo | None = None
            watcher, state = watch_disconnect(request, inp)
            try:
                async for kind, item in gen:
                    if kind == "chunk":
                        ids.extend(item)
                    else:
                        fin = item
            except RouterError as exc:
                metrics.REQUESTS.labels(api=api, outcome=type(exc).__name__).inc()
                return _err(exc)
            except asyncio.CancelledError:
                if not state["gone"]:
                    raise
                metrics.REQUESTS.labels(api=api, outcome="client_gone").inc()
                return error_body(499, "client closed the request", "client_closed")
            finally:
                watcher.cancel()
            assert fin is not None
            metrics.REQUESTS.labels(api=api, outcome="ok").inc()
            text = service.tokenizer.decode(ids) if service.tokenizer is not None else ""
            return JSONResponse({"id": oid, "object": obj, "created": created, "model": inp.model,
                                 "choices": [{**choice(text, _FINISH.get(fin.finish_reason, "stop"), True),
                                              "token_ids": ids}],
                                 "usage": usage_dict(fin), "kvmesh": routing_dict(fin)})

        # Streaming: pull the first item before answering 200 so that validation and
        # routing errors still get a proper status code and error body.
        first: tuple[str, Any] | None
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            first = None
        except RouterError as exc:
            metrics.REQUESTS.labels(api=api, outcome=type(exc).__name__).inc()
            return _err(exc)
        cobj = "chat.completion.chunk" if chat else "text_completion"

        def sse(doc: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps(doc).encode() + b"\n\n"

        async def events() -> AsyncIterator[bytes]:
            items = [first] if first is not None else []
            watcher, state = watch_disconnect(request, inp)
            try:
                async def all_items():
                    for it in items:
                        yield it
                    async for it in gen:
                        yield it

                async for kind, item in all_items():
                    if kind == "chunk":
                        delta = detok.push(item)
                        doc = {"id": oid, "object": cobj, "created": created, "model": inp.model,
                               "choices": [{**choice(delta, None, False), "token_ids": item}]}
                        yield sse(doc)
                    else:
                        fin = item
                        doc = {"id": oid, "object": cobj, "created": created, "model": inp.model,
                               "choices": [choice("", _FINISH.get(fin.finish_reason, "stop"), False)],
                               "kvmesh": routing_dict(fin)}
                        if include_usage:
                            doc["usage"] = usage_dict(fin)
                        yield sse(doc)
                        if include_usage:
                            yield sse({"id": oid, "object": cobj, "created": created, "model": inp.model,
                                       "choices": [], "usage": usage_dict(fin)})
                metrics.REQUESTS.labels(api=api, outcome="ok").inc()
            except RouterError as exc:
                metrics.REQUESTS.labels(api=api, outcome=type(exc).__name__).inc()
                yield sse({"error": {"message": exc.message, "type": exc.error_type, "param": exc.param,
                                     "code": exc.http_status}})
            except asyncio.CancelledError:
                if not state["gone"]:
                    raise
                metrics.REQUESTS.labels(api=api, outcome="client_gone").inc()
                return
            finally:
                watcher.cancel()
                await gen.aclose()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
        so = body.get("stream_options") or {}
        if not isinstance(so, dict):
            raise BadRequest("'stream_options' must be an object", "stream_options")
        return bool(body.get("stream")), bool(so.get("include_usage"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await read_json(request)
            inp = common(body, request)
            if "prompt" not in body:
                raise BadRequest("'prompt' is required", "prompt")
            prompt = body["prompt"]
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                inp.text = prompt
            elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                inp.tokens = list(prompt)
            else:
                raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)",
                                 "prompt")
            if body.get("echo"):
                raise BadRequest("'echo' is not supported", "echo")
            stream, include_usage = stream_flags(body)
        except RouterError as exc:
            metrics.REQUESTS.labels(api="completions", outcome=type(exc).__name__).inc()
            return _err(exc)
        return await run(request, inp, False, stream, include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            body = await read_json(request)
            inp = common(body, request)
            msgs = body.get("messages")
            if msgs is None:
                raise BadRequest("'messages' is required", "messages")
            if not isinstance(msgs, list) or not msgs:
                raise BadRequest("'messages' must be a non-empty list", "messages")
            out = []
            for i, m in enumerate(msgs):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                    raise BadRequest(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
                content = m.get("content")
                if isinstance(content, list):
                    parts = []
                    for part in content:
                        if not isinstance(part, dict) or part.get("type") != "text":
                            raise BadRequest(f"messages[{i}].content: only text parts are supported",
                                             f"messages[{i}].content")
                        parts.append(str(part.get("text", "")))
                    content = "".join(parts)
                elif content is None:
                    content = ""
                elif not isinstance(content, str):
                    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts",
                                     f"messages[{i}].content")
                out.append({**{k: v for k, v in m.items() if k != "content"}, "content": content})
            inp.chat = out
            agp = body.get("add_generation_prompt", True)
            inp.add_generation_prompt = bool(agp)
            stream, include_usage = stream_flags(body)
        except RouterError as exc:
            metrics.REQUESTS.labels(api="chat", outcome=type(exc).__name__).inc()
            return _err(exc)
        return await run(request, inp, True, stream, include_usage)

    @app.get("/v1/models")
    async def models():
        eps = [e.endpoint_id for e in service.core.decode_endpoints(cfg.model)]
        return {"object": "list", "data": [{"id": cfg.model, "object": "model", "created": 0, "owned_by": "kvmesh",
                                            "max_model_len": cfg.max_model_len, "endpoints": eps}]}

    @app.get("/health")
    async def health():
        n = service.cluster.live_decode_count()
        status = 200 if n > 0 else 503
        return JSONResponse(status_code=status, content={"status": "ok" if n else "no live endpoint",
                                                         "live_endpoints": n,
                                                         "indexer_up": service.cluster.indexer_up})

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception):
        return error_body(404, f"no route {request.url.path}", "invalid_request_error")

    @app.exception_handler(405)
    async def bad_method(request: Request, exc: Exception):
        return error_body(405, f"method {request.method} not allowed on {request.url.path}", "invalid_request_error")

    return app
