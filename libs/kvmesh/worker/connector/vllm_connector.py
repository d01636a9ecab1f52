"""``KvmeshConnector``: vLLM's KV connector v1 API on top of the kvmesh offload store.

Why it exists: on the CPU platform vLLM's own offloading connectors do not run,
and kvmesh needs one shared tier for two jobs — restoring KV that an engine
evicted while an agent paused (restore instead of recompute), and handing a
prefill worker's KV to a decode worker. vLLM loads this class with
``kv_transfer_config={"kv_connector": "KvmeshConnector",
"kv_connector_module_path": "kvmesh.worker.connector.vllm_connector", ...}``.

Keys: each block is stored under vLLM's own block hash in event form (low 64
bits of the digest) — the same key the engine's KV events carry and the
router/indexer compute — inside a namespace naming the model and KV layout.

Scheduler side (EngineCore process):
- ``get_num_new_matched_tokens`` asks the store how many blocks *after* the
  engine's own prefix hit are present (one ``Contains`` call, cached per
  request) and offers them as externally computed tokens, loaded
  asynchronously by default (``async_load``): the request waits in
  WAITING_FOR_REMOTE_KVS while other requests keep stepping.
- ``build_connector_meta`` turns pending loads into (keys, block ids) and plans
  saves of every block that became full and computed in this step.
- ``request_finished`` reports ``loaded_tokens`` (and, for the prefill role,
  the prompt's block keys) back through ``kv_transfer_params``.

Worker side (model-runner process):
- ``start_load_kv`` hands the planned loads to one background thread that
  fetches the blocks and writes them into the paged cache (blocks vLLM reserved
  for the waiting request, so nothing else touches them); ``get_finished``
  reports finished loads. With ``async_load: false`` it loads inline, before
  the forward pass. A failed fetch is reported through
  ``get_block_ids_with_load_errors`` (no later than the pass that reports the
  load finished) and vLLM recomputes (policy "recompute").
- A request finished (e.g. aborted) while its async load is in flight keeps
  its blocks until vLLM sees the load finish (``request_finished`` asks for the
  delay; the scheduler frees them on ``finished_recving``).
- ``wait_for_save`` copies the step's newly full blocks out of the paged cache
  and queues them for the background ``BlockSaver``; it never waits on the
  network.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import warnings
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvmesh.kvstore.mooncake.pool import PoolConfig
from kvmesh.worker.connector.layout import all_rank_namespaces, connector_namespace, rank_namespace
from kvmesh.worker.connector.saver import BlockSaver, SaveJob
from kvmesh.worker.connector.versions import check_vllm_version

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

PARAMS_KEY = "kvmesh"
STORE_BACKENDS = ("kvmesh", "mooncake")
POOL_OPTIONS = {f.name for f in dataclasses.fields(PoolConfig)}
_MASK64 = (1 << 64) - 1


def event_key(digest: Any) -> int:
    """vLLM's event form of a block hash: the low 64 bits of the digest, big-endian."""
    if isinstance(digest, int):
        return digest & _MASK64
    return int.from_bytes(bytes(digest), "big") & _MASK64


def _is_prefill_only(request: Any) -> bool:
    params = getattr(request, "kv_transfer_params", None) or {}
    return bool((params.get(PARAMS_KEY) or {}).get("prefill_only"))


# --------------------------------------------------------------------------- metadata (pickled to workers)


@dataclass
class LoadOp:
    req_id: str
    keys: list[int]
    block_ids: list[int]
    async_load: bool = False


@dataclass
class SaveOp:
    req_id: str
    keys: list[int]
    block_ids: list[int]
    token_ids: list[list[int]]
    parent: int | None
    session_id: str = ""


@dataclass
class KvmeshConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)


# --------------------------------------------------------------------------- scheduler-side state


@dataclass
class _ReqState:
    request: Any
    saved_upto: int = 0                 # blocks [0, saved_upto) are saved or need no save
    lookup: tuple[int, int, float] | None = None   # (local_blocks, hit_end_block, when)
    pending_load: tuple[int, int] | None = None    # block range to load this step
    loaded_tokens: int = 0
    first_schedule: bool = True
    store_fallback: bool = False      # the store was down/slow when this request looked it up


