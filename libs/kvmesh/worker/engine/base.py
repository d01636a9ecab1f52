"""The engine interface every worker backend implements (``sim`` and ``vllm``).

Why it exists: the worker gRPC servicer (``kvmesh.worker``), the benchmark
and the OpenAI HTTP API talk to an engine only through this contract, so the
simulator and a real in-process vLLM are interchangeable. Types are plain
dataclasses (no protobuf) so the engines stay free of gRPC; the servicer maps
them to and from ``kvmesh.worker.v1`` messages and maps ``EngineError``
subclasses to gRPC status codes via their ``grpc_code`` attribute.

Contract notes for implementers:
- ``generate`` yields *deltas*: each ``EngineOutput.new_token_ids`` holds only
  the tokens produced since the previous output. Exactly one output has
  ``finished=True`` and it is the last; it carries the usage fields.
- ``abort`` must free the request's KV blocks and make a pending ``generate``
  iterator end promptly (with ``finish_reason="abort"``) — never hang.
- Validation errors are raised by ``generate``/``prefill`` *before* the first
  yield, as ``InvalidRequestError`` subclasses.
- If the engine dies, every pending iterator raises ``EngineDeadError`` and
  ``healthy`` turns False.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from kvmesh.worker.config import WorkerConfig

FinishReason = Literal["stop", "length", "abort", "error", "tool_calls"]
HashAlgoName = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]


# --------------------------------------------------------------------------- errors


class EngineError(Exception):
    """Base of all engine errors; ``grpc_code`` names the ``grpc.StatusCode`` member."""

    grpc_code: str = "INTERNAL"
    http_status: int = 500


class InvalidRequestError(EngineError):
    """The request itself is bad; the message names the problem."""

    grpc_code = "INVALID_ARGUMENT"
    http_status = 400


class EmptyPromptError(InvalidRequestError):
    pass


class PromptTooLongError(InvalidRequestError):
    pass


class TokenOutOfVocabError(InvalidRequestError):
    pass


class BadSamplingError(InvalidRequestError):
    """max_tokens <= 0, temperature < 0, top_p outside (0, 1], ..."""


class UnknownLoraError(InvalidRequestError):
    pass


class DuplicateRequestError(InvalidRequestError):
    """A request id is already in flight on this engine."""


class QueueFullError(EngineError):
    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 429


class EngineUnavailableError(EngineError):
    """Engine not started, stopping, or dead."""

    grpc_code = "UNAVAILABLE"
    http_status = 503


class EngineDeadError(EngineUnavailableError):
    """The engine crashed; all in-flight requests fail with this."""


class KvTransferError(EngineError):
    """Restoring or saving KV through the offload store failed."""

    grpc_code = "UNAVAILABLE"
    http_status = 503


# --------------------------------------------------------------------------- data


@dataclass
class KvHandle:
    """Reference to KV held by the offload store (mirrors ``common.v1.KvHandle``)."""

    namespace: str
    block_keys: list[int]
    num_tokens: int
    store_address: str = ""
    producer_endpoint: str = ""
    first_token_id: int | None = None


@dataclass
class ToolCall:
    """One function call parsed out of a chat answer (OpenAI's ``tool_calls[i]``)."""

    id: str
    name: str
    arguments: str   # a JSON object, as text


@dataclass
class ToolCallDelta:
    """A piece of one tool call as the answer streams (OpenAI's ``delta.tool_calls[i]``)."""

    index: int
    id: str = ""          # the call's first piece only
    name: str = ""        # the call's first piece only
    arguments: str = ""   # more of the arguments' JSON text


@dataclass
class ParsedDelta:
    """What a streaming parser (tools, reasoning) made of an answer's newest tokens."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    reasoning: str = ""   # new reasoning text (a worker with a reasoning parser)


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    # vLLM's penalties and truncations (kvmesh.sampling), at the values that change nothing. The sim
    # engine's tokens are synthetic: it takes them and, as it does temperature, does not use them.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    thinking_token_budget: int = -1   # vLLM's: reasoning tokens allowed (-1 unlimited; needs a reasoning parser)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    cache_salt: str = ""
    lora_name: str = ""
    session_id: str = ""
    # KV computed elsewhere (a prefill worker); the engine restores it first.
    kv_handle: KvHandle | None = None
    # Compute KV and sample at most one token (prefill role).
    prefill_only: bool = False
    # Optional: precomputed 64-bit event keys of the prompt's full blocks. The
    # sim uses them instead of hashing (cluster simulator / benchmark). Must
    # equal what hashing the tokens would give.
    block_hashes: list[int] | None = None
    # Prompt length when ``prompt_token_ids`` is omitted and only
    # ``block_hashes`` are given (sim only).
    num_prompt_tokens: int | None = None
    # Chat tools (OpenAI JSON) the prompt offers and tool_choice, set only when the answer may call
    # them: the engine then parses tool calls out of its output (the final ``EngineOutput``).
    tools: list[dict] | None = None
    tool_choice: object = None
    # OpenAI's parallel_tool_calls: False limits the answer to one call, as vLLM's server does.
    parallel_tool_calls: bool = True
    # Structured outputs (kvmesh.structured_outputs' spec: vLLM's StructuredOutputsParams fields):
    # the answer must match it. None: unconstrained.
    structured_outputs: dict | None = None
    # A chat answer: an engine with a reasoning parser splits the model's reasoning from its content
    # (``EngineOutput.reasoning``, ``ParsedDelta.reasoning``); the chat template keywords the prompt was
    # rendered with go to that parser, as vLLM's server hands them over.
    reasoning: bool = False
    chat_template_kwargs: dict | None = None

    @property
    def prompt_len(self) -> int:
        if self.prompt_token_ids:
            return len(self.prompt_token_ids)
        return self.num_prompt_tokens or 0


@dataclass
class CacheTruth:
    """The engine's cache when a request arrived (``worker.proto`` ``CacheTruth``).

    The router compares it with its prediction to explain a miss
    (``kvmesh.routing.fidelity``): a prediction equal to this and an engine that later
    reused less means eviction while queued, not a wrong view.
    """

    gpu_tokens: int            # leading prompt tokens in the engine's own prefix cache
    store_tokens: int = 0      # leading prompt tokens the offload store held
    events_through: int = 0    # KV-event batches that describe that cache (published + pending)


@dataclass
class EngineOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0            # cumulative
    num_cached_tokens: int = 0            # gpu + offload; set on every output once known
    num_cached_tokens_gpu: int = 0
    num_cached_tokens_offload: int = 0
    kv_from_prefill: bool = False         # KV restored from a prefill worker's handle
    ttft_s: float | None = None           # engine-side TTFT, set on the first output
    error: str | None = None              # set with finish_reason="error"
    # Final output of a request with tools whose answer called them (finish_reason="tool_calls"):
    # the calls, and the text of the answer that is not a call.
    tool_calls: list[ToolCall] | None = None
    content: str | None = None
    # Final output only: the engine's cache at the request's arrival (None: the engine cannot say).
    truth: CacheTruth | None = None
    # Chat with tools, as the answer streams: the tool parser's reading of this output's tokens
    # (set on every output of such a request, the final one included; None: not parsed).
    delta: ParsedDelta | None = None
    # Final output of a chat answer an engine's reasoning parser read: the reasoning ("" if none), with
    # ``content`` the rest of the answer, and how many output tokens were reasoning.
    reasoning: str | None = None
    num_reasoning_tokens: int = 0


@dataclass
class PrefillResult:
    """What ``Engine.prefill`` returns: the KV handle (None if no offload store) and the output."""

    handle: KvHandle | None
    output: EngineOutput


@dataclass
class EngineLoad:
    running: int
    waiting: int
    kv_usage: float            # 0..1, used blocks / total blocks
    num_blocks: int
    free_blocks: int
    block_size: int
    waiting_prefill_tokens: int = 0   # uncached prompt tokens queued
    timestamp: float = 0.0            # unix seconds
    # Cumulative counters (tokens), the basis of vllm:prefix_cache_* metrics.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


@dataclass
class EngineInfo:
    engine: str                       # "sim" | "vllm"
    model: str
    block_size: int
    hash_algo: HashAlgoName = "sha256_cbor"
    max_model_len: int = 131072
    vocab_size: int = 32000
    kv_bytes_per_token: int = 0
    lora_names: list[str] = field(default_factory=list)
    # Adapter name -> the path the engine hashes into each LoRA block (vLLM: LoRARequest.lora_path).
    lora_paths: dict[str, str] = field(default_factory=dict)
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_topic: str = ""
    num_blocks: int = 0
    # True when the engine's NONE_HASH seed is kvmesh's (router can hash itself).
    hash_seed_matches: bool = True
    eos_token_id: int | None = None


# --------------------------------------------------------------------------- interface


class Engine(abc.ABC):
    """An LLM engine serving token-id requests (async, one per worker process)."""

    name: str = "engine"
    # The KV-event publisher binds port 0 itself and reports the port it got. vLLM's cannot,
    # so the worker picks its ports up front (``run._pin_port``).
    reports_event_ports: bool = True

    @classmethod
    @abc.abstractmethod
    def from_worker_config(cls, cfg: WorkerConfig, endpoint_id: str) -> Engine:
        """The engine a worker process runs, built from its settings (``kvmesh.worker.run``)."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Bring the engine up; returns when it can serve (readiness may then turn SERVING)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Abort everything in flight and release resources. Idempotent."""

    @abc.abstractmethod
    def generate(self, req: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream deltas for ``req``; raise ``InvalidRequestError`` before the first yield."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> bool:
        """Abort a request; True if it was in flight. Frees its blocks."""

    async def prefill(self, req: EngineRequest) -> PrefillResult:
        """Compute the prompt's KV, sample at most one token, hand the KV to the store.

        Default: run ``generate`` with ``max_tokens=1`` and ``prefill_only=True``;
        engines that can save to the offload store override this to return a handle.
        """
        req.prefill_only = True
        req.max_tokens = min(req.max_tokens, 1) if req.max_tokens > 0 else 1
        last: EngineOutput | None = None
        tokens: list[int] = []
        async for out in self.generate(req):
            tokens.extend(out.new_token_ids)
            last = out
        assert last is not None
        last.new_token_ids = tokens
        return PrefillResult(handle=None, output=last)

    @abc.abstractmethod
    def load(self) -> EngineLoad:
        """Current load snapshot (cheap, synchronous)."""

    @abc.abstractmethod
    def info(self) -> EngineInfo:
        """Static facts about the engine (cheap, synchronous)."""

    @property
    @abc.abstractmethod
    def healthy(self) -> bool:
        """False once the engine has died or been stopped."""

    def vllm_metrics(self, model_name: str) -> Any:
        """A prometheus collector of the ``vllm:*`` families this engine records itself, or None.

        The worker exports them in place of its own copies of those names.
        """
        return None


def kv_events_topic(endpoint_id: str, model: str) -> str:
    """The ZMQ topic every kvmesh engine publishes KV events under."""
    return f"kv@{endpoint_id}@{model}"
