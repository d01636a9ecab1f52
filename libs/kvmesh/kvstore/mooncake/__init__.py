"""Mooncake Store as the byte pool under the offload store (optional: ``kvmesh[mooncake]``).

The offload service keeps every kvmesh semantic (namespaces, chains, leading hits,
block checksums, its eviction policy, KV events to the indexer) and Mooncake holds the bytes,
pooled across the hosts whose clients mount a segment. ``pool`` wraps Mooncake's Python
client; ``client`` is the worker-side store client that moves bytes straight between
its memory and the pool. See docs/scale.md ("Mooncake Store as the byte pool").
"""
