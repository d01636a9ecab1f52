from kvmesh_api.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[_common_pb2.ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "tools_json", "tool_choice_json", "chat_template_kwargs_json", "parallel_tool_calls")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    tools_json: str
    tool_choice_json: str
    chat_template_kwargs_json: str
    parallel_tool_calls: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., tools_json: _Optional[str] = ..., tool_choice_json: _Optional[str] = ..., chat_template_kwargs_json: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "tokens", "text", "chat", "sampling", "cache_salt", "session_id", "lora_name", "tenant", "return_text", "policy", "include_reasoning")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    RETURN_TEXT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_REASONING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    tokens: _common_pb2.TokenIds
    text: str
    chat: ChatMessages
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    session_id: str
    lora_name: str
    tenant: str
    return_text: bool
    policy: str
    include_reasoning: bool
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., tokens: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., session_id: _Optional[str] = ..., lora_name: _Optional[str] = ..., tenant: _Optional[str] = ..., return_text: _Optional[bool] = ..., policy: _Optional[str] = ..., include_reasoning: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "final")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    final: Final
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., final: _Optional[_Union[Final, _Mapping]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("token_ids", "text", "parsed", "content_delta", "tool_call_deltas", "reasoning_delta")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PARSED_FIELD_NUMBER: _ClassVar[int]
    CONTENT_DELTA_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_DELTAS_FIELD_NUMBER: _ClassVar[int]
    REASONING_DELTA_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    parsed: bool
    content_delta: str
    tool_call_deltas: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolCallDelta]
    reasoning_delta: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., parsed: _Optional[bool] = ..., content_delta: _Optional[str] = ..., tool_call_deltas: _Optional[_Iterable[_Union[_common_pb2.ToolCallDelta, _Mapping]]] = ..., reasoning_delta: _Optional[str] = ...) -> None: ...

class RoutingDecision(_message.Message):
    __slots__ = ("endpoint", "endpoint_address", "policy", "predicted_cached_tokens", "predicted_cached_tokens_gpu", "predicted_cached_tokens_offload", "split", "prefill_endpoint", "uncached_tokens", "score", "attempts", "reason", "kv_from_prefill", "routing_overhead_ms", "mismatch", "decision_ms", "tokenize_ms", "hash_ms", "lookup_ms", "reused_tokens", "transferred_tokens", "moved", "given_up_tokens")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_CACHED_TOKENS_GPU_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_CACHED_TOKENS_OFFLOAD_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    UNCACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    KV_FROM_PREFILL_FIELD_NUMBER: _ClassVar[int]
    ROUTING_OVERHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_FIELD_NUMBER: _ClassVar[int]
    DECISION_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZE_MS_FIELD_NUMBER: _ClassVar[int]
    HASH_MS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MS_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERRED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    GIVEN_UP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    endpoint_address: str
    policy: str
    predicted_cached_tokens: int
    predicted_cached_tokens_gpu: int
    predicted_cached_tokens_offload: int
    split: bool
    prefill_endpoint: str
    uncached_tokens: int
    score: float
    attempts: int
    reason: str
    kv_from_prefill: bool
    routing_overhead_ms: float
    mismatch: str
    decision_ms: float
    tokenize_ms: float
    hash_ms: float
    lookup_ms: float
    reused_tokens: int
    transferred_tokens: int
    moved: bool
    given_up_tokens: int
    def __init__(self, endpoint: _Optional[str] = ..., endpoint_address: _Optional[str] = ..., policy: _Optional[str] = ..., predicted_cached_tokens: _Optional[int] = ..., predicted_cached_tokens_gpu: _Optional[int] = ..., predicted_cached_tokens_offload: _Optional[int] = ..., split: _Optional[bool] = ..., prefill_endpoint: _Optional[str] = ..., uncached_tokens: _Optional[int] = ..., score: _Optional[float] = ..., attempts: _Optional[int] = ..., reason: _Optional[str] = ..., kv_from_prefill: _Optional[bool] = ..., routing_overhead_ms: _Optional[float] = ..., mismatch: _Optional[str] = ..., decision_ms: _Optional[float] = ..., tokenize_ms: _Optional[float] = ..., hash_ms: _Optional[float] = ..., lookup_ms: _Optional[float] = ..., reused_tokens: _Optional[int] = ..., transferred_tokens: _Optional[int] = ..., moved: _Optional[bool] = ..., given_up_tokens: _Optional[int] = ...) -> None: ...

class Final(_message.Message):
    __slots__ = ("usage", "finish_reason", "routing", "request_id", "ttft_s", "tool_calls", "content", "reasoning")
    USAGE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    usage: _common_pb2.Usage
    finish_reason: _common_pb2.FinishReason
    routing: RoutingDecision
    request_id: str
    ttft_s: float
    tool_calls: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolCall]
    content: str
    reasoning: str
    def __init__(self, usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., routing: _Optional[_Union[RoutingDecision, _Mapping]] = ..., request_id: _Optional[str] = ..., ttft_s: _Optional[float] = ..., tool_calls: _Optional[_Iterable[_Union[_common_pb2.ToolCall, _Mapping]]] = ..., content: _Optional[str] = ..., reasoning: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "max_model_len", "block_size", "endpoints")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    max_model_len: int
    block_size: int
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., endpoints: _Optional[_Iterable[str]] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...
