"""Worker settings (prefill and decode services share them), env prefix ``KVMESH_WORKER_``.

Why it exists: one dataclass is the single source of defaults for flags,
environment variables, the docs and the stack launcher; it also builds the
sim engine's config, so the engine never reads the environment itself.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import ClassVar

from kvmesh.config import ConfigError
from kvmesh.metrics_http import METRICS_AUTH_METADATA, MetricsAuthConfig
from kvmesh.rpc.tls import TLS_METADATA, TlsConfig
from kvmesh.worker.engine.registry import ENGINES
from kvmesh.worker.engine.sim.latency import LatencyParams

ROLES = ("prefill", "decode", "both")


def _h(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class WorkerConfig:
    ENV_PREFIX: ClassVar[str] = "KVMESH_WORKER_"

    engine: str = field(default="sim", metadata=_h(f"engine backend: {' | '.join(ENGINES.names())}"))
    role: str = field(default="", metadata=_h("prefill | decode | both (set by the service)"))
    endpoint_id: str = field(default="", metadata=_h("unique endpoint id ('' = <role>-<hostname>-<port>)"))
    model: str = field(default="sim-model", metadata=_h("served model name (vllm: model directory or name)"))
    served_model_name: str = field(default="", metadata=_h("name clients use ('' = model)"))
    host: str = field(default="127.0.0.1", metadata=_h(
        "listen host of gRPC, HTTP and /metrics (0.0.0.0 = every interface; loopback by default)"))
    port: int = field(default=0, metadata=_h("gRPC listen port (0 = pick a free one)"))
    advertise_host: str = field(default="127.0.0.1", metadata=_h("host others use to reach this worker"))
    metrics_port: int = field(default=0, metadata=_h("Prometheus /metrics port (0 = off)"))
    tls: TlsConfig = field(default_factory=TlsConfig, metadata=TLS_METADATA)
    metrics_auth: MetricsAuthConfig = field(default_factory=MetricsAuthConfig, metadata=METRICS_AUTH_METADATA)
    http_port: int = field(default=-1, metadata=_h("OpenAI HTTP API port (-1 = off, 0 = free port)"))
    http_tls: str = field(default="auto", metadata={**_h(
        "OpenAI HTTP API over HTTPS with the worker's certificate, its endpoints then need a client "
        "certificate with a role in http_client_roles (/health stays open): on | off | auto (= with gRPC mTLS)"),
        "choices": ["auto", "on", "off"]})
    http_client_roles: str = field(default="gateway,router,admin", metadata=_h(
        "with HTTPS, the client-certificate roles that may call the OpenAI HTTP API (monitor may also read /metrics)"))
    tokenizer: str = field(default="", metadata=_h(
        "HF tokenizer dir for the HTTP API's text prompts (and the sim's answers to structured outputs)"))
    block_size: int = field(default=64, metadata=_h("KV block size in tokens"))
    num_blocks: int = field(default=8192, metadata=_h("KV cache capacity in blocks (sim; vllm: derived)"))
    kv_cache_memory_bytes: int = field(default=0, metadata=_h("vllm: KV cache bytes (0 = engine default)"))
    hash_algo: str = field(default="sha256_cbor", metadata=_h("prefix-caching hash algo"))
    max_num_seqs: int = field(default=256, metadata=_h("max running sequences"))
    max_num_batched_tokens: int = field(default=8192, metadata=_h("per-step token budget"))
    max_model_len: int = field(default=262144, metadata=_h("max prompt + output tokens"))
    max_waiting: int = field(default=4096, metadata=_h("waiting queue limit (0 = unlimited)"))
    vocab_size: int = field(default=32000, metadata=_h("vocabulary size (sim)"))
    eos_token_id: int = field(default=-1, metadata=_h("EOS token id (sim; -1 = none)"))
    default_max_tokens: int = field(default=0, metadata=_h(
        "max_tokens when a request gives 0 (0 = what is left of max_model_len, as vLLM)"))
    lora_names: list[str] = field(default_factory=list, metadata=_h("LoRA adapters served (comma list)"))
    lora_paths: dict[str, str] = field(default_factory=dict, metadata=_h(
        "sim: LoRA name -> path hashed into its blocks, as vLLM does (JSON; names are served too)"))
    kv_events_endpoint: str = field(default="tcp://*:0", metadata=_h(
        "ZMQ PUB endpoint for KV events ('' = off; '*' binds, a host connects)"))
    kv_events_replay_endpoint: str = field(default="tcp://127.0.0.1:0", metadata=_h(
        "ZMQ ROUTER replay endpoint (loopback by default: replay hands out every buffered event)"))
    kv_events_curve_secret: str = field(default="", metadata=_h(
        "CURVE secret certificate (NAME.key_secret) of the event and replay sockets ('' = off; sim engine "
        "only: vLLM's publisher has no CURVE)"))
    kv_events_curve_clients: str = field(default="", metadata=_h(
        "directory of the subscribers' CURVE public keys admitted to events and replay (with the secret)"))
    kv_events_buffer_bytes: int = field(default=16 << 20, metadata=_h(
        "sim: KV-event replay buffer bound in bytes (besides 10,000 batches): minutes of events at a soak's "
        "rate, reached early so the worker's memory is flat after"))
    malloc_arena_max: int = field(default=2, metadata=_h(
        "cap glibc malloc arenas (as MALLOC_ARENA_MAX; 0 = glibc's default of 8 per core)"))
    malloc_trim_s: float = field(default=30.0, metadata=_h(
        "return free heap memory to the OS this often (glibc malloc_trim; 0 = never)"))
    indexer_address: str = field(default="", metadata=_h("indexer host:port to self-register with ('' = off)"))
    heartbeat_s: float = field(default=2.0, metadata=_h("indexer heartbeat period"))
    registration_ttl_s: float = field(default=10.0, metadata=_h("endpoint TTL asked of the indexer"))
    offload_address: str = field(default="", metadata=_h("offload store host:port ('' = none)"))
    # A hung or slow store must cost a request at most these, then it is recomputed (docs/operations.md).
    offload_timeout_s: float = field(default=10.0, metadata=_h(
        "deadline of each offload store transfer (get, put, shared-memory release); past it a restore "
        "is recomputed and a save skipped"))
    offload_lookup_timeout_s: float = field(default=2.0, metadata=_h(
        "deadline of each offload store lookup (which blocks it holds); past it the prompt is recomputed"))
    time_scale: float = field(default=1.0, metadata=_h("sim: run this many times faster than real time"))
    virtual_time: bool = field(default=False, metadata=_h("sim: never sleep (virtual clock)"))
    seed: int = field(default=0, metadata=_h("engine seed (vllm dummy weights)"))
    kv_num_layers: int = field(default=2, metadata=_h("KV layout: layers (sim bytes per token)"))
    kv_num_kv_heads: int = field(default=2, metadata=_h("KV layout: KV heads"))
    kv_head_dim: int = field(default=32, metadata=_h("KV layout: head dim"))
    kv_dtype: str = field(default="bf16", metadata=_h("KV layout: dtype"))
    step_overhead_s: float = field(default=LatencyParams.step_overhead_s, metadata=_h("sim latency"))
    request_overhead_s: float = field(default=LatencyParams.request_overhead_s, metadata=_h("sim latency"))
    prefill_s_per_token: float = field(default=LatencyParams.prefill_s_per_token, metadata=_h("sim latency"))
    attn_s_per_token_pair: float = field(default=LatencyParams.attn_s_per_token_pair, metadata=_h("sim latency"))
    itl_s: float = field(default=LatencyParams.itl_s, metadata=_h("sim latency: decode step"))
    decode_s_per_seq: float = field(default=LatencyParams.decode_s_per_seq, metadata=_h("sim latency"))
    decode_s_per_ctx_token: float = field(default=LatencyParams.decode_s_per_ctx_token, metadata=_h("sim latency"))
    h2d_bytes_per_s: float = field(default=LatencyParams.h2d_bytes_per_s, metadata=_h("sim restore bandwidth"))
    model_h2d: bool = field(default=True, metadata=_h("sim: add a modelled host-to-device copy to each restore"))
    grace_s: float = field(default=10.0, metadata=_h("drain time on shutdown"))
    labels: dict[str, str] = field(default_factory=dict, metadata=_h("endpoint labels (JSON)"))
    sim_tool_calls: int = field(default=1, metadata=_h(
        "sim: tool calls per answer to a request with tools (its deterministic tool mode, for tests); "
        "parallel_tool_calls false gets one"))
    tool_call_parser: str = field(default="", metadata=_h(
        "vllm engine: vLLM tool parser for chat answers with tools (e.g. hermes), as vLLM's flag"))
    enable_auto_tool_choice: bool = field(default=False, metadata=_h(
        "vllm engine: let the model decide to call tools (tool_choice auto), as vLLM's flag"))
    reasoning_parser: str = field(default="", metadata=_h(
        "vLLM reasoning parser for chat answers (e.g. deepseek_r1, qwen3), as vLLM's flag: the answer's "
        "reasoning is returned apart from its content; the sim engine (with --tokenizer) splits its "
        "answers by position instead (--sim-reasoning-tokens)"))
    sim_reasoning_tokens: int = field(default=8, metadata=_h(
        "sim with a reasoning parser: the first this many output tokens of a chat answer are its reasoning"))
    sim_tool_call_share: float = field(default=1.0, metadata=_h(
        "sim: with tool_choice auto (or none given), the share of answers to a request with tools that call "
        "them, drawn per request, so that an agent's tool loop ends; 'required' or a named tool always calls "
        "(1.0 = every answer: the deterministic tool mode)"))
    sim_answer_tokens: int = field(default=0, metadata=_h(
        "sim: an answer ends (EOS, finish 'stop') after a length drawn per request between half and 1.5 times "
        "this, as a model answers and stops, so a request without max_tokens ends; EOS is --eos-token-id, else "
        "the tokenizer's (0 = answers run to max_tokens, as a dummy-weight model's do)"))
    vllm_options: dict = field(default_factory=dict, metadata=_h(
        "vllm engine: extra VllmEngineConfig settings (JSON), e.g. lora_modules"))

    def validate(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"setting 'engine': expected one of {ENGINES.names()}, got {self.engine!r}")
        if self.role and self.role not in ROLES:
            raise ConfigError(f"setting 'role': expected one of {ROLES}, got {self.role!r}")
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "vocab_size", "sim_tool_calls"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"setting {name!r} must be > 0, got {getattr(self, name)}")
        if self.default_max_tokens < 0:
            raise ConfigError(f"setting 'default_max_tokens' must be >= 0, got {self.default_max_tokens}")
        if self.time_scale <= 0:
            raise ConfigError(f"setting 'time_scale' must be > 0, got {self.time_scale}")
        if self.kv_events_buffer_bytes < 1 or self.malloc_arena_max < 0 or self.malloc_trim_s < 0:
            raise ConfigError("settings 'kv_events_buffer_bytes' must be >= 1, 'malloc_arena_max' and "
                              "'malloc_trim_s' >= 0")
        for name in ("offload_timeout_s", "offload_lookup_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"setting {name!r} must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.sim_tool_call_share <= 1.0:
            raise ConfigError(f"setting 'sim_tool_call_share' must be within [0, 1], got {self.sim_tool_call_share}")
        if self.sim_answer_tokens < 0:
            raise ConfigError(f"setting 'sim_answer_tokens' must be >= 0, got {self.sim_answer_tokens}")
        if self.sim_reasoning_tokens < 0:
            raise ConfigError(f"setting 'sim_reasoning_tokens' must be >= 0, got {self.sim_reasoning_tokens}")
        if self.reasoning_parser and self.engine == "sim" and not self.tokenizer:
            raise ConfigError("setting 'reasoning_parser': the sim engine decodes its answers' reasoning with "
                              "the worker's tokenizer: set 'tokenizer'")
        if "@" in self.endpoint_id:
            raise ConfigError("setting 'endpoint_id' must not contain '@'")
        if len(self.endpoint_id.encode()) > 128:
            raise ConfigError("setting 'endpoint_id' is longer than 128 bytes")
        if bool(self.kv_events_curve_secret) != bool(self.kv_events_curve_clients):
            raise ConfigError("settings 'kv_events_curve_secret' and 'kv_events_curve_clients' go together")
        if self.kv_events_curve_secret and self.engine != "sim":
            raise ConfigError(f"setting 'kv_events_curve_secret': the {self.engine} engine's KV-event publisher "
                              "cannot use CURVE (vLLM's has no CURVE); keep its sockets on loopback or behind "
                              "network policies instead")

    def curve_server(self):  # -> kvmesh.events.curve.CurveServer | None
        if not self.kv_events_curve_secret:
            return None
        from kvmesh.events.curve import CurveServer

        return CurveServer(self.kv_events_curve_secret, self.kv_events_curve_clients)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def resolve_endpoint_id(self, port: int) -> str:
        if self.endpoint_id:
            return self.endpoint_id
        return f"{self.role or 'worker'}-{socket.gethostname()}-{port}"

    def latency(self) -> LatencyParams:
        return LatencyParams(
            step_overhead_s=self.step_overhead_s, request_overhead_s=self.request_overhead_s,
            prefill_s_per_token=self.prefill_s_per_token, attn_s_per_token_pair=self.attn_s_per_token_pair,
            itl_s=self.itl_s, decode_s_per_seq=self.decode_s_per_seq,
            decode_s_per_ctx_token=self.decode_s_per_ctx_token, h2d_bytes_per_s=self.h2d_bytes_per_s,
        )

    def sim_engine_config(self, endpoint_id: str):  # -> SimEngineConfig (imported lazily)
        from kvmesh.worker.engine.sim.engine import SimEngineConfig

        return SimEngineConfig(
            model=self.model_name, endpoint_id=endpoint_id, block_size=self.block_size, num_blocks=self.num_blocks,
            hash_algo=self.hash_algo, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
            max_waiting=self.max_waiting, vocab_size=self.vocab_size,
            eos_token_id=self.eos_token_id if self.eos_token_id >= 0 else None,
            lora_names=[*self.lora_names, *(n for n in self.lora_paths if n not in self.lora_names)],
            lora_paths=dict(self.lora_paths),
            time_scale=self.time_scale, virtual_time=self.virtual_time,
            kv_events_endpoint=self.kv_events_endpoint, kv_events_replay_endpoint=self.kv_events_replay_endpoint,
            kv_events_curve=self.curve_server(), kv_events_buffer_bytes=self.kv_events_buffer_bytes,
            offload_address=self.offload_address, offload_timeout_s=self.offload_timeout_s,
            offload_lookup_timeout_s=self.offload_lookup_timeout_s,
            model_h2d=self.model_h2d, kv_num_layers=self.kv_num_layers,
            kv_num_kv_heads=self.kv_num_kv_heads, kv_head_dim=self.kv_head_dim, kv_dtype=self.kv_dtype,
            latency=self.latency(), tool_calls=self.sim_tool_calls, tokenizer=self.tokenizer,
            reasoning_tokens=self.sim_reasoning_tokens if self.reasoning_parser else 0,
            answer_tokens=self.sim_answer_tokens, tool_call_share=self.sim_tool_call_share,
        )
