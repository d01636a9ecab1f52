"""Continuous-batching scheduler (vLLM V1 style) over a ``BlockManager``.

Why it exists: queueing, chunked prefill and preemption decide TTFT and
throughput at least as much as raw compute does, and they decide *when* blocks
are cached and evicted (hence the KV event stream). The sim engine and the
cluster simulator share this synchronous, I/O-free core; time is whatever the
caller says it is (``plan()`` returns a step and its modelled duration,
``complete()`` applies it), so it runs in real time or virtual time alike.

Per step, like vLLM's V1 scheduler:
1. running requests first, in order: each gets its remaining tokens (decode: 1),
   capped by the step's token budget (chunked prefill). If blocks run out, the
   *last* running request is preempted (blocks freed, back to the head of the
   waiting queue, recomputed later; its outputs are kept);
2. then waiting requests, FIFO, while budget, ``max_num_seqs`` and blocks allow;
   a new request first takes its longest prefix-cache hit (capped at
   ``num_tokens - 1``), then slots for its first chunk. An optional ``ready``
   check (the engine's connector, asked at scheduling time as vLLM asks its
   KV connector) can hold a request back while its KV loads from elsewhere; the
   scheduler goes on with the next one and the held one keeps its place.
Blocks are cached (``BlockStored``) at allocation; a request that has computed
all its tokens samples one token; a finished request frees its blocks.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvmesh.hashing.prefix import common_prefix
from kvmesh.worker.engine.sim.block_manager import BlockManager
from kvmesh.worker.engine.sim.latency import LatencyModel, PrefillChunk

_MASK64 = (1 << 64) - 1


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Seq:
    """One request as the scheduler sees it."""

    request_id: str
    prompt_len: int
    max_tokens: int
    # Keys of full blocks known so far (prompt first; extended as outputs fill blocks).
    block_hashes: list[int]
    # prompt + output token ids; None when only hashes are known (cluster simulator).
    tokens: list[int] | None = None
    arrival: float = 0.0
    prefill_only: bool = False
    meta: Any = None
    # Tokens already in KV when the request arrives from elsewhere (offload restore).
    external_cached: int = 0
    num_computed: int = 0
    num_output: int = 0
    num_cached_tokens: int = -1       # tokens not computed at first scheduling (-1: not yet)
    num_cached_gpu: int = 0           # of which: hit in this engine's own prefix cache
    est_cached_tokens: int = 0        # hit estimated on arrival (for load reporting)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    first_token_time: float | None = None
    first_scheduled: float | None = None  # when it left the waiting queue the first time
    num_preemptions: int = 0
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    eos_token_id: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_output


@dataclass(slots=True)
class StepPlan:
    """What one step computes: ``(seq, new tokens)`` pairs and the modelled duration."""

    scheduled: list[tuple[Seq, int]]
    duration: float
    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    preempted: list[Seq] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class StepResult:
    """Sequences that produced a token this step, and those that finished."""

    sampled: list[tuple[Seq, int | None]]
    finished: list[Seq]


@dataclass
class SchedulerConfig:
    max_num_seqs: int = field(default=256, metadata={"help": "max running sequences"})
    max_num_batched_tokens: int = field(default=8192, metadata={"help": "per-step token budget"})
    max_model_len: int = field(default=131072, metadata={"help": "max prompt + output tokens"})
    max_waiting: int = field(default=4096, metadata={"help": "waiting queue limit (0 = unlimited)"})


def pseudo_block_hash(parent: int, request_key: int, index: int) -> int:
    """A deterministic 64-bit key for an output block when token ids are unknown."""
    x = (parent * 0x9E3779B97F4A7C15 + request_key * 0xBF58476D1CE4E5B9 + index + 1) & _MASK64
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 29)


HashExtender = Callable[[Seq, int], None]
Sampler = Callable[[Seq], int | None]
# (seq, its GPU prefix hit in blocks now) -> False to hold it back this step (KV still loading).
ReadyCheck = Callable[[Seq, int], bool]


def default_extender(seq: Seq, n_full: int) -> None:
    """Append pseudo keys for output blocks (hash-chain mode: no token ids)."""
    hs = seq.block_hashes
    rk = hash(seq.request_id) & _MASK64
    while len(hs) < n_full:
        parent = hs[-1] if hs else 0
        hs.append(pseudo_block_hash(parent, rk, len(hs)))


class Scheduler:
    """Continuous batching with chunked prefill, prefix caching and preemption."""

    def __init__(self, blocks: BlockManager, latency: LatencyModel, config: SchedulerConfig | None = None,
                 extend_hashes: HashExtender = default_extender, ready: ReadyCheck | None = None) -> None:
        self.blocks = blocks
        self.latency = latency
        self.config = config or SchedulerConfig()
        self.extend_hashes = extend_hashes
        self.ready = ready
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self._seqs: dict[str, Seq] = {}
        self.num_preemptions = 0
        self._waiting_uncached = 0

    # ------------------------------------------------------------------ requests

    def add(self, seq: Seq) -> None:
        if seq.request_id in self._seqs:
            raise KeyError(f"request id {seq.request_id!r} already in flight")
        hit = self.blocks.find_longest_hit(seq.block_hashes, seq.num_tokens)
        bs = self.blocks.block_size
        queued = min(self._queued_prefix(seq.block_hashes), max(0, (seq.num_tokens - 1) // bs))
        seq.est_cached_tokens = max(max(len(hit), queued) * bs, seq.external_cached)
        self._seqs[seq.request_id] = seq
        self.waiting.append(seq)
        self._waiting_uncached += seq.prompt_len - seq.est_cached_tokens

    def _queued_prefix(self, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` that a request already here computes first (FCFS).

        A burst's siblings arrive while the first one still computes their shared prefix:
        none of it is cached yet, but each will find it cached when scheduled. Counting it
        as uncached would report the burst's prefix once per sibling as queued work.
        """
        if not hashes:
            return 0
        head = hashes[0]
        best = 0
        for s in (*self.running, *self.waiting):
            if s.block_hashes and s.block_hashes[0] == head:
                best = max(best, min(common_prefix(s.block_hashes, hashes), s.prompt_len // self.blocks.block_size))
        return best

    def get(self, request_id: str) -> Seq | None:
        return self._seqs.get(request_id)

    def abort(self, request_id: str) -> Seq | None:
        """Remove a request wherever it is and free its blocks."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        if seq.status is SeqStatus.WAITING:
            try:
                self.waiting.remove(seq)
                self._waiting_uncached -= seq.prompt_len - seq.est_cached_tokens
            except ValueError:
                pass
        elif seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        self.blocks.free(request_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = "abort"
        return seq

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def waiting_prefill_tokens(self) -> int:
        """Uncached prompt tokens still to compute (waiting: estimated at arrival)."""
        running = 0
        for s in self.running:
            if s.num_computed < s.prompt_len:
                running += s.prompt_len - s.num_computed
        return max(self._waiting_uncached, 0) + running

    # ------------------------------------------------------------------ stepping

    def cache_computed(self, seq: Seq, num_tokens: int) -> None:
        """Cache the sequence's full blocks up to ``num_tokens`` (hashing output blocks first),
        as a step does once its slots are allocated; emits the ``Stored`` event."""
        n_full = num_tokens // self.blocks.block_size
        if len(seq.block_hashes) < n_full:
            self.extend_hashes(seq, n_full)
        self.blocks.cache_blocks(seq.request_id, seq.block_hashes, num_tokens)

    def _preempt(self, seq: Seq) -> None:
        self.blocks.free(seq.request_id)
        seq.status = SeqStatus.WAITING
        seq.num_computed = 0
        # Restored KV lived in the freed blocks; what survives is found again as a prefix hit.
        seq.external_cached = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.est_cached_tokens = 0
        self._waiting_uncached += seq.prompt_len
        self.waiting.appendleft(seq)

    def plan(self, now: float = 0.0) -> StepPlan:
        """Choose this step's work and allocate/cache its blocks (events are emitted here)."""
        cfg = self.config
        bm = self.blocks
        bs = bm.block_size
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[Seq, int]] = []
        chunks: list[PrefillChunk] = []
        decode_ctx: list[int] = []
        preempted: list[Seq] = []
        new_requests = 0

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            if n <= 0:
                i += 1
                continue
            target = seq.num_computed + n
            while not bm.allocate(seq.request_id, target):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break
            self.cache_computed(seq, min(target, seq.num_tokens))
            scheduled.append((seq, n))
            budget -= n
            if seq.num_computed >= seq.prompt_len and n == 1:
                decode_ctx.append(seq.num_computed)
            else:
                chunks.append(PrefillChunk(n, seq.num_computed))
            i += 1

        held: list[Seq] = []
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < cfg.max_num_seqs):
            seq = self.waiting[0]
            num_tokens = seq.num_tokens
            hit: list[int] = []
            computed = 0
            first = seq.num_cached_tokens < 0
            if seq.num_computed == 0:
                hit = bm.find_longest_hit(seq.block_hashes, num_tokens)
                if self.ready is not None and not self.ready(seq, len(hit)):
                    held.append(self.waiting.popleft())
                    continue
                computed = len(hit) * bs
                if seq.external_cached > computed:
                    # Restored from the offload store / a prefill worker: those
                    # tokens need slots but no compute.
                    computed = min(seq.external_cached, num_tokens - 1)
            n = min(num_tokens - computed, budget)
            target = computed + n
            if not bm.allocate(seq.request_id, target, hit, meta=seq.meta):
                break
            self.waiting.popleft()
            self._waiting_uncached -= seq.prompt_len - seq.est_cached_tokens
            if first:
                seq.first_scheduled = now
                bm.count_hit(seq.prompt_len, len(hit) * bs)
                seq.num_cached_tokens = computed
                seq.num_cached_gpu = len(hit) * bs
                new_requests += 1
            seq.num_computed = computed
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self.cache_computed(seq, min(target, num_tokens))
            scheduled.append((seq, n))
            budget -= n
            chunks.append(PrefillChunk(n, computed))
        if held:
            self.waiting.extendleft(reversed(held))

        duration = self.latency.step_time(chunks, decode_ctx, new_requests) if scheduled else 0.0
        return StepPlan(scheduled, duration, sum(c.tokens for c in chunks), len(decode_ctx), preempted)

    def complete(self, plan: StepPlan, now: float = 0.0, sample: Sampler | None = None,
                 defer_free: bool = False) -> StepResult:
        """Apply a planned step: advance computed tokens, sample, finish and free.

        With ``defer_free`` finished requests keep their blocks until ``release``
        (the engine saves them to the offload store first).
        """
        cfg = self.config
        sampled: list[tuple[Seq, int | None]] = []
        finished: list[Seq] = []
        for seq, n in plan.scheduled:
            if seq.status is not SeqStatus.RUNNING:
                continue   # aborted or preempted while the step ran
            seq.num_computed += n
            if seq.num_computed < seq.num_tokens:
                continue
            tok = sample(seq) if sample is not None else None
            seq.num_output += 1
            if seq.tokens is not None and tok is not None:
                seq.tokens.append(tok)
            if seq.first_token_time is None:
                seq.first_token_time = now
            sampled.append((seq, tok))
            reason = None
            if tok is not None and tok in seq.stop_token_ids:
                reason = "stop"
            elif seq.prefill_only or seq.num_output >= seq.max_tokens or seq.num_tokens >= cfg.max_model_len:
                reason = "length"
            if reason is not None:
                seq.finish_reason = reason
                finished.append(seq)
        for seq in finished:
            seq.status = SeqStatus.FINISHED
            self.running.remove(seq)
            self._seqs.pop(seq.request_id, None)
            if not defer_free:
                self.blocks.free(seq.request_id)
        return StepResult(sampled, finished)

    def release(self, seq: Seq) -> None:
        """Free a finished request's blocks (the engine may first save them to the store)."""
        self.blocks.free(seq.request_id)
