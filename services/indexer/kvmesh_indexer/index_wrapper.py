"""A backend wrapped by one concern, forwarding every call the concern does not change.

The indexer layers concerns over its backend as wrappers (``copy_ledger.CopyCountingIndex``
counts GPU copies, ``metrics.InstrumentedIndex`` times and traces), so a backend stays one file
that knows nothing of them. Each wrapper overrides only the calls it changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvmesh.index.base import BlockIndex, IndexStats, LookupResult, Tier


class IndexWrapper(BlockIndex):
    """Every ``BlockIndex`` call goes to ``inner``; its name and capabilities are ``inner``'s."""

    def __init__(self, inner: BlockIndex) -> None:
        self.inner = inner
        self.name = inner.name
        self.blocking = inner.blocking
        self.counts_copies = inner.counts_copies

    def add(self, model: str, endpoint: str, tier: Tier, keys: Sequence[int],
            chain_starts: Sequence[tuple[int, int | None]] | None = None) -> int:
        return self.inner.add(model, endpoint, tier, keys, chain_starts)

    def remove(self, model: str, endpoint: str, tier: Tier, keys: Sequence[int]) -> int:
        return self.inner.remove(model, endpoint, tier, keys)

    def clear_endpoint(self, endpoint: str, tier: Tier | None = None) -> int:
        return self.inner.clear_endpoint(endpoint, tier)

    def lookup(self, model: str, keys: Sequence[int], endpoint_filter: Iterable[str] | None = None,
               include_speculative: bool = False, exclude: Iterable[str] | None = None,
               extra_models: Sequence[str] = ()) -> LookupResult:
        return self.inner.lookup(model, keys, endpoint_filter, include_speculative, exclude, extra_models)

    def put_speculative(self, model: str, endpoint: str, keys: Sequence[int], ttl_s: float) -> None:
        self.inner.put_speculative(model, endpoint, keys, ttl_s)

    def endpoint_blocks(self, endpoint: str) -> int:
        return self.inner.endpoint_blocks(endpoint)

    def stats(self) -> IndexStats:
        return self.inner.stats()

    def ping(self) -> bool:
        return self.inner.ping()

    def close(self) -> None:
        self.inner.close()
