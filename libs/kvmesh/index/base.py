"""The block-index contract every backend implements.

The indexer service, the router's embedded mode and the virtual-time cluster
simulator all talk to one interface, so a backend can be swapped (memory,
Redis) without touching ingest or lookup code. The interface is synchronous:
the simulator calls it directly under virtual time, and the async service
decides itself whether a call may block (``blocking`` attribute) and must be
moved off the event loop.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# Longest speculative entry the indexer takes: an entry stands for KV an engine is about
# to hold, and no prefill in this field takes minutes.
MAX_SPECULATIVE_TTL_S = 300.0


class Tier(enum.IntEnum):
    """Where a block lives; values equal ``kvmesh.common.v1.Tier``."""

    GPU = 1
    CPU = 2
    DISK = 3

    @classmethod
    def from_medium(cls, medium: str | None) -> Tier:
        """Map vLLM's ``medium`` string (None means the engine's own cache)."""
        if medium is None or medium == "":
            return cls.GPU
        m = medium.upper()
        if m == "GPU":
            return cls.GPU
        if m == "CPU":
            return cls.CPU
        if m in ("STORAGE", "DISK"):
            return cls.DISK
        raise ValueError(f"unknown medium {medium!r} (expected GPU, CPU, STORAGE or DISK)")


TIERS: tuple[Tier, ...] = (Tier.GPU, Tier.CPU, Tier.DISK)


class IndexUnavailable(RuntimeError):
    """The backend cannot answer now (e.g. Redis is down); callers map it to UNAVAILABLE."""


@dataclass
class EndpointMatch:
    """Leading-match lengths of one endpoint for one chain."""

    endpoint_id: str
    tiers: dict[Tier, int] = field(default_factory=dict)
    combined: int = 0
    speculative: int = 0
    speculative_ttl_s: float = 0.0


@dataclass
class LookupResult:
    chain_length: int
    matches: dict[str, EndpointMatch] = field(default_factory=dict)

    def best_combined(self) -> int:
        return max((m.combined for m in self.matches.values()), default=0)


@dataclass
class IndexStats:
    backend: str
    entries: int          # block-endpoint-tier entries
    keys: int             # distinct (model, block key)
    endpoints: int
    entries_by_tier: dict[Tier, int] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)


class BlockIndex(ABC):
    """block key -> {endpoint, tier}, per model namespace."""

    name: str = "abstract"
    #: True when calls do network I/O and must not run on an event loop thread.
    blocking: bool = False
    #: True when GPU-tier entries count copies: vLLM's block pool may hold two blocks with one
    #: hash and reports each store and each eviction, so an add of a held GPU block is one more
    #: copy and a remove takes one copy; the block is held until its last copy goes. A backend
    #: without it keeps one entry per block (the indexer wraps it: ``kvmesh_indexer.copy_ledger``).
    counts_copies: bool = False

    @abstractmethod
    def add(self, model: str, endpoint: str, tier: Tier, keys: Sequence[int],
            chain_starts: Sequence[tuple[int, int | None]] | None = None) -> int:
        """Record that ``endpoint`` holds ``keys`` in ``tier``; returns entries newly added.

        ``chain_starts`` gives the parent links, as a ``BlockStored`` does:
        ``(offset, parent key or None for a first block)`` where a chain starts
        in ``keys``; every other key is the child of the key before it. A
        backend may use them to read fewer blocks per lookup; ``None`` (links
        unknown) is always correct, only possibly slower.
        """

    @abstractmethod
    def remove(self, model: str, endpoint: str, tier: Tier, keys: Sequence[int]) -> int:
        """Forget those entries; returns entries actually removed."""

    @abstractmethod
    def clear_endpoint(self, endpoint: str, tier: Tier | None = None) -> int:
        """Drop every entry of ``endpoint`` (optionally one tier) in all models; O(its entries).

        Without ``tier`` (the endpoint is gone, or its engine was reset: AllBlocksCleared, a
        restart) its speculative entries go too: the picks made for it are void. Every backend
        does this (``tests/services/indexer/test_index_backends.py``)."""

    @abstractmethod
    def lookup(self, model: str, keys: Sequence[int], endpoint_filter: Iterable[str] | None = None,
               include_speculative: bool = False, exclude: Iterable[str] | None = None,
               extra_models: Sequence[str] = ()) -> LookupResult:
        """Per endpoint and tier: the longest consecutive leading match of ``keys``.

        Stops reading at the first block no endpoint holds. ``exclude`` removes
        endpoints (dead ones) from the answer regardless of the filter.
        ``extra_models`` are namespaces searched too, in the same call (offload
        stores announcing blocks for every model); speculative entries come
        from ``model`` only.
        """

    @abstractmethod
    def put_speculative(self, model: str, endpoint: str, keys: Sequence[int], ttl_s: float) -> None:
        """Short-lived entries a router writes right after a pick."""

    @abstractmethod
    def endpoint_blocks(self, endpoint: str) -> int:
        """Entries currently held by ``endpoint`` (all models and tiers)."""

    @abstractmethod
    def stats(self) -> IndexStats: ...

    def ping(self) -> bool:
        """True when the backend can serve (always for in-process backends)."""
        return True

    def close(self) -> None:  # noqa: B027 - optional hook
        pass
