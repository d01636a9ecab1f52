"""Router configuration: defaults here, ``KVMESH_ROUTER_*`` env, then ``--flags``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from kvmesh.config import ConfigError
from kvmesh.metrics_http import METRICS_AUTH_METADATA, MetricsAuthConfig
from kvmesh.responses_api.store.registry import store_name
from kvmesh.routing.pd_split import SPLIT_FIELDS, SplitConfig, survival_problem
from kvmesh.routing.registry import available_policies
from kvmesh.routing.scoring import SCORING_METADATA, ScoringConfig
from kvmesh.rpc.tls import TLS_METADATA, TlsConfig


@dataclass
class RouterConfig:
    ENV_PREFIX: ClassVar[str] = "KVMESH_ROUTER_"

    host: str = field(default="127.0.0.1", metadata={
        "help": "listen host of gRPC, HTTP, ext_proc and /metrics (0.0.0.0 = every interface; loopback by default)"})
    port: int = field(default=50050, metadata={"help": "gRPC port"})
    http_port: int = field(default=8000, metadata={"help": "OpenAI-compatible HTTP port (0 = off)"})
    metrics_port: int = field(default=0, metadata={"help": "Prometheus /metrics port (0 = off)"})
    extproc_port: int = field(default=0, metadata={"help": "Envoy ext_proc endpoint-picker port (0 = off)"})
    tls: TlsConfig = field(default_factory=TlsConfig, metadata=TLS_METADATA)
    metrics_auth: MetricsAuthConfig = field(default_factory=MetricsAuthConfig, metadata=METRICS_AUTH_METADATA)
    model: str = field(default="tiny", metadata={"help": "served model name"})
    tokenizer_path: str = field(default="", metadata={"help": "model dir with tokenizer.json (+ chat template)"})
    max_model_len: int = field(default=1_048_576, metadata={"help": "max prompt + output tokens"})
    max_prompt_tokens: int = field(default=1_048_576, metadata={"help": "max prompt tokens"})
    max_text_bytes: int = field(default=8 * 1024 * 1024, metadata={"help": "max prompt text / HTTP body bytes"})
    max_tokens_default: int = field(default=0, metadata={
        "help": "max_tokens when the request gives none (0 = what is left of max_model_len, as vLLM)"})
    vocab_size: int = field(default=0, metadata={"help": "token ids must be below this (0 = tokenizer/worker)"})
    # Endpoints
    endpoints: list[str] = field(default_factory=list,
                                 metadata={"help": "static decode endpoints, comma-separated: ID=HOST:PORT (a kvmesh "
                                                   "worker's gRPC) or ID=http://HOST:PORT (an OpenAI server: vllm serve)"})
    prefill_endpoints: list[str] = field(default_factory=list,
                                         metadata={"help": "static prefill endpoints ID=HOST:PORT"})
    inference_pool: str = field(default="", metadata={
        "help": "NAMESPACE/NAME of a Gateway API InferencePool: its pods (selector, target port) are external "
                "OpenAI endpoints, watched with the kubernetes client ('' = none)"})
    kubeconfig: str = field(default="", metadata={
        "help": "kubeconfig file for --inference-pool ('' = in-cluster service account, else ~/.kube/config)"})
    external_connect_timeout_s: float = field(default=2.0, metadata={
        "help": "connect timeout to external OpenAI endpoints; a failed connect marks one down"})
    external_api_key: str = field(default="", metadata={
        "help": "bearer token sent to external OpenAI endpoints (their --api-key; '' = none)"})
    external_dp_size: int = field(default=1, metadata={
        "help": "data-parallel ranks of each external vLLM (its --data-parallel-size): every URL is N endpoints, "
                "ID and ID_dp<r> (the indexer's names), picked with vLLM's X-data-parallel-rank header"})
    indexer: str = field(default="", metadata={"help": "indexer HOST:PORT ('' = none: precise falls back)"})
    registry_poll_s: float = field(default=1.0, metadata={"help": "ListEndpoints poll period"})
    load_poll_s: float = field(default=0.25, metadata={"help": "GetLoad poll period per endpoint"})
    load_deadline_strikes: int = field(default=3, metadata={
        "help": "GetLoad polls past their deadline in a row that mark an endpoint down (a refused "
                "connection marks it down at once)"})
    load_staleness_s: float = field(default=2.0, metadata={"help": "ignore load reports older than this"})
    lookup_timeout_s: float = field(default=0.25, metadata={"help": "indexer Lookup deadline"})
    local_view_ttl_s: float = field(default=30.0, metadata={
        "help": "a lookup past its deadline is answered from the router's own recent view (index answers and "
                "prompts it saw finish, kept this long); 0 = off: it falls back to approx"})
    lookup_late_s: float = field(default=2.0, metadata={
        "help": "a lookup past its deadline stays open this long; its answer is merged into the local view "
                "when it comes (<= lookup_timeout_s: not kept open)"})
    lookup_loop_grace_s: float = field(default=2.0, metadata={
        "help": "a lookup's deadline is extended by the time the router's own event loop ran behind meanwhile, "
                "up to this much: an index answer that arrived while a busy loop could not read it is not late "
                "(0 = off)"})
    loop_lag_period_s: float = field(default=0.02, metadata={
        "help": "how often the router checks its event loop's lag (kvmesh_router_loop_lag_seconds; 0 = off, "
                "and no lookup grace)"})
    indexer_speculative: bool = field(default=True, metadata={"help": "also write speculative entries to the indexer"})
    # Hashing (must match the engines)
    block_size: int = field(default=64, metadata={"help": "engine KV block size"})
    hash_algo: str = field(default="sha256_cbor", metadata={"help": "engine --prefix-caching-hash-algo"})
    hash_seed: str = field(default="", metadata={"help": "NONE_HASH seed ('' = vLLM's rule)"})
    hash_cache_verify: str = field(default="sampled", metadata={"help": "incremental-hash prefix check"})
    hash_cache_max_blocks: int = field(default=2_000_000, metadata={"help": "hash cache bound (blocks)"})
    hash_cache_max_bytes: int = field(default=256 << 20, metadata={
        "help": "hash cache bound (estimated bytes: token ids kept by reference, digests, keys)"})
    lora_modules: dict[str, str] = field(default_factory=dict, metadata={"help": "LoRA name -> path (JSON)"})
    # Policy
    policy: str = field(default="precise", metadata={"help": "routing policy"})
    speculative_ttl_s: float = field(default=2.0, metadata={"help": "speculative entry TTL"})
    offload_enabled: str = field(default="auto", metadata={
        "choices": ["auto", "true", "false"],
        "help": "whether the engines restore from a shared offload store (kvmesh's, through its connector). auto: "
                "while the indexer lists a live store (ROLE_STORE) for the model, polled every --registry-poll-s "
                "(without --indexer: assumed, since nothing can list one); true / false: fixed. Without one the cost prices a displaced context as "
                "recomputed (the LRU cliff) and uses --blocking-weight, not --blocking-weight-with-store "
                "(docs/router.md)"})
    approx_capacity_blocks: int = field(default=100_000, metadata={
        "help": "blocks the approx policy assumes each endpoint keeps (set to the engines' KV blocks)"})
    # Scoring: an estimated time to first token per endpoint (kvmesh.routing.scoring); set the
    # latency figures to the served model and hardware (defaults: kvmesh.perfmodel, H100, ~32B dense).
    # Flags keep the bare field names (--queue-weight), shared with `kvmesh simulate`; env
    # KVMESH_ROUTER_SCORING_<FIELD>, the older KVMESH_ROUTER_<FIELD> still read.
    scoring: ScoringConfig = field(default_factory=ScoringConfig, metadata={**SCORING_METADATA, "env_aliases": [""]})
    # P/D split
    split_enabled: bool = field(default=False, metadata={"help": "allow the prefill/decode split"})
    split_threshold_tokens: int = field(default=2048, metadata={"help": "split when uncached >= this"})
    split_read_index: bool = field(default=SplitConfig.read_index, metadata=SPLIT_FIELDS["read_index"].metadata)
    split_survival_floor: float = field(default=SplitConfig.survival_floor,
                                        metadata=SPLIT_FIELDS["survival_floor"].metadata)
    split_survival_decay: float = field(default=SplitConfig.survival_decay,
                                        metadata=SPLIT_FIELDS["survival_decay"].metadata)
    split_store_wait_s: float = field(default=5.0, metadata={
        "help": "external P/D split: longest wait, after the prefill engine answered, for the store to hold the "
                "prompt's KV (the index says so) before the decode engine is sent the request"})
    # Gateway path (Envoy ext_proc picker): llm-d's P/D protocol and InferenceObjective priorities.
    gateway_prefill_header: str = field(default="x-prefiller-host-port", metadata={
        "help": "ext_proc picker: request header naming the prefill endpoint's host:port when the split is "
                "chosen (llm-d's P/D sidecar reads it on the decode pod); '' = the gateway path never splits"})
    inference_objectives: dict[str, int] = field(default_factory=dict, metadata={
        "help": "InferenceObjective name -> priority (JSON; with --inference-pool also read from the pool's "
                "InferenceObjective objects, these win); a request names its objective in the "
                "x-gateway-inference-objective header (unknown or none: 0); priority < 0 is sheddable"})
    shed_queue_depth: int = field(default=5, metadata={
        "help": "the pool is saturated when every live endpoint has this many waiting requests or "
                "shed_kv_usage KV in use; saturated, sheddable requests get 429"})
    shed_kv_usage: float = field(default=0.8, metadata={"help": "KV usage (0..1) that counts as saturated"})
    # Failures and tenants
    tokenize_cache_bytes: int = field(default=256 << 20, metadata={
        "help": "memory for incremental tokenization of long conversations, LRU (0 = off)"})
    tokenize_verify: str = field(default="sampled", metadata={
        "help": "check incremental tokenization against a full one: sampled | full | off"})
    tokenize_parts: int = field(default=0, metadata={
        "help": "a long new tail of a conversation is tokenized as this many parts at once, spliced where "
                "they agree (same ids; kvmesh.tokenization.parallel_encode); 0 = min(4, CPUs), 1 = one piece"})
    max_attempts: int = field(default=3, metadata={"help": "endpoints tried before the first token"})
    first_token_timeout_s: float = field(default=300.0, metadata={
        "help": "a try with no token after this long is cancelled and retried elsewhere (0 = no limit); "
                "long enough for a long prefill queued behind others"})
    stream_idle_timeout_s: float = field(default=30.0, metadata={
        "help": "a stream silent this long after its first token ends with an error naming what was "
                "sent (0 = no limit)"})
    hedge_delay_s: float = field(default=0.0, metadata={
        "help": "hedge the first token: a request with no token this long after it was sent also goes to the "
                "next best endpoint; the first to answer wins and the other is cancelled (0 = off, the default)"})
    hedge_budget: float = field(default=0.1, metadata={
        "help": "long-run share of requests that may be hedged (0..1; a token bucket, kvmesh.routing.hedge)"})
    hedge_burst: float = field(default=5.0, metadata={
        "help": "hedges allowed at once after a quiet spell (the bucket's size; < 1 = never)"})
    http_deadline_s: float = field(default=600.0, metadata={
        "help": "total deadline of an OpenAI HTTP request, arrival to last token (0 = none): past it the "
                "worker call is cancelled and the client gets a 504 error (an SSE error event once streaming)"})
    # Front door (docs/security.md): API keys -> tenants -> secret salts; bounded HTTP.
    auth: str = field(default="keys", metadata={
        "choices": ["keys", "off"],
        "help": "keys: every request needs an API key from --api-keys-file (401 / UNAUTHENTICATED otherwise); "
                "off: no authentication and tenants as clients claim them (local demo only; logged loudly)"})
    api_keys_file: str = field(default="", metadata={
        "help": "API keys file or directory (a mounted Kubernetes Secret): 'TENANT KEY-or-sha256:DIGEST "
                "[trusted]' per line; re-read when it changes (kvmesh.api_keys)"})
    api_keys_reload_s: float = field(default=1.0, metadata={"help": "check the keys file for changes this often"})
    trusted_gateways: str = field(default="", metadata={
        "help": "SPIFFE ids of gateways (mTLS client certificates, on gRPC or the HTTPS front door) that may "
                "name the tenant (x-tenant / the gRPC tenant field) and need no API key; comma-separated, a "
                "trailing * matches any id (spiffe://kvmesh.local/gateway/*); '' = none (keys' 'trusted' flag "
                "grants nothing)"})
    http_tls: str = field(default="off", metadata={
        "choices": ["auto", "on", "off"],
        "help": "serve the HTTP front door over HTTPS with the router's certificate (client certificates "
                "optional: they identify trusted gateways): on | off | auto (= with gRPC mTLS)"})
    salt_secret_file: str = field(default="", metadata={
        "help": "server secret of the tenants' cache salts (HMAC); replicas must share it ('' = a random "
                "secret per process: replicas then share no cache)"})
    tenant_header: str = field(default="x-tenant", metadata={
        "help": "header (HTTP or gRPC metadata) a trusted gateway key names the tenant in; ignored from other keys"})
    http_max_connections: int = field(default=1024, metadata={
        "help": "open HTTP connections above this are answered 503 and closed"})
    http_header_timeout_s: float = field(default=10.0, metadata={
        "help": "a request whose headers have not all arrived this long after its first byte is answered 408 "
                "and closed (a new connection that sends nothing is closed after --http-keepalive-s)"})
    http_body_timeout_s: float = field(default=60.0, metadata={
        "help": "a request body not all received by then is answered 408"})
    http_keepalive_s: float = field(default=65.0, metadata={
        "help": "an idle kept-alive HTTP connection is closed after this; longer than clients keep theirs "
                "(httpx 5 s), else a request sent as the router closes the connection is lost (ReadError)"})
    http_max_header_bytes: int = field(default=65536, metadata={"help": "request line + headers above this: 431"})
    max_json_depth: int = field(default=64, metadata={"help": "JSON bodies nested deeper are refused (400)"})
    # Stored Responses (kvmesh.responses_api.store): previous_response_id, item_reference, GET /v1/responses/{id}.
    responses_store: str = field(default="memory", metadata={
        "help": "where answered Responses API responses are kept for previous_response_id, item_reference and "
                "GET/DELETE /v1/responses/{id}: off | memory (this replica only) | a redis:// URL (shared by "
                "replicas; not the indexer's Redis); a request's store: false is never kept"})
    responses_store_ttl_s: float = field(default=3600.0, metadata={
        "help": "a stored response is forgotten this long after it was answered"})
    responses_store_max_bytes: int = field(default=256 << 20, metadata={
        "help": "memory store: bytes of stored responses in all (oldest forgotten first)"})
    responses_store_tenant_max_bytes: int = field(default=64 << 20, metadata={
        "help": "memory store: bytes one tenant's responses may take (its own oldest go first, never another "
                "tenant's); both stores: a larger single response is not kept (store: false)"})
    responses_background_max: int = field(default=256, metadata={
        "help": "background responses (background: true) this replica runs at once; past it a new one is a "
                "429 (they outlive their connections, so --http-max-connections does not bound them)"})
    responses_background_tenant_max: int = field(default=64, metadata={
        "help": "background responses one tenant may have running on this replica at once (429 past it)"})
    grace_s: float = field(default=5.0, metadata={"help": "drain time on shutdown"})

    def validate(self) -> None:
        if self.policy not in available_policies():
            raise ConfigError(f"setting 'policy': unknown {self.policy!r}; one of {available_policies()}")
        if not 1 <= self.external_dp_size <= 1024:
            raise ConfigError("setting 'external_dp_size' must be in [1, 1024]")
        if self.block_size <= 0:
            raise ConfigError("setting 'block_size' must be > 0")
        if problem := survival_problem(self.split_survival_floor, self.split_survival_decay):
            raise ConfigError(problem)
        if self.max_attempts < 1:
            raise ConfigError("setting 'max_attempts' must be >= 1")
        if self.tokenize_parts < 0:
            raise ConfigError(f"setting 'tokenize_parts' must be >= 0, got {self.tokenize_parts}")
        if self.tokenize_verify not in ("sampled", "full", "off"):
            raise ConfigError(f"setting 'tokenize_verify': {self.tokenize_verify!r} is not sampled, full or off")
        for name in ("http_max_connections", "http_max_header_bytes", "max_json_depth"):
            if getattr(self, name) < 1:
                raise ConfigError(f"setting {name!r} must be >= 1, got {getattr(self, name)}")
        for name in ("first_token_timeout_s", "stream_idle_timeout_s", "http_deadline_s", "http_header_timeout_s",
                     "http_body_timeout_s", "local_view_ttl_s", "lookup_late_s", "hedge_delay_s", "hedge_burst",
                     "lookup_loop_grace_s", "loop_lag_period_s", "http_keepalive_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"setting {name!r} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.hedge_budget <= 1.0:
            raise ConfigError(f"setting 'hedge_budget' must be in [0, 1], got {self.hedge_budget}")
        if self.load_deadline_strikes < 1:
            raise ConfigError("setting 'load_deadline_strikes' must be >= 1")
        if self.approx_capacity_blocks < 1:
            raise ConfigError("setting 'approx_capacity_blocks' must be >= 1")
        self.scoring.validate()
        if self.hash_cache_verify not in ("sampled", "full"):
            raise ConfigError("setting 'hash_cache_verify' must be sampled or full")
        for spec in [*self.endpoints, *self.prefill_endpoints]:
            parse_endpoint(spec)
        http_decode = any(parse_endpoint(s)[1].startswith(("http://", "https://")) for s in self.endpoints) or bool(
            self.inference_pool)
        for spec in self.prefill_endpoints:
            if parse_endpoint(spec)[1].startswith(("http://", "https://")) and not http_decode:
                raise ConfigError(f"prefill endpoint {spec!r}: an external OpenAI prefill endpoint hands its KV "
                                  "(through the store) to external decode endpoints only")
        if self.split_store_wait_s < 0:
            raise ConfigError("setting 'split_store_wait_s' must be >= 0")
        if self.inference_pool:
            ns, _, name = self.inference_pool.partition("/")
            if not ns or not name or "/" in name:
                raise ConfigError(f"setting 'inference_pool': {self.inference_pool!r} is not NAMESPACE/NAME")
        try:
            store_name(self.responses_store)
        except ValueError as exc:
            raise ConfigError(f"setting 'responses_store': {exc}") from None
        if self.responses_store_ttl_s <= 0 or self.responses_store_max_bytes < 1 \
                or self.responses_store_tenant_max_bytes < 1 or self.responses_background_max < 1 \
                or self.responses_background_tenant_max < 1:
            raise ConfigError("settings 'responses_store_ttl_s', 'responses_store_max_bytes', "
                              "'responses_store_tenant_max_bytes' and 'responses_background_*' must be > 0")
        if self.auth == "keys" and not self.api_keys_file:
            raise ConfigError("setting 'auth' is keys (the default) but no 'api_keys_file' is given: give "
                              "--api-keys-file, or --auth off for a local demo")


def parse_endpoint(spec: str) -> tuple[str, str]:
    """``ID=HOST:PORT`` or ``ID=http://HOST:PORT``; a bare address's id is its ``HOST:PORT`` (as in
    llm-d's event topic ``kv@<pod-ip>:<port>@<model>``)."""
    spec = spec.strip()
    eid, _, addr = spec.partition("=") if "=" in spec else (spec.split("://", 1)[-1].split("/")[0], "", spec)
    if ":" not in addr or not eid:
        raise ConfigError(f"endpoint {spec!r}: expected ID=HOST:PORT or ID=http://HOST:PORT")
    addr = addr.strip()
    if addr.startswith(("http://", "https://")):
        from kvmesh_router.openai_endpoint import base_url

        addr = base_url(addr)
    return eid.strip(), addr
