"""Configuration of the indexer service (flags ``--backend`` etc., env ``KVMESH_INDEXER_*``).

Models and static engines are given as JSON lists or in a compact comma form:

- ``--models 'tiny@128@sha256_cbor,big@64@sha256@myseed'``  (NAME@BLOCK_SIZE@ALGO[@SEED])
  or ``[{"name": "tiny", "block_size": 128, "hash_algo": "sha256_cbor", "seed": null}]``
- ``--engines 'e0@tiny@tcp://127.0.0.1:5557@tcp://127.0.0.1:5558,e1@tiny@tcp://127.0.0.1:5560@@bind'``
  (ID@MODEL@ZMQ[@REPLAY][@bind]) or ``[{"endpoint_id": "e0", "model": "tiny", "zmq_endpoint": ...,
  "replay_endpoint": ..., "bind": false, "hash_algo": null, "block_size": null, "seed_matches": true}]``

Every problem is a ``ConfigError`` naming the setting, raised before the server starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvmesh.config import ConfigError
from kvmesh.hashing import HashAlgo
from kvmesh.metrics_http import METRICS_AUTH_METADATA, MetricsAuthConfig
from kvmesh.rpc.tls import TLS_METADATA, TlsConfig
from kvmesh_indexer.central_socket import check_replay_template, dp_binds
from kvmesh_indexer.keys import EngineHashing, ModelSpec, check_block_size

BACKENDS = ("memory", "redis", "redis-cluster")


@dataclass
class EngineConfig:
    endpoint_id: str
    model: str
    zmq_endpoint: str
    replay_endpoint: str | None = None
    bind: bool = False
    hash_algo: str | None = None
    block_size: int | None = None
    seed_matches: bool = True

    def hashing(self) -> EngineHashing:
        return EngineHashing(self.hash_algo, self.block_size, self.seed_matches)


@dataclass
class IndexerConfig:
    ENV_PREFIX: ClassVar[str] = "KVMESH_INDEXER_"

    host: str = field(default="127.0.0.1", metadata={
        "help": "listen host of gRPC and /metrics (0.0.0.0 = every interface; loopback by default)"})
    port: int = field(default=50051, metadata={"help": "gRPC listen port (0 = pick a free one)"})
    grace_s: float = field(default=5.0, metadata={"help": "drain time for in-flight calls on shutdown"})
    metrics_port: int = field(default=0, metadata={"help": "Prometheus /metrics port (0 = off)"})
    tls: TlsConfig = field(default_factory=TlsConfig, metadata=TLS_METADATA)
    metrics_auth: MetricsAuthConfig = field(default_factory=MetricsAuthConfig, metadata=METRICS_AUTH_METADATA)
    backend: str = field(default="memory", metadata={
        "help": "index backend: memory | redis | redis-cluster (redis with a redis+cluster:// URL = redis-cluster)"})
    redis_url: str = field(default="redis://127.0.0.1:6379/0", metadata={
        "help": "redis:// or rediss:// URL (user:password@ for AUTH); for a cluster "
                "redis+cluster://host:port[,host:port...] (or rediss+cluster://)"})
    redis_namespace: str = field(default="kvm", metadata={"help": "key prefix in Redis"})
    redis_timeout_s: float = field(default=0.5, metadata={"help": "Redis socket timeout per call"})
    redis_probe_stride: int = field(default=32, metadata={
        "help": "Redis lookups read every Nth block of prefix-closed endpoints, then one gap per run end"})
    redis_anchor_depth: int = field(default=64, metadata={
        "help": "redis-cluster: blocks of a chain below this depth live on its first block's shard, the rest on "
                "the shard of its block at this depth (a lookup touches <= 2 shards); set it past shared prefixes"})
    gpu_copy_ledger_max_keys: int = field(default=4_000_000, metadata={
        "help": "redis backends: GPU blocks per endpoint whose copies this replica counts, so an engine's "
                "eviction of one of two copies of a block does not drop the block (0 = off)"})
    max_entries: int = field(default=20_000_000, metadata={
        "help": "memory backend: block-endpoint-tier entry budget (LRU eviction beyond it; 0 = unbounded)"})
    models: str = field(default="", metadata={"help": "models: JSON list or NAME@BLOCK_SIZE@ALGO[@SEED],..."})
    default_model: str = field(default="", metadata={"help": "model used when a request names none"})
    auto_models: bool = field(default=True, metadata={
        "help": "a registration naming an unknown model creates it (its block size, default algo)"})
    default_block_size: int = field(default=128, metadata={"help": "block size of auto-created models"})
    default_hash_algo: str = field(default="sha256_cbor", metadata={"help": "hash algo of auto-created models"})
    store_models: str = field(default="any,*", metadata={
        "help": "model names meaning 'every model' (offload stores): their blocks answer every model's lookup"})
    engines: str = field(default="", metadata={"help": "static engines: JSON list or ID@MODEL@ZMQ[@REPLAY][@bind],..."})
    kv_events_bind: str = field(default="", metadata={
        "help": "central KV-event socket(s) engines connect to, e.g. tcp://0.0.0.0:5557 (comma list; empty = off); "
                "endpoints are named by the topic kv@<pod-ip>:<port>@<model>"})
    kv_events_replay: str = field(default="", metadata={
        "help": "replay address of central-socket engines from their topic's endpoint, e.g. tcp://{host}:5558 "
                "(fields {endpoint} {host} {port}; empty = no replay)"})
    kv_events_dp_size: int = field(default=1, metadata={
        "help": "central socket: data-parallel ranks per engine (vLLM --data-parallel-size): each bind address "
                "also binds port+1..port+N-1, where vLLM's rank r connects; rank r>0 is endpoint <id>_dp<r>"})
    kv_events_max_endpoints: int = field(default=1024, metadata={
        "help": "central socket: most endpoints admitted (later topics are counted as rejected)"})
    kv_events_idle_purge_s: float = field(default=0.0, metadata={
        "help": "central socket: purge an endpoint silent this long (0 = never)"})
    kv_events_hash_algo: str = field(default="", metadata={
        "help": "central socket: engines' --prefix-caching-hash-algo (empty = the model's)"})
    heartbeat_ttl_s: float = field(default=10.0, metadata={"help": "default heartbeat TTL of registered endpoints"})
    lookup_timeout_s: float = field(default=1.0, metadata={"help": "max time a Lookup waits for the backend"})
    lookup_threads: int = field(default=4, metadata={
        "help": "threads that run Lookups against a blocking backend (Redis), apart from ingest's"})
    replay_timeout_s: float = field(default=2.0, metadata={"help": "max time for one replay request"})
    tail_probe_s: float = field(default=5.0, metadata={
        "help": "check a quiet endpoint's replay buffer this often, catching event messages lost with "
                "nothing after them (e.g. right after an engine restart); 0 = off"})
    speculative_ttl_s: float = field(default=2.0, metadata={"help": "TTL of PutSpeculative when the request has 0"})
    max_batch_events: int = field(default=10_000, metadata={"help": "larger ingest batches are rejected"})
    queue_size: int = field(default=10_000, metadata={"help": "per-endpoint ingest queue (ZMQ drops beyond)"})
    queue_bytes: int = field(default=16 * 1024 * 1024, metadata={
        "help": "per-endpoint ingest queue bound in payload bytes: ZMQ messages beyond are dropped, counted "
                "(kvmesh_indexer_dropped_messages_total) and repaired by replay; gRPC ingest waits"})
    socket_buffer_bytes: int = field(default=32 * 1024 * 1024, metadata={
        "help": "bytes ZMQ may hold per publisher connection before the indexer reads them (RCVHWM = this / "
                "max_message_bytes, at least 2 messages); beyond it ZMQ stops reading that connection and the "
                "publisher buffers, then drops at its own high-water mark (repaired by replay)"})
    max_message_bytes: int = field(default=8 * 1024 * 1024, metadata={
        "help": "largest KV-event message: ZMQ MAXMSGSIZE of every event socket (a peer sending more is "
                "disconnected), the gRPC ingest payload and the decoder's limit"})
    kv_events_curve_secret: str = field(default="", metadata={
        "help": "CURVE secret certificate (NAME.key_secret) the indexer presents to publishers ('' = off)"})
    kv_events_curve_servers: str = field(default="", metadata={
        "help": "directory of publishers' CURVE public keys, ENDPOINT_ID.key: an endpoint with a key there is "
                "subscribed to and replayed over CURVE"})
    max_seq_jump: int = field(default=1_000_000, metadata={
        "help": "a sequence jump past this many batches is refused unless the engine's replay buffer holds it "
                "or 3 batches in a row continue it (a forged 10^12 must not clear an endpoint)"})

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"setting 'backend': {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.backend == "redis" and self.redis_url.startswith(("redis+cluster://", "rediss+cluster://")):
            self.backend = "redis-cluster"
        if self.backend == "redis" and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"setting 'redis_url': {self.redis_url!r} must start with redis:// or rediss://")
        if self.backend == "redis-cluster":
            if not self.redis_url.startswith(("redis+cluster://", "rediss+cluster://")):
                raise ConfigError(f"setting 'redis_url': {self.redis_url!r} must start with redis+cluster:// or "
                                  "rediss+cluster:// for backend redis-cluster")
            if self.redis_anchor_depth < 1:
                raise ConfigError("setting 'redis_anchor_depth' must be >= 1")
        for name in ("heartbeat_ttl_s", "lookup_timeout_s", "replay_timeout_s", "redis_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"setting {name!r} must be > 0")
        if self.tail_probe_s < 0:
            raise ConfigError("setting 'tail_probe_s' must be >= 0 (0 = off)")
        if not 0 < self.speculative_ttl_s <= 300:
            raise ConfigError("setting 'speculative_ttl_s' must be in (0, 300]")
        if self.redis_probe_stride < 1:
            raise ConfigError("setting 'redis_probe_stride' must be >= 1")
        if self.gpu_copy_ledger_max_keys < 0:
            raise ConfigError("setting 'gpu_copy_ledger_max_keys' must be >= 0")
        if self.max_entries < 0:
            raise ConfigError("setting 'max_entries' must be >= 0")
        if self.socket_buffer_bytes <= 0:
            raise ConfigError("setting 'socket_buffer_bytes' must be > 0")
        if self.default_block_size <= 0:
            raise ConfigError("setting 'default_block_size' must be > 0")
        try:
            HashAlgo.parse(self.default_hash_algo)
        except ValueError as exc:
            raise ConfigError(f"setting 'default_hash_algo': {exc}") from None
        self.central_binds()
        if self.kv_events_replay:
            try:
                check_replay_template(self.kv_events_replay)
            except ValueError as exc:
                raise ConfigError(f"setting 'kv_events_replay': {exc}") from None
        if not 1 <= self.kv_events_dp_size <= 1024:
            raise ConfigError("setting 'kv_events_dp_size' must be in [1, 1024]")
        if self.kv_events_dp_size > 1:
            try:
                dp_binds(self.central_binds(), self.kv_events_dp_size)
            except ValueError as exc:
                raise ConfigError(f"setting 'kv_events_bind': {exc}") from None
        if self.kv_events_max_endpoints < 1:
            raise ConfigError("setting 'kv_events_max_endpoints' must be >= 1")
        if self.kv_events_idle_purge_s < 0:
            raise ConfigError("setting 'kv_events_idle_purge_s' must be >= 0")
        if self.kv_events_hash_algo:
            try:
                HashAlgo.parse(self.kv_events_hash_algo)
            except ValueError as exc:
                raise ConfigError(f"setting 'kv_events_hash_algo': {exc}") from None
        models = self.model_specs()
        if self.default_model and self.default_model not in models and not self.auto_models:
            raise ConfigError(f"setting 'default_model': {self.default_model!r} is not in 'models'")
        self.engine_configs(models)

    # ---- parsed views --------------------------------------------------------------------
    def central_binds(self) -> list[str]:
        binds = [b.strip() for b in self.kv_events_bind.split(",") if b.strip()]
        for b in binds:
            # vLLM connects its PUB only to a tcp address without '*' (it binds ipc/inproc itself).
            if not b.startswith("tcp://"):
                raise ConfigError(f"setting 'kv_events_bind': {b!r} must be tcp://host:port (engines connect to it)")
        return binds

    def store_model_names(self) -> set[str]:
        return {m.strip() for m in self.store_models.split(",") if m.strip()}

    def model_specs(self) -> dict[str, ModelSpec]:
        out: dict[str, ModelSpec] = {}
        for i, item in enumerate(_items(self.models, "models")):
            if isinstance(item, str):
                parts = item.split("@")
                if len(parts) not in (3, 4) or not parts[0]:
                    raise ConfigError(f"setting 'models' item {i} {item!r}: want NAME@BLOCK_SIZE@ALGO[@SEED]")
                item = {"name": parts[0], "block_size": parts[1], "hash_algo": parts[2],
                        "seed": parts[3] if len(parts) == 4 else None}
            if not isinstance(item, dict) or not item.get("name"):
                raise ConfigError(f"setting 'models' item {i}: needs a 'name'")
            name = str(item["name"])
            try:
                bs = int(item.get("block_size", self.default_block_size))
            except (TypeError, ValueError):
                raise ConfigError(f"setting 'models' model {name!r}: block_size {item.get('block_size')!r} "
                                  "is not an integer") from None
            if bs <= 0:
                raise ConfigError(f"setting 'models' model {name!r}: block_size must be > 0")
            algo = str(item.get("hash_algo") or self.default_hash_algo)
            try:
                HashAlgo.parse(algo)
            except ValueError as exc:
                raise ConfigError(f"setting 'models' model {name!r}: {exc}") from None
            unknown = set(item) - {"name", "block_size", "hash_algo", "seed", "lora_paths"}
            if unknown:
                raise ConfigError(f"setting 'models' model {name!r}: unknown keys {sorted(unknown)}")
            if name in out:
                raise ConfigError(f"setting 'models': model {name!r} given twice")
            out[name] = ModelSpec(name, bs, algo, item.get("seed"), dict(item.get("lora_paths") or {}))
        return out

    def engine_configs(self, models: dict[str, ModelSpec] | None = None) -> list[EngineConfig]:
        models = self.model_specs() if models is None else models
        out: list[EngineConfig] = []
        seen: set[str] = set()
        for i, item in enumerate(_items(self.engines, "engines")):
            if isinstance(item, str):
                parts = item.split("@")
                if len(parts) < 3:
                    raise ConfigError(f"setting 'engines' item {i} {item!r}: want ID@MODEL@ZMQ[@REPLAY][@bind]")
                bind = False
                if parts[-1] in ("bind", "connect") and len(parts) > 3:
                    bind = parts.pop() == "bind"
                item = {"endpoint_id": parts[0], "model": parts[1], "zmq_endpoint": parts[2],
                        "replay_endpoint": parts[3] if len(parts) > 3 and parts[3] else None, "bind": bind}
            if not isinstance(item, dict):
                raise ConfigError(f"setting 'engines' item {i}: want an object or ID@MODEL@ZMQ string")
            try:
                eng = EngineConfig(**item)
            except TypeError as exc:
                raise ConfigError(f"setting 'engines' item {i}: {exc}") from None
            where = f"setting 'engines' endpoint {eng.endpoint_id!r}"
            if not eng.endpoint_id or "@" in eng.endpoint_id or len(eng.endpoint_id.encode()) > 128:
                raise ConfigError(f"setting 'engines' item {i}: endpoint_id must be 1..128 bytes without '@'")
            if eng.endpoint_id in seen:
                raise ConfigError(f"{where}: given twice")
            seen.add(eng.endpoint_id)
            if not eng.zmq_endpoint.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"{where}: zmq_endpoint {eng.zmq_endpoint!r} must be tcp://, ipc:// or inproc://")
            if eng.replay_endpoint and not eng.replay_endpoint.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"{where}: replay_endpoint {eng.replay_endpoint!r} must be tcp://, ipc:// or "
                                  "inproc://")
            spec = models.get(eng.model)
            if spec is None:
                raise ConfigError(f"{where}: model {eng.model!r} is not in setting 'models' "
                                  f"(configured: {', '.join(sorted(models)) or 'none'})")
            if eng.hash_algo is not None:
                try:
                    HashAlgo.parse(eng.hash_algo)
                except ValueError as exc:
                    raise ConfigError(f"{where}: {exc}") from None
            try:
                check_block_size(eng.endpoint_id, spec, eng.hashing())
            except ValueError as exc:
                raise ConfigError(f"{where}: {exc}") from None
            out.append(eng)
        return out


def _items(raw: str, name: str) -> list[Any]:
    raw = (raw or "").strip()
    if not raw:
        return []
    if raw.startswith("["):
        try:
            val = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"setting {name!r}: invalid JSON: {exc}") from None
        if not isinstance(val, list):
            raise ConfigError(f"setting {name!r}: JSON must be a list")
        return val
    return [x.strip() for x in raw.split(",") if x.strip()]
