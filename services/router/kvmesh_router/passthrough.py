"""OpenAI requests to external engines: route precisely, then forward the body as it came.

A plain ``vllm serve`` does everything a client may ask (tools and their parser,
structured output, logprobs, penalties...), so the router must not re-express the
request: it reads the body only to predict (render with the same chat template and
hash the tokens with the tenant's salt, exactly as for kvmesh workers), picks the
endpoint, and forwards the body unchanged but for ``cache_salt``, which it sets to
the tenant's salt so that the engine hashes its blocks as the prediction did (and
tenants never share KV). The answer (status, body, SSE stream) goes back untouched;
the routing decision rides in ``x-kvmesh-*`` response headers, and the engine's
``usage.prompt_tokens_details.cached_tokens`` (vLLM's ``--enable-prompt-tokens-details``)
is compared with the prediction, as for workers.

The Messages API takes the same path (``/v1/messages`` is vLLM's own, since 0.11):
the body goes to the engine's ``/v1/messages`` with the tenant's ``cache_salt``, so
vLLM parses tool calls, applies stop sequences and writes Anthropic's events; the
router predicts from the chat conversation ``kvmesh.anthropic.requests`` converts it
to (vLLM's own conversion), and errors it writes itself have Anthropic's shape
(``Shape``).

A connect failure marks the endpoint down and the request goes to the next best
one; so does a connection that closes before any answer. Nothing is retried once
the engine has answered.

P/D split (``--split-enabled`` with external ``--prefill-endpoints``), llm-d's sidecar
convention with kvmesh's store as the KV transport: the prefill engine gets the body
with ``max_tokens`` 1, no stream and ``kv_transfer_params`` ``{"kvmesh": {"prefill_only":
true}}``; its ``KvmeshConnector`` saves the prompt's blocks to the store. Once the index
says the store holds them (``split_store_wait_s`` at most), the decode engine gets the
client's body as usual, and its connector loads the prefix from the store instead of
computing it. A failed prefill only costs the split: the decode engine computes the prompt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from opentelemetry import propagate

from kvmesh.openai.errors import OpenAIError, error_response
from kvmesh.openai.requests import SESSION_HEADER, parse_json_body, read_body, string
from kvmesh.routing.types import Decision
from kvmesh.tokenization.chat_render import ChatRenderError, chat_request_from_body
from kvmesh_api.common.v1 import common_pb2
from kvmesh_router import external_split, metrics
from kvmesh_router.engine_usage import EngineUsage
from kvmesh_router.errors import BadRequest, RouterError, Unavailable
from kvmesh_router.http_guard import SCOPE_KEY
from kvmesh_router.http_outcome import answer_or_error, router_error_response
from kvmesh_router.openai_endpoint import CONNECT_ERRORS
from kvmesh_router.service import GenInput, Prepared, RouterService

log = logging.getLogger(__name__)

# Failures before any answer that say nothing about the endpoint's health beyond this
# connection (a pooled keep-alive connection the server had closed, a server that just died).
_NO_ANSWER = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class Shape:
    """How an API writes the errors the router itself answers (OpenAI's shape by default)."""

    def error(self, status: int, message: str, etype: str) -> Response:
        return error_response(status, message, etype)

    def router_error(self, exc: RouterError) -> Response:
        return error_response(exc.http_status, exc.message, exc.error_type, exc.param)

    def stream_error(self, message: str) -> bytes:
        """An SSE event that ends a stream the engine broke off."""
        msg = {"error": {"message": message, "type": "upstream_error", "code": 502}}
        return b"data: " + json.dumps(msg).encode() + b"\n\n"


OPENAI = Shape()


def gen_input(body: dict[str, Any], headers: Any, chat: bool, tenant: str) -> GenInput:
    """What the router needs to predict the engine's prompt; nothing else of the body is read."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a string", "model")
    inp = GenInput(model=model)
    if chat:
        try:
            inp.chat_request = chat_request_from_body(body)
        except ChatRenderError as exc:
            raise BadRequest(exc.message, exc.param) from None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            inp.text = prompt
        elif (isinstance(prompt, list) and prompt
              and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            inp.tokens = prompt
        else:
            raise BadRequest("'prompt' must be a non-empty string or list of token ids (one prompt per request)",
                             "prompt")
        ast = body.get("add_special_tokens", True)
        if not isinstance(ast, bool):
            raise BadRequest("'add_special_tokens' must be a boolean", "add_special_tokens")
        inp.add_special_tokens = ast
    try:
        inp.cache_salt = string(body, "cache_salt")
        user = body.get("user")
        inp.session_id = (string(body, "session_id") or headers.get(SESSION_HEADER, "")
                          or (user if isinstance(user, str) else ""))
    except OpenAIError as exc:
        raise BadRequest(exc.message, exc.param) from None
    inp.tenant = tenant   # from the request scope: the key's, never the client's claim
    inp.request_id = headers.get("x-request-id", "")
    inp.policy = headers.get("x-kvmesh-policy", "")
    return inp


# kvmesh's own body fields: read by the router, never forwarded to an external engine.
ROUTER_ONLY = ("kvmesh_policy",)


def engine_body(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` without the router's own fields, for an engine's own API."""
    return {k: v for k, v in body.items() if k not in ROUTER_ONLY}


class AnswerTap(Protocol):
    """Sees a successful answer of an external engine before the client does, and may rewrite it."""

    async def body(self, raw: bytes) -> bytes:
        """A whole (JSON) answer."""

    def stream(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """A streamed answer's bytes, as they come."""


class Passthrough:
    """The HTTP front door's path for routers whose endpoints are external OpenAI servers."""

    def __init__(self, service: RouterService, watch: Callable[[Request, GenInput], Any]) -> None:
        self.service = service
        self.cfg = service.cfg
        self._watch = watch

    @property
    def cluster(self) -> Any:
        return self.service.cluster

    def applies(self) -> bool:
        cluster = getattr(self.service, "cluster", None)   # front-door tests run without one
        return cluster is not None and cluster.external_mode

    async def handle(self, request: Request, chat: bool) -> Response:
        api = "passthrough-chat" if chat else "passthrough-completions"
        path = "/v1/chat/completions" if chat else "/v1/completions"
        cfg = self.cfg
        try:
            raw = await read_body(request, cfg.max_text_bytes, cfg.http_body_timeout_s)
            body = parse_json_body(raw, cfg.max_json_depth)
        except OpenAIError as exc:
            metrics.REQUESTS.labels(api=api, outcome=type(exc).__name__).inc()
            return exc.response()
        try:
            scope = request.scope.get("state", {}).get(SCOPE_KEY)
            inp = gen_input(body, request.headers, chat, scope.tenant if scope is not None else "")
            inp.deadline = scope.deadline if scope is not None else None
        except RouterError as exc:
            return router_error_response(exc, api, OPENAI)
        return await self.forward(request, api, path, inp, body, raw, OPENAI)

    async def forward(self, request: Request, api: str, path: str, inp: GenInput, body: dict[str, Any],
                      raw: bytes | None, shape: Shape, tap: AnswerTap | None = None) -> Response:
        """Predict and pick for ``inp``, then send ``body`` (``raw`` when the salt is already there);
        ``tap`` sees, and may rewrite, a successful answer on its way to the client."""
        try:
            p = await self.service.prepare(inp)
        except RouterError as exc:
            return router_error_response(exc, api, shape)
        if raw is None or (p.salt and body.get("cache_salt") != p.salt):
            if p.salt:
                body["cache_salt"] = p.salt
            content = json.dumps(body, ensure_ascii=False).encode()
        else:
            content = raw   # the very bytes the client sent
        headers = {"content-type": "application/json", "x-request-id": p.request_id}
        propagate.inject(headers, context=propagate.extract(dict(request.headers)))
        watch = self._watch(request, inp)
        return await answer_or_error(api, watch, self._send(request, api, path, inp, p, content, headers, shape, body,
                                                            tap), shape)

    async def _send(self, request: Request, api: str, path: str, inp: GenInput, p: Prepared, content: bytes,
                    headers: dict[str, str], shape: Shape, body: dict[str, Any], tap: AnswerTap | None) -> Response:
        exclude = {e for e in self.service.core.endpoints if e not in self.cluster.external}
        failures: list[str] = []
        deadline = inp.deadline   # the request scope's
        call = _Call()
        inp.calls.append(call)
        try:
            return await self._attempts(api, path, inp, p, content, headers, exclude, failures, deadline, shape,
                                        body, tap)
        finally:
            inp.calls.remove(call)

    async def _attempts(self, api: str, path: str, inp: GenInput, p: Prepared, content: bytes,
                        headers: dict[str, str], exclude: set[str], failures: list[str],
                        deadline: float | None, shape: Shape, body: dict[str, Any], tap: AnswerTap | None
                        ) -> Response:
        ext = self.cluster.external
        client = ext.client
        for attempt in range(1, self.cfg.max_attempts + 1):
            d, split = await self.service.decide(p, inp.policy, exclude)
            # Only the first try splits: a retry is already late.
            split_to = split.prefill_endpoint if split.split and split.prefill_endpoint in ext and attempt == 1 else ""
            self.service.record_routed(p, d, split if split_to else None)
            url = ext.urls.get(d.endpoint_id)
            if url is None:   # removed by discovery since the decision
                self.service.settle(p, d)
                exclude.add(d.endpoint_id)
                continue
            split_headers: dict[str, str] = {}
            if self.cfg.split_enabled and not split_to:
                split_headers = {"x-kvmesh-split": "false", "x-kvmesh-split-reason": split.reason[:200]
                                 or "the prefill endpoint is not an external engine"}
            if split_to:
                try:
                    done = await self._prefill(p, split_to, path, external_split.prefill_body(body), headers,
                                               deadline)
                except BaseException:
                    self.service.settle(p, d)
                    raise
                split_headers = {"x-kvmesh-split": "true" if done is not None else "failed",
                                 "x-kvmesh-prefill-endpoint": split_to}
                if done is not None:
                    p.prefill_usage = done.usage()
                    # The decode engine restores what the store now holds of the prompt.
                    tokens = max(d.predicted_cached_tokens, done.held_blocks * p.req.block_size)
                    d = dataclasses.replace(d, predicted_cached_tokens_offload=tokens - d.predicted_cached_tokens_gpu)
            left = None if deadline is None else max(0.001, deadline - time.monotonic())
            req = client.build_request("POST", url + path, content=content,
                                       headers={**headers, **self.cluster.external.rank_headers(d.endpoint_id)},
                                       timeout=httpx.Timeout(left, connect=self.cfg.external_connect_timeout_s))
            try:
                resp = await client.send(req, stream=True)
            except CONNECT_ERRORS as exc:
                self._failed(p, d, exc, failures, exclude, mark_dead=True)
                continue
            except _NO_ANSWER as exc:
                self._failed(p, d, exc, failures, exclude, mark_dead=False)
                continue
            except httpx.TimeoutException:
                self.service.settle(p, d)
                return shape.error(504, "deadline exceeded before the engine answered", "timeout")
            except BaseException:
                self.service.settle(p, d)
                raise
            self.service.core.on_first_token(p.req, time.monotonic())
            out_headers = {"x-kvmesh-endpoint": d.endpoint_id, "x-kvmesh-request-id": p.request_id,
                           "x-kvmesh-predicted-cached-tokens": str(d.predicted_cached_tokens),
                           "x-kvmesh-predicted-cached-tokens-gpu": str(d.predicted_cached_tokens_gpu),
                           "x-kvmesh-predicted-cached-tokens-offload": str(d.predicted_cached_tokens_offload),
                           "x-kvmesh-attempts": str(attempt), **split_headers}
            ctype = resp.headers.get("content-type", "application/json")
            if "text/event-stream" not in ctype:
                try:
                    raw = await resp.aread()
                except httpx.HTTPError as exc:
                    self.service.settle(p, d)
                    raise Unavailable(f"endpoint {d.endpoint_id} broke off its answer: {exc}") from None
                except BaseException:
                    self.service.settle(p, d)
                    raise
                finally:
                    await resp.aclose()
                usage = EngineUsage()
                if resp.status_code == 200:
                    usage.from_json(raw)
                    if tap is not None:
                        raw = await tap.body(raw)
                self._done(api, p, d, resp.status_code, usage)
                return Response(raw, status_code=resp.status_code, media_type=ctype, headers=out_headers)
            return StreamingResponse(self._stream(api, p, d, resp, shape, tap if resp.status_code == 200 else None),
                                     status_code=resp.status_code,
                                     media_type=ctype, headers=out_headers)
        raise Unavailable(f"no endpoint could serve the request after {self.cfg.max_attempts} attempt(s): "
                          + "; ".join(failures))

    async def _prefill(self, p: Prepared, eid: str, path: str, content: bytes, headers: dict[str, str],
                       deadline: float | None) -> external_split.Prefilled | None:
        """The prefill half of the split (``external_split``), or None when it failed."""
        return await external_split.prefill(self.cluster, self.service.core.load, self.cfg, p.engine_id,
                                            p.req.keys, p.req.num_tokens, p.req.block_size, len(p.tokens), eid,
                                            path, content, headers, deadline)

    def _failed(self, p: Prepared, d: Decision, exc: Exception, failures: list[str], exclude: set[str],
                mark_dead: bool) -> None:
        why = f"{type(exc).__name__}: {exc}"
        self.service.settle(p, d)
        failures.append(f"{d.endpoint_id}: {why}")
        exclude.add(d.endpoint_id)
        if mark_dead:
            self.cluster.mark_dead(d.endpoint_id, why)
        metrics.RETRIES.labels(reason=type(exc).__name__).inc()
        log.warning("retrying on another endpoint", extra={"request_id": p.request_id, "endpoint": d.endpoint_id,
                                                            "why": why})

    async def _stream(self, api: str, p: Prepared, d: Decision, resp: httpx.Response, shape: Shape,
                      tap: AnswerTap | None = None) -> AsyncIterator[bytes]:
        usage = EngineUsage()
        outcome = "broken"
        chunks = resp.aiter_raw() if tap is None else tap.stream(resp.aiter_raw())
        try:
            async for chunk in chunks:
                usage.feed(chunk)
                yield chunk
            outcome = "ok"
        except httpx.HTTPError as exc:
            # Too late to retry: the client has part of the answer. An SSE error event says so.
            log.warning("external endpoint broke off a stream", extra={"request_id": p.request_id,
                                                                      "endpoint": d.endpoint_id, "error": str(exc)})
            yield shape.stream_error(f"endpoint {d.endpoint_id} broke off the stream: {exc}")
        finally:
            await resp.aclose()
            if outcome == "ok":
                self._done(api, p, d, resp.status_code, usage)
            else:
                self.service.settle(p, d)
                metrics.REQUESTS.labels(api=api, outcome=outcome).inc()

    def _done(self, api: str, p: Prepared, d: Decision, status: int, usage: EngineUsage) -> None:
        self.service.settle(p, d)
        metrics.REQUESTS.labels(api=api, outcome="ok" if status == 200 else f"http_{status}").inc()
        actual = usage.cached_tokens
        metrics.PREDICTED_TOKENS.inc(d.predicted_cached_tokens)
        if usage.prompt_tokens is not None:
            metrics.PROMPT_TOKENS.inc(usage.prompt_tokens)
        if actual is None:
            return
        split = p.prefill_usage is not None
        if not split:
            self.service.observe_engine_cached(d.endpoint_id, d.survival_predicted_tokens, actual)
        # A split's decode engine counts the KV its prefill engine computed as cached: reuse is
        # what the prefill engine found, less what the decode engine computed again
        # (RouterService.count_reuse).
        reused, _ = self.service.count_reuse(p, common_pb2.Usage(cached_tokens=actual), split=split)
        if usage.prompt_tokens is not None:
            self.service.count_moved(d, usage.prompt_tokens, reused)
        metrics.CACHED_DIFF.observe(actual - d.predicted_cached_tokens)
        if actual != d.predicted_cached_tokens:
            metrics.MISMATCHES.inc()
            log.info("predicted cached tokens differ from the engine's",
                     extra={"request_id": p.request_id, "endpoint": d.endpoint_id,
                            "predicted": d.predicted_cached_tokens, "actual": actual,
                            "predicted_gpu": d.predicted_cached_tokens_gpu,
                            "predicted_offload": d.predicted_cached_tokens_offload})


class _Call:
    """Lets the disconnect watch cancel the forwarding task while it waits for the engine."""

    def __init__(self) -> None:
        self._task = asyncio.current_task()

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
