"""The ``sim`` engine: the async ``Engine`` over the block manager, scheduler and latency model.

Why it exists: it lets the whole stack (router, indexer, offload store, P/D
split) run on a laptop with no GPU while behaving, as seen from outside,
like a vLLM engine: same block hashes, same KV event wire format on ZMQ (with
replay), same eviction order, ``num_cached_tokens`` per request, and step
latencies from a documented model. Time runs at ``time_scale`` times real time,
or, with ``virtual_time``, not at all (no sleeping; a virtual clock advances by
each step's modelled duration) so benchmarks and the cluster simulator go as
fast as the CPU allows.

Offload hook: with ``offload_address`` set, a new request first restores the
longest run of blocks beyond its GPU hit that the offload store holds, and
finished requests save their full blocks there. The store is asked again when
the scheduler takes the request, if GPU blocks it had on arrival were evicted
while it queued: vLLM's scheduler asks its KV connector
(``get_num_new_matched_tokens``) at that point, not on arrival, so a prefix the
store backs is restored rather than recomputed. The request is held back while
that restore runs (vLLM's ``WAITING_FOR_REMOTE_KVS``); others go on. A ``kv_handle`` (from a
prefill worker) is restored the same way from the handle's store. KV bytes are
synthetic but of realistic size (``kv_bytes_per_token``); restore time is the
measured transfer plus a modelled host-to-device copy.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from array import array
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from kvmesh.worker.engine.base import (
    BadSamplingError,
    CacheTruth,
    Engine,
    EngineDeadError,
    EngineInfo,
    EngineLoad,
    EngineOutput,
    EngineRequest,
    EngineUnavailableError,
    KvHandle,
    ParsedDelta,
    PrefillResult,
    PromptTooLongError,
    kv_events_topic,
)
from kvmesh.worker.engine.sim.block_manager import BlockManager, Cleared, Removed, Stored
from kvmesh.worker.engine.sim.latency import LatencyModel, LatencyParams
from kvmesh.worker.engine.sim.reasoning import SimReasoningStream
from kvmesh.worker.engine.sim.scheduler import Scheduler, SchedulerConfig, Seq, StepPlan, default_extender
from kvmesh.worker.engine.sim.structured import load_tokenizer, scripted_answer
from kvmesh.worker.engine.sim.tool_calls import SimToolStream, calls_tools, sim_tool_calls
from kvmesh.worker.engine.validation import validate_request

if TYPE_CHECKING:
    from kvmesh.worker.config import WorkerConfig

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
MEDIUM_GPU = "GPU"


@dataclass
class SimEngineConfig:
    """Everything the sim engine needs; ``kvmesh.worker.config`` maps worker settings onto it."""

    model: str = "sim-model"
    endpoint_id: str = "sim-0"
    block_size: int = 64
    num_blocks: int = 8192
    hash_algo: str = "sha256_cbor"
    hash_seed: str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 262144
    max_waiting: int = 4096
    vocab_size: int = 32000
    eos_token_id: int | None = None
    lora_names: list[str] = field(default_factory=list)
    # Adapter name -> path hashed into its blocks, as vLLM does (a name without one hashes "").
    lora_paths: dict[str, str] = field(default_factory=dict)
    time_scale: float = 1.0
    virtual_time: bool = False
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_buffer_steps: int = 10_000
    kv_events_buffer_bytes: int = 16 << 20   # the replay buffer's byte bound (kvmesh.events.publisher)
    kv_events_curve: Any = None   # kvmesh.events.curve.CurveServer: CURVE on the event and replay sockets
    clear_events_on_start: bool = True
    enable_events: bool = True
    offload_address: str = ""
    offload_save: bool = True
    offload_timeout_s: float = 10.0       # deadline of each store transfer (get, put)
    offload_lookup_timeout_s: float = 2.0  # deadline of each store lookup (contains)
    model_h2d: bool = True            # add the modelled host-to-device copy to each restore
    hash_memo_blocks: int = -1        # exact block-digest memo size (-1 = 2 x num_blocks, 0 = off)
    kv_num_layers: int = 2
    kv_num_kv_heads: int = 2
    kv_head_dim: int = 32
    kv_dtype: str = "bf16"
    latency: LatencyParams = field(default_factory=LatencyParams)
    tool_calls: int = 1   # calls per answer in the deterministic tool mode (parallel_tool_calls false: 1)
    # With tool_choice "auto" (or none given), the share of answers that call tools, drawn per request
    # from the answer's seed, so that an agent's tool loop ends as a model's does; "required" or a
    # named tool always calls. 1.0 = every answer calls (the deterministic tool mode tests use).
    tool_call_share: float = 1.0
    tokenizer: str = ""   # HF tokenizer dir: structured outputs are answered with its token ids
    # Reasoning mode (sim.reasoning): the first this many output tokens of a chat answer are its
    # reasoning (0 = off; needs ``tokenizer``).
    reasoning_tokens: int = 0
    # A plain answer ends with EOS (finish "stop") after a length drawn per request between half and
    # 1.5 times this, when its max_tokens allows that many: as a model answers and stops, so a request
    # without max_tokens (vLLM then allows what is left of max_model_len) ends (0 = answers run to
    # max_tokens). The EOS is ``eos_token_id``, else the tokenizer's.
    answer_tokens: int = 0

    def validate(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if self.max_model_len <= 0 or self.vocab_size <= 0:
            raise ValueError("max_model_len and vocab_size must be > 0")
        if self.reasoning_tokens and not self.tokenizer:
            raise ValueError("the sim's reasoning mode decodes its answers: it needs a tokenizer")
        if not 0.0 <= self.tool_call_share <= 1.0:
            raise ValueError(f"tool_call_share must be within [0, 1], got {self.tool_call_share}")
        if self.answer_tokens < 0:
            raise ValueError(f"answer_tokens must be >= 0, got {self.answer_tokens}")
        if self.answer_tokens and self.eos_token_id is None and not self.tokenizer:
            raise ValueError("answers that end (answer_tokens) need an EOS: eos_token_id or a tokenizer")

    @property
    def kv_bytes_per_token(self) -> int:
        from kvmesh.kvstore.layout import kv_bytes_per_token

        return kv_bytes_per_token(self.kv_num_layers, self.kv_num_kv_heads, self.kv_head_dim, self.kv_dtype)

    @property
    def offload_namespace(self) -> str:
        from kvmesh.kvstore.layout import namespace_for

        return namespace_for(self.model, self.kv_num_layers, self.kv_num_kv_heads, self.kv_head_dim,
                             self.kv_dtype, self.block_size)


class _DigestMemo:
    """Exact memo of recently hashed blocks: (parent digest, token bytes, extra keys) -> digest.

    Agent prompts repeat long prefixes, and hashing a 100k-token prompt is most of
    a sim request's CPU. The key holds the full parent digest and the block's
    token ids, so a hit returns exactly what hashing would; published events do
    not change. Bounded LRU of ``capacity`` blocks (0 = off).
    """

    def __init__(self, hasher: Any, capacity: int) -> None:
        self.hasher = hasher
        self.capacity = capacity
        self._memo: OrderedDict[tuple, bytes] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def digests(self, tokens: list[int], extra: Any) -> list[bytes]:
        h = self.hasher
        if self.capacity <= 0 or (extra is not None and extra.mm):
            return h.block_digests(tokens, extra)
        from kvmesh.hashing import block_extra_keys

        bs = h.block_size
        n = len(tokens) // bs
        keys_first = block_extra_keys(extra, 0, bs, 0)[0] if extra is not None else None
        keys_rest = block_extra_keys(extra, bs, 2 * bs, 0)[0] if extra is not None else None
        memo = self._memo
        get = memo.get
        touch = memo.move_to_end
        out: list[bytes] = []
        prev: bytes | None = None
        for i in range(n):
            s = i * bs
            key = (prev, array("I", tokens[s:s + bs]).tobytes(), keys_first if i == 0 else keys_rest)
            d = get(key)
            if d is None:
                # First miss: hash the rest in one batch (the hasher's fast path), remember it.
                rest = h.block_digests(tokens[s:n * bs], extra, prev, i)
                for j, dj in enumerate(rest):
                    sj = s + j * bs
                    memo[(prev, array("I", tokens[sj:sj + bs]).tobytes(),
                          keys_first if i + j == 0 else keys_rest)] = dj
                    prev = dj
                self.misses += len(rest)
                self.hits += i
                out.extend(rest)
                while len(memo) > self.capacity:
                    memo.popitem(last=False)
                return out
            touch(key)
            out.append(d)
            prev = d
        self.hits += n
        return out


class _Outbox:
    """A minimal single-consumer queue (asyncio.Queue costs more than the whole sim step per token)."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None

    def put_nowait(self, item: object) -> None:
        self.items.append(item)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def get_nowait(self) -> object:
        return self.items.popleft()

    async def get(self) -> object:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


