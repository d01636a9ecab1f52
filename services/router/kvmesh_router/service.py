"""One request through the router: validate → tokenize → hash → look up → decide → forward → stream.

Both front doors (gRPC ``Generate`` and the OpenAI HTTP API) and the ext_proc
picker call into this class, so they route identically. Failures before the
first token are retried on the next best endpoint (bounded); after tokens
have been streamed the client gets a clean error saying what was generated.
Cancelling the consuming task (client cancel, deadline) cancels the worker
call, which aborts the engine request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from opentelemetry import propagate, trace

from kvmesh import structured_outputs
from kvmesh.api_keys import TenantSalts
from kvmesh.hashing import ExtraKeys
from kvmesh.index.base import MAX_SPECULATIVE_TTL_S
from kvmesh.request_ids import engine_request_id
from kvmesh.routing.fidelity import RouterSide, classify, live_view, split_predicted_blocks
from kvmesh.routing.hedge import HedgeBudget
from kvmesh.routing.pd_split import SplitDecision
from kvmesh.routing.policy import NoEndpointError
from kvmesh.routing.prefix_memory import speculative_ttl
from kvmesh.routing.router import RouterCore, prefill_request_id
from kvmesh.routing.scoring import max_hit_blocks
from kvmesh.routing.split_reuse import split_reuse
from kvmesh.routing.types import COST_TERMS, Decision, Matches, RouteRequest
from kvmesh.sampling import KNOBS, first_error
from kvmesh.telemetry import tracer
from kvmesh.tokenization.chat_render import ChatRequest
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.router.v1 import router_pb2
from kvmesh_api.worker.v1 import worker_pb2
from kvmesh_router import external_generate, external_split, metrics
from kvmesh_router.cluster import Cluster
from kvmesh_router.config import RouterConfig
from kvmesh_router.errors import (
    BadRequest,
    DeadlineExceeded,
    RouterError,
    StreamBroken,
    Unavailable,
    UnknownModel,
    UpstreamError,
)

log = logging.getLogger(__name__)
_tracer = tracer("kvmesh.router")

MAX_REQUEST_ID = 128
MAX_SALT = 256
MAX_SESSION_ID = 256   # bytes; a longer one is kept as its digest (bounded_session)
MAX_MESSAGES = 4096
MAX_STOP = 16
# Worker failures that mean "this endpoint is gone", so another may serve the request.
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
              grpc.StatusCode.CANCELLED}


@dataclass
class GenInput:
    """A request from either front door, before tokenization."""

    model: str
    tokens: Sequence[int] | None = None   # a list or a protobuf repeated field (not copied)
    text: str | None = None
    chat: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    # The whole chat request (tools, tool_choice, template keywords...); None = just ``chat`` and
    # ``add_generation_prompt``. Rendered by ``kvmesh.tokenization.chat_render``, as the worker does.
    chat_request: ChatRequest | None = None
    sampling: common_pb2.SamplingParams = field(default_factory=common_pb2.SamplingParams)
    request_id: str = ""
    cache_salt: str = ""
    session_id: str = ""
    lora_name: str = ""
    # Who the request is served as: set by the front door's request scope from the credential
    # (kvmesh_router.request_scope), never from what the client claims.
    tenant: str = ""
    # The ext_proc picker predicts for a worker that hashes with the body's cache_salt as sent.
    salt_verbatim: bool = False
    policy: str = ""
    deadline: float | None = None   # time.monotonic() deadline
    trace_context: Any = None       # OTel context of the caller (HTTP traceparent); None = current
    # Worker calls in flight, so a front door that learns of a client disconnect
    # out of band (HTTP) can cancel them.
    calls: list[Any] = field(default_factory=list)
    add_special_tokens: bool = True
    # vLLM's ``include_reasoning``: false drops a reasoning model's reasoning from the answer.
    include_reasoning: bool = True
    # Set by ``generate`` once known, for a front door that ends a stream before the engine's
    # final report (the Messages API on a stop sequence): the prompt's length and predicted hit.
    prompt_tokens: int = 0
    predicted_cached_tokens: int = 0
    # time.perf_counter() when the front door got the request (before reading its body), and the
    # time from then to the first decision: RoutingDecision.decision_ms.
    received: float | None = None
    decision_s: float = 0.0
    tokenize_s: float = 0.0
    hash_s: float = 0.0      # of the decision: hashing the blocks
    lookup_s: float = 0.0    # of the decision: the first attempt's index lookup


def bounded_session(session_id: str) -> str:
    """A session id as the router keeps it. The body's ``session_id``, ``user`` or
    ``metadata.user_id`` is bounded only by the body's size, and the router keeps state per
    session (working set, affinity, tokenization), so an id over ``MAX_SESSION_ID`` bytes is
    kept as its digest."""
    raw = session_id.encode("utf-8", "surrogatepass")
    return session_id if len(raw) <= MAX_SESSION_ID else "sha256:" + hashlib.sha256(raw).hexdigest()


def tenant_session(tenant: str, session_id: str) -> str:
    """The session id the router and the engines know a request by: the client's, within its
    tenant. Session ids are the client's choice; unscoped, one tenant reusing another's would
    take over that session's home (the working set keeps one per id) and its store grouping."""
    session_id = bounded_session(session_id)
    return f"{len(tenant)}:{tenant}|{session_id}" if tenant and session_id else session_id


@dataclass
class Prepared:
    request_id: str
    tokens: Sequence[int]
    extra: ExtraKeys | None
    salt: str
    req: RouteRequest
    reused_blocks: int = 0
    hashed_blocks: int = 0
    # Only when the LoRA adapter is loaded from several paths: (endpoints, extra, request) per
    # path; ``decide`` scores each group with its own keys and adopts the winner's.
    variants: list[tuple[set[str], ExtraKeys, RouteRequest]] = field(default_factory=list)
    # Endpoints that don't serve the request's LoRA adapter (never chosen).
    lora_lacking: set[str] = field(default_factory=set)
    lora_name: str = ""
    routed_at: float = 0.0   # time.monotonic() of the latest pick (retries re-pick)
    # The prefill endpoint's usage of the latest split: what it found cached is the split's reuse.
    prefill_usage: common_pb2.Usage | None = None

    @property
    def engine_id(self) -> str:
        """The id engines and the load view know the request by: ``request_id`` (the client's,
        which responses and logs carry) made unique per request (``prepare``)."""
        return self.req.request_id

    def try_id(self, attempt: int) -> str:
        """The engine id of try ``attempt``: a retry's own, as the failed try may still be held."""
        return self.engine_id if attempt == 1 else f"{self.engine_id}-r{attempt}"


@dataclass
class FinalInfo:
    usage: common_pb2.Usage
    finish_reason: int
    routing: router_pb2.RoutingDecision
    request_id: str
    ttft_s: float
    output_ids: list[int]
    # The worker parsed tool calls out of the answer: the calls and the text that is not one.
    tool_calls: list[common_pb2.ToolCall] = field(default_factory=list)
    content: str | None = None
    # The worker's reasoning parser read the answer: its reasoning ("" if none); ``content`` is the rest.
    reasoning: str | None = None

    @property
    def parsed_text(self) -> str | None:
        """The answer's text as the worker parsed it (None: decode the tokens)."""
        return (self.content or "") if self.tool_calls or self.reasoning is not None else None

    def routing_doc(self) -> dict[str, Any]:
        """The routing decision as JSON answers carry it (under ``kvmesh``), every field present."""
        return MessageToDict(self.routing, preserving_proto_field_name=True,
                             always_print_fields_with_no_presence=True)


