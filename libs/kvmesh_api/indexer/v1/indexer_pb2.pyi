from kvmesh_api.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_name", "tier")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_block_hash: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    lora_name: str
    tier: _common_pb2.Tier
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., parent_block_hash: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., lora_name: _Optional[str] = ..., tier: _Optional[_Union[_common_pb2.Tier, str]] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "tier")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    tier: _common_pb2.Tier
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., tier: _Optional[_Union[_common_pb2.Tier, str]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllBlocksCleared
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("ts", "events")
    TS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    ts: float
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    def __init__(self, ts: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ...) -> None: ...

class IngestEventsRequest(_message.Message):
    __slots__ = ("endpoint_id", "model", "seq", "vllm_payload", "batch")
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    VLLM_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    endpoint_id: str
    model: str
    seq: int
    vllm_payload: bytes
    batch: EventBatch
    def __init__(self, endpoint_id: _Optional[str] = ..., model: _Optional[str] = ..., seq: _Optional[int] = ..., vllm_payload: _Optional[bytes] = ..., batch: _Optional[_Union[EventBatch, _Mapping]] = ...) -> None: ...

class IngestEventsResponse(_message.Message):
    __slots__ = ("batches_accepted", "batches_rejected", "events_applied", "events_rejected")
    BATCHES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    EVENTS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    EVENTS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    batches_accepted: int
    batches_rejected: int
    events_applied: int
    events_rejected: int
    def __init__(self, batches_accepted: _Optional[int] = ..., batches_rejected: _Optional[int] = ..., events_applied: _Optional[int] = ..., events_rejected: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("model", "tokens", "chain", "extra_keys", "endpoint_filter", "include_speculative", "include_applied")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FILTER_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_APPLIED_FIELD_NUMBER: _ClassVar[int]
    model: str
    tokens: _common_pb2.TokenIds
    chain: BlockChain
    extra_keys: _common_pb2.ExtraKeys
    endpoint_filter: _containers.RepeatedScalarFieldContainer[str]
    include_speculative: bool
    include_applied: bool
    def __init__(self, model: _Optional[str] = ..., tokens: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., chain: _Optional[_Union[BlockChain, _Mapping]] = ..., extra_keys: _Optional[_Union[_common_pb2.ExtraKeys, _Mapping]] = ..., endpoint_filter: _Optional[_Iterable[str]] = ..., include_speculative: _Optional[bool] = ..., include_applied: _Optional[bool] = ...) -> None: ...

class BlockChain(_message.Message):
    __slots__ = ("keys", "keys_be64")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEYS_BE64_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[int]
    keys_be64: bytes
    def __init__(self, keys: _Optional[_Iterable[int]] = ..., keys_be64: _Optional[bytes] = ...) -> None: ...

class TierMatch(_message.Message):
    __slots__ = ("tier", "blocks")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tier: _common_pb2.Tier
    blocks: int
    def __init__(self, tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., blocks: _Optional[int] = ...) -> None: ...

class EndpointMatch(_message.Message):
    __slots__ = ("endpoint_id", "tiers", "combined_blocks", "speculative_blocks", "speculative_ttl_s")
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    COMBINED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    endpoint_id: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierMatch]
    combined_blocks: int
    speculative_blocks: int
    speculative_ttl_s: float
    def __init__(self, endpoint_id: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierMatch, _Mapping]]] = ..., combined_blocks: _Optional[int] = ..., speculative_blocks: _Optional[int] = ..., speculative_ttl_s: _Optional[float] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("matches", "chain_length", "block_size", "keys", "applied_batches")
    class AppliedBatchesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    CHAIN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    matches: _containers.RepeatedCompositeFieldContainer[EndpointMatch]
    chain_length: int
    block_size: int
    keys: _containers.RepeatedScalarFieldContainer[int]
    applied_batches: _containers.ScalarMap[str, int]
    def __init__(self, matches: _Optional[_Iterable[_Union[EndpointMatch, _Mapping]]] = ..., chain_length: _Optional[int] = ..., block_size: _Optional[int] = ..., keys: _Optional[_Iterable[int]] = ..., applied_batches: _Optional[_Mapping[str, int]] = ...) -> None: ...

