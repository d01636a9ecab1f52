"""Configuration of the offload service (flags ``--ram-capacity-bytes`` etc., env ``KVMESH_OFFLOAD_*``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from kvmesh.config import ConfigError
from kvmesh.kvstore.eviction_registry import eviction_policy_names
from kvmesh.kvstore.mooncake.pool import PoolConfig
from kvmesh.metrics_http import METRICS_AUTH_METADATA, MetricsAuthConfig
from kvmesh.rpc.tls import TLS_METADATA, TlsConfig

GiB = 1024 ** 3
BYTE_POOLS = ["local", "mooncake"]


@dataclass
class OffloadConfig:
    ENV_PREFIX: ClassVar[str] = "KVMESH_OFFLOAD_"

    host: str = field(default="127.0.0.1", metadata={
        "help": "listen host of gRPC, the bulk port and /metrics (0.0.0.0 = every interface; loopback by default)"})
    port: int = field(default=50051, metadata={"help": "gRPC listen port (0 = pick a free one)"})
    grace_s: float = field(default=10.0, metadata={"help": "drain time for in-flight calls on shutdown"})
    metrics_port: int = field(default=0, metadata={"help": "Prometheus /metrics port (0 = off)"})
    tls: TlsConfig = field(default_factory=TlsConfig, metadata=TLS_METADATA)
    metrics_auth: MetricsAuthConfig = field(default_factory=MetricsAuthConfig, metadata=METRICS_AUTH_METADATA)
    ram_capacity_bytes: int = field(default=2 * GiB, metadata={"help": "RAM tier budget in bytes"})
    byte_pool: str = field(default="local", metadata={
        "choices": BYTE_POOLS,
        "help": "where block bytes live: local (this process's memory) | mooncake (a Mooncake Store pool; "
                "this store keeps the index, checksums, eviction and events; clients move the bytes)"})
    mooncake: PoolConfig = field(default_factory=PoolConfig, metadata={
        "help": "the Mooncake pool (--byte-pool mooncake)"})
    disk_path: str = field(default="", metadata={"help": "disk tier folder (empty = no disk tier)"})
    disk_capacity_bytes: int = field(default=16 * GiB, metadata={"help": "disk tier budget in bytes"})
    disk_fsync: bool = field(default=False, metadata={"help": "fsync each disk block before it becomes visible"})
    eviction_policy: str = field(default="agent", metadata={"help": f"RAM eviction policy: {' | '.join(eviction_policy_names())}"})
    evict_on_full: bool = field(default=True, metadata={
        "help": "evict to make room; if false a Put that does not fit gets RESOURCE_EXHAUSTED"})
    max_block_bytes: int = field(default=64 * 1024 * 1024, metadata={"help": "largest accepted block"})
    malloc_trim_s: float = field(default=5.0, metadata={
        "help": "return freed heap memory to the OS this often (glibc malloc_trim), so RSS follows the RAM "
                "tier as blocks are evicted (0 = never: RSS keeps its peak)"})
    shm_enabled: bool = field(default=True, metadata={"help": "serve PutShm/GetShm (same-host fast path)"})
    direct_put: bool = field(default=True, metadata={
        "help": "serve ReservePut/CommitPut: same-host clients write blocks straight into the store's shared "
                "slabs (one copy); they map the slabs writable, so turn off when same-uid clients do not trust "
                "each other"})
    bulk_port: int = field(default=0, metadata={
        "help": "TCP port of the bulk Get data plane for other hosts (0 = any free port, -1 = off)"})
    lease_ttl_s: float = field(default=120.0, metadata={
        "help": "how long a GetShm/GetBulk lease keeps blocks for a reader that has not released them"})
    lease_bind_host: bool = field(default=True, metadata={
        "help": "a lease is usable (bulk read, release) only from the host that took it; off behind NAT or a proxy"})
    endpoint_id: str = field(default="offload-0", metadata={"help": "this store's endpoint id in the index"})
    model: str = field(default="any", metadata={"help": "model name in the KV-event topic and registration"})
    events_endpoint: str = field(default="", metadata={
        "help": "ZMQ KV-event publisher endpoint, e.g. tcp://*:5560 (empty = no events)"})
    events_replay_endpoint: str = field(default="", metadata={
        "help": "ZMQ replay endpoint, e.g. tcp://127.0.0.1:5561 (hands out every buffered event: keep it private)"})
    events_curve_secret: str = field(default="", metadata={
        "help": "CURVE secret certificate (NAME.key_secret) of the event and replay sockets (empty = off)"})
    events_curve_clients: str = field(default="", metadata={
        "help": "directory of the subscribers' CURVE public keys admitted to events and replay"})
    indexer_address: str = field(default="", metadata={"help": "indexer host:port to register with (empty = off)"})
    advertise_host: str = field(default="127.0.0.1", metadata={"help": "host other services use to reach us"})
    register_ttl_s: float = field(default=30.0, metadata={"help": "heartbeat TTL asked of the indexer"})

    def validate(self) -> None:
        if self.ram_capacity_bytes <= 0:
            raise ConfigError("ram_capacity_bytes must be > 0")
        if self.disk_path and self.disk_capacity_bytes <= 0:
            raise ConfigError("disk_capacity_bytes must be > 0 when disk_path is set")
        if self.eviction_policy not in eviction_policy_names():
            raise ConfigError(f"eviction_policy {self.eviction_policy!r} unknown; choose from {eviction_policy_names()}")
        if not -1 <= self.bulk_port <= 65535:
            raise ConfigError("bulk_port must be -1 (off), 0 (any) or a port number")
        if self.lease_ttl_s <= 0:
            raise ConfigError("lease_ttl_s must be > 0")
        if not 0 < self.max_block_bytes <= 64 * 1024 * 1024:
            raise ConfigError("max_block_bytes must be in (0, 64 MiB]")
        if not self.endpoint_id or "@" in self.endpoint_id:
            raise ConfigError("endpoint_id must be non-empty and contain no '@'")
        if bool(self.events_curve_secret) != bool(self.events_curve_clients):
            raise ConfigError("events_curve_secret and events_curve_clients go together")
        if self.byte_pool not in BYTE_POOLS:
            raise ConfigError(f"byte_pool {self.byte_pool!r} unknown; choose from {BYTE_POOLS}")
        if self.byte_pool == "mooncake":
            if not self.mooncake.master:
                raise ConfigError("byte_pool mooncake needs --mooncake-master (host:port of mooncake_master)")
            if self.disk_path:
                raise ConfigError("byte_pool mooncake keeps no disk tier (Mooncake has its own SSD offload)")
            if self.mooncake.protocol not in ("tcp", "rdma"):
                raise ConfigError("mooncake protocol must be tcp or rdma")
            if self.mooncake.segment_bytes < -1 or self.mooncake.buffer_bytes <= 0:
                raise ConfigError("mooncake segment_bytes must be >= -1 and buffer_bytes > 0")
        if self.indexer_address and not self.events_endpoint:
            raise ConfigError("indexer_address needs events_endpoint (the indexer subscribes to our events)")
