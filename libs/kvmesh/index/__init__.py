"""The cluster-wide KV block index: backends, key derivation, event ingest.

Synchronous cores live here so the indexer service and the virtual-time
cluster simulator share them (see docs/indexer.md).
"""

from kvmesh.index.base import BlockIndex, EndpointMatch, IndexStats, IndexUnavailable, LookupResult, Tier
from kvmesh.index.memory import MemoryIndex

__all__ = ["BlockIndex", "EndpointMatch", "IndexStats", "IndexUnavailable", "LookupResult", "MemoryIndex", "Tier"]
