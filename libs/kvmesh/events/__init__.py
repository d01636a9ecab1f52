"""vLLM KV-event wire format: codec, topics and a vLLM-compatible ZMQ publisher."""

from kvmesh.events.codec import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    DecodedMessage,
    DecodeError,
    EventError,
    KVEvent,
    KVEventBatch,
    decode_batch,
    decode_message,
    encode_batch,
    encode_message,
    is_replay_end,
)
from kvmesh.events.publisher import KvEventPublisher
from kvmesh.events.topic import make_topic, parse_topic

__all__ = [
    "REPLAY_END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodeError",
    "DecodedBatch",
    "DecodedMessage",
    "EventError",
    "KVEvent",
    "KVEventBatch",
    "KvEventPublisher",
    "decode_batch",
    "decode_message",
    "encode_batch",
    "encode_message",
    "is_replay_end",
    "make_topic",
    "parse_topic",
]
