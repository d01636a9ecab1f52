"""Count an engine's copies of a GPU block for backends that keep one entry per block.

Why: vLLM's block pool may hold two blocks with one hash. A prompt whose every block is
cached still has its last token computed, so vLLM computes the last block again into a new
block (each resend of a block-aligned prompt adds a copy); a block computed again while an
older copy is still cached (restored from a store, prefilled side by side) is one too. vLLM
caches every copy, announces each with a ``BlockStored`` and each eviction with a
``BlockRemoved``. An index that keeps a set of (block, endpoint) forgets the block at the first
copy's eviction, while the engine still serves the other copy to every later request: the
router then sends that prefix elsewhere or predicts it as a miss.

The in-memory backend counts copies itself (``MemoryIndex.counts_copies``). The Redis backends
cannot: every indexer replica applies every batch to the shared Redis, so a count kept there
would be raised once per replica. This wrapper keeps the count in the replica instead, from
the endpoint's own event stream (applied once per replica, in sequence order), so every
replica decides the same: a removal reaches the backend only with the last copy. Adds always
pass through (they are idempotent in the backend).

It never keeps more copies than the stream showed: a failed backend call, a clear or a
ledger over ``max_keys`` forgets the endpoint's counts, and a removal of a key it does not
know goes through, as without the ledger. So it can only make the index hold a block the
engine still holds. Cost: about 100 bytes of replica memory per GPU block the endpoints hold.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from kvmesh.index.base import BlockIndex, IndexStats, Tier
from kvmesh_indexer.index_wrapper import IndexWrapper

log = logging.getLogger(__name__)


class CopyCountingIndex(IndexWrapper):
    """A backend whose GPU-tier removals reach it only with an engine's last copy of a block."""

    def __init__(self, inner: BlockIndex, max_keys: int = 4_000_000) -> None:
        super().__init__(inner)
        self.counts_copies = True
        self.max_keys = max_keys
        self._copies: dict[tuple[str, str], dict[int, int]] = {}   # (endpoint, model) -> key -> copies
        self.extra_copies = 0   # copies beyond the first, over all endpoints
        # Ingest may run endpoints on several threads; each endpoint's own batches come in order.
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        # Backend extras (lookup_async, check_layout, run_id, ...) pass through unchanged.
        return getattr(self.inner, name)

    def add(self, model: str, endpoint: str, tier: Tier, keys: Sequence[int],
            chain_starts: Sequence[tuple[int, int | None]] | None = None) -> int:
        if Tier(tier) == Tier.GPU:
            with self._lock:
                held = self._copies.setdefault((endpoint, model), {})
                extra = 0
                for k in keys:
                    n = held.get(k, 0)
                    held[k] = n + 1
                    extra += n > 0
                self.extra_copies += extra
                over = len(held) > self.max_keys
            if over:
                log.warning("copy ledger over its bound; counting restarts for the endpoint",
                            extra={"endpoint": endpoint, "max_keys": self.max_keys})
                self._forget(endpoint)
        try:
            return self.inner.add(model, endpoint, tier, keys, chain_starts)
        except Exception:
            self._forget(endpoint)   # the ingest re-syncs the endpoint; counts restart with it
            raise

    def remove(self, model: str, endpoint: str, tier: Tier, keys: Sequence[int]) -> int:
        held = self._copies.get((endpoint, model)) if Tier(tier) == Tier.GPU else None
        if held:
            last: list[int] = []
            with self._lock:
                for k in keys:
                    n = held.get(k, 0)
                    if n > 1:
                        held[k] = n - 1   # another copy is still in the engine's cache
                        self.extra_copies -= 1
                        continue
                    held.pop(k, None)
                    last.append(k)
            keys = last
            if not keys:
                return 0
        try:
            return self.inner.remove(model, endpoint, tier, keys)
        except Exception:
            self._forget(endpoint)
            raise

    def clear_endpoint(self, endpoint: str, tier: Tier | None = None) -> int:
        if tier is None or Tier(tier) == Tier.GPU:
            self._forget(endpoint)
        return self.inner.clear_endpoint(endpoint, tier)

    def _forget(self, endpoint: str) -> None:
        with self._lock:
            for ek in [ek for ek in self._copies if ek[0] == endpoint]:
                held = self._copies.pop(ek)
                self.extra_copies -= sum(n - 1 for n in held.values() if n > 1)

    def stats(self) -> IndexStats:
        st = self.inner.stats()
        st.counters["gpu_extra_copies"] = self.extra_copies
        return st
