"""vLLM-exact prefix-cache block hashing (see docs/hashing-and-events.md)."""

from kvmesh.hashing.algos import HashAlgo, hash_object
from kvmesh.hashing.extra_keys import ExtraKeys, MMRange, block_extra_keys, to_event_extra_keys
from kvmesh.hashing.hasher import DEFAULT_NONE_HASH_SEED, BlockHasher, as_token_list, event_key, resolve_seed

__all__ = [
    "DEFAULT_NONE_HASH_SEED",
    "BlockHasher",
    "ExtraKeys",
    "HashAlgo",
    "MMRange",
    "as_token_list",
    "block_extra_keys",
    "event_key",
    "hash_object",
    "resolve_seed",
    "to_event_extra_keys",
]
