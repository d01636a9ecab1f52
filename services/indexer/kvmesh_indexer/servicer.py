"""gRPC ``kvmesh.indexer.v1.Indexer``: lookups, ingest, registration, stats.

Why it is thin: the rules live in ``kvmesh.index`` (backends, ingest core,
liveness) so the simulator can reuse them; this module validates requests,
maps errors to gRPC status codes, keeps blocking backend calls off the event
loop within the caller's deadline, and wires registrations to ZMQ
subscriptions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from opentelemetry import trace

from kvmesh.events.codec import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvmesh.hashing import BlockHasher, ExtraKeys, HashAlgo, MMRange
from kvmesh.index.base import MAX_SPECULATIVE_TTL_S, BlockIndex, IndexUnavailable, LookupResult, Tier
from kvmesh.index.packed import PackedKeys
from kvmesh.rpc.authz import peer_identity
from kvmesh.rpc.peers import LOCAL, LOOPBACK, peer_host
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.indexer.v1 import indexer_pb2, indexer_pb2_grpc
from kvmesh_indexer.central_socket import AdmitError, replay_address
from kvmesh_indexer.config import EngineConfig, IndexerConfig
from kvmesh_indexer.ingest import Ingestor
from kvmesh_indexer.keys import EngineHashing, ModelSpec, check_block_size
from kvmesh_indexer.liveness import Liveness
from kvmesh_indexer.pump import EndpointSource, IngestPump
from kvmesh_indexer.zmq_subscriber import ZmqSubscriber

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("kvmesh.indexer")
T = TypeVar("T")

MAX_CHAIN = 65_536
MAX_TOKENS = 1_048_576
MAX_PAYLOAD = 16 * 1024 * 1024
_MAX_U64 = (1 << 64) - 1   # a publisher may send seq 2^64-1; the count must still fit the field
MAX_SALT = 256

_ALGO_NAMES = {common_pb2.HASH_ALGO_SHA256: "sha256", common_pb2.HASH_ALGO_SHA256_CBOR: "sha256_cbor",
               common_pb2.HASH_ALGO_XXHASH: "xxhash", common_pb2.HASH_ALGO_XXHASH_CBOR: "xxhash_cbor"}
_MEDIUM = {common_pb2.TIER_UNSPECIFIED: "GPU", common_pb2.TIER_GPU: "GPU", common_pb2.TIER_CPU: "CPU",
           common_pb2.TIER_DISK: "STORAGE"}


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _plaintext_host(context: grpc.aio.ServicerContext) -> str | None:
    """The caller's host when it has no mTLS identity (roles decide then), else None."""
    if peer_identity(context) is not None:
        return None
    return peer_host(context.peer() or "")