@dataclass(eq=False)
class _Live:
    """One in-flight request: its scheduler state and the stream back to the caller."""

    req: EngineRequest
    seq: Seq
    queue: _Outbox
    arrival_wall: float
    arrival: float
    extra: Any = None              # kvmesh.hashing.ExtraKeys or None
    last_digest: bytes | None = None
    sample_base: int = 0
    script: list[int] | None = None   # a structured answer's token ids, then its EOS (sim.structured)
    calls_tools: bool = False   # the answer is tool calls (sim_tool_calls)
    answer_len: int = 0   # the answer ends with EOS at this many tokens (SimEngineConfig.answer_tokens; 0 = never)
    ttft_s: float | None = None
    last_token_at: float | None = None   # engine clock of the last token (inter-token latency)
    restored_offload: int = 0      # tokens restored from the store beyond the GPU hit
    # Leading blocks it could reuse on arrival (GPU hit or restored): a scheduling-time check
    # restores from the store what of them left the GPU while it queued.
    backed_blocks: int = 0
    loading: asyncio.Future | None = None   # a scheduling-time restore in flight
    truth: CacheTruth | None = None   # the cache at arrival, reported with the final output
    kv_from_prefill: bool = False
    done: bool = False


class _Meta:
    """What the event builder needs from a request (kept on the block manager's ``Stored``)."""

    __slots__ = ("tokens", "lora_name", "lora_id", "extra", "session_id")

    def __init__(self, tokens: list[int] | None, lora_name: str | None, lora_id: int | None, extra: Any,
                 session_id: str | None) -> None:
        self.tokens = tokens
        self.lora_name = lora_name
        self.lora_id = lora_id
        self.extra = extra
        self.session_id = session_id


_ANSWER_SALT = 0xA5A5_5A5A_0F0F_F0F0   # the answer length's draw apart from the tokens' (same base)
_TOOL_SALT = 0x3C3C_C3C3_6969_9696   # and whether it calls tools