@dataclass
class Parsed:
    """A chat answer as the worker's parser (tools, reasoning) read its newest tokens (``worker.proto``
    ``GenerateResponse.parsed``): new text that is not a tool call, new pieces of tool calls, and new
    reasoning. ``generate`` yields it as ("parsed", Parsed) *before* the chunk of the same tokens, so
    a door knows from the stream's first item that its text comes parsed, and shows these instead
    of the decoded chunks."""

    content: str
    tool_calls: list[common_pb2.ToolCallDelta]
    reasoning: str = ""



def _first_call_only(inp: GenInput, calls: Any) -> list[Any]:
    """A worker's tool calls (or streamed pieces of them) for the client. With
    ``parallel_tool_calls`` false (OpenAI's field, Anthropic's ``disable_parallel_tool_use``)
    only the first call, as vLLM's server filters its answer, whatever the worker sent."""
    creq = inp.chat_request
    if creq is None or creq.parallel_tool_calls:
        return list(calls)
    return [c for i, c in enumerate(calls) if getattr(c, "index", i) == 0]

# One try of a request: its prepared copy, its decision, its worker stream.
_Try = tuple[Prepared, Decision, AsyncIterator[tuple[str, Any]]]


class _BeforeFirstToken(Exception):
    def __init__(self, why: str, mark_dead: bool = True, endpoint: str = "") -> None:
        super().__init__(why)
        self.why = why
        self.mark_dead = mark_dead
        self.endpoint = endpoint   # the endpoint that failed, when not the try's own (a hedge)


async def _next_item(gen: AsyncIterator[tuple[str, Any]]) -> tuple[str, Any]:
    return await gen.__anext__()


# Below this a full tokenization is cheap (< ~5 ms) and caching would only cost memory.
INCREMENTAL_MIN_CHARS = 16_384
INCREMENTAL_KEY_CHARS = 4_096


def tenant_salts(cfg: RouterConfig) -> TenantSalts:
    """The salts' secret from ``salt_secret_file``; without one a random secret of this process."""
    if cfg.salt_secret_file:
        return TenantSalts.from_file(cfg.salt_secret_file)
    if cfg.auth == "keys":
        log.warning("no --salt-secret-file: tenant salts use a random secret of this process, so router "
                    "replicas (and restarts) do not share prefix caches")
    return TenantSalts(secrets.token_bytes(32))