class IndexerServicer(indexer_pb2_grpc.IndexerServicer):
    def __init__(self, cfg: IndexerConfig, index: BlockIndex, ingestor: Ingestor, pump: IngestPump,
                 subscriber: ZmqSubscriber, liveness: Liveness) -> None:
        self.cfg = cfg
        self.index = index
        self.ingestor = ingestor
        self.pump = pump
        self.subscriber = subscriber
        self.liveness = liveness
        self.models: dict[str, ModelSpec] = ingestor.models
        self.store_models = cfg.store_model_names()
        self._hashers: dict[str, BlockHasher] = {}
        self.started_at = time.monotonic()
        self.first_seen: dict[str, float] = {}
        # Without mTLS: the host each endpoint registered from (the only fact about a plaintext caller).
        self.registrars: dict[str, str] = {}
        self.counters: dict[str, int] = {}
        self.central_bound: list[str] = []   # addresses of the central socket, once bound
        # Lookups get threads of their own: on the default executor they queued behind every
        # endpoint's ingest batch and re-sync (measured: 22 ms on average, up to 0.2 s, in a soak).
        self._lookup_pool = ThreadPoolExecutor(max(1, cfg.lookup_threads), thread_name_prefix="lookup")

    # ---- helpers ---------------------------------------------------------------------------
    def _bump(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    async def _backend(self, context: grpc.aio.ServicerContext | None, fn: Callable[..., T], *args: Any,
                       timeout: float | None = None, pool: ThreadPoolExecutor | None = None) -> T:
        """Run a backend call within the deadline; UNAVAILABLE when it fails or is too slow."""
        limit = self._limit(context, timeout)
        with self._unavailable(limit):
            if self.index.blocking:
                work = (asyncio.get_running_loop().run_in_executor(pool, fn, *args) if pool is not None
                        else asyncio.to_thread(fn, *args))
                return await asyncio.wait_for(work, timeout=limit)
            return fn(*args)

    async def _backend_async(self, context: grpc.aio.ServicerContext | None, work: Awaitable[T]) -> T:
        """``_backend`` for a backend call that runs on the event loop (``lookup_async``)."""
        limit = self._limit(context, None)
        with self._unavailable(limit):
            return await asyncio.wait_for(work, timeout=limit)

    def _limit(self, context: grpc.aio.ServicerContext | None, timeout: float | None) -> float:
        """The backend's time: its own timeout (lookup's by default), within the caller's deadline."""
        limit = timeout if timeout is not None else self.cfg.lookup_timeout_s
        if context is not None:
            remaining = context.time_remaining()
            if remaining is not None:
                limit = max(0.001, min(limit, remaining - 0.01))
        return limit

    @staticmethod
    @contextlib.contextmanager
    def _unavailable(limit: float) -> Iterator[None]:
        """A backend that fails or misses ``limit`` is UNAVAILABLE to the caller."""
        try:
            yield
        except IndexUnavailable as exc:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, f"index backend unavailable: {exc}") from exc
        except TimeoutError:
            raise _Abort(grpc.StatusCode.UNAVAILABLE,
                         f"index backend did not answer within {limit:.3f}s") from None

    async def _guard(self, context: grpc.aio.ServicerContext, coro: Awaitable[T]) -> T:
        try:
            return await coro
        except _Abort as exc:
            await context.abort(exc.code, exc.message)
            raise  # unreachable: abort raises

    def model_spec(self, name: str, *, create_from: indexer_pb2.Endpoint | None = None) -> ModelSpec:
        spec = self.models.get(name)
        if spec is None and create_from is not None and self.cfg.auto_models:
            algo = _ALGO_NAMES.get(create_from.hash_algo, self.cfg.default_hash_algo)
            spec = ModelSpec(name, create_from.block_size or self.cfg.default_block_size, algo)
            self.models[name] = spec
            log.info("model created from registration", extra={"model": name, "block_size": spec.block_size,
                                                                 "hash_algo": spec.hash_algo})
        if spec is None:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"unknown model {name!r} (configured: {', '.join(sorted(self.models)) or 'none'})")
        return spec

    def hasher(self, spec: ModelSpec) -> BlockHasher:
        h = self._hashers.get(spec.name)
        if h is None:
            h = self._hashers[spec.name] = spec.hasher()
        return h

    def _model_name(self, requested: str) -> str:
        name = requested or self.cfg.default_model
        if not name:
            if len(self.models) == 1:
                return next(iter(self.models))
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "model is required (no default_model configured)")
        return name

    # ---- static configuration ------------------------------------------------------------
    async def add_static_engine(self, eng: EngineConfig) -> None:
        rec = self.liveness.add_static(eng.endpoint_id, indexer_pb2.Endpoint(
            endpoint_id=eng.endpoint_id, model=eng.model, kv_events_endpoint=eng.zmq_endpoint,
            kv_events_replay_endpoint=eng.replay_endpoint or "", subscriber_binds=eng.bind,
            block_size=eng.block_size or 0))
        self.first_seen.setdefault(eng.endpoint_id, time.monotonic())
        sub = await self.subscriber.add(EndpointSource(eng.endpoint_id, eng.model, eng.hashing(),
                                                       eng.replay_endpoint), eng.zmq_endpoint, eng.bind)
        if sub.bound_endpoint and eng.zmq_endpoint.endswith((":0", ":*")):
            rec.info.kv_events_endpoint = sub.bound_endpoint   # listed with the port its bind got

    # ---- central socket --------------------------------------------------------------------
    async def admit_central(self, endpoint: str, model: str, topic_endpoint: str = "", dp_rank: int = 0
                            ) -> EndpointSource:
        """Admit an endpoint named by a topic on the central socket (DP rank ``dp_rank`` of the engine
        the topic names); ``AdmitError`` says why not."""
        if len(endpoint.encode()) > 128:
            raise AdmitError("bad_endpoint", f"endpoint id of {len(endpoint.encode())} bytes (max 128)")
        rec = self.liveness.records.get(endpoint)
        if endpoint in self.subscriber.subs or (rec is not None and not rec.purged):
            # Two feeds with independent sequence numbers would clear each other's entries.
            raise AdmitError("endpoint_conflict", f"endpoint {endpoint!r} is already configured or registered")
        if model in self.store_models:
            raise AdmitError("unknown_model", f"model {model!r} is reserved for offload stores")
        try:
            self.model_spec(model, create_from=indexer_pb2.Endpoint(model=model))
        except _Abort as exc:
            raise AdmitError("unknown_model", exc.message) from None
        replay = None
        if self.cfg.kv_events_replay:
            try:
                replay = replay_address(self.cfg.kv_events_replay, topic_endpoint or endpoint, dp_rank)
            except ValueError as exc:
                raise AdmitError("bad_endpoint", str(exc)) from None
        engine = EngineHashing(self.cfg.kv_events_hash_algo or None, None, True)
        self.liveness.add_static(endpoint, indexer_pb2.Endpoint(
            endpoint_id=endpoint, model=model, kv_events_endpoint=",".join(self.central_bound),
            kv_events_replay_endpoint=replay or "", subscriber_binds=True))
        self.first_seen.setdefault(endpoint, time.monotonic())
        src = EndpointSource(endpoint, model, engine, replay)
        self.pump.configure(src)
        return src

    async def purge_central(self, endpoint: str, reason: str) -> int:
        blocks = await self.purge(endpoint, reason)
        self.liveness.deregister(endpoint)
        return blocks

    # ---- Lookup ---------------------------------------------------------------------------
    async def Lookup(self, request: indexer_pb2.LookupRequest, context: grpc.aio.ServicerContext
                     ) -> indexer_pb2.LookupResponse:
        return await self._guard(context, self._lookup(request, context))

    async def _lookup(self, request: indexer_pb2.LookupRequest, context: grpc.aio.ServicerContext
                      ) -> indexer_pb2.LookupResponse:
        with _tracer.start_as_current_span("indexer.lookup") as span:
            model = self._model_name(request.model)
            span.set_attribute("kvmesh.model", model)
            which = request.WhichOneof("query")
            hashed: list[int] | None = None
            if which == "chain":
                keys = self._chain_keys(request.chain)
                if not keys:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "empty chain")
                if len(keys) > MAX_CHAIN:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"chain of {len(keys)} keys exceeds {MAX_CHAIN}")
                spec = self.models.get(model)
            elif which == "tokens":
                spec = self.model_spec(model)
                if spec.block_size <= 0:  # a store's wildcard model ("any"): it has no token blocks
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"model {model!r} has no block size: look it up by chain, not tokens")
                ids = request.tokens.ids
                if len(ids) > MAX_TOKENS:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{len(ids)} token ids exceed {MAX_TOKENS}")
                extra = _extra_keys(request.extra_keys) if request.HasField("extra_keys") else None
                hasher = self.hasher(spec)
                tokens = list(ids)
                keys = await asyncio.to_thread(hasher.block_keys, tokens, extra) if len(tokens) > 8192 else \
                    hasher.block_keys(tokens, extra)
                hashed = keys
            else:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "query must be a chain or tokens")
            span.set_attribute("kvmesh.chain_length", len(keys))
            exclude = set(self.liveness.dead())
            filt = list(request.endpoint_filter) or None
            # How far each engine's events are applied, read BEFORE the index: the router tells
            # index lag from a view bug by it (kvmesh.routing.fidelity). Read after, it could count
            # a batch applied while the lookup was in flight (a thread, 10-200 ms under load) that
            # the answer does not reflect, and a lagging answer would pass for an up-to-date one.
            # A batch's seq is recorded only once its events are written, so read first it is a
            # lower bound of what the answer rests on.
            applied: dict[str, int] = {}
            if request.include_applied:
                for eid, st in self.ingestor.endpoints.copy().items():
                    if st.model == model:
                        applied[eid] = 0 if st.last_seq is None else min(st.last_seq + 1, _MAX_U64)
            res = LookupResult(chain_length=len(keys))
            if keys and getattr(self.index, "native_async", False):
                # On this loop (an asyncio Redis client): no hop to a lookup thread and back.
                res = await self._backend_async(context, self.index.lookup_async(  # type: ignore[attr-defined]
                    model, keys, filt, request.include_speculative, exclude, self._extra_models(model)))
            elif keys:
                res = await self._backend(context, self._lookup_all, model, keys, filt,
                                          request.include_speculative, exclude, pool=self._lookup_pool)
            resp = indexer_pb2.LookupResponse(chain_length=len(keys), block_size=spec.block_size if spec else 0)
            if hashed is not None:
                resp.keys.extend(hashed)
            for eid, n in applied.items():
                resp.applied_batches[eid] = n
            for em in sorted(res.matches.values(), key=lambda m: (-m.combined, -m.speculative, m.endpoint_id)):
                out = resp.matches.add(endpoint_id=em.endpoint_id, combined_blocks=em.combined,
                                       speculative_blocks=em.speculative, speculative_ttl_s=em.speculative_ttl_s)
                for tier in sorted(em.tiers):
                    out.tiers.add(tier=int(tier), blocks=em.tiers[tier])
            span.set_attribute("kvmesh.endpoints_matched", len(resp.matches))
            span.set_attribute("kvmesh.best_combined", res.best_combined())
            return resp

    def _chain_keys(self, chain: indexer_pb2.BlockChain) -> Sequence[int]:
        """The chain's keys; packed ones (``keys_be64``) stay packed for a Redis backend, which
        sends them to its scripts as they are (``kvmesh.index.packed``)."""
        if not chain.keys_be64:
            return list(chain.keys)
        if chain.keys:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "chain: set keys or keys_be64, not both")
        if len(chain.keys_be64) % 8:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"chain.keys_be64 of {len(chain.keys_be64)} bytes is not a multiple of 8")
        if len(chain.keys_be64) > 8 * MAX_CHAIN:   # before unpacking anything
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"chain of {len(chain.keys_be64) // 8} keys exceeds {MAX_CHAIN}")
        packed = PackedKeys(chain.keys_be64)
        return packed if self.index.blocking else packed.tolist()

    def _lookup_all(self, model: str, keys: Sequence[int], filt: list[str] | None, spec: bool,
                    exclude: set[str]) -> LookupResult:
        # Offload stores that serve every model announce blocks under a shared
        # model name; their entries answer every model's lookup, in the same call.
        return self.index.lookup(model, keys, filt, spec, exclude, self._extra_models(model))

    def _extra_models(self, model: str) -> list[str]:
        return sorted(self.store_models - {model})

    # ---- PutSpeculative -------------------------------------------------------------------
    async def PutSpeculative(self, request: indexer_pb2.PutSpeculativeRequest, context: grpc.aio.ServicerContext
                             ) -> indexer_pb2.PutSpeculativeResponse:
        async def run() -> indexer_pb2.PutSpeculativeResponse:
            if not request.endpoint_id:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "endpoint_id is required")
            eid = request.endpoint_id
            # The Redis layouts keep speculative entries as "<endpoint>=<expiry>...;" strings.
            if len(eid.encode()) > 128 or any(c in eid for c in ";=@\x1f"):
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             "endpoint_id must be 1..128 bytes without ';', '=', '@' or \\x1f")
            model = self._model_name(request.model)
            ttl = request.ttl_s or self.cfg.speculative_ttl_s
            if not 0 < ttl <= MAX_SPECULATIVE_TTL_S:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"ttl_s {request.ttl_s} must be in (0, {MAX_SPECULATIVE_TTL_S:g}]")
            if len(request.keys) > MAX_CHAIN:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{len(request.keys)} keys exceed {MAX_CHAIN}")
            if request.keys:
                await self._backend(context, self.index.put_speculative, model, request.endpoint_id,
                                    list(request.keys), ttl)
            return indexer_pb2.PutSpeculativeResponse()
        return await self._guard(context, run())

    # ---- IngestEvents ----------------------------------------------------------------------
    async def IngestEvents(self, request_iterator, context: grpc.aio.ServicerContext
                           ) -> indexer_pb2.IngestEventsResponse:
        resp = indexer_pb2.IngestEventsResponse()
        async for req in request_iterator:
            ep = req.endpoint_id
            if not ep:
                resp.batches_rejected += 1
                self.ingestor.observer.on_rejected("", "missing_endpoint_id", 1)
                log.warning("ingest batch without endpoint_id skipped")
                continue
            src = self.pump.sources.get(ep)
            model = req.model or (src.model if src else "") or self.cfg.default_model
            if not model or (model not in self.models and model not in self.store_models):
                resp.batches_rejected += 1
                self.ingestor.observer.on_rejected(ep, "unknown_model", 1)
                log.warning("ingest batch for unknown model skipped", extra={"endpoint": ep, "model": model})
                continue
            if model not in self.models:
                self.models[model] = _store_spec(model, self.cfg.default_hash_algo)
            self.first_seen.setdefault(ep, time.monotonic())
            body = req.WhichOneof("body")
            try:
                if body == "vllm_payload":
                    if len(req.vllm_payload) > min(MAX_PAYLOAD, self.cfg.max_message_bytes):
                        resp.batches_rejected += 1
                        self.ingestor.observer.on_rejected(ep, "oversize_payload", 1)
                        log.warning("oversize ingest payload skipped",
                                    extra={"endpoint": ep, "bytes": len(req.vllm_payload)})
                        continue
                    res = await self.pump.submit(ep, req.seq, payload=req.vllm_payload, model=model)
                elif body == "batch":
                    if len(req.batch.events) > self.cfg.max_batch_events:
                        resp.batches_rejected += 1
                        resp.events_rejected += len(req.batch.events)
                        self.ingestor.observer.on_rejected(ep, "oversize_batch", len(req.batch.events))
                        log.warning("oversize ingest batch skipped",
                                    extra={"endpoint": ep, "events": len(req.batch.events)})
                        continue
                    res = await self.pump.submit(ep, req.seq, batch=_from_proto_batch(req.batch), model=model)
                else:
                    resp.batches_rejected += 1
                    self.ingestor.observer.on_rejected(ep, "empty_body", 1)
                    continue
            except IndexUnavailable as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"index backend unavailable: {exc}")
                raise
            except ValueError as exc:
                resp.batches_rejected += 1
                log.warning("ingest batch rejected", extra={"endpoint": ep, "error": str(exc)})
                continue
            if res.accepted:
                resp.batches_accepted += 1
            else:
                resp.batches_rejected += 1
            resp.events_applied += res.applied
            resp.events_rejected += res.rejected
        return resp

    # ---- registration -----------------------------------------------------------------------
    async def RegisterEndpoint(self, request: indexer_pb2.RegisterEndpointRequest,
                               context: grpc.aio.ServicerContext) -> indexer_pb2.RegisterEndpointResponse:
        async def run() -> indexer_pb2.RegisterEndpointResponse:
            ep = request.endpoint
            eid = ep.endpoint_id
            if not eid or len(eid.encode()) > 128 or "@" in eid:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "endpoint_id must be 1..128 bytes without '@'")
            if request.ttl_s < 0:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"ttl_s {request.ttl_s} must be >= 0")
            model = self._model_name(ep.model)
            engine = EngineHashing(
                _ALGO_NAMES.get(ep.hash_algo), ep.block_size or None,
                # Without a declared algo the producer hashes like kvmesh (e.g. an offload store).
                ep.hash_seed_matches or ep.hash_algo == common_pb2.HASH_ALGO_UNSPECIFIED)
            if model not in self.store_models:
                spec = self.model_spec(model, create_from=ep)
                try:
                    check_block_size(eid, spec, engine)
                except ValueError as exc:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            elif model not in self.models:
                self.models[model] = _store_spec(model, self.cfg.default_hash_algo)
            for addr, what in ((ep.kv_events_endpoint, "kv_events_endpoint"),
                               (ep.kv_events_replay_endpoint, "kv_events_replay_endpoint")):
                if addr and not addr.startswith(("tcp://", "ipc://", "inproc://")):
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what} {addr!r} must be tcp://, ipc:// or inproc://")
            known = self.liveness.records.get(eid)
            host = _plaintext_host(context)
            self._check_takeover(eid, ep, known, host)
            self.liveness.register(eid, ep, request.ttl_s)
            if host is not None:
                self.registrars[eid] = host
            self.first_seen.setdefault(eid, time.monotonic())
            src = EndpointSource(eid, model, engine, ep.kv_events_replay_endpoint or None)
            if ep.kv_events_endpoint:
                try:
                    await self.subscriber.add(src, ep.kv_events_endpoint, ep.subscriber_binds)
                except ValueError as exc:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            else:
                self.pump.configure(src)
            log.info("endpoint registered", extra={"endpoint": eid, "model": model, "zmq": ep.kv_events_endpoint,
                                                   "re_register": known is not None})
            return indexer_pb2.RegisterEndpointResponse()
        return await self._guard(context, run())

    async def Heartbeat(self, request: indexer_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
                        ) -> indexer_pb2.HeartbeatResponse:
        if request.leaving:
            return await self._leave(request.endpoint_id, context)
        if not self.liveness.heartbeat(request.endpoint_id):
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"endpoint {request.endpoint_id!r} is not registered (or expired); register again")
        return indexer_pb2.HeartbeatResponse()

    async def _leave(self, eid: str, context: grpc.aio.ServicerContext) -> indexer_pb2.HeartbeatResponse:
        """An endpoint ends its own registration at shutdown: it expires now (as after a missed
        TTL) and its blocks are purged. With mTLS the role table lets only the endpoint itself
        send this; without, only the host that registered it (or the indexer's own host)."""
        host = _plaintext_host(context)
        owner = self.registrars.get(eid)
        if host is not None and owner is not None and host not in (owner, LOOPBACK, LOCAL):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"endpoint {eid!r} was registered from another host: without mTLS only that host "
                                "may end its registration")
        if not self.liveness.expire(eid):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"endpoint {eid!r} is not registered")
        await self._guard(context, self.purge(eid, "left"))
        self.liveness.mark_purged(eid)
        log.info("endpoint left", extra={"endpoint": eid})
        return indexer_pb2.HeartbeatResponse()

    async def DeregisterEndpoint(self, request: indexer_pb2.DeregisterEndpointRequest,
                                 context: grpc.aio.ServicerContext) -> indexer_pb2.DeregisterEndpointResponse:
        """Admin only: with mTLS the role table admits only ``admin``; without, only callers on the
        indexer's own host (the local admin). Endpoints leave with ``Heartbeat(leaving=true)``."""
        eid = request.endpoint_id
        host = _plaintext_host(context)
        if host is not None and host not in (LOOPBACK, LOCAL):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "without mTLS only a caller on the indexer's own host (the local admin) may "
                                f"deregister an endpoint; {eid!r} may end its own registration with "
                                "Heartbeat(leaving=true)")
        if not self.liveness.deregister(eid):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"endpoint {eid!r} is not registered")
        blocks = await self._guard(context, self.purge(eid, "deregistered"))
        return indexer_pb2.DeregisterEndpointResponse(blocks_purged=blocks)

    def _check_takeover(self, eid: str, ep: indexer_pb2.Endpoint, known: Any, host: str | None) -> None:
        """Without mTLS, a live endpoint's addresses change only from the host that registered it.

        Otherwise anyone could re-register an endpoint id with their own address and receive
        its share of prompts (issue #20, attack 1). With mTLS the role table already binds the
        id to the certificate. A registration that expired, or was deregistered, is free again.
        """
        if host is None or known is None or known.static or not self.liveness.is_alive(eid):
            return
        owner = self.registrars.get(eid)
        if owner is None or owner == host:
            return
        old = known.info
        moved = old is None or (ep.grpc_address, ep.kv_events_endpoint, ep.kv_events_replay_endpoint) != (
            old.grpc_address, old.kv_events_endpoint, old.kv_events_replay_endpoint)
        if moved:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                         f"endpoint {eid!r} is registered from another host and still alive: it can move only "
                         "after it deregisters or its TTL expires (or with mTLS identities)")

    async def purge(self, endpoint: str, reason: str) -> int:
        await self.subscriber.remove(endpoint)
        try:
            blocks = await self.pump.forget(endpoint)
        except IndexUnavailable as exc:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, f"index backend unavailable: {exc}") from exc
        self.first_seen.pop(endpoint, None)
        log.info("endpoint purged", extra={"endpoint": endpoint, "reason": reason, "blocks": blocks})
        return blocks

    async def sweep_dead(self) -> list[str]:
        """Purge registered endpoints past their heartbeat TTL (they are already excluded from answers)."""
        purged = []
        for eid in self.liveness.to_purge():
            try:
                await self.purge(eid, "heartbeat_ttl")
            except _Abort:
                continue  # backend down: retried on the next sweep
            self.liveness.mark_purged(eid)
            purged.append(eid)
        return purged

    async def ListEndpoints(self, request: indexer_pb2.ListEndpointsRequest, context: grpc.aio.ServicerContext
                            ) -> indexer_pb2.ListEndpointsResponse:
        resp = indexer_pb2.ListEndpointsResponse()
        ids = set(self.liveness.records) | set(self.ingestor.endpoints.copy())
        now = time.monotonic()
        for eid in sorted(ids):
            rec = self.liveness.records.get(eid)
            st = self.ingestor.endpoints.get(eid)
            info = rec.info if rec is not None and rec.info is not None else indexer_pb2.Endpoint(
                endpoint_id=eid, model=st.model if st else "")
            # A store serving every model is listed for every model: its blocks answer any
            # model's lookup, and a router that does not know it cannot count them.
            if request.model and info.model != request.model and not (
                    info.role == common_pb2.ROLE_STORE and info.model in self.store_models):
                continue
            if request.role and info.role != request.role:
                continue
            try:
                blocks = await self._backend(context, self.index.endpoint_blocks, eid)
            except _Abort:
                blocks = 0
            resp.endpoints.add(
                endpoint=info, alive=self.liveness.is_alive(eid),
                seconds_since_heartbeat=self.liveness.seconds_since_heartbeat(eid),
                seconds_since_event=(now - st.last_event_at) if st and st.last_event_at is not None else -1.0,
                blocks=blocks, last_seq=st.last_seq if st and st.last_seq is not None else 0)
        return resp

    def freshness(self) -> list[tuple[str, float, bool]]:
        """(endpoint, seconds since last event or since first known, published?) for the metrics."""
        now = time.monotonic()
        out = []
        for eid in sorted(set(self.first_seen.copy()) | set(self.ingestor.endpoints.copy())):
            st = self.ingestor.endpoints.get(eid)
            if st is not None and st.last_event_at is not None:
                out.append((eid, now - st.last_event_at, True))
            else:
                out.append((eid, now - self.first_seen.get(eid, self.started_at), False))
        return out

    async def Stats(self, request: indexer_pb2.StatsRequest, context: grpc.aio.ServicerContext
                    ) -> indexer_pb2.StatsResponse:
        async def run() -> indexer_pb2.StatsResponse:
            st = await self._backend(context, self.index.stats)
            counters: dict[str, int] = dict(self.counters)
            for k, v in st.counters.items():
                counters[f"index_{k}"] = int(v)
            for es in self.ingestor.endpoints.copy().values():
                counters["events_applied"] = counters.get("events_applied", 0) + es.events_applied
                counters["events_rejected"] = counters.get("events_rejected", 0) + es.events_rejected
                counters["batches"] = counters.get("batches", 0) + es.batches
                for k, v in es.counters.items():
                    counters[k] = counters.get(k, 0) + v
            for t, n in st.entries_by_tier.items():
                counters[f"entries_{Tier(t).name.lower()}"] = n
            return indexer_pb2.StatsResponse(backend=st.backend, entries=st.entries, keys=st.keys,
                                             endpoints=st.endpoints, counters=counters)
        return await self._guard(context, run())


