"""kvmesh indexer service: engine KV events -> cluster-wide block index (see docs/indexer.md)."""
