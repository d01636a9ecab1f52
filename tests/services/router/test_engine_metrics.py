"""vLLM's /metrics page -> the router's load report (``kvmesh_router.engine_metrics``)."""

from __future__ import annotations

import pytest

from kvmesh_router.engine_metrics import MetricsError, parse_vllm_metrics

# The shape vLLM 0.1x serves: HELP/TYPE lines, model_name and engine labels, an info gauge.
PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny-llama"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 4.0
vllm:num_requests_waiting{engine="1",model_name="tiny-llama"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="tiny-llama"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="100",prefix_caching_hash_algo="sha256_cbor"} 1.0
vllm:cache_config_info{block_size="32",engine="1",num_gpu_blocks="100",prefix_caching_hash_algo="sha256_cbor"} 1.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny-llama"} 1234.0
"""


def test_engines_add_up_and_usage_averages() -> None:
    r = parse_vllm_metrics(PAGE, "tiny-llama", now=5.0)
    assert (r.running, r.waiting) == (4, 6)
    assert r.kv_usage == pytest.approx(0.375)
    assert r.num_blocks == 200 and r.free_blocks == 125
    assert r.received_at == 5.0


def test_other_models_samples_are_skipped() -> None:
    other = PAGE.replace('model_name="tiny-llama"} 3.0', 'model_name="other"} 30.0')
    assert parse_vllm_metrics(other, "tiny-llama").running == 1
    assert parse_vllm_metrics(other, "").running == 31   # no model given: everything counts


def test_the_older_gauge_name_and_unprofiled_blocks() -> None:
    old = (PAGE.replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
           .replace('num_gpu_blocks="100"', 'num_gpu_blocks="None"'))
    r = parse_vllm_metrics(old, "tiny-llama")
    assert r.kv_usage == pytest.approx(0.375) and r.num_blocks == 0


@pytest.mark.parametrize("text", ["", "<html>nope</html>\n", "vllm:num_requests_running{ 3\n",
                                  "# TYPE x gauge\nx 1\n"])
def test_pages_that_are_not_vllm_metrics_are_refused(text: str) -> None:
    with pytest.raises(MetricsError):
        parse_vllm_metrics(text, "tiny-llama")
