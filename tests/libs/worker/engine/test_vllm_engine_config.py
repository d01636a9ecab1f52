"""The vllm engine's settings and request checks, without starting vLLM (fast tier)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.config import ConfigError
from kvmesh.worker.engine.base import (
    BadSamplingError,
    EmptyPromptError,
    EngineRequest,
    EngineUnavailableError,
    PromptTooLongError,
    QueueFullError,
    TokenOutOfVocabError,
    UnknownLoraError,
)
from kvmesh.worker.engine.vllm_engine import VllmEngine, VllmEngineConfig

pytestmark = pytest.mark.timeout(60)


def _engine(model: Path, **kw) -> VllmEngine:
    return VllmEngine(VllmEngineConfig(model=str(model), **kw))


@pytest.mark.parametrize(("kw", "needle"), [
    ({"model": ""}, "model"),
    ({"block_size": 24}, "block_size"),
    ({"hash_algo": "md5"}, "hash_algo"),
    ({"kv_cache_memory_bytes": -1}, "kv_cache_memory_bytes"),
])
def test_bad_settings_name_the_setting(tiny_model_dir: Path, kw, needle) -> None:
    cfg = VllmEngineConfig(**{"model": str(tiny_model_dir), **kw})
    with pytest.raises(ConfigError, match=needle):
        VllmEngine(cfg)


def test_missing_model_dir_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config.json"):
        _engine(tmp_path / "nope")


def test_max_model_len_is_capped_to_the_kv_cache(tiny_model_dir: Path) -> None:
    # 512 B/token for the tiny model; vLLM keeps one block in reserve.
    assert _engine(tiny_model_dir, kv_cache_memory_bytes=4 << 20, block_size=32)._max_model_len == (256 - 1) * 32
    assert _engine(tiny_model_dir, kv_cache_memory_bytes=128 << 20)._max_model_len == 131072
    assert _engine(tiny_model_dir, max_model_len=1000)._max_model_len == 1000


@pytest.mark.vllm  # imports vLLM (slow), starts nothing
def test_engine_args_wire_events_connector_and_lora(tiny_model_dir: Path) -> None:
    pytest.importorskip("vllm")
    e = _engine(tiny_model_dir, served_model_name="tiny", endpoint_id="w9", kv_events_endpoint="tcp://*:6000",
                kv_events_replay_endpoint="tcp://*:6001", offload_address="127.0.0.1:7000",
                lora_modules={"ad1": "/x"}, hash_algo="sha256")
    args = e.engine_args()
    assert args.kv_events_config.topic == "kv@w9@tiny"
    assert args.kv_events_config.replay_endpoint == "tcp://*:6001"
    assert args.prefix_caching_hash_algo == "sha256" and args.enable_prefix_caching
    tc = args.kv_transfer_config
    assert tc.kv_connector == "KvmeshConnector" and tc.kv_connector_module_path == "kvmesh.worker.connector.vllm_connector"
    assert tc.kv_load_failure_policy == "recompute"
    assert tc.kv_connector_extra_config["store_address"] == "127.0.0.1:7000"
    assert tc.kv_connector_extra_config["namespace"] == "tiny/L2-H2-D32-bf16-bs32/vllm-paged-cpu"
    # the worker's store deadlines reach the connector (docs/operations.md)
    assert tc.kv_connector_extra_config["lookup_timeout_s"] == e.cfg.offload_lookup_timeout_s
    assert tc.kv_connector_extra_config["io_timeout_s"] == e.cfg.offload_timeout_s
    assert args.enable_lora and args.load_format == "dummy" and args.enforce_eager


@pytest.mark.vllm  # imports vLLM (slow), starts nothing
def test_sampling_knobs_reach_vllms_sampling_params(tiny_model_dir: Path) -> None:
    pytest.importorskip("vllm")
    e = _engine(tiny_model_dir, max_model_len=1024)
    sp = e._sampling_params(EngineRequest("r", [1, 2, 3], max_tokens=8, temperature=0.7, top_p=0.8, top_k=20,
                                          repetition_penalty=1.05, presence_penalty=0.5, frequency_penalty=-0.25,
                                          min_p=0.05))
    assert (sp.top_k, sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty, sp.min_p) == (
        20, 1.05, 0.5, -0.25, 0.05)
    off = e._sampling_params(EngineRequest("r", [1, 2, 3], max_tokens=8))
    assert (off.top_k, off.repetition_penalty, off.presence_penalty, off.frequency_penalty, off.min_p) in (
        (0, 1.0, 0.0, 0.0, 0.0), (-1, 1.0, 0.0, 0.0, 0.0))   # vLLM's own "off"


@pytest.mark.parametrize(("req", "exc", "needle"), [
    (EngineRequest("r", []), EmptyPromptError, "empty"),
    (EngineRequest("r", [1, 32000]), TokenOutOfVocabError, "32000"),
    (EngineRequest("r", [1, -1]), TokenOutOfVocabError, "-1"),
    (EngineRequest("r", [1] * 2000), PromptTooLongError, "max_model_len"),
    (EngineRequest("r", [1], max_tokens=0), BadSamplingError, "max_tokens"),
    (EngineRequest("r", [1], top_p=0.0), BadSamplingError, "top_p"),
    (EngineRequest("r", [1], top_k=-2), BadSamplingError, "top_k"),
    (EngineRequest("r", [1], min_p=1.5), BadSamplingError, "min_p"),
    (EngineRequest("r", [1], frequency_penalty=-3.0), BadSamplingError, "frequency_penalty"),
    (EngineRequest("r", [1], stop_token_ids=[40000]), TokenOutOfVocabError, "stop token"),
    (EngineRequest("r", [1], lora_name="x"), UnknownLoraError, "'x'"),
    (EngineRequest("r", [1], cache_salt="s" * 300), Exception, "cache_salt"),
])
def test_request_checks(tiny_model_dir: Path, req, exc, needle) -> None:
    e = _engine(tiny_model_dir, max_model_len=1024)
    with pytest.raises(exc, match=needle):
        e._validate(req)


def test_queue_limit_and_not_started(tiny_model_dir: Path) -> None:
    e = _engine(tiny_model_dir, max_waiting=1)
    e._validate(EngineRequest("a", [1, 2]))
    e._inflight["a"] = object()  # type: ignore[assignment]
    with pytest.raises(QueueFullError):
        e._validate(EngineRequest("b", [1, 2]))
    with pytest.raises(EngineUnavailableError):
        e._require_up()
    assert not e.healthy


@pytest.mark.vllm  # imports vLLM (slow), starts nothing
def test_structured_outputs_become_vllms_params(tiny_model_dir: Path) -> None:
    """The spec becomes vLLM's ``StructuredOutputsParams`` (options kept); vLLM's own refusal of a spec
    is a 400, and a worker told to run without the tokenizer says how to turn it back on."""
    pytest.importorskip("vllm")
    from kvmesh.worker.engine.base import InvalidRequestError

    e = _engine(tiny_model_dir)
    req = EngineRequest(request_id="r", prompt_token_ids=[1, 2], structured_outputs={
        "json": {"type": "object"}, "disable_any_whitespace": True})
    params = e._sampling_params(req).structured_outputs
    assert params.json == {"type": "object"} and params.disable_any_whitespace
    assert e._sampling_params(EngineRequest(request_id="r", prompt_token_ids=[1, 2])).structured_outputs is None
    req.prefill_only = True   # a prefill's one token is never returned: unconstrained
    assert e._sampling_params(req).structured_outputs is None
    with pytest.raises(InvalidRequestError, match="structured_outputs"):
        e._sampling_params(EngineRequest(request_id="r", prompt_token_ids=[1, 2],
                                         structured_outputs={"regex": "a", "choice": ["a"]}))
    with pytest.raises(InvalidRequestError, match="skip_tokenizer_init"):
        _engine(tiny_model_dir, skip_tokenizer_init=True)._sampling_params(
            EngineRequest(request_id="r", prompt_token_ids=[1, 2], structured_outputs={"choice": ["a"]}))