def _tokenizer_eos(path: str) -> int:
    eos = load_tokenizer(path).eos_token_id
    if eos is None:
        raise ValueError(f"the tokenizer in {path} has no EOS token to end the sim's answers (answer_tokens)")
    return int(eos)


def _mix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def synthetic_block(key: int, size: int) -> bytes:
    """Deterministic KV bytes for a block (content is derived from its key, so restores verify)."""
    unit = key.to_bytes(8, "little")
    n = size // 8 + 1
    return (unit * n)[:size]


class SimEngine(Engine):
    """Async simulated engine; see the module docstring."""

    name = "sim"

    @classmethod
    def from_worker_config(cls, cfg: WorkerConfig, endpoint_id: str) -> SimEngine:
        return cls(cfg.sim_engine_config(endpoint_id))

    def __init__(self, config: SimEngineConfig | None = None) -> None:
        self.cfg = config or SimEngineConfig()
        self.cfg.validate()
        c = self.cfg
        from kvmesh.hashing import BlockHasher

        self.hasher = BlockHasher(c.hash_algo, c.block_size, c.hash_seed)
        memo = 2 * c.num_blocks if c.hash_memo_blocks < 0 else c.hash_memo_blocks
        self.digest_memo = _DigestMemo(self.hasher, memo)
        self.blocks = BlockManager(c.num_blocks, c.block_size, enable_events=c.enable_events)
        self.latency = LatencyModel(c.latency)
        self.scheduler = Scheduler(
            self.blocks, self.latency,
            SchedulerConfig(max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
                            max_model_len=c.max_model_len, max_waiting=c.max_waiting),
            extend_hashes=self._extend_hashes, ready=self._ready,
        )
        self.topic = kv_events_topic(c.endpoint_id, c.model)
        self._publisher: Any = None
        self._live: dict[str, _Live] = {}
        self._answer_eos: int | None = None   # set by start() with answer_tokens
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._started = False
        self._stopping = False
        self._dead: BaseException | None = None
        self._fault: BaseException | None = None
        self._vclock = 0.0
        self._t0 = time.monotonic()
        self._offload: dict[str, Any] = {}
        self._bg: set[asyncio.Task] = set()
        self._inline_save: set[str] = set()
        self.steps = 0
        self._vm: Any = None      # VllmRequestMetrics once the worker asks for vLLM's metrics
        self.events_published = 0
        self.offload_saved_blocks = 0
        self.offload_restored_blocks = 0
        self.offload_fallbacks = 0        # restores that failed (store down/slow): recomputed locally
        self.offload_late_restores = 0    # restores at scheduling time of blocks evicted while queued
        self.offload_timeouts: dict[str, int] = {}   # store calls past their deadline, by operation
        self.restore_seconds = 0.0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._started:
            return
        c = self.cfg
        if c.reasoning_tokens:
            # Every chat answer decodes its reasoning: load the tokenizer before serving, off the loop.
            await asyncio.to_thread(load_tokenizer, c.tokenizer)
        if c.answer_tokens:
            self._answer_eos = c.eos_token_id if c.eos_token_id is not None else \
                await asyncio.to_thread(_tokenizer_eos, c.tokenizer)
        if c.kv_events_endpoint and c.enable_events:
            from kvmesh.events import KvEventPublisher

            self._publisher = KvEventPublisher(c.kv_events_endpoint, topic=self.topic,
                                               replay_endpoint=c.kv_events_replay_endpoint or None,
                                               buffer_steps=c.kv_events_buffer_steps,
                                               buffer_bytes=c.kv_events_buffer_bytes, curve=c.kv_events_curve)
            if c.clear_events_on_start:
                # A restarted engine's cache is empty: say so, as vLLM's reset does,
                # so indexers drop whatever they remember for this endpoint.
                from kvmesh.events import AllBlocksCleared

                self._publisher.publish([AllBlocksCleared()])
                self.events_published += 1
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name=f"sim-engine-{c.endpoint_id}")
        self._started = True
        log.info("sim engine started", extra={"endpoint_id": c.endpoint_id, "model": c.model,
                                              "block_size": c.block_size, "num_blocks": c.num_blocks,
                                              "virtual_time": c.virtual_time, "time_scale": c.time_scale})

    async def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        for rid in list(self._live):
            await self.abort(rid)
        if self._task is not None:
            self._wake.set()
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        for t in list(self._bg):
            t.cancel()
        for client in self._offload.values():
            try:
                await client.close()
            except Exception:  # noqa: BLE001 - best effort on shutdown
                pass
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None

    @property
    def healthy(self) -> bool:
        return self._started and not self._stopping and self._dead is None

    @property
    def kv_events_endpoint(self) -> str:
        return self._publisher.endpoint if self._publisher is not None else ""

    @property
    def kv_events_replay_endpoint(self) -> str:
        return (self._publisher.replay_endpoint or "") if self._publisher is not None else ""

    def inject_fault(self, message: str = "injected engine fault") -> None:
        """Make the engine loop crash at its next step (fault-injection for tests and chaos runs)."""
        self._fault = RuntimeError(message)
        self._wake.set()

    def now(self) -> float:
        """Engine time in seconds: virtual clock, or scaled real time since start."""
        if self.cfg.virtual_time:
            return self._vclock
        return (time.monotonic() - self._t0) * self.cfg.time_scale

    # ------------------------------------------------------------------ info/load

    def info(self) -> EngineInfo:
        c = self.cfg
        return EngineInfo(
            engine="sim", model=c.model, block_size=c.block_size, hash_algo=self.hasher.algo.value,
            max_model_len=c.max_model_len, vocab_size=c.vocab_size, kv_bytes_per_token=c.kv_bytes_per_token,
            lora_names=list(c.lora_names), lora_paths={n: c.lora_paths.get(n, "") for n in c.lora_names},
            kv_events_endpoint=self.kv_events_endpoint,
            kv_events_replay_endpoint=self.kv_events_replay_endpoint, kv_events_topic=self.topic,
            num_blocks=c.num_blocks, hash_seed_matches=not self.hasher.seed_is_random and c.hash_seed is None,
            eos_token_id=c.eos_token_id,
        )

    def load(self) -> EngineLoad:
        s = self.scheduler
        b = self.blocks
        return EngineLoad(
            running=s.num_running, waiting=s.num_waiting, kv_usage=b.usage, num_blocks=b.num_blocks,
            free_blocks=b.num_free_blocks, block_size=b.block_size,
            waiting_prefill_tokens=s.waiting_prefill_tokens(), timestamp=time.time(),
            prefix_cache_queries=b.queries_tokens, prefix_cache_hits=b.hits_tokens,
        )

    # ------------------------------------------------------------------ validation

    def _check_up(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine is dead: {self._dead}")
        if not self._started or self._stopping:
            raise EngineUnavailableError("engine is not running")

    def _validate(self, req: EngineRequest) -> None:
        c = self.cfg
        validate_request(req, vocab_size=c.vocab_size, max_model_len=c.max_model_len, lora_names=c.lora_names,
                         in_flight=self._live, queued=self.scheduler.num_waiting, max_queued=c.max_waiting,
                         allow_block_hashes=True, reasoning=bool(c.reasoning_tokens))
        # vLLM clamps max_tokens to the room left; the sim rejects it so callers see the mistake.
        if req.max_tokens > c.max_model_len:
            raise BadSamplingError(f"max_tokens {req.max_tokens} exceeds max_model_len {c.max_model_len}")
        needed = -(-req.prompt_len // c.block_size)
        if needed > c.num_blocks - 1:
            raise PromptTooLongError(f"prompt needs {needed} KV blocks but the cache holds {c.num_blocks - 1}")

    # ------------------------------------------------------------------ hashing

    def _extra_keys(self, req: EngineRequest) -> Any:
        if not (req.cache_salt or req.lora_name):
            return None
        from kvmesh.hashing import ExtraKeys

        lora = req.lora_name or None
        return ExtraKeys(cache_salt=req.cache_salt or None, lora_name=lora,
                         lora_path=self.cfg.lora_paths.get(lora, "") if lora else None)

    def _extend_hashes(self, seq: Seq, n_full: int) -> None:
        """Hash output blocks as they fill (vLLM hashes generated tokens too)."""
        live = self._live.get(seq.request_id)
        if live is None or seq.tokens is None or live.last_digest is None and seq.block_hashes:
            default_extender(seq, n_full)
            return
        have = len(seq.block_hashes)
        bs = self.cfg.block_size
        toks = seq.tokens[have * bs: n_full * bs]
        digests = self.hasher.block_digests(toks, live.extra, live.last_digest, have)
        if digests:
            live.last_digest = digests[-1]
            seq.block_hashes.extend(int.from_bytes(d, "big") & _MASK64 for d in digests)

    # ------------------------------------------------------------------ requests

    def _make_live(self, req: EngineRequest) -> _Live:
        c = self.cfg
        extra = self._extra_keys(req)
        last_digest = None
        if req.block_hashes is not None:
            keys = list(req.block_hashes)
            tokens = list(req.prompt_token_ids) if req.prompt_token_ids else None
        else:
            tokens = list(req.prompt_token_ids)
            digests = self.digest_memo.digests(tokens, extra)
            keys = [int.from_bytes(d, "big") & _MASK64 for d in digests]
            last_digest = digests[-1] if digests else None
        stop = set(req.stop_token_ids)
        if c.eos_token_id is not None and not req.ignore_eos:
            stop.add(c.eos_token_id)
        if req.seed is not None:
            base = _mix(req.seed & _MASK64)
        elif req.temperature == 0 and tokens:
            base = _mix(zlib.crc32(repr(tokens[-64:]).encode()))
        else:
            base = _mix(zlib.crc32(req.request_id.encode()))
        calls = not req.prefill_only and self._calls_tools(req, base)
        script = None
        if req.structured_outputs and not req.prefill_only and not calls:
            # Structured outputs: the answer is a fixed text that matches the constraint, then EOS.
            script, eos = scripted_answer(req.structured_outputs, c.tokenizer)
            stop.add(eos)
        answer_len = 0
        if self._answer_eos is not None and script is None and not req.prefill_only and not req.ignore_eos:
            # Its length is drawn as its tokens are: the same request (seed) ends at the same token.
            stop.add(self._answer_eos)
            answer_len = self.cfg.answer_tokens // 2 + _mix(base ^ _ANSWER_SALT) % self.cfg.answer_tokens + 1
        lora_id = c.lora_names.index(req.lora_name) + 1 if req.lora_name else None
        meta = _Meta(tokens, req.lora_name or None, lora_id, extra, req.session_id or None)
        seq = Seq(request_id=req.request_id, prompt_len=req.prompt_len, max_tokens=req.max_tokens,
                  block_hashes=keys, tokens=tokens, arrival=self.now(), prefill_only=req.prefill_only,
                  meta=meta, stop_token_ids=frozenset(stop))
        live = _Live(req=req, seq=seq, queue=_Outbox(), arrival_wall=time.monotonic(), arrival=seq.arrival,
                     extra=extra, last_digest=last_digest, sample_base=base, script=script, calls_tools=calls, answer_len=answer_len)
        return live

    def _calls_tools(self, req: EngineRequest, base: int) -> bool:
        """Whether this answer is tool calls: always when tools must be called, else drawn (tool_call_share)."""
        if not calls_tools(req.tools, req.tool_choice):
            return False
        share = self.cfg.tool_call_share
        if share >= 1.0 or req.tool_choice == "required" or isinstance(req.tool_choice, dict):
            return True
        return (_mix(base ^ _TOOL_SALT) >> 11) * 2.0 ** -53 < share

    def _truth(self, seq: Seq) -> CacheTruth:
        """What this engine would reuse of ``seq`` if scheduled now, and which events describe it."""
        gpu = len(self.blocks.find_longest_hit(seq.block_hashes, seq.num_tokens)) * self.cfg.block_size
        published = self._publisher.next_seq if self._publisher is not None else 0
        return CacheTruth(gpu_tokens=gpu, events_through=published + (1 if self.blocks.has_pending_events() else 0))

    def _sample(self, seq: Seq) -> int | None:
        """Deterministic pseudo-random token: a function of (seed or request, position)."""
        live = self._live.get(seq.request_id)
        if live is not None and live.script is not None:
            return live.script[min(seq.num_output, len(live.script) - 1)]
        if live is not None and live.answer_len and seq.num_output + 1 >= live.answer_len:
            return self._answer_eos
        base = live.sample_base if live else 0
        return _mix(base + seq.num_output) % self.cfg.vocab_size

    async def generate(self, req: EngineRequest) -> AsyncIterator[EngineOutput]:
        self._check_up()
        self._validate(req)
        if req.structured_outputs and self.cfg.tokenizer and not req.prefill_only:
            # The first structured answer loads the tokenizer: off the loop, whose GetLoad answers
            # keep the worker alive in the router's eyes (a load on the loop took longer than
            # their deadline under CI's load, and the router marked the worker down).
            await asyncio.to_thread(load_tokenizer, self.cfg.tokenizer)
        live = self._make_live(req)
        self._live[req.request_id] = live
        live.truth = self._truth(live.seq)
        try:
            await self._restore(live)
            if self.cfg.offload_address or req.kv_handle is not None:
                live.backed_blocks = max(live.truth.gpu_tokens, live.seq.external_cached) // self.cfg.block_size
            if live.done:   # aborted while restoring
                item = live.queue.get_nowait()
                if isinstance(item, BaseException):
                    raise item
                yield item
                return
            self._check_up()
            self.scheduler.add(live.seq)
            self._wake.set()
            # The deterministic tool-call mode (tests): the answer is its calls, streamed as deltas.
            calls = sim_tool_calls(req.request_id, req.tools, req.tool_choice, self.cfg.tool_calls,
                                   req.parallel_tool_calls) if live.calls_tools else []
            tools = SimToolStream(calls) if calls else None
            budget = req.thinking_token_budget if req.thinking_token_budget >= 0 else self.cfg.reasoning_tokens
            think = SimReasoningStream(load_tokenizer(self.cfg.tokenizer), min(self.cfg.reasoning_tokens, budget)) \
                if req.reasoning and self.cfg.reasoning_tokens and live.script is None else None
            while True:
                item = await live.queue.get()
                if isinstance(item, BaseException):
                    raise item
                thought = think.push(item.new_token_ids, final=item.finished) if think is not None else None
                if tools is not None and item.finished and item.finish_reason in ("stop", "length"):
                    item.tool_calls, item.content, item.finish_reason = list(tools.calls), "", "tool_calls"
                    item.delta = tools.finish(req.request_id)
                elif tools is not None and think is not None and not think.reasoning_done:
                    item.delta = ParsedDelta()   # still reasoning: the calls come after it
                elif tools is not None:   # an aborted answer says no more
                    item.delta = tools.next() if not item.finished else ParsedDelta()
                if thought is not None and think is not None:
                    # A reasoning model's answer: its reasoning, then its calls or its text.
                    item.delta = item.delta or ParsedDelta(content=thought.content)
                    item.delta.reasoning = thought.reasoning
                    if item.finished:
                        item.reasoning, content = think.result()
                        item.num_reasoning_tokens = min(len(think.ids), think.limit)
                        if item.tool_calls is None:
                            item.content = content
                yield item
                if item.finished:
                    return
        finally:
            if not live.done:
                # Consumer went away (cancel/disconnect) or an error: abort and free blocks.
                live.done = True
                self._abort_seq(req.request_id)
            self._live.pop(req.request_id, None)

    async def abort(self, request_id: str) -> bool:
        live = self._live.get(request_id)
        if live is None or live.done:
            return False
        live.done = True
        seq = self._abort_seq(request_id)
        self._record_finished(live, seq or live.seq, "abort", self.now())
        live.queue.put_nowait(self._final(live, seq or live.seq, "abort"))
        return True

    def _abort_seq(self, request_id: str) -> Seq | None:
        seq = self.scheduler.abort(request_id)
        self._flush_events()
        return seq

    async def prefill(self, req: EngineRequest) -> PrefillResult:
        req.prefill_only = True
        req.max_tokens = 1
        self._inline_save.add(req.request_id)
        tokens: list[int] = []
        last: EngineOutput | None = None
        seq: Seq | None = None
        gen = self.generate(req)
        try:
            async for out in gen:
                tokens.extend(out.new_token_ids)
                last = out
                live = self._live.get(req.request_id)
                if live is not None:
                    seq = live.seq
        finally:
            await gen.aclose()
            self._inline_save.discard(req.request_id)
        assert last is not None
        last.new_token_ids = tokens
        handle = None
        if self.cfg.offload_address and seq is not None and last.finish_reason != "abort":
            n = seq.prompt_len // self.cfg.block_size
            keys = seq.block_hashes[:n]
            await self._save(self.cfg.offload_address, seq, keys, wait=True)
            handle = KvHandle(namespace=self.cfg.offload_namespace, block_keys=list(keys),
                              num_tokens=n * self.cfg.block_size, store_address=self.cfg.offload_address,
                              producer_endpoint=self.cfg.endpoint_id,
                              first_token_id=tokens[0] if tokens else None)
        return PrefillResult(handle=handle, output=last)

    # ------------------------------------------------------------------ offload

    def _client(self, address: str) -> Any:
        client = self._offload.get(address)
        if client is None:
            from kvmesh.kvstore.client import OffloadClient

            client = OffloadClient(address, timeout_s=self.cfg.offload_timeout_s)
            self._offload[address] = client
        return client

    async def _restore(self, live: _Live) -> None:
        """Pull KV beyond the GPU hit from the store (a prefill worker's handle, or shared offload)."""
        c = self.cfg
        seq = live.seq
        h = live.req.kv_handle
        address, namespace = self._store_of(live)
        if not address:
            return
        bs = c.block_size
        max_blocks = min(len(seq.block_hashes), (seq.num_tokens - 1) // bs)
        gpu = len(self.blocks.find_longest_hit(seq.block_hashes, seq.num_tokens))
        if h is not None:
            # Only the part of the handle that is this request's own chain is usable.
            n = 0
            for a, b in zip(h.block_keys, seq.block_hashes, strict=False):
                if a != b:
                    break
                n += 1
            want = min(n, max_blocks)
            if n < len(h.block_keys):
                log.warning("kv handle does not match the prompt's block chain",
                            extra={"request_id": seq.request_id, "matching_blocks": n,
                                   "handle_blocks": len(h.block_keys)})
        else:
            want = max_blocks
        if want <= gpu:
            return
        client = self._client(address)
        t0 = time.monotonic()
        try:
            if h is None:
                present = await self._lookup(client, namespace, seq.block_hashes[:want])
                if live.truth is not None:
                    live.truth.store_tokens = present * bs
                want = min(want, present)
                if want <= gpu:
                    return
            blobs = await client.get(namespace, seq.block_hashes[gpu:want])
        except Exception as exc:  # noqa: BLE001 - a store outage degrades to local prefill
            self.offload_fallbacks += 1
            self._count_timeout("restore", exc)
            log.warning("offload restore failed; computing locally",
                        extra={"request_id": seq.request_id, "error": str(exc) or type(exc).__name__})
            return
        measured = time.monotonic() - t0
        got = gpu + len(blobs)
        if got <= gpu:
            return
        restored_bytes = sum(len(b) for b in blobs)
        seq.external_cached = got * bs
        live.restored_offload = (got - gpu) * bs
        live.kv_from_prefill = h is not None
        self.offload_restored_blocks += got - gpu
        delay = await self._charge_restore(measured, restored_bytes)
        log.debug("restored kv", extra={"request_id": seq.request_id, "blocks": got - gpu,
                                        "bytes": restored_bytes, "measured_s": measured, "h2d_s": delay})

    def _store_of(self, live: _Live) -> tuple[str, str]:
        """The store address and namespace ``live`` restores from: its prefill worker's handle's,
        else the shared offload store's."""
        c = self.cfg
        h = live.req.kv_handle
        address = h.store_address if h is not None and h.store_address else c.offload_address
        namespace = (h.namespace or c.offload_namespace) if h is not None else c.offload_namespace
        return address, namespace

    async def _charge_restore(self, measured: float, nbytes: int) -> float:
        """Account a restore's time (the measured transfer plus the modelled host-to-device copy
        of ``nbytes``) on the engine's clock; returns the modelled copy's seconds."""
        c = self.cfg
        delay = self.latency.restore_time(nbytes) if c.model_h2d else 0.0
        self.restore_seconds += measured + delay
        if c.virtual_time:
            # No real time passes in virtual mode: charge the measured transfer too.
            self._vclock += measured + delay
        elif delay > 0:
            # The measured transfer already took real time; add the modelled host-to-device copy.
            await asyncio.sleep(delay / c.time_scale)
        return delay

    def _ready(self, seq: Seq, gpu_blocks: int) -> bool:
        """The scheduler's check before it takes ``seq``: False while the store restores blocks
        it had on arrival and lost while it queued (see the module docstring)."""
        live = self._live.get(seq.request_id)
        if live is None or live.done or live.seq is not seq:
            return True
        if live.loading is not None:
            return False
        covered = max(gpu_blocks, seq.external_cached // self.cfg.block_size)
        if covered >= live.backed_blocks:
            return True
        t = asyncio.ensure_future(self._late_restore(live, covered))
        live.loading = t
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)
        return False

    async def _late_restore(self, live: _Live, start: int) -> None:
        """Restore blocks ``start..backed_blocks`` of ``live`` from the store, as far as it holds them."""
        c = self.cfg
        seq = live.seq
        address, namespace = self._store_of(live)
        got = start
        blobs: list[bytes] = []
        t0 = time.monotonic()
        try:
            client = self._client(address)
            present = await self._lookup(client, namespace, seq.block_hashes[:live.backed_blocks])
            if present > start:
                blobs = await client.get(namespace, seq.block_hashes[start:present])
                got = start + len(blobs)
            if got > start and not live.done:
                await self._charge_restore(time.monotonic() - t0, sum(len(b) for b in blobs))
                if not live.done and seq.num_computed == 0:
                    seq.external_cached = max(seq.external_cached, got * c.block_size)
                    live.restored_offload = max(live.restored_offload, (got - start) * c.block_size)
                    self.offload_restored_blocks += got - start
                    self.offload_late_restores += 1
        except Exception as exc:  # noqa: BLE001 - a store outage degrades to local prefill
            self.offload_fallbacks += 1
            self._count_timeout("restore", exc)
            log.warning("offload restore at scheduling failed; computing locally",
                        extra={"request_id": seq.request_id, "error": str(exc) or type(exc).__name__})
        finally:
            # What the store could not give is computed: never ask again for this scheduling.
            live.backed_blocks = min(live.backed_blocks, got)
            live.loading = None
            self._wake.set()

    async def _lookup(self, client: Any, namespace: str, keys: list[int]) -> int:
        """The store's leading run of ``keys``, within the lookup deadline (the client's own
        deadline is the longer transfer one)."""
        async with asyncio.timeout(self.cfg.offload_lookup_timeout_s):
            return await client.contains(namespace, keys)

    def _count_timeout(self, op: str, exc: BaseException) -> None:
        """A store call past its deadline (gRPC's own or the lookup's), for
        ``kvmesh_worker_offload_timeouts_total``."""
        if isinstance(exc, TimeoutError) or getattr(exc, "code", None) == grpc.StatusCode.DEADLINE_EXCEEDED:
            self.offload_timeouts[op] = self.offload_timeouts.get(op, 0) + 1

    async def _save(self, address: str, seq: Seq, keys: list[int], wait: bool) -> None:
        if not keys:
            return
        c = self.cfg
        client = self._client(address)
        size = c.kv_bytes_per_token * c.block_size
        namespace = c.offload_namespace
        bs = c.block_size

        async def run() -> None:
            try:
                present = await self._lookup(client, namespace, keys)
                todo = keys[present:]
                if not todo:
                    return
                toks = None
                if seq.tokens is not None and len(seq.tokens) >= len(keys) * bs:
                    toks = [seq.tokens[i * bs:(i + 1) * bs] for i in range(present, len(keys))]
                parent = keys[present - 1] if present else None
                await client.put(namespace, [(k, synthetic_block(k, size)) for k in todo], token_ids=toks,
                                 parent=parent, block_size=bs, session_id=(seq.meta.session_id or "")
                                 if seq.meta else "")
                self.offload_saved_blocks += len(todo)
            except Exception as exc:  # noqa: BLE001 - saving is best effort
                self._count_timeout("save", exc)
                log.warning("offload save failed", extra={"request_id": seq.request_id,
                                                          "error": str(exc) or type(exc).__name__})

        if wait:
            await run()
        else:
            t = asyncio.create_task(run())
            self._bg.add(t)
            t.add_done_callback(self._bg.discard)

    # ------------------------------------------------------------------ the loop

    def _final(self, live: _Live, seq: Seq, reason: str, tokens: list[int] | None = None) -> EngineOutput:
        cached = max(seq.num_cached_tokens, 0)
        return EngineOutput(
            request_id=seq.request_id, new_token_ids=tokens or [], finished=True, finish_reason=reason,
            num_prompt_tokens=seq.prompt_len, num_output_tokens=seq.num_output, num_cached_tokens=cached,
            num_cached_tokens_gpu=min(seq.num_cached_gpu, cached),
            num_cached_tokens_offload=max(cached - seq.num_cached_gpu, 0),
            kv_from_prefill=live.kv_from_prefill, ttft_s=None,
        )

    def _flush_events(self) -> None:
        events = self.blocks.take_events()
        if not events or self._publisher is None:
            return
        from kvmesh.events import AllBlocksCleared, BlockRemoved, BlockStored
        from kvmesh.hashing import block_extra_keys, to_event_extra_keys

        bs = self.cfg.block_size
        wire: list[Any] = []
        for e in events:
            if isinstance(e, Stored):
                m: _Meta | None = e.meta
                toks = m.tokens[e.token_start:e.token_end] if m is not None and m.tokens is not None else []
                extra = m.extra if m is not None else None
                ek = [to_event_extra_keys(block_extra_keys(extra, s, s + bs, 0)[0])
                      for s in range(e.token_start, e.token_end, bs)]
                wire.append(BlockStored(
                    block_hashes=list(e.block_hashes), parent_block_hash=e.parent_block_hash, token_ids=toks,
                    block_size=bs, lora_id=m.lora_id if m else None, medium=MEDIUM_GPU,
                    lora_name=m.lora_name if m else None, extra_keys=ek, group_idx=0,
                    session_id=m.session_id if m else None))
            elif isinstance(e, Removed):
                wire.append(BlockRemoved(block_hashes=[e.block_hash], medium=MEDIUM_GPU, group_idx=0))
            elif isinstance(e, Cleared):
                wire.append(AllBlocksCleared())
        try:
            self._publisher.publish(wire)
            self.events_published += 1
        except Exception as exc:  # noqa: BLE001 - events are best effort; the index recovers by replay
            log.warning("kv event publish failed", extra={"error": str(exc)})

    async def _run(self) -> None:
        try:
            while not self._stopping:
                if self._fault is not None:
                    raise self._fault
                if not self.scheduler.has_work:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                plan = self.scheduler.plan(self.now())
                self._flush_events()
                if plan.empty:
                    if any(live.loading is not None for live in self._live.values()):
                        # Only requests whose KV is loading wait: their restores wake the loop.
                        self._wake.clear()
                        await self._wake.wait()
                        continue
                    self._fail_stuck()
                    await asyncio.sleep(0)
                    continue
                await self._advance(plan.duration)
                self._deliver(plan)
                self.steps += 1
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - any crash makes the engine dead, never hung
            self._die(exc)

    async def _advance(self, duration: float) -> None:
        if self.cfg.virtual_time:
            self._vclock += duration
            await asyncio.sleep(0)
        else:
            await asyncio.sleep(duration / self.cfg.time_scale)

    def _fail_stuck(self) -> None:
        """Nothing runs and the head of the queue cannot get blocks: it can never run."""
        if self.scheduler.running or not self.scheduler.waiting:
            return
        seq = self.scheduler.waiting[0]
        self.scheduler.abort(seq.request_id)
        live = self._live.get(seq.request_id)
        if live is not None and not live.done:
            live.done = True
            out = self._final(live, seq, "error")
            out.error = "KV cache too small for this request"
            live.queue.put_nowait(out)

    def _deliver(self, plan: StepPlan) -> None:
        now = self.now()
        res = self.scheduler.complete(plan, now, self._sample)
        finished = {id(s) for s in res.finished}
        c = self.cfg
        for seq, tok in res.sampled:
            live = self._live.get(seq.request_id)
            if live is None or live.done:
                continue
            out = EngineOutput(request_id=seq.request_id, new_token_ids=[tok] if tok is not None else [],
                               num_prompt_tokens=seq.prompt_len, num_output_tokens=seq.num_output)
            cached = max(seq.num_cached_tokens, 0)
            out.num_cached_tokens = cached
            out.num_cached_tokens_gpu = min(seq.num_cached_gpu, cached)
            out.num_cached_tokens_offload = max(cached - seq.num_cached_gpu, 0)
            if seq.num_output == 1:
                out.ttft_s = now - live.arrival
                live.ttft_s = out.ttft_s
            if self._vm is not None and tok is not None:
                if live.last_token_at is None:
                    self._vm.first_token(now - live.arrival)
                else:
                    self._vm.token_gap(now - live.last_token_at)
            live.last_token_at = now
            if id(seq) in finished:
                out.finished = True
                out.finish_reason = seq.finish_reason  # type: ignore[assignment]
                out.kv_from_prefill = live.kv_from_prefill
                out.truth = live.truth
                live.done = True
                self._record_finished(live, seq, seq.finish_reason or "stop", now)
                if (c.offload_address and c.offload_save and seq.finish_reason != "abort"
                        and seq.request_id not in self._inline_save):
                    n = seq.num_computed // c.block_size
                    self._extend_for_save(seq, n)
                    # The save runs off the step path; the blocks' bytes derive from their keys.
                    coro_keys = list(seq.block_hashes[:n])
                    t = asyncio.ensure_future(self._save(c.offload_address, seq, coro_keys, wait=True))
                    self._bg.add(t)
                    t.add_done_callback(self._bg.discard)
            live.queue.put_nowait(out)
        self._flush_events()

    def _record_finished(self, live: _Live, seq: Seq, reason: str, now: float) -> None:
        if self._vm is not None:
            first = live.arrival + live.ttft_s if live.ttft_s is not None else None
            self._vm.finished(reason, arrival=live.arrival, scheduled=seq.first_scheduled, first_token=first,
                              now=now, prompt_tokens=seq.prompt_len, output_tokens=seq.num_output)

    def vllm_metrics(self, model_name: str) -> Any:
        """vLLM's request metrics, recorded in this engine's clock (see ``kvmesh.worker.vllm_metrics``)."""
        if self._vm is None:
            from kvmesh.worker.vllm_metrics import VllmRequestMetrics

            self._vm = VllmRequestMetrics(model_name)
        return self._vm

    def _extend_for_save(self, seq: Seq, n: int) -> None:
        if len(seq.block_hashes) < n:
            self._extend_hashes(seq, n)

    def _die(self, exc: BaseException) -> None:
        self._dead = exc
        log.error("sim engine crashed", extra={"error": repr(exc)})
        err = EngineDeadError(f"engine crashed: {exc}")
        for live in list(self._live.values()):
            if not live.done:
                live.done = True
                live.queue.put_nowait(err)

    # ------------------------------------------------------------------ cluster-sim helpers

    def request_from_chain(self, request_id: str, block_hashes: list[int], num_prompt_tokens: int,
                           max_tokens: int = 1, **kw: Any) -> EngineRequest:
        """An ``EngineRequest`` that carries a precomputed block-hash chain instead of tokens."""
        return EngineRequest(request_id=request_id, prompt_token_ids=[], max_tokens=max_tokens,
                             block_hashes=block_hashes, num_prompt_tokens=num_prompt_tokens, **kw)
