"""The router's live picture of the cluster: endpoints, their load, and the index.

Endpoints come from static configuration and from the indexer's registry
(``ListEndpoints``, polled). Each endpoint's load is polled with ``GetLoad``;
the routing core applies the staleness bound. An endpoint that fails a call is
marked not alive until its next successful poll, so retries go elsewhere.
The indexer may be down: ``lookup`` then returns None and the caller falls
back, which is counted and logged (once per outage, not per request).

Each endpoint's ``GetInfo`` is read when it (re)appears, for the LoRA adapter
paths it loaded: vLLM hashes the path into every block of a LoRA request, so
the router must hash with the path of the endpoint it scores (see
:meth:`Cluster.lora_groups`). Static ``lora_modules`` cover endpoints whose
GetInfo is unknown; GetInfo wins where it answered.

External engines (an OpenAI-HTTP server such as ``vllm serve``: ``--endpoints
ID=http://HOST:PORT`` or an InferencePool's pods) are endpoints too, scored like
workers; their load is read from vLLM's ``/metrics`` instead of ``GetLoad`` and only a
failed connect marks them down (``openai_endpoint``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc
import httpx

from kvmesh.events.topic import dp_endpoint
from kvmesh.index.packed import pack_keys
from kvmesh.routing.load import LoadReport
from kvmesh.routing.local_view import LocalView
from kvmesh.routing.router import RouterCore
from kvmesh.routing.types import (
    ROLE_BOTH,
    ROLE_DECODE,
    ROLE_PREFILL,
    ROLE_STORE,
    EndpointView,
    Matches,
    TierMatch,
)
from kvmesh.rpc.channel import aio_channel
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.indexer.v1 import indexer_pb2, indexer_pb2_grpc
from kvmesh_api.worker.v1 import worker_pb2, worker_pb2_grpc
from kvmesh_router import metrics
from kvmesh_router.config import RouterConfig, parse_endpoint
from kvmesh_router.engine_metrics import MetricsError
from kvmesh_router.index_lookup import IndexLookups, LookupCall
from kvmesh_router.loop_lag import LoopLag, wait_answer
from kvmesh_router.openai_endpoint import CONNECT_ERRORS, OpenAIEndpoints, is_http_address

log = logging.getLogger(__name__)

_ROLES = {common_pb2.ROLE_PREFILL: ROLE_PREFILL, common_pb2.ROLE_DECODE: ROLE_DECODE,
          common_pb2.ROLE_BOTH: ROLE_BOTH, common_pb2.ROLE_STORE: ROLE_STORE}


class Cluster:
    def __init__(self, cfg: RouterConfig, core: RouterCore) -> None:
        self.cfg = cfg
        self.core = core
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}
        self.http_addresses: dict[str, str] = {}
        self.stores: set[str] = set()
        metrics.OFFLOAD_ENABLED.set(int(core.cfg.offload_enabled))
        # endpoint -> {LoRA name: path} from its GetInfo (absent: unknown, static config applies).
        self.lora_paths: dict[str, dict[str, str]] = {}
        # endpoint -> its engine's max_model_len from GetInfo (what /v1/models and defaults use).
        self.max_model_lens: dict[str, int] = {}
        self._conflicts_logged: set[str] = set()
        self._no_info: set[str] = set()   # GetInfo unimplemented: don't ask on every poll
        self._load_strikes: dict[str, int] = {}   # endpoint -> GetLoad deadlines in a row
        self._indexer_ch = aio_channel(cfg.indexer, retry_attempts=1) if cfg.indexer else None
        self.indexer = indexer_pb2_grpc.IndexerStub(self._indexer_ch) if self._indexer_ch else None
        # Lookups are sent and answered off the event loop (see index_lookup); the aio channel
        # above carries the registry polls and speculative puts.
        self.lookups = IndexLookups(cfg.indexer) if cfg.indexer else None
        self.indexer_up = True
        # Lookups send the chain packed (BlockChain.keys_be64) until an indexer that predates it
        # answers with an empty chain; then repeated keys, as before.
        self.packed_lookups = True
        self.local_view = LocalView(ttl_s=cfg.local_view_ttl_s)
        # The lookup deadline does not charge the indexer for the router's own loop lag.
        self.loop_lag = LoopLag(cfg.loop_lag_period_s) if cfg.loop_lag_period_s > 0 else None
        self._tasks: list[asyncio.Task] = []
        self._static: set[str] = set()
        self.pool_watcher: Any = None   # InferencePoolWatcher when --inference-pool is set
        self.discovered_objectives: dict[str, int] = {}   # InferenceObjective name -> priority
        self.external = OpenAIEndpoints(cfg.external_connect_timeout_s, cfg.external_api_key, cfg.external_dp_size)
        for spec in cfg.endpoints:
            eid, addr = parse_endpoint(spec)
            if is_http_address(addr):
                self.set_external(eid, addr, True, "static")
                self._static.add(eid)
                continue
            self._add(EndpointView(eid, addr, cfg.model, ROLE_DECODE, cfg.block_size, True, "static"))
            self._static.add(eid)
        for spec in cfg.prefill_endpoints:
            eid, addr = parse_endpoint(spec)
            if is_http_address(addr):   # an external prefill engine (P/D split through the store)
                self.set_external(eid, addr, True, "static", ROLE_PREFILL)
            else:
                self._add(EndpointView(eid, addr, cfg.model, ROLE_PREFILL, cfg.block_size, True, "static"))
            self._static.add(eid)

    # -- endpoints ---------------------------------------------------------------
    def _add(self, ep: EndpointView) -> None:
        old = self.core.endpoints.get(ep.endpoint_id)
        if old is not None and old.address != ep.address:
            self._drop_channel(ep.endpoint_id)
        self.core.set_endpoint(ep)

    def set_external(self, eid: str, url: str, alive: bool, source: str, role: str = ROLE_DECODE) -> None:
        """Add or update an external OpenAI endpoint (static config or discovery; a pod that is
        not ready is removed, not added down, since a working ``/metrics`` would revive it).
        A data-parallel server is one endpoint per DP rank (``external_dp_size``)."""
        for rank in range(self.cfg.external_dp_size):
            rid = dp_endpoint(eid, rank)
            self.external.urls[rid] = url
            self.external.ranks[rid] = (eid, rank)
            cur = self.core.endpoints.get(rid)
            if cur is None or cur.address != url:
                self._add(EndpointView(rid, url, self.cfg.model, role, self.cfg.block_size, alive, source))
                self.http_addresses[rid] = url.split("://", 1)[1]

    @property
    def external_mode(self) -> bool:
        """The HTTP front door forwards bodies (external endpoints configured or discovered)."""
        return bool(self.external) or bool(self.cfg.inference_pool)

    def apply_discovered(self, snapshot: dict[str, str]) -> None:
        """The InferencePool's endpoints now (id -> URL): add the new, drop the gone."""
        for eid in [e for e, ep in self.core.endpoints.items() if ep.source == "inference-pool"
                    and self.external.ranks.get(e, (e, 0))[0] not in snapshot]:
            log.info("endpoint left the InferencePool", extra={"endpoint": eid})
            self.remove_external(eid)
        for eid, url in snapshot.items():
            cur = self.core.endpoints.get(eid)
            if cur is not None and cur.source != "inference-pool":
                continue   # configured statically: that entry wins
            if cur is None or cur.address != url:
                log.info("endpoint joined from the InferencePool", extra={"endpoint": eid, "url": url})
            self.set_external(eid, url, True, "inference-pool")

    def apply_objectives(self, priorities: dict[str, int]) -> None:
        """The pool's InferenceObjective priorities from the cluster (``--inference-objectives`` wins)."""
        if priorities != self.discovered_objectives:
            log.info("InferenceObjective priorities", extra={"objectives": priorities})
        self.discovered_objectives = priorities

    def objective_priority(self, name: str) -> int:
        static = self.cfg.inference_objectives
        return static[name] if name in static else self.discovered_objectives.get(name, 0)

    def remove_external(self, eid: str) -> None:
        for rid in self.external.siblings(eid):
            self.external.ranks.pop(rid, None)
            if self.external.urls.pop(rid, None) is not None:
                self.http_addresses.pop(rid, None)
                self._remove_endpoint(rid)

    def _remove_endpoint(self, eid: str) -> None:
        """Forget an endpoint that left: the routing core's state and its per-endpoint metrics."""
        self.core.remove_endpoint(eid)
        metrics.forget_endpoint(eid)

    def _drop_channel(self, eid: str) -> None:
        self.lora_paths.pop(eid, None)
        self.max_model_lens.pop(eid, None)
        self._no_info.discard(eid)
        ch = self._channels.pop(eid, None)
        self._stubs.pop(eid, None)
        if ch is not None:
            asyncio.ensure_future(ch.close())

    def stub(self, eid: str) -> worker_pb2_grpc.WorkerStub:
        st = self._stubs.get(eid)
        if st is None:
            ep = self.core.endpoints[eid]
            ch = aio_channel(ep.address, retry_attempts=1)
            self._channels[eid] = ch
            st = self._stubs[eid] = worker_pb2_grpc.WorkerStub(ch)
        return st

    def mark_dead(self, eid: str, why: str) -> None:
        # A server that cannot be connected to is down with all its DP ranks.
        for rid in self.external.siblings(eid) if eid in self.external else [eid]:
            if self.core.set_alive(rid, False):
                log.warning("endpoint marked down", extra={"endpoint": rid, "why": why})

    def live_decode_count(self) -> int:
        return len(self.core.decode_endpoints(self.cfg.model))

    # -- background loops ----------------------------------------------------------
    def start(self) -> None:
        if self.cfg.inference_pool and self.pool_watcher is None:
            from kvmesh_router.inference_pool import InferencePoolWatcher

            ns, _, name = self.cfg.inference_pool.partition("/")
            self.pool_watcher = InferencePoolWatcher(ns, name, self.apply_discovered, self.cfg.kubeconfig,
                                                     objectives=self.apply_objectives)
            self.pool_watcher.start()
        self._tasks.append(asyncio.create_task(self._load_loop(), name="load-poll"))
        if self.loop_lag is not None:
            self.loop_lag.start()
        if self.indexer is not None:
            self._tasks.append(asyncio.create_task(self._registry_loop(), name="registry-poll"))

    async def stop(self) -> None:
        if self.loop_lag is not None:
            await self.loop_lag.stop()
        if self.pool_watcher is not None:
            await self.pool_watcher.stop()
        if self.lookups is not None:
            self.lookups.close()   # cancels the lookups still open past their deadline
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
        for ch in self._channels.values():
            await ch.close()
        if self._indexer_ch is not None:
            await self._indexer_ch.close()
        await self.external.aclose()

    async def refresh_registry(self) -> None:
        assert self.indexer is not None
        resp = await self.indexer.ListEndpoints(indexer_pb2.ListEndpointsRequest(model=self.cfg.model),
                                                timeout=self.cfg.lookup_timeout_s * 4)
        seen = set()
        live_stores = False
        for st in resp.endpoints:
            e = st.endpoint
            role = _ROLES.get(e.role, ROLE_DECODE)
            seen.add(e.endpoint_id)
            if e.endpoint_id in self.external:
                continue   # the indexer knows it by its events only; the router's entry is the HTTP one
            if role == ROLE_STORE:
                self.stores.add(e.endpoint_id)
                live_stores = live_stores or st.alive
                continue
            if e.http_address:
                self.http_addresses[e.endpoint_id] = e.http_address
            cur = self.core.endpoints.get(e.endpoint_id)
            if cur is None or cur.address != e.grpc_address:
                # New endpoints start not alive; the first good GetLoad makes them routable.
                self._add(EndpointView(e.endpoint_id, e.grpc_address, e.model or self.cfg.model, role,
                                       e.block_size or self.cfg.block_size, False, "registry"))
                if e.block_size and e.block_size != self.cfg.block_size:
                    log.warning("endpoint block size differs from the router's; its hits will not match",
                                extra={"endpoint": e.endpoint_id, "block_size": e.block_size})
            if not st.alive and cur is not None:
                self.mark_dead(e.endpoint_id, "registry says not alive")
        if self.cfg.offload_enabled == "auto":
            self.set_offload(live_stores)
        for eid in [eid for eid, ep in self.core.endpoints.items()
                    if ep.source == "registry" and eid not in seen]:
            log.info("endpoint left the registry", extra={"endpoint": eid})
            self._remove_endpoint(eid)
            self.local_view.forget_endpoint(eid)
            self._drop_channel(eid)

    def set_offload(self, on: bool) -> None:
        """``--offload-enabled auto``: the cost prices a store only while one is live (its restores
        are then what a displaced context costs; without one, a recompute)."""
        if self.core.cfg.offload_enabled != on:
            self.core.cfg.offload_enabled = on
            metrics.OFFLOAD_ENABLED.set(int(on))
            log.info("offload store live: the cost prices restores" if on else
                     "no live offload store: the cost prices recomputes", extra={"offload_enabled": on})

    async def _registry_loop(self) -> None:
        while True:
            try:
                await self.refresh_registry()
            except grpc.aio.AioRpcError as exc:
                log.debug("registry poll failed", extra={"code": exc.code().name})
            await asyncio.sleep(self.cfg.registry_poll_s)

    async def poll_load(self, eid: str) -> None:
        if eid in self.external:
            await self.poll_metrics(eid)
            return
        try:
            r = await self.stub(eid).GetLoad(worker_pb2.GetLoadRequest(), timeout=max(0.5, self.cfg.load_poll_s * 2))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                # A slow answer is not a dead worker: on a loaded machine every worker (or the
                # router) can stall past the poll deadline at once, and marking them all down
                # turned a soak's stall into 503s. Only consecutive deadlines mark it down; a hung
                # worker's requests are retried by the first-token timeout meanwhile.
                self._load_strikes[eid] = self._load_strikes.get(eid, 0) + 1
                if self._load_strikes[eid] < self.cfg.load_deadline_strikes:
                    return
            self.mark_dead(eid, f"GetLoad {exc.code().name}")
            return
        self._load_strikes.pop(eid, None)
        self.core.load.update(eid, LoadReport(r.running, r.waiting, r.kv_usage, r.waiting_prefill_tokens,
                                              r.num_blocks, r.free_blocks, time.monotonic()))
        ep = self.core.endpoints.get(eid)
        revived = ep is not None and not ep.alive
        # A revived endpoint may be a restarted worker with other adapters: read its info again.
        if ep is not None and (revived or (eid not in self.lora_paths and eid not in self._no_info)):
            await self.fetch_info(eid)
        if revived and self.core.set_alive(eid, True):
            log.info("endpoint up", extra={"endpoint": eid})

    async def poll_metrics(self, eid: str) -> None:
        """An external engine's load from its ``/metrics``; down only if the connection fails."""
        try:
            rep = await self.external.load(eid, self.cfg.model, max(0.5, self.cfg.load_poll_s * 2))
        except CONNECT_ERRORS as exc:
            self.mark_dead(eid, f"/metrics: {type(exc).__name__}")
            return
        except (httpx.HTTPError, MetricsError) as exc:
            # Served but no usable page: keep it routable; its load report goes stale.
            log.debug("external endpoint metrics unreadable", extra={"endpoint": eid, "error": str(exc)})
            rep = None
        except KeyError:
            return   # removed by discovery meanwhile
        if rep is not None:
            self.core.load.update(eid, rep)
        ep = self.core.endpoints.get(eid)
        if ep is not None and not ep.alive and self.core.set_alive(eid, True):
            log.info("endpoint up", extra={"endpoint": eid})

    async def fetch_info(self, eid: str) -> None:
        """Record the endpoint's LoRA name -> path map from ``GetInfo`` (kept unknown on failure)."""
        try:
            info = await self.stub(eid).GetInfo(worker_pb2.GetInfoRequest(),
                                                timeout=max(0.5, self.cfg.load_poll_s * 2))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._no_info.add(eid)
            log.debug("GetInfo failed; static lora_modules apply", extra={"endpoint": eid,
                                                                         "code": exc.code().name})
            return
        if info.max_model_len:
            self.max_model_lens[eid] = info.max_model_len
        paths = dict(info.lora_paths)
        for name in info.lora_names:
            # Older workers list names only; their path is unknown, so fall back to static config.
            if name not in paths and name in self.cfg.lora_modules:
                paths[name] = self.cfg.lora_modules[name]
            paths.setdefault(name, "")
        if self.lora_paths.get(eid) != paths:
            log.info("endpoint LoRA adapters", extra={"endpoint": eid, "lora_paths": paths})
        self.lora_paths[eid] = paths

    def max_model_len(self) -> int:
        """The smallest max_model_len among live endpoints that reported one (0 = none known)."""
        live = {e.endpoint_id for e in self.core.decode_endpoints(self.cfg.model)}
        lens = [n for eid, n in self.max_model_lens.items() if eid in live]
        return min(lens) if lens else 0

    def knows_lora(self, name: str) -> bool:
        return name in self.cfg.lora_modules or any(name in m for m in self.lora_paths.values())

    def lora_groups(self, name: str) -> tuple[dict[str, set[str]], set[str]]:
        """Endpoints by the path they hash ``name`` with, and endpoints that don't serve it.

        An endpoint whose GetInfo answered serves exactly its adapters; one whose info is
        unknown is assumed to serve the static ``lora_modules`` entry. One path is the
        common case; several mean the same adapter name was loaded from different paths,
        so each group needs its own block keys (logged once per name).
        """
        groups: dict[str, set[str]] = {}
        lacking: set[str] = set()
        static = self.cfg.lora_modules.get(name)
        for eid in self.core.endpoints:
            known = self.lora_paths.get(eid)
            path = known.get(name) if known is not None else static
            if path is None:
                lacking.add(eid)
            else:
                groups.setdefault(path, set()).add(eid)
        if len(groups) > 1 and name not in self._conflicts_logged:
            self._conflicts_logged.add(name)
            log.warning("LoRA adapter loaded from different paths on different endpoints; hashing per path",
                        extra={"lora_name": name, "paths": {p: sorted(e) for p, e in groups.items()}})
        return groups, lacking

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll_load(eid) for eid in list(self.core.endpoints)))

    async def _load_loop(self) -> None:
        while True:
            await self.poll_all()
            await asyncio.sleep(self.cfg.load_poll_s)

    # -- index -------------------------------------------------------------------------
    async def lookup(self, keys: list[int]) -> Matches | None:
        """Per-endpoint, per-tier matches of ``keys``; None when neither the indexer nor the local
        view can answer.

        The call is sent at once, off the event loop (``kvmesh_router.index_lookup``), and the
        indexer gets ``lookup_timeout_s`` from the send, plus the time the router's own event loop
        ran behind schedule meanwhile (``kvmesh_router.loop_lag``, at most
        ``lookup_loop_grace_s``). An answer that has arrived at the deadline counts, whether or
        not the loop has read it yet. Past that, the router's local view answers
        (``kvmesh.routing.local_view``) and the call stays open until ``lookup_late_s``, its
        answer merged into the view when it comes: a loaded indexer slows the view's updates
        down instead of sending every request to ``approx``.
        """
        if self.indexer is None or self.lookups is None:
            return None
        if not keys:
            return Matches()
        cfg = self.cfg
        late = cfg.local_view_ttl_s > 0 and cfg.lookup_late_s > cfg.lookup_timeout_s
        limit = max(cfg.lookup_late_s if late else cfg.lookup_timeout_s, cfg.lookup_timeout_s + cfg.lookup_loop_grace_s)
        call = self._send(keys, limit)
        answered, grace = await wait_answer(call.waiter, cfg.lookup_timeout_s, self.loop_lag, cfg.lookup_loop_grace_s,
                                            arrived=call.arrived)
        if not answered:
            if late:
                call.waiter.add_done_callback(lambda w: self._merge_late(keys, w))
            else:
                call.cancel()
            local = self.local_view.matches(keys, time.monotonic()) if cfg.local_view_ttl_s > 0 else None
            if local is not None:
                metrics.LOOKUPS.labels(outcome="local").inc()
                return local
            self._indexer_failed("DEADLINE_EXCEEDED", "lookup past its deadline")
            return None
        got = call.outcome()
        if self._older_indexer(got):
            # An indexer older than BlockChain.keys_be64 read no keys: send them as repeated keys from now on.
            log.warning("the indexer does not read packed chains (an older version); sending repeated keys")
            self.packed_lookups = False
            return await self.lookup(keys)
        if isinstance(got, BaseException):
            code = got.code().name if isinstance(got, grpc.Call) else type(got).__name__
            details = got.details() if isinstance(got, grpc.Call) else str(got)
            self._indexer_failed(code, details or "")
            return None
        matches = matches_from_proto(got, self.stores)
        metrics.LOOKUPS.labels(outcome="ok_loop_lag" if grace > 0 else "ok").inc()
        if not self.indexer_up:
            log.info("indexer back; precise routing resumed")
        self.indexer_up = True
        if cfg.local_view_ttl_s > 0:
            self.local_view.learn(keys, matches, time.monotonic())
        return matches

    def _send(self, keys: list[int], timeout: float) -> LookupCall:
        assert self.lookups is not None
        chain = (indexer_pb2.BlockChain(keys_be64=pack_keys(keys)) if self.packed_lookups
                 else indexer_pb2.BlockChain(keys=keys))
        return self.lookups.send(indexer_pb2.LookupRequest(model=self.cfg.model, chain=chain, include_speculative=True,
                                                           include_applied=True), timeout)

    def _older_indexer(self, got: object) -> bool:
        return (self.packed_lookups and isinstance(got, grpc.Call) and isinstance(got, grpc.RpcError)
                and got.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty chain" in (got.details() or ""))

    def _merge_late(self, keys: list[int], waiter: asyncio.Future) -> None:
        if waiter.cancelled():
            return
        got = waiter.result()
        if isinstance(got, indexer_pb2.LookupResponse):
            metrics.LOOKUPS.labels(outcome="late_merged").inc()
            self.local_view.learn(keys, matches_from_proto(got, self.stores), time.monotonic())

    def _indexer_failed(self, code: str, details: str) -> None:
        metrics.FALLBACKS.labels(reason=code).inc()
        if self.indexer_up:
            log.warning("indexer unavailable; precise routing falls back to approx",
                        extra={"code": code, "details": details})
        self.indexer_up = False

    async def put_speculative(self, eid: str, keys: list[int], ttl_s: float) -> None:
        if self.indexer is None or not keys or not self.cfg.indexer_speculative or not self.indexer_up:
            return
        try:
            await self.indexer.PutSpeculative(
                indexer_pb2.PutSpeculativeRequest(model=self.cfg.model, endpoint_id=eid, keys=keys, ttl_s=ttl_s),
                timeout=self.cfg.lookup_timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.debug("PutSpeculative failed", extra={"code": exc.code().name})


def matches_from_proto(resp: indexer_pb2.LookupResponse, stores: set[str]) -> Matches:
    out = Matches()
    for m in resp.matches:
        tm = TierMatch(speculative=m.speculative_blocks)
        for t in m.tiers:
            if t.tier == common_pb2.TIER_GPU:
                tm.gpu = max(tm.gpu, t.blocks)
            elif t.tier == common_pb2.TIER_CPU:
                tm.cpu = max(tm.cpu, t.blocks)
            elif t.tier == common_pb2.TIER_DISK:
                tm.disk = max(tm.disk, t.blocks)
        if m.endpoint_id in stores:
            out.store = out.store.merged(TierMatch(cpu=max(tm.cpu, tm.gpu), disk=tm.disk))
        else:
            out.per_endpoint[m.endpoint_id] = tm
    out.applied = dict(resp.applied_batches)
    return out
