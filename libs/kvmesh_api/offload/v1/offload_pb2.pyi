from kvmesh_api.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutHeader(_message.Message):
    __slots__ = ("namespace", "session_id", "parent_key", "has_parent", "block_size")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    HAS_PARENT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    session_id: str
    parent_key: int
    has_parent: bool
    block_size: int
    def __init__(self, namespace: _Optional[str] = ..., session_id: _Optional[str] = ..., parent_key: _Optional[int] = ..., has_parent: _Optional[bool] = ..., block_size: _Optional[int] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("key", "data", "last", "checksum", "token_ids")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    key: int
    data: bytes
    last: bool
    checksum: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., checksum: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    chunk: BlockChunk
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ..., chunk: _Optional[_Union[BlockChunk, _Mapping]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "already_present", "bytes", "evicted")
    STORED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    already_present: int
    bytes: int
    evicted: int
    def __init__(self, stored: _Optional[int] = ..., already_present: _Optional[int] = ..., bytes: _Optional[int] = ..., evicted: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace", "keys", "chunk_bytes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[int]
    chunk_bytes: int
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[int]] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("chunk", "tier")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    chunk: BlockChunk
    tier: _common_pb2.Tier
    def __init__(self, chunk: _Optional[_Union[BlockChunk, _Mapping]] = ..., tier: _Optional[_Union[_common_pb2.Tier, str]] = ...) -> None: ...

class ContainsRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[int]] = ...) -> None: ...

class ContainsResponse(_message.Message):
    __slots__ = ("leading_present", "leading_in_ram")
    LEADING_PRESENT_FIELD_NUMBER: _ClassVar[int]
    LEADING_IN_RAM_FIELD_NUMBER: _ClassVar[int]
    leading_present: int
    leading_in_ram: int
    def __init__(self, leading_present: _Optional[int] = ..., leading_in_ram: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[int]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("ram_bytes", "ram_capacity_bytes", "disk_bytes", "disk_capacity_bytes", "ram_blocks", "disk_blocks", "counters", "eviction_policy", "pool", "pool_prefix", "pool_master")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAM_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    EVICTION_POLICY_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    POOL_PREFIX_FIELD_NUMBER: _ClassVar[int]
    POOL_MASTER_FIELD_NUMBER: _ClassVar[int]
    ram_bytes: int
    ram_capacity_bytes: int
    disk_bytes: int
    disk_capacity_bytes: int
    ram_blocks: int
    disk_blocks: int
    counters: _containers.ScalarMap[str, int]
    eviction_policy: str
    pool: str
    pool_prefix: str
    pool_master: str
    def __init__(self, ram_bytes: _Optional[int] = ..., ram_capacity_bytes: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., disk_capacity_bytes: _Optional[int] = ..., ram_blocks: _Optional[int] = ..., disk_blocks: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ..., eviction_policy: _Optional[str] = ..., pool: _Optional[str] = ..., pool_prefix: _Optional[str] = ..., pool_master: _Optional[str] = ...) -> None: ...

class ShmRequest(_message.Message):
    __slots__ = ("header", "segment", "keys", "offsets", "sizes", "checksums", "tokens", "capacity", "map_store")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    MAP_STORE_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    segment: str
    keys: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenBlock]
    capacity: int
    map_store: bool
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ..., segment: _Optional[str] = ..., keys: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[_Union[TokenBlock, _Mapping]]] = ..., capacity: _Optional[int] = ..., map_store: _Optional[bool] = ...) -> None: ...

class TokenBlock(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ShmGetResponse(_message.Message):
    __slots__ = ("leading_present", "sizes", "tiers", "offsets", "truncated", "checksums", "segments", "lease")
    LEADING_PRESENT_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    leading_present: int
    sizes: _containers.RepeatedScalarFieldContainer[int]
    tiers: _containers.RepeatedScalarFieldContainer[_common_pb2.Tier]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    truncated: bool
    checksums: _containers.RepeatedScalarFieldContainer[int]
    segments: _containers.RepeatedScalarFieldContainer[str]
    lease: bytes
    def __init__(self, leading_present: _Optional[int] = ..., sizes: _Optional[_Iterable[int]] = ..., tiers: _Optional[_Iterable[_Union[_common_pb2.Tier, str]]] = ..., offsets: _Optional[_Iterable[int]] = ..., truncated: _Optional[bool] = ..., checksums: _Optional[_Iterable[int]] = ..., segments: _Optional[_Iterable[str]] = ..., lease: _Optional[bytes] = ...) -> None: ...

class ShmRelease(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: bytes
    def __init__(self, lease: _Optional[bytes] = ...) -> None: ...

class BulkGetResponse(_message.Message):
    __slots__ = ("leading_present", "sizes", "tiers", "checksums", "bulk_port", "lease")
    LEADING_PRESENT_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    leading_present: int
    sizes: _containers.RepeatedScalarFieldContainer[int]
    tiers: _containers.RepeatedScalarFieldContainer[_common_pb2.Tier]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    bulk_port: int
    lease: bytes
    def __init__(self, leading_present: _Optional[int] = ..., sizes: _Optional[_Iterable[int]] = ..., tiers: _Optional[_Iterable[_Union[_common_pb2.Tier, str]]] = ..., checksums: _Optional[_Iterable[int]] = ..., bulk_port: _Optional[int] = ..., lease: _Optional[bytes] = ...) -> None: ...

class ShmReleaseResponse(_message.Message):
    __slots__ = ("held",)
    HELD_FIELD_NUMBER: _ClassVar[int]
    held: bool
    def __init__(self, held: _Optional[bool] = ...) -> None: ...

class PutReservation(_message.Message):
    __slots__ = ("reservation", "segments", "offsets", "ttl_s", "min_block_bytes")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    MIN_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    reservation: bytes
    segments: _containers.RepeatedScalarFieldContainer[str]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    ttl_s: float
    min_block_bytes: int
    def __init__(self, reservation: _Optional[bytes] = ..., segments: _Optional[_Iterable[str]] = ..., offsets: _Optional[_Iterable[int]] = ..., ttl_s: _Optional[float] = ..., min_block_bytes: _Optional[int] = ...) -> None: ...

class PutCommit(_message.Message):
    __slots__ = ("reservation", "checksums", "tokens", "abort")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    reservation: bytes
    checksums: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenBlock]
    abort: bool
    def __init__(self, reservation: _Optional[bytes] = ..., checksums: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[_Union[TokenBlock, _Mapping]]] = ..., abort: _Optional[bool] = ...) -> None: ...
