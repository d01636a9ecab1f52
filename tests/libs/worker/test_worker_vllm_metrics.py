"""vLLM's own metric names on the worker's serving port, for the simulated engine.

A dashboard or autoscaler built for vLLM scrapes ``/metrics`` on the port that
serves OpenAI requests; the sim engine records vLLM's request histograms
(TTFT, inter-token, e2e, queue, prefill, decode) and counters in its own clock,
the worker adds the engine-state gauges, and every name appears once.
"""

from __future__ import annotations

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.worker.config import WorkerConfig
from kvmesh.worker.run import start_worker
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.worker.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.timeout(60)

BS = 16
NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
         "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
         "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
         "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success")


def samples(text: str) -> tuple[dict[str, int], dict[tuple[str, tuple], float]]:
    fams: dict[str, int] = {}
    values: dict[tuple[str, tuple], float] = {}
    for fam in text_string_to_metric_families(text):
        fams[fam.name] = fams.get(fam.name, 0) + 1
        for s in fam.samples:
            values[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return fams, values


def value(values: dict, name: str, **labels: str) -> float:
    want = {"model_name": "sim-model", "engine": "0", **labels}
    return values[(name, tuple(sorted(want.items())))]


async def test_sim_worker_serves_vllm_metrics_on_its_serving_port() -> None:
    w = await start_worker(WorkerConfig(engine="sim", role="decode", model="sim-model", endpoint_id="w-metrics",
                                        block_size=BS, num_blocks=64, host="127.0.0.1", time_scale=50.0,
                                        max_model_len=4096, vocab_size=1000, http_port=0))
    try:
        prompts = [list(range(100, 100 + 3 * BS + 1)), list(range(500, 500 + BS + 5))]
        async with grpc.aio.insecure_channel(w.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            info = await stub.GetInfo(worker_pb2.GetInfoRequest())
            async with httpx.AsyncClient(base_url=f"http://{info.http_address}", timeout=10) as http:
                for p in prompts:   # OpenAI HTTP on the serving port
                    r = await http.post("/v1/completions", json={"model": "sim-model", "prompt": p, "max_tokens": 4,
                                                                 "ignore_eos": True})
                    assert r.status_code == 200, r.text
                # ... and the gRPC path: the engine records both alike.
                msgs = [m async for m in stub.Generate(worker_pb2.GenerateRequest(
                    request_id="g1", prompt_token_ids=prompts[0] + [9] * BS,
                    sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True)))]
                assert msgs[-1].finished
                page = await http.get("/metrics")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
        fams, values = samples(page.text)
        for name in NAMES:
            assert fams.get(name) == 1, f"{name}: {fams.get(name)} families"
        n = 3
        assert value(values, "vllm:e2e_request_latency_seconds_count") == n
        assert value(values, "vllm:time_to_first_token_seconds_count") == n
        assert value(values, "vllm:request_queue_time_seconds_count") == n
        assert value(values, "vllm:inter_token_latency_seconds_count") == n * (4 - 1)
        assert value(values, "vllm:generation_tokens_total") == n * 4
        assert value(values, "vllm:prompt_tokens_total") == len(prompts[0]) * 2 + len(prompts[1]) + BS
        assert value(values, "vllm:request_success_total", finished_reason="length") == n
        # Phase times add up as in vLLM: queue + prefill + decode == e2e (same clock, per request).
        total = sum(value(values, f"vllm:request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode"))
        assert total == pytest.approx(value(values, "vllm:e2e_request_latency_seconds_sum"), rel=1e-6)
        assert value(values, "vllm:e2e_request_latency_seconds_sum") > value(
            values, "vllm:time_to_first_token_seconds_sum") > 0
        assert value(values, "vllm:num_requests_running") == 0
        # The metrics port serves the same families.
        assert set(samples(w.metrics.render())[0]) == set(fams)
    finally:
        await w.stop(0)
