from kvmesh_api.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt_token_ids", "sampling", "cache_salt", "lora_name", "session_id", "kv_handle", "tools_json", "tool_choice_json", "parallel_tool_calls", "parse_reasoning", "chat_template_kwargs_json")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_JSON_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    PARSE_REASONING_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    lora_name: str
    session_id: str
    kv_handle: _common_pb2.KvHandle
    tools_json: str
    tool_choice_json: str
    parallel_tool_calls: bool
    parse_reasoning: bool
    chat_template_kwargs_json: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ..., session_id: _Optional[str] = ..., kv_handle: _Optional[_Union[_common_pb2.KvHandle, _Mapping]] = ..., tools_json: _Optional[str] = ..., tool_choice_json: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ..., parse_reasoning: _Optional[bool] = ..., chat_template_kwargs_json: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "finished", "finish_reason", "usage", "kv_from_prefill", "ttft_s", "tool_calls", "content", "truth", "parsed", "content_delta", "tool_call_deltas", "reasoning_delta", "reasoning")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    KV_FROM_PREFILL_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TRUTH_FIELD_NUMBER: _ClassVar[int]
    PARSED_FIELD_NUMBER: _ClassVar[int]
    CONTENT_DELTA_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_DELTAS_FIELD_NUMBER: _ClassVar[int]
    REASONING_DELTA_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    kv_from_prefill: bool
    ttft_s: float
    tool_calls: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolCall]
    content: str
    truth: CacheTruth
    parsed: bool
    content_delta: str
    tool_call_deltas: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolCallDelta]
    reasoning_delta: str
    reasoning: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., kv_from_prefill: _Optional[bool] = ..., ttft_s: _Optional[float] = ..., tool_calls: _Optional[_Iterable[_Union[_common_pb2.ToolCall, _Mapping]]] = ..., content: _Optional[str] = ..., truth: _Optional[_Union[CacheTruth, _Mapping]] = ..., parsed: _Optional[bool] = ..., content_delta: _Optional[str] = ..., tool_call_deltas: _Optional[_Iterable[_Union[_common_pb2.ToolCallDelta, _Mapping]]] = ..., reasoning_delta: _Optional[str] = ..., reasoning: _Optional[str] = ...) -> None: ...

class CacheTruth(_message.Message):
    __slots__ = ("known", "gpu_tokens", "store_tokens", "events_through")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    GPU_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_THROUGH_FIELD_NUMBER: _ClassVar[int]
    known: bool
    gpu_tokens: int
    store_tokens: int
    events_through: int
    def __init__(self, known: _Optional[bool] = ..., gpu_tokens: _Optional[int] = ..., store_tokens: _Optional[int] = ..., events_through: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt_token_ids", "sampling", "cache_salt", "lora_name", "session_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    lora_name: str
    session_id: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("handle", "usage")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    handle: _common_pb2.KvHandle
    usage: _common_pb2.Usage
    def __init__(self, handle: _Optional[_Union[_common_pb2.KvHandle, _Mapping]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("running", "waiting", "kv_usage", "num_blocks", "free_blocks", "block_size", "waiting_prefill_tokens", "timestamp")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    WAITING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_usage: float
    num_blocks: int
    free_blocks: int
    block_size: int
    waiting_prefill_tokens: int
    timestamp: float
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., waiting_prefill_tokens: _Optional[int] = ..., timestamp: _Optional[float] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("endpoint_id", "model", "block_size", "hash_algo", "role", "max_model_len", "vocab_size", "engine", "kv_bytes_per_token", "lora_names", "kv_events_endpoint", "kv_events_replay_endpoint", "http_address", "lora_paths")
    class LoraPathsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LORA_NAMES_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_REPLAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LORA_PATHS_FIELD_NUMBER: _ClassVar[int]
    endpoint_id: str
    model: str
    block_size: int
    hash_algo: _common_pb2.HashAlgo
    role: _common_pb2.Role
    max_model_len: int
    vocab_size: int
    engine: str
    kv_bytes_per_token: int
    lora_names: _containers.RepeatedScalarFieldContainer[str]
    kv_events_endpoint: str
    kv_events_replay_endpoint: str
    http_address: str
    lora_paths: _containers.ScalarMap[str, str]
    def __init__(self, endpoint_id: _Optional[str] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., hash_algo: _Optional[_Union[_common_pb2.HashAlgo, str]] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., engine: _Optional[str] = ..., kv_bytes_per_token: _Optional[int] = ..., lora_names: _Optional[_Iterable[str]] = ..., kv_events_endpoint: _Optional[str] = ..., kv_events_replay_endpoint: _Optional[str] = ..., http_address: _Optional[str] = ..., lora_paths: _Optional[_Mapping[str, str]] = ...) -> None: ...
