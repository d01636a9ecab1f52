"""The offload store's bytes in a Mooncake Store pool (``--byte-pool mooncake``).

Why: one store process is where kvmesh stopped (one host's RAM, reached by other hosts
only over gRPC or the bulk port). With a pool, the store keeps what makes kvmesh's tier
useful to routing — namespaces, chains and depths, the checksum of every block, its
chain-aware eviction policy and the KV events the indexer turns into routable tiers —
while Mooncake holds the bytes in memory lent by any number of hosts, and the workers
move them directly (``kvmesh.kvstore.mooncake.client``).

The store runs metadata-only (sizes in bytes) and this module keeps the pool in step
with it: every block the store drops (eviction, Delete, the clear at start-up) is
removed from the pool by a janitor thread, off the store's lock. Mooncake refuses to
remove an object a reader holds a lease on; such a removal is retried until it goes.
A commit (``PutShm`` with no segment) first cancels pending removals of its keys, then
checks the objects exist, under the janitor's lock, so a removal in flight cannot
delete a block just committed.

What is kept and what is lost: eviction stays kvmesh's (chain-aware, whole tails
first) as long as the pool's lent memory exceeds the store's budget by Mooncake's
eviction headroom (``--mooncake-segment-bytes`` -1 does that on the store host). If
Mooncake evicts on its own (the pool is over its high watermark), it does so per
object: a reader then finds the hole, reads only the blocks before it, and tells the
store to forget the rest (Delete), so the index and the events follow.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvmesh.kvstore.mooncake.pool import OBJECT_HAS_LEASE, OBJECT_NOT_FOUND, Pool, describe, object_key
from kvmesh_offload.store import CPU, StoreEvent

log = logging.getLogger(__name__)

POOL_NAME = "mooncake"
RETRY_S = 1.0
# Mooncake evicts above 90% of a segment by default: lend this much more than the budget.
HEADROOM = 1 / 0.85


def pool_prefix(endpoint_id: str) -> str:
    """Objects of one store; its start-up clear removes exactly these."""
    return f"kvmesh/{endpoint_id}/"


class PoolTier:
    def __init__(self, pool: Pool, prefix: str) -> None:
        self.pool = pool
        self.prefix = prefix
        self._pending: dict[str, float] = {}     # object key -> next attempt (monotonic)
        self._cv = threading.Condition()
        self._removing = threading.Lock()         # held while a removal batch is in flight
        self._stop = False
        self._inflight = 0                        # removals taken off _pending, not yet settled
        self.removed = 0
        self.remove_failures = 0
        self._thread = threading.Thread(target=self._run, name="kvmesh-pool-janitor", daemon=True)
        self._thread.start()

    @property
    def master(self) -> str:
        return self.pool.cfg.master

    def key(self, namespace: str, key: int) -> str:
        return object_key(self.prefix, namespace, key)

    # -- the store's event sink -----------------------------------------------------------------

    def sink(self, inner: Callable[[list[StoreEvent]], None] | None) -> Callable[[list[StoreEvent]], None]:
        """Wrap the store's event sink: what the store drops is removed from the pool, then published."""
        def on_events(events: list[StoreEvent]) -> None:
            drop: list[str] = []
            for ev in events:
                if ev.kind == "removed" and ev.medium == CPU:
                    drop.extend(self.key(ev.namespace, k) for k in ev.keys)
                elif ev.kind == "cleared":
                    self.clear()
            if drop:
                self.discard(drop)
            if inner is not None:
                inner(events)
        return on_events

    def clear(self) -> None:
        """Remove every object of this store (a restart: the index that named them is gone)."""
        with self._removing:
            n = self.pool.remove_prefix(self.prefix)
        if n > 0:
            log.info("removed the previous run's pool objects", extra={"objects": n, "prefix": self.prefix})

    def discard(self, keys: Sequence[str]) -> None:
        now = time.monotonic()
        with self._cv:
            for k in keys:
                self._pending[k] = now
            self._cv.notify()

    # -- commits ------------------------------------------------------------------------------

    def missing(self, namespace: str, keys: Sequence[int]) -> list[int]:
        """Keys whose objects are not in the pool, after cancelling their pending removals."""
        objs = [self.key(namespace, k) for k in keys]
        with self._removing:
            with self._cv:
                for o in objs:
                    self._pending.pop(o, None)
            found = self.pool.exists(objs)
        return [k for k, f in zip(keys, found, strict=True) if f != 1]

    # -- janitor ------------------------------------------------------------------------------

    def pending(self) -> int:
        """Removals not done yet (queued, deferred or in flight)."""
        with self._cv:
            return len(self._pending) + self._inflight

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop:
                    now = time.monotonic()
                    due = [k for k, t in self._pending.items() if t <= now]
                    if due:
                        break
                    wait = min(self._pending.values(), default=now + 3600) - now
                    self._cv.wait(max(0.01, min(wait, 5.0)))
                if self._stop:
                    return
            with self._removing:
                with self._cv:
                    due = [k for k in due if k in self._pending]   # a commit may have cancelled some
                    for k in due:
                        del self._pending[k]
                    self._inflight = len(due)
                try:
                    codes = self.pool.remove(due)
                except Exception as exc:  # noqa: BLE001 - the pool may be down; keep trying
                    log.warning("pool removal failed", extra={"objects": len(due), "error": str(exc)})
                    codes = [OBJECT_HAS_LEASE] * len(due)
                retry = [k for k, c in zip(due, codes, strict=True) if c not in (0, OBJECT_NOT_FOUND)]
                later = time.monotonic() + RETRY_S
                # Requeued before a commit can look: it cancels these like any pending removal.
                with self._cv:
                    for k in retry:
                        self._pending.setdefault(k, later)
                    self._inflight = 0
            self.removed += len(due) - len(retry)
            self.remove_failures += len(retry)
            if retry:
                codes_seen = sorted({describe(c) for c in codes if c not in (0, OBJECT_NOT_FOUND)})
                log.debug("pool removals deferred", extra={"objects": len(retry), "codes": codes_seen})

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(5)
        self.pool.close()
