"""The ``kvmesh.worker.v1.Worker`` gRPC service over any ``kvmesh.worker.engine.base.Engine``.

Why it exists: prefill and decode services differ only in role; this one
servicer owns the contract for both — request validation with messages that
name the problem, the mapping of engine errors to gRPC status codes, aborting
the engine request (and freeing its blocks) when the client cancels or
disconnects, one OpenTelemetry span per request with ``gen_ai.*`` attributes,
and per-request metrics. An engine crash turns every open stream into
UNAVAILABLE (never a hang) and flips health to NOT_SERVING via ``on_engine_dead``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from opentelemetry import trace

from kvmesh import structured_outputs
from kvmesh.sampling import knobs_of
from kvmesh.worker.engine.base import (
    Engine,
    EngineDeadError,
    EngineError,
    EngineOutput,
    EngineRequest,
    KvHandle,
)
from kvmesh.worker.metrics import WorkerMetrics
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.worker.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)
_tracer = trace.get_tracer(__name__)

MAX_REQUEST_ID_BYTES = 128
MAX_STOP_STRINGS = 16
MAX_STOP_BYTES = 256
MAX_CACHE_SALT_BYTES = 256

FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
    "tool_calls": common_pb2.FINISH_REASON_TOOL_CALLS,
}
HASH_ALGO = {
    "sha256": common_pb2.HASH_ALGO_SHA256,
    "sha256_cbor": common_pb2.HASH_ALGO_SHA256_CBOR,
    "xxhash": common_pb2.HASH_ALGO_XXHASH,
    "xxhash_cbor": common_pb2.HASH_ALGO_XXHASH_CBOR,
}
ROLE = {"prefill": common_pb2.ROLE_PREFILL, "decode": common_pb2.ROLE_DECODE, "both": common_pb2.ROLE_BOTH,
        "": common_pb2.ROLE_BOTH}


class BadRequest(ValueError):
    """A request field is invalid (maps to INVALID_ARGUMENT)."""


def _status(err: EngineError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, err.grpc_code, grpc.StatusCode.INTERNAL)


def usage_of(out: EngineOutput) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                            cached_tokens=out.num_cached_tokens, cached_tokens_gpu=out.num_cached_tokens_gpu,
                            cached_tokens_offload=out.num_cached_tokens_offload,
                            reasoning_tokens=out.num_reasoning_tokens)


def handle_to_proto(h: KvHandle | None) -> common_pb2.KvHandle:
    if h is None:
        return common_pb2.KvHandle()
    return common_pb2.KvHandle(namespace=h.namespace, block_keys=h.block_keys, num_tokens=h.num_tokens,
                               store_address=h.store_address, producer_endpoint=h.producer_endpoint,
                               first_token_id=h.first_token_id or 0, has_first_token=h.first_token_id is not None)


def handle_from_proto(h: common_pb2.KvHandle) -> KvHandle | None:
    if not h.block_keys and not h.namespace:
        return None
    return KvHandle(namespace=h.namespace, block_keys=list(h.block_keys), num_tokens=h.num_tokens,
                    store_address=h.store_address, producer_endpoint=h.producer_endpoint,
                    first_token_id=h.first_token_id if h.has_first_token else None)


def _tools(msg: Any) -> tuple[list[dict] | None, Any]:
    """The chat tools and tool_choice of a GenerateRequest (JSON text fields; a PrefillRequest has none)."""
    raw = getattr(msg, "tools_json", "")
    if not raw:
        return None, None
    try:
        tools = json.loads(raw)
        choice = json.loads(msg.tool_choice_json) if msg.tool_choice_json else "auto"
    except json.JSONDecodeError as exc:
        raise BadRequest(f"tools_json / tool_choice_json is not JSON: {exc}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                              and isinstance(t["function"].get("name"), str) for t in tools):
        raise BadRequest("tools_json must be a list of {type, function: {name, ...}} objects")
    return tools or None, choice


def _reasoning(msg: Any) -> tuple[bool, dict | None]:
    """Whether a GenerateRequest is a chat answer to parse for reasoning, and its template keywords."""
    if not getattr(msg, "parse_reasoning", False):
        return False, None
    raw = msg.chat_template_kwargs_json
    try:
        kwargs = json.loads(raw) if raw else None
    except json.JSONDecodeError as exc:
        raise BadRequest(f"chat_template_kwargs_json is not JSON: {exc}") from None
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs_json must be a JSON object")
    return True, kwargs


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Implements Generate / Prefill / Abort / GetLoad / GetInfo for one engine."""

    def __init__(self, engine: Engine, *, role: str, endpoint_id: str, model_name: str,
                 default_max_tokens: int = 0, metrics: WorkerMetrics | None = None,
                 http_address: str = "", on_engine_dead: Callable[[], Awaitable[None]] | None = None) -> None:
        self.engine = engine
        self.role = role
        self.endpoint_id = endpoint_id
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.metrics = metrics
        self.http_address = http_address
        self.on_engine_dead = on_engine_dead
        self.kv_events_endpoint = ""
        self.kv_events_replay_endpoint = ""

    # ------------------------------------------------------------------ request building

    def _build(self, msg: Any, *, prefill_only: bool, kv_handle: common_pb2.KvHandle | None) -> EngineRequest:
        rid = msg.request_id
        if not rid:
            raise BadRequest("request_id is required")
        if len(rid.encode()) > MAX_REQUEST_ID_BYTES:
            raise BadRequest(f"request_id is longer than {MAX_REQUEST_ID_BYTES} bytes")
        if msg.model and msg.model != self.model_name:
            raise BadRequest(f"unknown model {msg.model!r}; this worker serves {self.model_name!r}")
        if len(msg.cache_salt.encode()) > MAX_CACHE_SALT_BYTES:
            raise BadRequest(f"cache_salt is longer than {MAX_CACHE_SALT_BYTES} bytes")
        sp = msg.sampling
        if len(sp.stop) > MAX_STOP_STRINGS:
            raise BadRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(sp.stop)}")
        for s in sp.stop:
            if len(s.encode()) > MAX_STOP_BYTES:
                raise BadRequest(f"stop string longer than {MAX_STOP_BYTES} bytes")
        # As vLLM: without max_tokens, what is left of max_model_len (unless a default is configured).
        max_tokens = sp.max_tokens or self.default_max_tokens or max(
            1, self.engine.info().max_model_len - len(msg.prompt_token_ids))
        if prefill_only or self.role == "prefill":
            max_tokens = 1
        temperature = sp.temperature if sp.HasField("temperature") else 1.0
        top_p = sp.top_p if sp.HasField("top_p") else 1.0
        tools, tool_choice = _tools(msg)
        structured = None
        if not (prefill_only or self.role == "prefill"):   # a prefill's one token is never returned
            try:
                structured = structured_outputs.from_json(sp.structured_outputs_json)
            except structured_outputs.StructuredOutputsError as exc:
                raise BadRequest(exc.message) from None
        # Unset (or a PrefillRequest, which has no tools) is OpenAI's default: parallel calls allowed.
        single = "parallel_tool_calls" in msg.DESCRIPTOR.fields_by_name and msg.HasField("parallel_tool_calls") \
            and not msg.parallel_tool_calls
        reasoning, template_kwargs = _reasoning(msg)
        return EngineRequest(
            reasoning=reasoning and not (prefill_only or self.role == "prefill"), chat_template_kwargs=template_kwargs,
            tools=tools, tool_choice=tool_choice, parallel_tool_calls=not single, structured_outputs=structured,
            request_id=rid, prompt_token_ids=list(msg.prompt_token_ids), max_tokens=max_tokens,
            temperature=temperature, top_p=top_p, seed=sp.seed if sp.HasField("seed") else None, **knobs_of(sp),
            stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos, cache_salt=msg.cache_salt,
            lora_name=msg.lora_name, session_id=msg.session_id,
            kv_handle=handle_from_proto(kv_handle) if kv_handle is not None else None,
            prefill_only=prefill_only or self.role == "prefill",
        )

    async def _fail(self, context: grpc.aio.ServicerContext, exc: BaseException, rpc: str, span: Any) -> None:
        if isinstance(exc, BadRequest):
            code, msg = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        elif isinstance(exc, EngineError):
            code, msg = _status(exc), str(exc)
            if isinstance(exc, EngineDeadError) and self.on_engine_dead is not None:
                await self.on_engine_dead()
        else:
            log.exception("worker rpc failed", extra={"rpc": rpc})
            code, msg = grpc.StatusCode.INTERNAL, f"internal error: {exc}"
        span.set_status(trace.Status(trace.StatusCode.ERROR, msg))
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if self.metrics:
            self.metrics.observe(rpc, code.name.lower())
        await context.abort(code, msg)

    def _span_start(self, name: str, req: EngineRequest | None, msg: Any) -> Any:
        span = _tracer.start_span(name, kind=trace.SpanKind.SERVER)
        span.set_attribute("gen_ai.operation.name", "text_completion")
        span.set_attribute("gen_ai.system", "vllm" if getattr(self.engine, "name", "") == "vllm" else "kvmesh")
        span.set_attribute("gen_ai.request.model", self.model_name)
        span.set_attribute("gen_ai.request.id", msg.request_id)
        span.set_attribute("kvmesh.endpoint_id", self.endpoint_id)
        span.set_attribute("kvmesh.role", self.role or "both")
        span.set_attribute("gen_ai.usage.input_tokens", len(msg.prompt_token_ids))
        if req is not None:
            span.set_attribute("gen_ai.request.max_tokens", req.max_tokens)
            span.set_attribute("gen_ai.request.temperature", req.temperature)
            span.set_attribute("gen_ai.request.top_p", req.top_p)
            # OpenTelemetry's GenAI names for those it has (top_k and the two OpenAI penalties).
            for name in ("top_k", "presence_penalty", "frequency_penalty"):
                if msg.sampling.HasField(name):
                    span.set_attribute(f"gen_ai.request.{name}", getattr(req, name))
        if msg.session_id:
            span.set_attribute("session.id", msg.session_id)
        return span

    @staticmethod
    def _span_finish(span: Any, out: EngineOutput | None, ttft: float | None) -> None:
        if out is not None:
            span.set_attribute("gen_ai.usage.input_tokens", out.num_prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", out.num_output_tokens)
            span.set_attribute("gen_ai.usage.prompt_tokens", out.num_prompt_tokens)
            span.set_attribute("gen_ai.usage.completion_tokens", out.num_output_tokens)
            span.set_attribute("gen_ai.usage.cache_read.input_tokens", out.num_cached_tokens)
            span.set_attribute("gen_ai.usage.cached_tokens", out.num_cached_tokens)
            span.set_attribute("kvmesh.cached_tokens_gpu", out.num_cached_tokens_gpu)
            span.set_attribute("kvmesh.cached_tokens_offload", out.num_cached_tokens_offload)
            span.set_attribute("kvmesh.kv_from_prefill", out.kv_from_prefill)
            if out.finish_reason:
                span.set_attribute("gen_ai.response.finish_reasons", [out.finish_reason])
        if ttft is not None:
            span.set_attribute("gen_ai.latency.time_to_first_token", ttft)
        span.end()

    # ------------------------------------------------------------------ RPCs

    async def Generate(self, request: worker_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.GenerateResponse]:
        t0 = time.monotonic()
        req: EngineRequest | None = None
        try:
            req = self._build(request, prefill_only=False,
                              kv_handle=request.kv_handle if request.HasField("kv_handle") else None)
        except BadRequest as exc:
            span = self._span_start("kvmesh.worker.Generate", None, request)
            try:
                await self._fail(context, exc, "generate", span)
            finally:
                span.end()
        assert req is not None
        span = self._span_start("kvmesh.worker.Generate", req, request)
        ttft: float | None = None
        last: EngineOutput | None = None
        finished = False
        gen = self.engine.generate(req)
        try:
            with trace.use_span(span, end_on_exit=False):
                async for out in gen:
                    last = out
                    msg = worker_pb2.GenerateResponse(token_ids=out.new_token_ids, finished=out.finished)
                    if ttft is None and (out.new_token_ids or out.finished):
                        ttft = time.monotonic() - t0
                        msg.ttft_s = ttft
                    if out.delta is not None:
                        msg.parsed = True
                        msg.content_delta = out.delta.content
                        msg.reasoning_delta = out.delta.reasoning
                        for d in out.delta.tool_calls:
                            msg.tool_call_deltas.add(index=d.index, id=d.id, name=d.name, arguments=d.arguments)
                    if out.finished:
                        finished = True
                        msg.finish_reason = FINISH.get(out.finish_reason or "", 0)
                        msg.usage.CopyFrom(usage_of(out))
                        msg.kv_from_prefill = out.kv_from_prefill
                        for c in out.tool_calls or []:
                            msg.tool_calls.add(id=c.id, name=c.name, arguments=c.arguments)
                        if out.content is not None:
                            msg.content = out.content
                        if out.reasoning is not None:
                            msg.reasoning = out.reasoning
                        if out.truth is not None:
                            t = out.truth
                            msg.truth.CopyFrom(worker_pb2.CacheTruth(
                                known=True, gpu_tokens=t.gpu_tokens, store_tokens=t.store_tokens,
                                events_through=t.events_through))
                    yield msg
                    if out.finished:
                        break
        except (asyncio.CancelledError, GeneratorExit):
            # Client cancelled or disconnected: abort the engine request, free its blocks.
            await self._abort_quietly(req.request_id)
            span.set_attribute("kvmesh.cancelled", True)
            if self.metrics:
                self.metrics.observe("generate", "cancelled")
            self._span_finish(span, last, ttft)
            raise
        except (EngineError, Exception) as exc:  # noqa: BLE001 - mapped to a status, never a hung stream
            await gen.aclose()
            self._span_finish_error(span, last, ttft)
            await self._fail(context, exc, "generate", _NoSpan())
            return
        finally:
            await gen.aclose()
        if not finished:
            return
        if last is not None and last.finish_reason == "error":
            span.set_status(trace.Status(trace.StatusCode.ERROR, last.error or "engine error"))
        self._span_finish(span, last, ttft)
        if self.metrics and last is not None:
            self.metrics.observe(
                "generate", last.finish_reason or "ok", prompt=last.num_prompt_tokens,
                output=last.num_output_tokens, cached_gpu=last.num_cached_tokens_gpu,
                cached_offload=last.num_cached_tokens_offload, ttft_s=ttft, kv_from_prefill=last.kv_from_prefill,
                duration_s=time.monotonic() - t0)

    def _span_finish_error(self, span: Any, last: EngineOutput | None, ttft: float | None) -> None:
        span.set_status(trace.Status(trace.StatusCode.ERROR, "engine error"))
        self._span_finish(span, last, ttft)

    async def _abort_quietly(self, request_id: str) -> None:
        try:
            await asyncio.shield(self.engine.abort(request_id))
        except Exception:  # noqa: BLE001 - the request may be gone already
            pass

    async def Prefill(self, request: worker_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.PrefillResponse:
        t0 = time.monotonic()
        span = self._span_start("kvmesh.worker.Prefill", None, request)
        try:
            req = self._build(request, prefill_only=True, kv_handle=None)
            with trace.use_span(span, end_on_exit=False):
                res = await self.engine.prefill(req)
        except asyncio.CancelledError:
            await self._abort_quietly(request.request_id)
            span.set_attribute("kvmesh.cancelled", True)
            span.end()
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            try:
                await self._fail(context, exc, "prefill", span)
            finally:
                span.end()
            return worker_pb2.PrefillResponse()
        out = res.output
        ttft = time.monotonic() - t0
        self._span_finish(span, out, ttft)
        if out.finish_reason in ("abort", "error"):
            await context.abort(grpc.StatusCode.ABORTED if out.finish_reason == "abort" else grpc.StatusCode.INTERNAL,
                                f"prefill {out.finish_reason}: {out.error or 'request ended early'}")
        if self.metrics:
            self.metrics.observe("prefill", out.finish_reason or "ok", prompt=out.num_prompt_tokens,
                                 output=out.num_output_tokens, cached_gpu=out.num_cached_tokens_gpu,
                                 cached_offload=out.num_cached_tokens_offload, ttft_s=ttft,
                                 duration_s=ttft)
        handle = res.handle
        if handle is not None and handle.first_token_id is None and out.new_token_ids:
            handle.first_token_id = out.new_token_ids[0]
        return worker_pb2.PrefillResponse(handle=handle_to_proto(handle), usage=usage_of(out))

    async def Abort(self, request: worker_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> worker_pb2.AbortResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        return worker_pb2.AbortResponse(found=await self.engine.abort(request.request_id))

    async def GetLoad(self, request: worker_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.GetLoadResponse:
        if not self.engine.healthy:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is not running")
        ld = self.engine.load()
        return worker_pb2.GetLoadResponse(
            running=ld.running, waiting=ld.waiting, kv_usage=ld.kv_usage, num_blocks=ld.num_blocks,
            free_blocks=ld.free_blocks, block_size=ld.block_size, waiting_prefill_tokens=ld.waiting_prefill_tokens,
            timestamp=ld.timestamp or time.time())

    async def GetInfo(self, request: worker_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.GetInfoResponse:
        info = self.engine.info()
        return worker_pb2.GetInfoResponse(
            endpoint_id=self.endpoint_id, model=self.model_name, block_size=info.block_size,
            hash_algo=HASH_ALGO.get(info.hash_algo, 0), role=ROLE.get(self.role, common_pb2.ROLE_BOTH),
            max_model_len=info.max_model_len, vocab_size=info.vocab_size, engine=info.engine,
            kv_bytes_per_token=info.kv_bytes_per_token, lora_names=info.lora_names, lora_paths=info.lora_paths,
            kv_events_endpoint=self.kv_events_endpoint or info.kv_events_endpoint,
            kv_events_replay_endpoint=self.kv_events_replay_endpoint or info.kv_events_replay_endpoint,
            http_address=self.http_address)


class _NoSpan:
    """Span stand-in once the real span has been ended."""

    def set_status(self, *_: Any) -> None:
        pass

    def set_attribute(self, *_: Any) -> None:
        pass