class RouterService:
    def __init__(self, cfg: RouterConfig, core: RouterCore, cluster: Cluster, tokenizer: Any | None) -> None:
        self.cfg = cfg
        self.core = core
        self.cluster = cluster
        self.tokenizer = tokenizer
        self.vocab_size = cfg.vocab_size or (tokenizer.vocab_size if tokenizer is not None else 0)
        self.salts = tenant_salts(cfg)
        self._bg: set[asyncio.Task] = set()
        self.hedge_budget = HedgeBudget(cfg.hedge_budget, cfg.hedge_burst)
        self.incremental = None
        if tokenizer is not None and cfg.tokenize_cache_bytes > 0:
            from kvmesh.tokenization.incremental import IncrementalTokenizer

            encode_tail = None
            if cfg.tokenize_parts != 1 and getattr(tokenizer, "has_fast", False):
                from kvmesh.tokenization.parallel_encode import ParallelEncoder

                encode_tail = ParallelEncoder(tokenizer.encode_with_offsets, tokenizer.encode_with_offsets_batch,
                                              cfg.tokenize_parts or None).encode
            self.incremental = IncrementalTokenizer(
                tokenizer.encode_with_offsets, max_bytes=cfg.tokenize_cache_bytes, verify=cfg.tokenize_verify,
                on_outcome=lambda o: metrics.TOKENIZE_CACHE.labels(outcome=o).inc(), encode_tail=encode_tail)

    # -- validation and tokenization ------------------------------------------------
    def validate(self, inp: GenInput) -> None:
        if not inp.model:
            raise BadRequest("'model' is required", "model")
        if inp.model != self.cfg.model:
            raise UnknownModel(inp.model, self.cfg.model)
        if len(inp.request_id.encode()) > MAX_REQUEST_ID:
            raise BadRequest(f"request_id longer than {MAX_REQUEST_ID} bytes", "request_id")
        if len(inp.cache_salt.encode()) > MAX_SALT:
            raise BadRequest(f"cache_salt longer than {MAX_SALT} bytes", "cache_salt")
        if inp.lora_name and not self.cluster.knows_lora(inp.lora_name):
            raise BadRequest(f"unknown LoRA adapter {inp.lora_name!r}", "lora_name")
        if inp.policy and inp.policy not in self._policies():
            raise BadRequest(f"unknown policy {inp.policy!r}; one of {', '.join(self._policies())}", "policy")
        s = inp.sampling
        if s.HasField("temperature") and not (0.0 <= s.temperature <= 2.0):
            raise BadRequest(f"temperature must be in [0, 2], got {s.temperature:g}", "temperature")
        if s.HasField("top_p") and not (0.0 < s.top_p <= 1.0):
            raise BadRequest(f"top_p must be in (0, 1], got {s.top_p:g}", "top_p")
        bad_knob = first_error({name: getattr(s, name) for name in KNOBS if s.HasField(name)})
        if bad_knob is not None:
            raise BadRequest(bad_knob[1], bad_knob[0])
        if s.structured_outputs_json:
            try:
                structured_outputs.from_json(s.structured_outputs_json)
            except structured_outputs.StructuredOutputsError as exc:
                raise BadRequest(exc.message, exc.param) from None
        if len(s.stop) > MAX_STOP or any(len(x.encode()) > 256 for x in s.stop):
            raise BadRequest(f"stop: at most {MAX_STOP} strings of at most 256 bytes", "stop")
        if s.max_tokens > self.max_model_len():
            raise BadRequest(f"max_tokens {s.max_tokens} exceeds max_model_len {self.max_model_len()}",
                             "max_tokens")
        n_msgs = len(inp.chat_request.messages) if inp.chat_request is not None else len(inp.chat or [])
        if n_msgs > MAX_MESSAGES:
            raise BadRequest(f"at most {MAX_MESSAGES} messages", "messages")
        if inp.text is not None and len(inp.text.encode()) > self.cfg.max_text_bytes:
            raise BadRequest(f"prompt text over {self.cfg.max_text_bytes} bytes", "prompt")

    @staticmethod
    def _policies() -> list[str]:
        from kvmesh.routing.registry import available_policies

        return available_policies()

    async def tokenize(self, inp: GenInput) -> Sequence[int]:
        t0 = time.perf_counter()
        if inp.tokens is not None:
            tokens = inp.tokens
            field_name = "prompt"
        else:
            field_name = "messages" if self._is_chat(inp) else "prompt"
            if self.tokenizer is None:
                raise BadRequest("this router has no tokenizer; send token ids (set the router's "
                                 "tokenizer_path to accept text and chat)", field_name)
            from kvmesh.tokenization import TokenizerError

            try:
                msgs = inp.chat_request.messages if inp.chat_request is not None else inp.chat or []
                size = len(inp.text or "") + sum(len(str(m.get("content", ""))) for m in msgs)
                fn = lambda: self._encode_text(inp, size)  # noqa: E731
                tokens = await asyncio.to_thread(fn) if size > 65536 else fn()
            except TokenizerError as exc:
                raise BadRequest(str(exc), getattr(exc, "param", field_name)) from None
            inp.tokenize_s = time.perf_counter() - t0
            metrics.TOKENIZE.observe(inp.tokenize_s)
        if not tokens:
            raise BadRequest("the prompt is empty", field_name)
        if len(tokens) > self.cfg.max_prompt_tokens:
            raise BadRequest(f"prompt has {len(tokens)} tokens, over the limit of {self.cfg.max_prompt_tokens}",
                             field_name)
        max_len = self.max_model_len()
        if len(tokens) + max(1, inp.sampling.max_tokens) > max_len:
            raise BadRequest(f"prompt ({len(tokens)} tokens) + max_tokens ({inp.sampling.max_tokens or 1}) exceeds "
                             f"max_model_len {max_len}", field_name)
        # Token ids over gRPC arrive as a protobuf field; a Python scan of 200k ids costs ~8 ms, so
        # their vocabulary check is left to the worker (INVALID_ARGUMENT is passed through). Ids the
        # router's own tokenizer made are in its vocabulary: only a client's list is scanned.
        if (self.vocab_size and inp.tokens is not None and isinstance(tokens, list)
                and (max(tokens) >= self.vocab_size or min(tokens) < 0)):
            bad = next(t for t in tokens if t >= self.vocab_size or t < 0)
            raise BadRequest(f"token id {bad} outside the vocabulary (size {self.vocab_size})", field_name)
        return tokens

    @staticmethod
    def _is_chat(inp: GenInput) -> bool:
        return inp.chat is not None or inp.chat_request is not None

    def max_model_len(self) -> int:
        """The longest prompt + output every live endpoint takes: the workers' own (GetInfo), capped
        by the configured one."""
        return min(self.cfg.max_model_len, self.cluster.max_model_len() or self.cfg.max_model_len)

    def _encode_text(self, inp: GenInput, size: int) -> list[int]:
        """Render (chat) and tokenize. A long conversation is tokenized incrementally: only what
        changed since its previous turn (``kvmesh.tokenization.incremental``), keyed by tenant and
        session (or, without a session id, by the conversation's opening)."""
        if self._is_chat(inp):
            creq = inp.chat_request or ChatRequest(messages=inp.chat or [],
                                                   add_generation_prompt=inp.add_generation_prompt)
            text = self.tokenizer.render(creq)
            if creq.add_special_tokens:
                return self.tokenizer.renderer.encode(text, add_special_tokens=True)
        elif inp.add_special_tokens:
            return self.tokenizer.encode(inp.text or "", add_special_tokens=True)
        else:
            text = inp.text or ""
        if self.incremental is None or size < INCREMENTAL_MIN_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=False)
        key = (self.salt_for(inp), bounded_session(inp.session_id) or hash(text[:INCREMENTAL_KEY_CHARS]))
        return self.incremental.encode_ids(key, text)

    def salt_for(self, inp: GenInput) -> str:
        """The tenant's secret salt, mixed with the client's ``cache_salt`` (which never replaces it)."""
        if inp.salt_verbatim:
            return inp.cache_salt
        return self.salts.salt(inp.tenant, inp.cache_salt)

    async def prepare(self, inp: GenInput) -> Prepared:
        self.validate(inp)
        tokens = await self.tokenize(inp)
        salt = self.salt_for(inp)
        rid = inp.request_id or uuid.uuid4().hex
        # Engines and the load view know the request by an id of its own (kvmesh.request_ids):
        # the client's may be reused, or retried by Envoy on another replica.
        engine_rid = engine_request_id(rid) if inp.request_id else rid
        session = tenant_session(inp.tenant, inp.session_id)
        groups: dict[str, set[str]] = {}
        lacking: set[str] = set()
        paths: list[str | None] = [None]
        if inp.lora_name:
            # vLLM hashes the adapter's path: use the one the endpoints loaded (GetInfo, else static).
            groups, lacking = self.cluster.lora_groups(inp.lora_name)
            paths = list(groups) or [self.cfg.lora_modules.get(inp.lora_name, "")]

        def hashed(path: str | None) -> tuple[ExtraKeys | None, RouteRequest, int, int]:
            extra = None
            if salt or inp.lora_name:
                extra = ExtraKeys(cache_salt=salt or None, lora_name=inp.lora_name or None, lora_path=path)
            res = self.core.chain(tokens, extra, session)
            metrics.HASH_BLOCKS.labels(kind="reused").inc(res.reused_blocks)
            metrics.HASH_BLOCKS.labels(kind="hashed").inc(res.hashed_blocks)
            req = RouteRequest(engine_rid, inp.model, res.keys, len(tokens), self.core.block_size, session,
                               inp.tenant)
            return extra, req, res.reused_blocks, res.hashed_blocks

        t0 = time.perf_counter()
        extra, req, reused, n_hashed = hashed(paths[0])
        inp.hash_s = time.perf_counter() - t0
        p = Prepared(rid, tokens, extra, salt, req, reused, n_hashed, lora_lacking=lacking, lora_name=inp.lora_name)
        if len(paths) > 1:
            p.variants.append((groups[paths[0]], extra, req))  # type: ignore[arg-type]
            for path in paths[1:]:
                ex, rq, reused, n_hashed = hashed(path)
                p.variants.append((groups[path], ex, rq))  # type: ignore[index, arg-type]
                p.reused_blocks += reused
                p.hashed_blocks += n_hashed
        return p

    async def decide(self, p: Prepared, policy: str, exclude: set[str], subset: set[str] | None = None,
                     timing: GenInput | None = None) -> tuple[Decision, SplitDecision]:
        """The endpoint (and split) for ``p``; ``timing`` gets the index lookup's time (``lookup_s``).
        While admission control holds it (``Decision.hold``, kvmesh.routing.admission) it is
        decided again every ``admit_recheck_s``, as the simulator does, with the time held so far;
        a hold never outlasts the request's deadline (``timing.deadline``): it is sent instead."""
        t0 = time.monotonic()
        held = 0.0
        recheck = self.core.cfg.scoring.admit_recheck_s
        deadline = timing.deadline if timing is not None else None
        while True:
            d, split = await self._decide_once(p, policy, exclude, subset, timing, held)
            if not d.hold or (deadline is not None and time.monotonic() + recheck >= deadline):
                if held:
                    metrics.HELD.observe(held)
                d.hold = ""
                return d, split
            metrics.HOLDS.inc()
            await asyncio.sleep(recheck)
            held = time.monotonic() - t0

    async def _decide_once(self, p: Prepared, policy: str, exclude: set[str], subset: set[str] | None,
                           timing: GenInput | None, held_s: float) -> tuple[Decision, SplitDecision]:
        if subset is not None:
            exclude = exclude | {e for e in self.core.endpoints if e not in subset}
        if p.lora_lacking:
            exclude = exclude | p.lora_lacking
        if not p.variants:
            return await self._decide_keys(p.req, p.lora_name, policy, exclude, timing, held_s)
        best: tuple[Decision, SplitDecision, ExtraKeys, RouteRequest] | None = None
        errors: list[str] = []
        for eids, extra, req in p.variants:
            others = {e for e in self.core.endpoints if e not in eids}
            try:
                d, split = await self._decide_keys(req, p.lora_name, policy, exclude | others, timing, held_s)
            except Unavailable as exc:
                errors.append(exc.message)
                continue
            if best is None or d.score < best[0].score:
                best = (d, split, extra, req)
        if best is None:
            raise Unavailable(errors[0] if errors else f"no live endpoint serves LoRA adapter {p.lora_name!r}")
        # The request now carries the winning path's keys (speculative entries, completion).
        p.extra, p.req = best[2], best[3]
        return best[0], best[1]

    async def _decide_keys(self, req: RouteRequest, lora_name: str, policy: str, exclude: set[str],
                           timing: GenInput | None = None, held_s: float = 0.0) -> tuple[Decision, SplitDecision]:
        pol = self.core.policy(policy) if policy else self.core.default_policy
        # A policy that predicts nothing gets no matches, but its split reads them
        # (RouterCore.split_lookup). Looked up before the decision: nothing may await between
        # a decision and its record_routed, or concurrent requests decide on the same load and
        # a load-driven policy sends them all to one endpoint.
        lookup = pol.uses_index or self.core.split_lookup(req, policy)
        t0 = time.perf_counter()
        matches = await self.cluster.lookup(req.keys) if lookup else None
        if timing is not None and lookup and self.cluster.indexer is not None:
            timing.lookup_s += time.perf_counter() - t0
        seen = matches if pol.uses_index else None   # what the policy itself decides on
        try:
            d = self.core.decide(req, seen, time.monotonic(), policy, exclude, held_s)
        except NoEndpointError as exc:
            msg = str(exc) + (f" serving LoRA adapter {lora_name!r}" if lora_name else "")
            raise Unavailable(msg) from None
        d.view = self._router_side(req, d, seen, pol.uses_index and self.cluster.indexer is not None)
        if d.fallback:
            metrics.FALLBACKS.labels(reason="approx").inc()
        split = self.core.decide_split(d, req, time.monotonic(), exclude, matches)
        return d, split

    @staticmethod
    def _router_side(req: RouteRequest, d: Decision, matches: Matches | None, uses_index: bool) -> RouterSide:
        """What the prediction rested on, to classify a miss once the engine reports (routing.fidelity)."""
        bs = req.block_size
        win = d.chosen()
        applied = -1
        if matches is not None and matches.applied is not None:
            applied = matches.applied.get(d.endpoint_id, 0)
        return RouterSide(
            predicted=d.predicted_cached_tokens // bs,
            index_gpu=min(matches.get(d.endpoint_id).gpu, max_hit_blocks(req.num_tokens, bs))
            if matches is not None and matches.source != "local" else -1,
            speculative=(win.speculative_blocks + win.pending_blocks) if win is not None else 0,
            index_applied=applied, uses_index=uses_index,
            index_store=min(max(matches.store.cpu, matches.store.disk), max_hit_blocks(req.num_tokens, bs))
            if matches is not None and matches.source != "local" else -1,
            lookup_timed_out=uses_index and (matches is None or matches.source == "local"))

    def _mismatch(self, p: Prepared, d: Decision, msg: worker_pb2.GenerateResponse, actual: int,
                  split: bool, predicted: int) -> str:
        """The class of a missed prediction ("" when exact), counted by cause."""
        bs = p.req.block_size
        side: RouterSide = d.view or RouterSide(predicted=predicted // bs, uses_index=False)
        if split:
            side = dataclasses.replace(side, predicted=predicted // bs)
        t = msg.truth
        cap = max_hit_blocks(p.req.num_tokens, bs)
        view = live_view(side, known=t.known, gpu_blocks=min(t.gpu_tokens // bs, cap),
                         store_blocks=min(t.store_tokens // bs, cap), events_through=t.events_through)
        cls = classify(view, actual // bs, uses_index=side.uses_index, split=split)
        if not cls and actual != predicted:
            cls = "unknown"   # equal in whole blocks, not in tokens: a partial block was counted
        if cls:
            metrics.MISPREDICTIONS.labels(cause=cls).inc()
        return cls

    def record_routed(self, p: Prepared, d: Decision, split: SplitDecision | None = None) -> None:
        now = time.monotonic()
        p.routed_at = now
        self.core.on_routed(p.req, d, now, split)
        split_to = split.prefill_endpoint if split is not None and split.split else ""
        metrics.DECISIONS.labels(policy=d.policy, endpoint=d.endpoint_id, split=str(bool(split_to)).lower()).inc()
        # A split request's prefix is computed on the prefill endpoint first: other router
        # replicas should send its siblings' prefills there (the decode endpoint has it later).
        # Lives as long as the router's own entry: until the prefill should be done, plus one
        # event delivery.
        ttl = min(speculative_ttl(self.cfg.speculative_ttl_s, d.score), MAX_SPECULATIVE_TTL_S)
        t = asyncio.create_task(self.cluster.put_speculative(split_to or d.endpoint_id, p.req.keys, ttl))
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    def settle(self, p: Prepared, d: Decision, generated: list[int] | None = None) -> None:
        """The request is over: release its in-flight count, and drop a load report that counted it.

        A ``GetLoad`` report taken while this request ran still shows it (running, queued
        prefill, its KV blocks) until the next poll, but the client's next turn arrives right
        after the response: its prefix's holder would look busy and the turn would leave its
        KV. Without the report, the router's own in-flight requests still count; only traffic
        from elsewhere goes unseen, until the next poll.
        """
        rep = self.core.load.reports.get(d.endpoint_id)
        if rep is not None and rep.received_at >= p.routed_at:
            self.core.load.forget(d.endpoint_id)
        if generated is None:
            self.core.on_finished(p.req, d, time.monotonic())
        else:
            self.core.on_finished(p.req, d, time.monotonic(), p.tokens, generated, p.extra)

    # -- the full request -------------------------------------------------------------
    async def generate(self, inp: GenInput) -> AsyncIterator[tuple[str, Any]]:
        """Yield ``("chunk", [ids])`` items then one ``("final", FinalInfo)``; raise ``RouterError``."""
        # The span is not made current across yields: a streaming consumer may resume this
        # generator from another task/context. It is made current around outgoing calls only.
        span = _tracer.start_span("router.generate", context=inp.trace_context)
        try:
            t0 = time.perf_counter()
            with trace.use_span(span, end_on_exit=False):
                p = await self.prepare(inp)
            inp.prompt_tokens = len(p.tokens)
            span.set_attribute("kvmesh.request_id", p.request_id)
            span.set_attribute("kvmesh.prompt_tokens", len(p.tokens))
            span.set_attribute("kvmesh.hash.reused_blocks", p.reused_blocks)
            span.set_attribute("kvmesh.hash.hashed_blocks", p.hashed_blocks)
            # External OpenAI endpoints get the token ids through vLLM's completions API
            # (``external_generate``); the HTTP front door forwards bodies instead (``passthrough``).
            exclude: set[str] = set()
            failures: list[str] = []
            attempts = 0
            if self.cfg.hedge_delay_s > 0:
                self.hedge_budget.on_request()
            while True:
                attempts += 1
                if inp.deadline is not None and time.monotonic() >= inp.deadline:
                    raise DeadlineExceeded("deadline exceeded before an endpoint answered")
                with trace.use_span(span, end_on_exit=False):
                    d, split = await self.decide(p, inp.policy, exclude, timing=inp if attempts == 1 else None)
                if split.split and (d.endpoint_id in self.cluster.external) != (
                        split.prefill_endpoint in self.cluster.external):
                    # A kvmesh prefill worker's KV handle means nothing to an external engine, and
                    # an external prefill engine hands over through the store only to its peers.
                    split = SplitDecision(False, reason="the decode and prefill endpoints are not of one kind "
                                                        "(external engine and kvmesh worker)")
                elif split.split and attempts > 1 and d.endpoint_id in self.cluster.external:
                    split = SplitDecision(False, reason="a retry does not split")   # already late
                inp.predicted_cached_tokens = d.predicted_cached_tokens
                now = time.perf_counter()
                overhead = now - t0
                if attempts == 1:
                    metrics.OVERHEAD.observe(overhead)
                    inp.decision_s = now - (inp.received if inp.received is not None else t0)
                    metrics.DECISION.observe(inp.decision_s)
                self.record_routed(p, d, split)   # first: it marks the decision moved or not
                self._trace_decision(span, d, split, attempts)
                try:
                    async for item in self._attempt(p, inp, d, split, attempts, overhead, span, exclude, failures):
                        yield item
                    metrics.REQUESTS.labels(api="core", outcome="ok").inc()
                    return
                except _BeforeFirstToken as exc:
                    self.settle(p, d)
                    failed = exc.endpoint or d.endpoint_id
                    failures.append(f"{failed}: {exc.why}")
                    if exc.mark_dead:
                        self.cluster.mark_dead(failed, exc.why)
                    exclude.add(failed)
                    span.add_event("retry", {"endpoint": failed, "why": exc.why})
                    if attempts >= self.cfg.max_attempts:
                        raise Unavailable(f"no endpoint could serve the request after {attempts} attempt(s): "
                                          + "; ".join(failures)) from None
                    metrics.RETRIES.labels(reason=exc.why.split(" ")[0]).inc()
                    log.warning("retrying on another endpoint",
                                extra={"request_id": p.request_id, "endpoint": failed, "why": exc.why})
                except BaseException:
                    self.settle(p, d)
                    raise
        except RouterError as exc:
            span.set_attribute("kvmesh.error", type(exc).__name__)
            span.set_status(trace.Status(trace.StatusCode.ERROR, exc.message))
            raise
        finally:
            span.end()

    def _trace_decision(self, span: trace.Span, d: Decision, split: SplitDecision, attempts: int) -> None:
        span.set_attribute("kvmesh.route.policy", d.policy)
        span.set_attribute("kvmesh.route.endpoint", d.endpoint_id)
        span.set_attribute("kvmesh.route.reason", d.reason)
        span.set_attribute("kvmesh.route.score", d.score)
        span.set_attribute("kvmesh.route.predicted_cached_tokens", d.predicted_cached_tokens)
        span.set_attribute("kvmesh.route.predicted_cached_tokens_gpu", d.predicted_cached_tokens_gpu)
        span.set_attribute("kvmesh.route.predicted_cached_tokens_offload", d.predicted_cached_tokens_offload)
        span.set_attribute("kvmesh.route.uncached_tokens", d.uncached_tokens)
        span.set_attribute("kvmesh.route.fallback", d.fallback)
        span.set_attribute("kvmesh.route.attempt", attempts)
        span.set_attribute("kvmesh.route.moved", d.moved)
        span.set_attribute("kvmesh.route.given_up_tokens", d.given_up_tokens)
        span.set_attribute("kvmesh.route.candidates",
                           [f"{c.endpoint_id}:cost={c.cost:.3f}s:cached={c.credit_blocks:g}:q={c.queue:g}"
                            + (f":{c.excluded}" if c.excluded else "") for c in d.candidates[:16]])
        win = d.chosen()
        if win is not None:
            # The winner's cost by term (routing.scoring): which part of the estimate decided.
            for term in COST_TERMS:
                span.set_attribute(f"kvmesh.route.cost.{term}", getattr(win, term))
        span.set_attribute("kvmesh.split", split.split)
        span.set_attribute("kvmesh.split.reason", split.reason)
        span.set_attribute("kvmesh.split.prefill_endpoint", split.prefill_endpoint)
        for k, v in split.inputs.items():
            span.set_attribute(f"kvmesh.split.{k}", v)

    def _remaining(self, inp: GenInput) -> float | None:
        if inp.deadline is None:
            return None
        rem = inp.deadline - time.monotonic()
        if rem <= 0:
            raise DeadlineExceeded("deadline exceeded")
        return rem

    async def _prefill(self, p: Prepared, inp: GenInput, split: SplitDecision,
                       parent: trace.Span) -> common_pb2.KvHandle | None:
        """Run the prompt on the prefill endpoint; None means "prefill locally instead"."""
        with _tracer.start_as_current_span("router.prefill", context=trace.set_span_in_context(parent)) as span:
            span.set_attribute("kvmesh.prefill_endpoint", split.prefill_endpoint)
            self.core.load.on_sent(split.prefill_endpoint, prefill_request_id(p.engine_id), len(p.tokens),
                                   time.monotonic())
            try:
                resp = await self.cluster.stub(split.prefill_endpoint).Prefill(
                    worker_pb2.PrefillRequest(request_id=prefill_request_id(p.engine_id), model=inp.model,
                                              prompt_token_ids=p.tokens, sampling=inp.sampling,
                                              cache_salt=p.salt, lora_name=inp.lora_name,
                                              session_id=p.req.session_id),
                    timeout=self._remaining(inp))
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise DeadlineExceeded("deadline exceeded during prefill") from None
                if exc.code() in _RETRYABLE:
                    self.cluster.mark_dead(split.prefill_endpoint, f"Prefill {exc.code().name}")
                log.warning("prefill endpoint failed; decoding with local prefill",
                            extra={"request_id": p.request_id, "endpoint": split.prefill_endpoint,
                                   "code": exc.code().name})
                span.set_attribute("kvmesh.prefill_failed", exc.code().name)
                return None
            finally:
                self.core.load.on_finished(prefill_request_id(p.engine_id))
            p.prefill_usage = resp.usage
            return resp.handle

    # -- hedging the first token ---------------------------------------------------------
    async def _attempt(self, p: Prepared, inp: GenInput, d: Decision, split: SplitDecision, attempt: int,
                       overhead: float, span: trace.Span, exclude: set[str], failures: list[str]
                       ) -> AsyncIterator[tuple[str, Any]]:
        """One try on ``d``; with hedging on, and no first token after ``hedge_delay_s``, a copy
        races it on the next best endpoint (budget permitting). The first to yield wins and the
        other is cancelled, which aborts its engine request and releases its in-flight count.
        A split try is hedged too: its first token waits on the prefill endpoint, the transfer
        and the decode endpoint, any of which can stall; the copy runs unsplit on another decode
        endpoint, and a lost split's prefill call is cancelled with it (kvmesh workers and
        external engines alike).

        The caller owns the first try (settles it on failure); this owns the copy. A try that
        fails while the other still runs is recorded here (``failures``, ``exclude``); when both
        fail, the last failure is raised, naming its endpoint.
        """
        primary = self._run(p, inp, d, split, attempt, overhead, span)
        delay = self.cfg.hedge_delay_s
        if delay <= 0:
            async for item in primary:
                yield item
            return
        first = asyncio.ensure_future(_next_item(primary))
        tries: dict[asyncio.Future, _Try] = {first: (p, d, primary)}
        hedge: _Try | None = None
        winner: _Try | None = None
        try:
            done, _ = await asyncio.wait({first}, timeout=delay)
            if not done:
                hedge = await self._start_hedge(p, inp, d, attempt, overhead, span, exclude)
            if hedge is None:
                item = await first
                winner = tries.pop(first)
            else:
                tries[asyncio.ensure_future(_next_item(hedge[2]))] = hedge
                fut, item = await self._race(tries, primary, exclude, failures)
                winner = tries.pop(fut)
                loser = hedge if winner[2] is primary else (p, d, primary)
                for fut in list(tries):   # cancel the loser's call (aborts its engine request)
                    await self._drop_try(fut, tries.pop(fut)[2])
                self.settle(loser[0], loser[1])
                won = winner[2] is not primary
                inp.predicted_cached_tokens = winner[1].predicted_cached_tokens
                metrics.HEDGES.labels(event="won" if won else "lost").inc()
                msg = f"hedged after {delay:g}s: {winner[1].endpoint_id} answered before {loser[1].endpoint_id}"
                span.add_event("hedge_done", {"winner": winner[1].endpoint_id, "loser": loser[1].endpoint_id})
                log.info("hedged request answered", extra={
                    "request_id": p.request_id, "endpoint": winner[1].endpoint_id, "hedge_won": won})
                if item[0] == "final":
                    item[1].routing.reason += "; " + msg
                else:
                    winner[1].reason += "; " + msg   # read when the final message is built
            yield item
            wp, wd, wgen = winner
            try:
                async for item in wgen:
                    yield item
            except BaseException:
                if wgen is not primary:
                    self.settle(wp, wd)
                raise
        finally:
            for fut in list(tries):
                await self._drop_try(fut, tries.pop(fut)[2])
            if hedge is not None and winner is None:
                self.settle(hedge[0], hedge[1])   # the caller settles the first try

    async def _race(self, tries: dict[asyncio.Future, _Try], primary: AsyncIterator[tuple[str, Any]],
                    exclude: set[str], failures: list[str]) -> tuple[asyncio.Future, tuple[str, Any]]:
        """The try that yields first, with its first item. A try that fails before its first
        token while the other runs is recorded and released; the last failure is raised."""
        while True:
            done, _ = await asyncio.wait(tries, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=lambda f: tries[f][2] is not primary):   # a tie goes to the first try
                exc = fut.exception()
                if exc is None:
                    return fut, fut.result()
                tp, td, gen = tries.pop(fut)
                if not tries or not isinstance(exc, _BeforeFirstToken):
                    if gen is not primary:
                        self.settle(tp, td)
                        if isinstance(exc, _BeforeFirstToken):
                            exc.endpoint = td.endpoint_id
                    raise exc
                failures.append(f"{td.endpoint_id}: {exc.why}")
                if exc.mark_dead:
                    self.cluster.mark_dead(td.endpoint_id, exc.why)
                exclude.add(td.endpoint_id)
                self.settle(tp, td)

    async def _start_hedge(self, p: Prepared, inp: GenInput, d: Decision, attempt: int, overhead: float,
                           span: trace.Span, exclude: set[str]
                           ) -> _Try | None:
        """Decide and send the copy, or None (budget spent, no other endpoint)."""
        if inp.deadline is not None and time.monotonic() >= inp.deadline:
            return None
        if not self.hedge_budget.take():
            metrics.HEDGES.labels(event="denied").inc()
            return None
        # Its own in-flight entry (the load view is keyed by request id) and its own variant pick.
        hp = dataclasses.replace(p, variants=list(p.variants))
        try:
            with trace.use_span(span, end_on_exit=False):
                hd, _ = await self.decide(hp, inp.policy, exclude | {d.endpoint_id})
        except Unavailable:
            self.hedge_budget.tokens += 1.0   # not spent
            metrics.HEDGES.labels(event="no_endpoint").inc()
            return None
        hp.req = dataclasses.replace(hp.req, request_id=f"{p.engine_id}-h{attempt}")
        no_split = SplitDecision(split=False)
        self.record_routed(hp, hd, no_split)
        metrics.HEDGES.labels(event="sent").inc()
        span.add_event("hedge", {"endpoint": hd.endpoint_id, "after_s": self.cfg.hedge_delay_s,
                                 "first": d.endpoint_id})
        log.info("hedging the first token on another endpoint", extra={
            "request_id": p.request_id, "endpoint": hd.endpoint_id, "first": d.endpoint_id})
        return hp, hd, self._run(hp, inp, hd, no_split, attempt, overhead, span, worker_rid=hp.req.request_id)

    @staticmethod
    async def _drop_try(fut: asyncio.Future, gen: AsyncIterator[tuple[str, Any]]) -> None:
        """End a try that lost (or whose request ended): ``_run``'s cleanup cancels its worker
        call, which aborts the engine request."""
        if not fut.done():
            fut.cancel()
        await asyncio.wait({fut})
        if not fut.cancelled():
            fut.exception()   # retrieved: the loser's own error is not the request's
        await gen.aclose()   # type: ignore[attr-defined]

    async def _run(self, p: Prepared, inp: GenInput, d: Decision, split: SplitDecision, attempt: int,
                   overhead: float, span: trace.Span, worker_rid: str = "") -> AsyncIterator[tuple[str, Any]]:
        if d.endpoint_id in self.cluster.external:   # a plain vLLM (also as a hedge): its completions API
            async for item in self._run_external(p, inp, d, split, attempt, overhead, span, worker_rid):
                yield item
            return
        handle = await self._prefill(p, inp, split, span) if split.split else None
        wreq = worker_pb2.GenerateRequest(
            request_id=worker_rid or p.try_id(attempt),
            model=inp.model,
            prompt_token_ids=p.tokens, sampling=inp.sampling, cache_salt=p.salt, lora_name=inp.lora_name,
            session_id=p.req.session_id)
        if inp.sampling.max_tokens == 0:
            # As vLLM: what is left of max_model_len (unless the router is configured with a default).
            wreq.sampling.max_tokens = self.cfg.max_tokens_default or max(1, self.max_model_len() - len(p.tokens))
        if handle is not None:
            wreq.kv_handle.CopyFrom(handle)
        creq = inp.chat_request
        if creq is not None and creq.tools_active:
            # The worker parses the answer's tool calls (vLLM's parser, or the sim's tool mode).
            wreq.tools_json = json.dumps(creq.tools)
            wreq.tool_choice_json = json.dumps(creq.effective_tool_choice)
            if not creq.parallel_tool_calls:
                wreq.parallel_tool_calls = False
        if creq is not None or inp.chat is not None:
            # A chat answer: a worker with a reasoning parser splits off its reasoning, reading the
            # template keywords the prompt was rendered with (the engine's own override the client's).
            wreq.parse_reasoning = True
            kwargs = creq.rendered_kwargs if creq is not None else {}
            if kwargs:
                wreq.chat_template_kwargs_json = json.dumps(kwargs)
        try:
            with trace.use_span(span, end_on_exit=False):   # trace context goes out with the call
                call = self.cluster.stub(d.endpoint_id).Generate(wreq, timeout=self._remaining(inp))
        except KeyError:
            raise _BeforeFirstToken("endpoint vanished") from None
        generated: list[int] = []
        ttft = 0.0
        t_start = time.monotonic()
        inp.calls.append(call)
        try:
            final: FinalInfo | None = None
            while True:
                msg = await self._read(call, d, generated)
                if msg is grpc.aio.EOF:
                    break
                if final is not None:
                    continue   # read to the stream's end: the call (and its client span) then completes
                ids = list(msg.token_ids)
                if ids:
                    if not generated:
                        self.core.on_first_token(p.req, time.monotonic())
                        ttft = msg.ttft_s or (time.monotonic() - t_start)
                    generated.extend(ids)
                if msg.parsed:
                    yield "parsed", Parsed(msg.content_delta, _first_call_only(inp, msg.tool_call_deltas),
                                           msg.reasoning_delta if inp.include_reasoning else "")
                if ids:
                    yield "chunk", ids
                if msg.finished:
                    final = self._final(p, inp, d, split, handle, msg, generated, ttft, attempt, overhead,
                                        span)
            if final is not None:
                yield "final", final
                return
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="stream ended without a final message")
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeadlineExceeded(f"deadline exceeded after {len(generated)} generated tokens") from None
            if generated:
                raise StreamBroken(f"endpoint {d.endpoint_id} failed ({code.name}: {exc.details()}) after "
                                   f"{len(generated)} generated tokens: {generated}", generated) from None
            if code in _RETRYABLE:
                raise _BeforeFirstToken(f"{code.name}: {exc.details()}") from None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise _BeforeFirstToken(f"{code.name}: {exc.details()}", mark_dead=False) from None
            raise UpstreamError(f"endpoint {d.endpoint_id}: {exc.details()}", code) from None
        finally:
            inp.calls.remove(call)
            if not call.done():
                call.cancel()

    async def _run_external(self, p: Prepared, inp: GenInput, d: Decision, split: SplitDecision, attempt: int,
                            overhead: float, span: trace.Span, worker_rid: str = ""
                            ) -> AsyncIterator[tuple[str, Any]]:
        """``_run`` for an external vLLM: the token ids through its completions API (``external_generate``)."""
        url = self.cluster.external.urls.get(d.endpoint_id)
        if url is None:
            raise _BeforeFirstToken("endpoint vanished", mark_dead=False)
        max_tokens = inp.sampling.max_tokens or self.cfg.max_tokens_default or max(
            1, self.max_model_len() - len(p.tokens))
        body = external_generate.request_body(inp.model, p.tokens, inp.sampling, max_tokens, p.salt)
        headers = {"x-request-id": worker_rid or p.try_id(attempt)}
        with trace.use_span(span, end_on_exit=False):
            propagate.inject(headers)
        ext = self.cluster.external
        held: int | None = None
        if split.split:
            d, held = await self._prefill_external(p, inp, d, split, body, headers, span)
        done = external_generate.Completion()
        generated: list[int] = []
        ttft = 0.0
        t_start = time.monotonic()
        self._remaining(inp)   # DeadlineExceeded when already past it
        try:
            async for ids in external_generate.stream_tokens(
                    ext.client, url, body, {**ext.headers, **headers, **ext.rank_headers(d.endpoint_id)},
                    ext.connect_timeout_s, self.cfg.first_token_timeout_s, self.cfg.stream_idle_timeout_s, done,
                    inp.deadline):
                if not generated:
                    self.core.on_first_token(p.req, time.monotonic())
                    ttft = time.monotonic() - t_start
                generated.extend(ids)
                yield "chunk", ids
        except external_generate.Deadline:
            raise DeadlineExceeded(f"deadline exceeded after {len(generated)} generated tokens") from None
        except external_generate.NoAnswer as exc:
            raise _BeforeFirstToken(exc.why, mark_dead=exc.mark_dead) from None
        except external_generate.Rejected as exc:
            code = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
                    422: grpc.StatusCode.INVALID_ARGUMENT}.get(exc.status, grpc.StatusCode.UNKNOWN)
            raise UpstreamError(f"endpoint {d.endpoint_id}: {exc.message}", code) from None
        except external_generate.Broken as exc:
            raise StreamBroken(f"endpoint {d.endpoint_id} failed ({exc}) after {len(generated)} generated "
                               f"tokens: {generated}", generated) from None
        msg = worker_pb2.GenerateResponse(finished=True, finish_reason=done.finish_reason)
        if done.usage_seen:
            msg.usage.prompt_tokens = done.prompt_tokens
            msg.usage.completion_tokens = done.completion_tokens
            msg.usage.cached_tokens = done.cached_tokens
        if held:
            # The decode engine found more than its own GPU cache held: the store's copy of the prefill.
            msg.kv_from_prefill = done.cached_tokens > d.predicted_cached_tokens_gpu
        yield "final", self._final(p, inp, d, split, None, msg, generated, ttft, attempt, overhead, span,
                                   via_store=held is not None)

    async def _prefill_external(self, p: Prepared, inp: GenInput, d: Decision, split: SplitDecision,
                                body: dict[str, Any], headers: dict[str, str], span: trace.Span
                                ) -> tuple[Decision, int | None]:
        """The split toward external engines (``external_split``): the prefill engine computes the
        prompt and its connector saves it to the store; the decision then counts what the store
        holds, which the decode engine's connector restores. None: the prefill failed (the decode
        engine computes the prompt; only the split is lost)."""
        with _tracer.start_as_current_span("router.prefill", context=trace.set_span_in_context(span)) as pspan:
            pspan.set_attribute("kvmesh.prefill_endpoint", split.prefill_endpoint)
            done = await external_split.prefill(
                self.cluster, self.core.load, self.cfg, p.engine_id, p.req.keys, p.req.num_tokens,
                p.req.block_size, len(p.tokens), split.prefill_endpoint, "/v1/completions",
                external_split.prefill_body(body), {"content-type": "application/json", **headers}, inp.deadline)
            if done is None:
                pspan.set_attribute("kvmesh.prefill_failed", "external")
                d.reason += "; split: the prefill engine failed, the decode engine computes the prompt"
                return d, None
            held = done.held_blocks
            pspan.set_attribute("kvmesh.prefill_store_blocks", held)
            p.prefill_usage = done.usage()
        tokens = max(d.predicted_cached_tokens, held * p.req.block_size)
        d = dataclasses.replace(d, predicted_cached_tokens_offload=tokens - d.predicted_cached_tokens_gpu)
        inp.predicted_cached_tokens = d.predicted_cached_tokens
        return d, held

    async def _read(self, call: Any, d: Decision, generated: list[int]) -> Any:
        """The next message of a worker stream, or EOF, within the first-token or idle timeout.

        A hung worker (stopped, deadlocked, partitioned) keeps its TCP connection, so only
        silence shows it: before the first token the try is retried on another endpoint; after
        it the client gets a clean error naming what was already sent, never an endless stall.
        """
        limit = self.cfg.stream_idle_timeout_s if generated else self.cfg.first_token_timeout_s
        if not limit:
            return await call.read()
        try:
            async with asyncio.timeout(limit):   # no task per token, unlike wait_for
                return await call.read()
        except TimeoutError:
            call.cancel()
            if generated:
                metrics.STALLS.labels(stage="stream").inc()
                raise StreamBroken(f"endpoint {d.endpoint_id} silent for {limit:g}s after {len(generated)} "
                                   f"generated tokens: {generated}", generated) from None
            metrics.STALLS.labels(stage="first_token").inc()
            raise _BeforeFirstToken(f"STALLED: no token within {limit:g}s") from None

    def observe_engine_cached(self, endpoint_id: str, predicted: int, actual: int) -> None:
        """A request that ran on ``endpoint_id`` without a split: how much of its predicted hit the
        engine found, for the split rule (``kvmesh.routing.survival``) and the operator's gauge."""
        self.core.on_engine_cached(endpoint_id, predicted, actual)
        if predicted > 0:
            metrics.HIT_SURVIVAL.labels(endpoint=endpoint_id).set(self.core.survival.rate(endpoint_id))

    @staticmethod
    def count_reuse(p: Prepared, usage: common_pb2.Usage, split: bool) -> tuple[int, int]:
        """The hit-rate counters, and the request's (reused, transferred) tokens for its
        ``RoutingDecision``. Reused: tokens no engine computed for the request. A split's
        decode endpoint reports the prefill endpoint's KV as restored, but that KV was computed
        for this request; counted as reuse it made a policy that splits more look like it hits
        more (a live A/B with kv-cache-tester, docs/bench-history.md). Its reuse is what the
        prefill endpoint found cached, cut to what the decode endpoint did not compute again (the
        store can lose the transfer before the restore: ``kvmesh.routing.split_reuse``); the rest
        of the decode endpoint's count is transferred. A split whose prefill endpoint reported no
        usage (an external engine without ``--enable-prompt-tokens-details``) keeps the decode
        endpoint's count."""
        gpu, offload, transferred = usage.cached_tokens_gpu, usage.cached_tokens_offload, 0
        if not gpu and not offload:
            gpu = usage.cached_tokens   # an external engine's usage names no tier
        if split and p.prefill_usage is not None:
            r = split_reuse(p.prefill_usage.cached_tokens_gpu, p.prefill_usage.cached_tokens_offload,
                            usage.cached_tokens)
            gpu, offload, transferred = r.gpu, r.offload, r.transferred
            metrics.TRANSFERRED_TOKENS.inc(transferred)
            metrics.SPLIT_LOST_TOKENS.inc(r.lost)
        metrics.CACHED_TOKENS.labels(tier="gpu").inc(gpu)
        metrics.CACHED_TOKENS.labels(tier="offload").inc(offload)
        return gpu + offload, transferred

    @staticmethod
    def count_moved(d: Decision, prompt_tokens: int, reused_tokens: int) -> None:
        """The moved-turn counters: a request its router sent away from its session's previous
        endpoint (``Decision.moved``), with its prompt and what it reused, so an operator reads
        what moves cost in hit rate the way the simulator reports it (``moved_hit_rate``), and
        what the moves chose to give up (``moved_given_up_share``)."""
        if d.moved:
            metrics.MOVED_REQUESTS.inc()
            metrics.MOVED_PROMPT_TOKENS.inc(prompt_tokens)
            metrics.MOVED_CACHED_TOKENS.inc(reused_tokens)
            metrics.MOVED_GIVEN_UP_TOKENS.inc(d.given_up_tokens)

    def _final(self, p: Prepared, inp: GenInput, d: Decision, split: SplitDecision,
               handle: common_pb2.KvHandle | None, msg: worker_pb2.GenerateResponse, generated: list[int],
               ttft: float, attempt: int, overhead: float, span: trace.Span,
               via_store: bool = False) -> FinalInfo:
        """The final message. ``via_store``: the prompt went through an external prefill engine
        and the store (predicted exactly, unlike a kvmesh worker's handle)."""
        split_done = handle is not None or via_store
        usage = common_pb2.Usage()
        usage.CopyFrom(msg.usage)
        bs = p.req.block_size
        predicted, predicted_gpu = d.predicted_cached_tokens, d.predicted_cached_tokens_gpu
        if handle is not None:
            # A split: the decode endpoint reuses the prefill endpoint's KV once it has arrived,
            # which the router planned; predict that, not the decode endpoint's cache before.
            predicted = split_predicted_blocks(p.req.num_tokens, bs, d.predicted_cached_tokens // bs) * bs
            predicted_gpu = min(predicted_gpu, predicted)
        if not usage.prompt_tokens:
            usage.prompt_tokens = len(p.tokens)
        if not usage.completion_tokens:
            usage.completion_tokens = len(generated)
        routing = router_pb2.RoutingDecision(
            endpoint=d.endpoint_id, endpoint_address=self.core.endpoints[d.endpoint_id].address
            if d.endpoint_id in self.core.endpoints else "", policy=d.policy,
            predicted_cached_tokens=predicted,
            predicted_cached_tokens_gpu=predicted_gpu,
            predicted_cached_tokens_offload=predicted - predicted_gpu,
            split=split_done, prefill_endpoint=split.prefill_endpoint if split_done else "",
            uncached_tokens=d.uncached_tokens, score=d.score, attempts=attempt,
            reason=d.reason + (f"; split: {split.reason}" if split.reason else ""),
            kv_from_prefill=msg.kv_from_prefill, routing_overhead_ms=overhead * 1000.0,
            decision_ms=inp.decision_s * 1000.0, tokenize_ms=inp.tokenize_s * 1000.0, hash_ms=inp.hash_s * 1000.0,
            lookup_ms=inp.lookup_s * 1000.0, moved=d.moved, given_up_tokens=d.given_up_tokens)
        actual = usage.cached_tokens
        if not split_done:
            self.observe_engine_cached(d.endpoint_id, d.survival_predicted_tokens, actual)
        metrics.PROMPT_TOKENS.inc(usage.prompt_tokens)
        routing.reused_tokens, routing.transferred_tokens = self.count_reuse(p, usage, split=split_done)
        self.count_moved(d, usage.prompt_tokens, routing.reused_tokens)
        metrics.PREDICTED_TOKENS.inc(predicted)
        routing.mismatch = self._mismatch(p, d, msg, actual, handle is not None, predicted)
        if self.cfg.local_view_ttl_s > 0:
            # The engine now holds this prompt (a split's decode endpoint too, once its KV
            # arrived): a lookup past its deadline can still find it.
            self.cluster.local_view.served(d.endpoint_id, p.req.keys, time.monotonic())
        metrics.CACHED_DIFF.observe(int(actual) - predicted)
        if actual != predicted:
            metrics.MISMATCHES.inc()
            log.info("predicted cached tokens differ from the engine's",
                     extra={"request_id": p.request_id, "endpoint": d.endpoint_id, "cause": routing.mismatch,
                            "predicted": predicted, "actual": actual, "split": handle is not None})
        span.set_attribute("kvmesh.usage.cached_tokens", actual)
        span.set_attribute("kvmesh.usage.completion_tokens", usage.completion_tokens)
        # OpenTelemetry GenAI semantic conventions, so trace UIs show the request's shape.
        span.set_attribute("gen_ai.request.model", p.req.model)
        span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
        span.set_attribute("gen_ai.usage.cached_tokens", actual)
        span.set_attribute("gen_ai.usage.cached_tokens_predicted", predicted)
        span.set_attribute("gen_ai.latency.time_to_first_token", ttft)
        self.settle(p, d, generated)
        return FinalInfo(usage, msg.finish_reason or common_pb2.FINISH_REASON_STOP, routing, p.request_id,
                         ttft, generated, _first_call_only(inp, msg.tool_calls),
                         msg.content if msg.HasField("content") else None,
                         (msg.reasoning if inp.include_reasoning else "") if msg.HasField("reasoning") else None)
