"""An external vLLM server's load, read from its Prometheus ``/metrics``.

A plain ``vllm serve`` has no ``GetLoad``; the same three numbers the router scores
with are on its ``/metrics`` page: ``vllm:num_requests_waiting``,
``vllm:num_requests_running`` and ``vllm:kv_cache_usage_perc`` (a fraction, despite the
name; ``vllm:gpu_cache_usage_perc`` before vLLM 0.10). ``vllm:cache_config_info``
carries the KV capacity in blocks as a label. A server with several engines (data
parallel) reports one sample per engine (label ``engine``, the DP rank): queues add up,
usage is averaged, unless one engine's load is asked for (the router's DP-rank endpoints).
The text is parsed with prometheus-client's parser, not by hand.
"""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from kvmesh.routing.load import LoadReport

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
CACHE_INFO = "vllm:cache_config_info"


class MetricsError(ValueError):
    """The page is not Prometheus text or lacks vLLM's queue gauges."""


def parse_vllm_metrics(text: str, model: str = "", now: float | None = None, engine: str | None = None
                       ) -> LoadReport:
    """The load in a ``/metrics`` page; samples labelled with another ``model_name`` (or, given
    ``engine``, another ``engine``) are skipped."""
    values: dict[str, list[float]] = {}
    num_blocks = 0
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if model and s.labels.get("model_name", model) != model:
                    continue
                if engine is not None and s.labels.get("engine", engine) != engine:
                    continue
                if s.name == CACHE_INFO:
                    try:
                        num_blocks += int(s.labels.get("num_gpu_blocks") or 0)
                    except ValueError:
                        pass   # "None" before the engine has profiled its memory
                elif s.name in (WAITING, RUNNING, *KV_USAGE):
                    values.setdefault(s.name, []).append(float(s.value))
    except ValueError as exc:   # the parser's error for anything that is not exposition text
        raise MetricsError(f"not Prometheus text: {exc}") from None
    if WAITING not in values or RUNNING not in values:
        raise MetricsError(f"no {WAITING} / {RUNNING} samples (is this a vLLM server?)")
    usage = next((values[k] for k in KV_USAGE if k in values), [0.0])
    kv = min(1.0, max(0.0, sum(usage) / len(usage)))
    return LoadReport(running=int(sum(values[RUNNING])), waiting=int(sum(values[WAITING])), kv_usage=kv,
                      num_blocks=num_blocks, free_blocks=int(num_blocks * (1.0 - kv)),
                      received_at=time.monotonic() if now is None else now)