class PutSpeculativeRequest(_message.Message):
    __slots__ = ("model", "endpoint_id", "keys", "ttl_s")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    model: str
    endpoint_id: str
    keys: _containers.RepeatedScalarFieldContainer[int]
    ttl_s: float
    def __init__(self, model: _Optional[str] = ..., endpoint_id: _Optional[str] = ..., keys: _Optional[_Iterable[int]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PutSpeculativeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Endpoint(_message.Message):
    __slots__ = ("endpoint_id", "model", "role", "grpc_address", "http_address", "kv_events_endpoint", "kv_events_replay_endpoint", "subscriber_binds", "block_size", "hash_algo", "hash_seed_matches", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_REPLAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBER_BINDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_MATCHES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    endpoint_id: str
    model: str
    role: _common_pb2.Role
    grpc_address: str
    http_address: str
    kv_events_endpoint: str
    kv_events_replay_endpoint: str
    subscriber_binds: bool
    block_size: int
    hash_algo: _common_pb2.HashAlgo
    hash_seed_matches: bool
    labels: _containers.ScalarMap[str, str]
    def __init__(self, endpoint_id: _Optional[str] = ..., model: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., grpc_address: _Optional[str] = ..., http_address: _Optional[str] = ..., kv_events_endpoint: _Optional[str] = ..., kv_events_replay_endpoint: _Optional[str] = ..., subscriber_binds: _Optional[bool] = ..., block_size: _Optional[int] = ..., hash_algo: _Optional[_Union[_common_pb2.HashAlgo, str]] = ..., hash_seed_matches: _Optional[bool] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RegisterEndpointRequest(_message.Message):
    __slots__ = ("endpoint", "ttl_s")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    endpoint: Endpoint
    ttl_s: float
    def __init__(self, endpoint: _Optional[_Union[Endpoint, _Mapping]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class RegisterEndpointResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("endpoint_id", "leaving")
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    endpoint_id: str
    leaving: bool
    def __init__(self, endpoint_id: _Optional[str] = ..., leaving: _Optional[bool] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeregisterEndpointRequest(_message.Message):
    __slots__ = ("endpoint_id",)
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    endpoint_id: str
    def __init__(self, endpoint_id: _Optional[str] = ...) -> None: ...

class DeregisterEndpointResponse(_message.Message):
    __slots__ = ("blocks_purged",)
    BLOCKS_PURGED_FIELD_NUMBER: _ClassVar[int]
    blocks_purged: int
    def __init__(self, blocks_purged: _Optional[int] = ...) -> None: ...

class ListEndpointsRequest(_message.Message):
    __slots__ = ("model", "role")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    model: str
    role: _common_pb2.Role
    def __init__(self, model: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ...) -> None: ...

class EndpointStatus(_message.Message):
    __slots__ = ("endpoint", "alive", "seconds_since_heartbeat", "seconds_since_event", "blocks", "last_seq")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_EVENT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    endpoint: Endpoint
    alive: bool
    seconds_since_heartbeat: float
    seconds_since_event: float
    blocks: int
    last_seq: int
    def __init__(self, endpoint: _Optional[_Union[Endpoint, _Mapping]] = ..., alive: _Optional[bool] = ..., seconds_since_heartbeat: _Optional[float] = ..., seconds_since_event: _Optional[float] = ..., blocks: _Optional[int] = ..., last_seq: _Optional[int] = ...) -> None: ...

class ListEndpointsResponse(_message.Message):
    __slots__ = ("endpoints",)
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    endpoints: _containers.RepeatedCompositeFieldContainer[EndpointStatus]
    def __init__(self, endpoints: _Optional[_Iterable[_Union[EndpointStatus, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("backend", "entries", "keys", "endpoints", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    entries: int
    keys: int
    endpoints: int
    counters: _containers.ScalarMap[str, int]
    def __init__(self, backend: _Optional[str] = ..., entries: _Optional[int] = ..., keys: _Optional[int] = ..., endpoints: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ...) -> None: ...
