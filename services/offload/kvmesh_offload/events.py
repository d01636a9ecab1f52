"""Turns the store's events into vLLM-format KV events on a ZMQ publisher.

The indexer subscribes to these exactly as to an engine, so blocks the store
holds become routable as tier CPU (RAM) or DISK.
"""

from __future__ import annotations

import logging

from kvmesh.events.codec import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvmesh.events.publisher import KvEventPublisher
from kvmesh_offload.store import StoreEvent

log = logging.getLogger(__name__)


def to_wire(ev: StoreEvent) -> KVEvent:
    if ev.kind == "stored":
        return BlockStored(block_hashes=list(ev.keys), parent_block_hash=ev.parent, token_ids=list(ev.token_ids),
                           block_size=ev.block_size, lora_id=None, medium=ev.medium, lora_name=None)
    if ev.kind == "removed":
        return BlockRemoved(block_hashes=list(ev.keys), medium=ev.medium)
    return AllBlocksCleared()


class EventBridge:
    """The store's event sink: publishes each batch synchronously (PUB never blocks)."""

    def __init__(self, publisher: KvEventPublisher) -> None:
        self.publisher = publisher

    def __call__(self, events: list[StoreEvent]) -> None:
        self.publisher.publish([to_wire(e) for e in events])
