"""msgspec mirror of vLLM's KV-event structs, used to decode well-formed batches fast.

The tolerant decoder in :mod:`kvmesh.events.codec` validates field by field in Python,
which is ~10x slower than vLLM's own typed msgspec decoder. Nearly all traffic is
well-formed current-vLLM output, so the codec first tries these structs (identical
field names, order, defaults and tag settings to ``vllm/distributed/kv_events.py``) and
falls back to the tolerant path per batch or per event only when they reject the input
(legacy array events, missing optional-in-practice fields, garbage).
"""

from __future__ import annotations

from typing import Any

import msgspec


class _Event(msgspec.Struct, omit_defaults=True, tag=True, gc=False):
    pass


class BlockStoredW(_Event, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemovedW(_Event, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksClearedW(_Event, tag="AllBlocksCleared"):
    pass


class BatchW(msgspec.Struct, array_like=True, gc=False):
    """A batch whose events are decoded one by one (so one bad event loses only itself)."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class TypedBatchW(msgspec.Struct, array_like=True, gc=False):
    """A batch decoded in one call, as vLLM's own KVEventBatch decoder does."""

    ts: float
    events: list[BlockStoredW | BlockRemovedW | AllBlocksClearedW]
    data_parallel_rank: int | None = None


typed_batch_decoder = msgspec.msgpack.Decoder(TypedBatchW)
encoder = msgspec.msgpack.Encoder()
batch_decoder = msgspec.msgpack.Decoder(BatchW)
event_decoder = msgspec.msgpack.Decoder(BlockStoredW | BlockRemovedW | AllBlocksClearedW)
DecodeFailure = msgspec.DecodeError  # ValidationError is a subclass
astuple = msgspec.structs.astuple