def _store_spec(name: str, algo: str) -> ModelSpec:
    """A shared namespace for offload stores: keys arrive as kvmesh keys of any model (block size 0 = any)."""
    return ModelSpec(name, 0, algo)


def _extra_keys(pb: common_pb2.ExtraKeys) -> ExtraKeys | None:
    if len(pb.cache_salt.encode()) > MAX_SALT:
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"cache_salt longer than {MAX_SALT} bytes")
    try:
        ek = ExtraKeys(cache_salt=pb.cache_salt or None, lora_name=pb.lora_name or None,
                       lora_path=pb.lora_path or None,
                       mm=tuple(MMRange(r.identifier, r.offset, r.length) for r in pb.mm))
    except (ValueError, TypeError) as exc:
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad extra_keys: {exc}") from None
    return None if ek.is_empty else ek


def _from_proto_batch(pb: indexer_pb2.EventBatch) -> KVEventBatch:
    events: list[Any] = []
    for ev in pb.events:
        kind = ev.WhichOneof("event")
        if kind == "stored":
            s = ev.stored
            events.append(BlockStored(
                block_hashes=list(s.block_hashes),
                parent_block_hash=s.parent_block_hash if s.HasField("parent_block_hash") else None,
                token_ids=list(s.token_ids), block_size=s.block_size, lora_name=s.lora_name or None,
                medium=_MEDIUM.get(s.tier, "GPU")))
        elif kind == "removed":
            events.append(BlockRemoved(block_hashes=list(ev.removed.block_hashes),
                                       medium=_MEDIUM.get(ev.removed.tier, "GPU")))
        elif kind == "cleared":
            events.append(AllBlocksCleared())
        else:
            events.append(_UnknownEvent())
    return KVEventBatch(pb.ts, events)


class _UnknownEvent:
    """An empty oneof: rejected (and counted) by the ingest core."""


__all__ = ["IndexerServicer", "HashAlgo"]
