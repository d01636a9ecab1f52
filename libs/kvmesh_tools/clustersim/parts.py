"""The simulated workers and offload store: thin wrappers that put the real
components (C's block manager + scheduler + latency model, E's RAM tier, B's
index) behind the few calls the event loop needs.

Why it exists: the event loop should only move time; what a worker caches,
evicts and how long a step takes must come from the same code the services run.
These wrappers only translate (block-manager events → index updates) and keep
per-worker counters.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice, takewhile

from kvmesh.index.base import Tier
from kvmesh.index.memory import MemoryIndex
from kvmesh.kvstore.block import CapacityError
from kvmesh.kvstore.eviction_registry import is_timed, make_eviction_policy
from kvmesh.kvstore.ram_tier import RamTier
from kvmesh.worker.engine.sim.block_manager import BlockManager, Removed, Stored
from kvmesh.worker.engine.sim.latency import LatencyModel, LatencyParams
from kvmesh.worker.engine.sim.scheduler import Scheduler, SchedulerConfig, Seq, StepPlan, pseudo_block_hash

_MASK64 = (1 << 64) - 1


def stable_extender(seq: Seq, n_full: int) -> None:
    """Keys for output blocks, stable across processes (str hashing is salted per process)."""
    hs = seq.block_hashes
    rk = zlib.crc32(seq.request_id.encode())
    while len(hs) < n_full:
        hs.append(pseudo_block_hash(hs[-1] if hs else 0, rk, len(hs)))


@dataclass
class WorkerSpec:
    endpoint_id: str
    role: str                  # decode | prefill
    num_blocks: int
    block_size: int


class SimWorker:
    """One engine: real scheduler + block manager; publishes to the index when asked."""

    def __init__(self, spec: WorkerSpec, latency: LatencyParams, sched_cfg: SchedulerConfig,
                 index: MemoryIndex | None, model: str) -> None:
        self.spec = spec
        self.id = spec.endpoint_id
        self.role = spec.role
        self.bm = BlockManager(spec.num_blocks + 1, spec.block_size, enable_events=index is not None)
        self.latency = LatencyModel(latency)
        self.sched = Scheduler(self.bm, self.latency, sched_cfg, extend_hashes=stable_extender)
        self.index = index
        self.model = model
        self.busy_s = 0.0
        self.steps = 0
        self.plan: StepPlan | None = None
        self.macro: list | None = None   # decode fast-forward in progress: [start, n, d0, slope, applied]
        self.gen = 0

    def publish(self) -> None:
        """Apply the block manager's KV events to the index (what the indexer would ingest)."""
        if self.index is None:
            return
        idx, model, ep = self.index, self.model, self.id
        # A run of evictions is one index update (an allocation evicts thousands of blocks at
        # once); the order of adds, removes and clears is kept.
        gone: list[int] = []
        for ev in self.bm.take_events():
            if type(ev) is Removed:
                gone.append(ev.block_hash)
                continue
            if gone:
                idx.remove(model, ep, Tier.GPU, gone)
                gone = []
            if type(ev) is Stored:
                idx.add(model, ep, Tier.GPU, ev.block_hashes, [(0, ev.parent_block_hash)])
            else:
                idx.clear_endpoint(ep)
        if gone:
            idx.remove(model, ep, Tier.GPU, gone)

    def gpu_hit_blocks(self, keys: list[int], num_tokens: int) -> int:
        return len(self.bm.find_longest_hit(keys, num_tokens))


class SimOffload:
    """The shared offload store in metadata-only mode (capacity in blocks).

    One namespace, so the tier's keys are the block keys themselves: the service's
    ``(namespace, key)`` ids would cost a tuple per block on every touch, put and eviction
    (a fleet run makes tens of millions of them), and policies treat keys as opaque.

    The router's view of the store is read off the tier itself (:meth:`leading`), not off
    the index: the indexer mirrors the store's events, and in virtual time it does so at
    once, so the two agree block for block, while a fleet's store stores and evicts a block
    per block it keeps (millions of index updates that would only restate the tier).
    """

    NS = "sim"
    KNOWN_MAX = 4096

    def __init__(self, capacity_blocks: int, eviction: str, clock: Callable[[], float] | None = None) -> None:
        self.tier = RamTier(capacity_blocks, make_eviction_policy(eviction))
        # Time-aware policies read the simulation's virtual clock, as the store reads the wall clock.
        self._clock = clock if is_timed(eviction) else None
        self.puts = 0
        self.refused = 0          # puts that cannot fit, whole (the service answers RESOURCE_EXHAUSTED)
        self.restored_blocks = 0
        self._present = self.tier.keys()   # a live view: membership without a method call
        self._holds = self.tier.holds()     # the same, as a function for the C-speed prefix scan
        # Per prompt (by list identity), the leading keys found present and the store's eviction
        # count then: until the next eviction they are still there, so a prompt asked about
        # again (a waiting request, at every step that reaches it) is scanned on from there.
        self._known: dict[int, tuple[list[int], int, int]] = {}

    def leading(self, keys: list[int], cap: int) -> int:
        """How many of ``keys[:cap]`` the store holds, from the first on."""
        evictions = self.tier.evictions
        known = self._known.get(id(keys))
        start = known[2] if known is not None and known[0] is keys and known[1] == evictions else 0
        if start >= cap:
            return cap
        # takewhile/islice scan in C: a prompt is up to ~16k blocks.
        n = start + len(list(takewhile(self._holds, islice(keys, start, cap))))
        if len(self._known) >= self.KNOWN_MAX:
            self._known.clear()   # a bound on the prompts it keeps alive: a forgotten one is scanned from 0
        self._known[id(keys)] = (keys, evictions, n)
        return n

    def _new_batch(self) -> None:
        if self._clock is not None:
            self.tier.policy.new_batch(self._clock())  # type: ignore[call-arg]
        else:
            self.tier.new_batch()

    def touch(self, keys: list[int], session: str) -> None:
        self._new_batch()
        self.tier.touch_many(keys, session)  # type: ignore[arg-type]
        self.restored_blocks += len(keys)

    def put(self, keys: list[int], start: int, session: str) -> None:
        """Write-through of a request's computed blocks from ``start`` (the first the store
        lacks), as the store service's Put takes them: blocks already there are touched, room
        for the new ones is made at once and the put's own blocks never push each other out;
        a put that cannot fit is refused whole."""
        tier = self.tier
        if tier.capacity <= 0:
            return
        self._new_batch()
        present = self._present
        seen: set[int] = set()
        held: list[int] = []
        new: list[int] = []
        depths: list[int] = []
        for i in range(start, len(keys)):
            k = keys[i]
            if k in seen:
                continue
            seen.add(k)
            if k in present:
                held.append(k)
            else:
                new.append(k)
                depths.append(i)
        if held:
            tier.touch_many(held, session)  # type: ignore[arg-type]
        if not new:
            return
        try:
            tier.make_room(len(new), protect=seen)  # type: ignore[arg-type]
        except CapacityError:
            # Refused whole, as the service answers; the tier evicts nothing for a refused put.
            self.refused += 1
            return
        tier.add_many(new, depths, session)  # type: ignore[arg-type]
        self.puts += len(new)
