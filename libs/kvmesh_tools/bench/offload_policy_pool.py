"""``kvmesh bench offload-policy --backend mooncake``: does the Mooncake pool keep the store's hit rate?

The trace is replayed twice per policy and capacity through the real store core
(``OffloadStore``, metadata-only, the policy on the trace's clock): once as the
built-in store (a hit is a block its index holds), once pooled: the same store plus
a real Mooncake pool holding one small object per block (``PoolTier``: evictions
removed from the pool by its janitor), where a hit is a block a reader can really
read — its index says present *and* its object is in the pool — and a hole is
deleted from the index, as ``MooncakeStoreClient`` does. Each request reads its
chain's leading hits, then writes the rest of its chain (up to the capacity) and
commits it. The pool's chain-aware hit rate must stay within 1 point of the store's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvmesh.kvstore.eviction_registry import is_timed, make_eviction_policy
from kvmesh.kvstore.mooncake.pool import MIN_SEGMENT, Pool, PoolConfig
from kvmesh_offload.pool_tier import HEADROOM, PoolTier
from kvmesh_offload.store import BlockIn, OffloadStore, StoreFullError
from kvmesh_tools.policysim import TraceRequest

OBJECT_BYTES = 1024   # the pool's allocation unit per block here: small, the bench is about which blocks stay


@dataclasses.dataclass
class Outcome:
    hits: int = 0
    total: int = 0
    evictions: int = 0
    refused: int = 0
    holes: int = 0
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.total if self.total else 0.0


def _store(policy: str, capacity: int, clock: list[float], sink: Any = None) -> OffloadStore:
    pol = make_eviction_policy(policy)
    store = OffloadStore(capacity * OBJECT_BYTES, policy=pol, metadata_only=True, event_sink=sink)
    if is_timed(policy):
        store.ram.new_batch = lambda: pol.new_batch(clock[0])  # type: ignore[method-assign]
    return store


def replay_store(reqs: Sequence[TraceRequest], policy: str, capacity: int,
                 pool: PoolTier | None = None) -> Outcome:
    clock = [0.0]
    store = _store(policy, capacity, clock, pool.sink(None) if pool is not None else None)
    store.open()
    out = Outcome()
    src = np.zeros(OBJECT_BYTES, dtype=np.uint8)
    if pool is not None:
        addr, _ = pool.pool.register(src)
    t0 = time.perf_counter()
    for req in reqs:
        clock[0] = req.t
        ns, blocks = req.namespace, req.blocks
        n = len(blocks)
        out.total += n
        hit = len(store.get(ns, blocks, req.session))
        if pool is not None and hit:
            found = pool.pool.exists([pool.key(ns, k) for k in blocks[:hit]])
            readable = next((i for i, f in enumerate(found) if f != 1), hit)
            if readable < hit:
                out.holes += 1
                store.delete(ns, blocks[readable:hit])
                hit = readable
        out.hits += hit
        tail = blocks[hit:min(n, capacity)]
        if not tail:
            continue
        if pool is not None:
            todo = tail
            for _ in range(2):   # again once: a janitor removal in flight may have taken a rewritten object
                objs = [pool.key(ns, k) for k in todo]
                pool.pool.put_from(objs, [addr] * len(objs), [OBJECT_BYTES] * len(objs))
                todo = pool.missing(ns, tail)
                if not todo:
                    break
            missing = set(todo)
            if missing:   # the pool refused some (full): commit the leading run it took
                tail = tail[:next(i for i, k in enumerate(tail) if k in missing)]
        try:
            store.put(ns, [BlockIn(k, None, 0, (), OBJECT_BYTES) for k in tail],
                      parent=blocks[hit - 1] if hit else None, session=req.session)
        except StoreFullError:
            out.refused += 1
    out.seconds = time.perf_counter() - t0
    out.evictions = int(store.counters["evictions_ram"])
    if pool is not None:
        pool.pool.unregister(addr)
    return out


def replay_pooled(reqs: Sequence[TraceRequest], policy: str, capacity: int, master: str, run: str) -> Outcome:
    seg = max(MIN_SEGMENT, int(capacity * OBJECT_BYTES * HEADROOM))
    tier = PoolTier(Pool(PoolConfig(master=master, segment_bytes=seg, buffer_bytes=MIN_SEGMENT)), f"kvmesh/{run}/")
    try:
        out = replay_store(reqs, policy, capacity, tier)
        deadline = time.monotonic() + 60
        while tier.pending() and time.monotonic() < deadline:
            time.sleep(0.1)
        return out
    finally:
        tier.close()