class KvmeshConnector(KVConnectorBase_V1):
    """Offload store connector (see module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        check_vllm_version()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._block_size = int(vllm_config.cache_config.block_size)
        self._address = str(extra.get("store_address", ""))
        if not self._address:
            raise ValueError("KvmeshConnector needs kv_connector_extra_config['store_address'] (host:port)")
        base = str(extra.get("namespace") or self._default_namespace(vllm_config))
        pc = vllm_config.parallel_config
        tp, pp = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
        # The scheduler checks every rank's slice; a worker reads and writes its own.
        self._rank_namespaces = all_rank_namespaces(base, tp, pp)
        self._namespace = base if role == KVConnectorRole.SCHEDULER else self._worker_namespace(base, tp, pp)
        self._lookup_timeout = float(extra.get("lookup_timeout_s", 2.0))
        self._io_timeout = float(extra.get("io_timeout_s", 30.0))
        self._retry_after = float(extra.get("store_retry_after_s", 5.0))
        self._save_enabled = bool(extra.get("save", True))
        self._load_enabled = bool(extra.get("load", True))
        self._use_shm = extra.get("use_shm")
        # Skip checksums of same-host shm reads (a store and host you trust): saves a pass over the bytes.
        self._trust_local_store = bool(extra.get("trust_local_store", False))
        self._async_load = bool(extra.get("async_load", True))
        # "kvmesh": the store holds the bytes; "mooncake": a store started with --byte-pool mooncake,
        # whose bytes this worker moves to and from the pool itself (mooncake_* options: PoolConfig).
        self._backend = str(extra.get("store_backend", "kvmesh"))
        if self._backend not in STORE_BACKENDS:
            raise ValueError(f"store_backend {self._backend!r} unknown; choose one of {', '.join(STORE_BACKENDS)}")
        self._pool_opts = {k[len("mooncake_"):]: v for k, v in extra.items() if k.startswith("mooncake_")}
        unknown = sorted(set(self._pool_opts) - POOL_OPTIONS)
        if unknown:
            raise ValueError(f"unknown mooncake_ option(s) {unknown}; known: {sorted(POOL_OPTIONS)}")
        self._store_down_until = 0.0
        self._client: Any = None
        # scheduler side
        self._reqs: dict[str, _ReqState] = {}
        self._recent_saved: OrderedDict[int, None] = OrderedDict()
        self._recent_cap = int(extra.get("recent_saved_keys", 100_000))
        self._loads_in_flight: set[str] = set()   # async loads issued, not yet seen finished
        self.fallbacks = 0
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._block_dim: dict[str, int] = {}
        self._layer_bytes: dict[str, int] = {}
        self._block_bytes = 0
        self._load_errors: set[int] = set()
        self._errors_lock = threading.Lock()
        self._loader: ThreadPoolExecutor | None = None
        self._pending_loads: dict[str, Future] = {}
        self._saver: BlockSaver | None = None
        self._max_pending = int(extra.get("max_pending_bytes", 256 << 20))
        logger.info("kvmesh connector up", extra={"role": role.name, "store": self._address,
                                                  "namespace": self._namespace})

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _worker_namespace(base: str, tp: int, pp: int) -> str:
        if tp * pp == 1:
            return base
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        return rank_namespace(base, get_tensor_model_parallel_rank(), tp, get_pp_group().rank_in_group, pp)

    @staticmethod
    def _default_namespace(vllm_config: VllmConfig) -> str:
        mc = vllm_config.model_config
        pc = vllm_config.parallel_config
        name = mc.served_model_name if isinstance(mc.served_model_name, str) else mc.model
        return connector_namespace(str(name), mc.get_num_layers(pc), mc.get_num_kv_heads(pc), mc.get_head_size(),
                                   mc.dtype, vllm_config.cache_config.block_size)

    def _store(self) -> Any:
        if self._client is None:
            timeout = self._lookup_timeout if self._role == KVConnectorRole.SCHEDULER else self._io_timeout
            if self._backend == "mooncake":
                # The store keeps the index; the bytes move between this process and the Mooncake pool.
                from kvmesh.kvstore.mooncake.client import MooncakeStoreClient

                self._client = MooncakeStoreClient(self._address, pool=PoolConfig(**self._pool_opts), timeout_s=timeout)
            else:
                from kvmesh.kvstore.client import SyncOffloadClient

                self._client = SyncOffloadClient(self._address, use_shm=self._use_shm, timeout_s=timeout,
                                                 trust_local_store=self._trust_local_store)
        return self._client

    def _store_usable(self) -> bool:
        return time.monotonic() >= self._store_down_until

    def _mark_store_down(self, exc: Exception, what: str) -> None:
        self.fallbacks += 1
        self._store_down_until = time.monotonic() + self._retry_after
        logger.warning("offload store unusable; recomputing instead",
                       extra={"op": what, "error": str(exc), "retry_after_s": self._retry_after})

    def _keys(self, request: Request) -> list[int]:
        return [event_key(h) for h in request.block_hashes]

    # ================================================================== scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _ReqState(request=request)
        if not self._load_enabled:
            return 0, False
        if not self._store_usable():
            st.store_fallback = True
            return 0, False
        bs = self._block_size
        local_blocks = num_computed_tokens // bs
        # At least one token must be computed by the engine to sample from.
        limit = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        if limit <= local_blocks:
            return 0, False
        now = time.monotonic()
        if st.lookup is not None and st.lookup[0] == local_blocks and now - st.lookup[2] < 1.0:
            hit_end = st.lookup[1]
        else:
            keys = self._keys(request)[local_blocks:limit]
            try:
                present = len(keys)
                for ns in self._rank_namespaces:
                    present = min(present, self._store().contains(ns, keys[:present]))
                    if not present:
                        break
            except Exception as exc:  # store down/slow: recompute, never fail the request
                self._mark_store_down(exc, "contains")
                st.store_fallback = True
                return 0, False
            hit_end = local_blocks + present
            st.lookup = (local_blocks, hit_end, now)
        if hit_end <= local_blocks:
            return 0, False
        return (hit_end - local_blocks) * bs, self._async_load

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _ReqState(request=request)
        st.request = request
        st.first_schedule = True
        if num_external_tokens > 0 and st.lookup is not None:
            end_block = st.lookup[1]
            start_tok = end_block * self._block_size - num_external_tokens
            st.pending_load = (max(0, start_tok // self._block_size), end_block)
            st.loaded_tokens += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvmeshConnectorMetadata()
        sched: list[tuple[str, int]] = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        sched += list(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        bs = self._block_size
        if self._async_load:
            # Requests waiting for their KV are not scheduled: their loads go out now.
            for req_id, st in self._reqs.items():
                if st.pending_load is None:
                    continue
                s, e = st.pending_load
                st.pending_load = None
                block_ids = list(self._kv_cache_manager.get_block_ids(req_id)[0])
                meta.loads.append(LoadOp(req_id, self._keys(st.request)[s:e], block_ids[s:e], async_load=True))
                self._loads_in_flight.add(req_id)
                if not _is_prefill_only(st.request):
                    st.saved_upto = max(st.saved_upto, e)
        for req_id, computed_before in sched:
            st = self._reqs.get(req_id)
            if st is None:
                continue
            request = st.request
            block_ids: list[int] | None = None
            prefill_only = _is_prefill_only(request)
            if st.first_schedule:
                # Prefix hits (local or restored) need no save -- except for a prefill
                # hand-off, whose whole prompt must be in the store even if the store
                # lost blocks this engine still caches (the saver skips present ones).
                if not prefill_only:
                    st.saved_upto = max(st.saved_upto, computed_before // bs)
                st.first_schedule = False
            if st.pending_load is not None:
                s, e = st.pending_load
                st.pending_load = None
                block_ids = list(self._kv_cache_manager.get_block_ids(req_id)[0])
                keys = self._keys(request)
                meta.loads.append(LoadOp(req_id, keys[s:e], block_ids[s:e]))
                if not prefill_only:
                    st.saved_upto = max(st.saved_upto, e)
            if not self._save_enabled:
                continue
            after = computed_before + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            full = min(len(request.block_hashes), after // bs)
            if full <= st.saved_upto:
                continue
            if block_ids is None:
                block_ids = list(self._kv_cache_manager.get_block_ids(req_id)[0])
            keys = self._keys(request)
            start = st.saved_upto
            st.saved_upto = full
            # Drop blocks this engine already saved recently (shared prefixes), keep chain order.
            idx = [i for i in range(start, full) if prefill_only or keys[i] not in self._recent_saved]
            if not idx:
                continue
            tokens = request.all_token_ids
            first = idx[0]
            meta.saves.append(SaveOp(
                req_id=req_id, keys=[keys[i] for i in idx], block_ids=[block_ids[i] for i in idx],
                token_ids=[list(tokens[i * bs:(i + 1) * bs]) for i in idx],
                parent=keys[first - 1] if first > 0 else None))
            for i in idx:
                self._recent_saved[keys[i]] = None
            while len(self._recent_saved) > self._recent_cap:
                self._recent_saved.popitem(last=False)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        for req_id in connector_output.finished_recving or ():
            self._loads_in_flight.discard(req_id)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        # A load still writing into this request's blocks: vLLM frees them once the
        # worker reports the load finished (finished_recving of a finished request).
        delay = request.request_id in self._loads_in_flight
        self._loads_in_flight.discard(request.request_id)
        params: dict[str, Any] = {"loaded_tokens": st.loaded_tokens if st else 0,
                                  "store_fallback": bool(st and st.store_fallback)}
        if _is_prefill_only(request):
            n = len(request.prompt_token_ids or []) // self._block_size
            params["prompt_keys"] = self._keys(request)[:n]
            params["namespace"] = self._namespace
        return delay, {PARAMS_KEY: params}

    @property
    def requires_kv_delivery(self) -> bool:
        # A dropped save is only a future cache miss; never hold blocks for it.
        return False

    # ================================================================== worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config is not None else None
        self._kv_caches = dict(sorted(kv_caches.items()))
        total = 0
        for name, t in self._kv_caches.items():
            dim = 0
            if num_blocks is not None and t.shape[0] != num_blocks and t.ndim > 1 and t.shape[1] == num_blocks:
                dim = 1
            self._block_dim[name] = dim
            self._layer_bytes[name] = t.select(dim, 0).numel() * t.element_size()
            total += self._layer_bytes[name]
        self._block_bytes = total
        logger.info("kvmesh connector registered KV caches",
                    extra={"layers": len(self._kv_caches), "block_bytes": total})

    def _ensure_caches(self, forward_context: ForwardContext) -> None:
        if self._kv_caches:
            return
        caches = {}
        for name, layer in forward_context.no_compile_layers.items():
            kv = getattr(layer, "kv_cache", None)
            if isinstance(kv, list):
                kv = kv[0] if kv else None
            if isinstance(kv, torch.Tensor):
                caches[name] = kv
        self.register_kv_caches(caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvmeshConnectorMetadata) or not meta.loads:
            return
        self._ensure_caches(forward_context)
        for op in meta.loads:
            if op.async_load:
                if self._loader is None:
                    # One thread: loads run in order and never compete with each other for memory bandwidth.
                    self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmesh-load")
                self._pending_loads[op.req_id] = self._loader.submit(self._load_logged, op)
            else:
                self._load_logged(op)

    def _load_logged(self, op: LoadOp) -> None:
        try:
            self._load(op)
        except Exception as exc:
            with self._errors_lock:
                self._load_errors.update(op.block_ids)
            logger.warning("restoring KV from the offload store failed; vLLM recomputes",
                           extra={"req_id": op.req_id, "blocks": len(op.keys), "error": str(exc)})

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = {rid for rid, fut in self._pending_loads.items() if fut.done()}
        for rid in done:
            del self._pending_loads[rid]
        return None, done or None

    def _load(self, op: LoadOp) -> None:
        with self._store().fetch(self._namespace, op.keys) as lease:
            if len(lease.views) != len(op.keys):
                raise RuntimeError(f"store returned {len(lease.views)} of {len(op.keys)} blocks")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only buffers: we copy out at once
                for view, bid in zip(lease.views, op.block_ids, strict=True):
                    if len(view) != self._block_bytes:
                        raise RuntimeError(f"block of {len(view)} bytes, expected {self._block_bytes} "
                                           "(layout mismatch)")
                    src = torch.frombuffer(view, dtype=torch.uint8)
                    off = 0
                    for name, kv in self._kv_caches.items():
                        n = self._layer_bytes[name]
                        dst = kv.select(self._block_dim[name], bid)
                        dst.copy_(src[off:off + n].view(kv.dtype).view(dst.shape))
                        off += n
        if not lease.valid:
            # The store's lease on its memory expired while we copied: the bytes may be reused ones.
            raise RuntimeError("offload store lease expired during the copy")

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete inside start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # copied once per step in wait_for_save, after every layer has written

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvmeshConnectorMetadata) or not meta.saves or not self._kv_caches:
            return
        if self._saver is None:
            self._saver = BlockSaver(self._store(), self._max_pending)
        for op in meta.saves:
            idx = torch.tensor(op.block_ids, dtype=torch.long)
            per_layer = []
            for name, kv in self._kv_caches.items():
                dim = self._block_dim[name]
                # [n_blocks, ...] contiguous copy of this layer's blocks, as raw bytes
                blocks = kv.index_select(dim, idx.to(kv.device))
                if dim != 0:
                    blocks = blocks.movedim(dim, 0)
                per_layer.append(blocks.contiguous().cpu().view(torch.uint8).reshape(len(op.block_ids), -1))
            joined = torch.cat(per_layer, dim=1).numpy()
            payloads = [joined[i].tobytes() for i in range(len(op.block_ids))]
            self._saver.submit(SaveJob(self._namespace, op.keys, payloads, op.token_ids, op.parent,
                                       self._block_size, op.session_id))

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._errors_lock:
            errs, self._load_errors = self._load_errors, set()
        return errs

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        if self._saver is not None:
            self._saver.close()
            self._saver = None
        if self._client is not None:
            self._client.close()
            self._client = None
