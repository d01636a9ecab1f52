"""kvmesh KV offload store: tiers, eviction, disk, shared memory and the client."""
