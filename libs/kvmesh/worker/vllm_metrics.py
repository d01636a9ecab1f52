"""vLLM's request metrics, recorded by an engine that is not vLLM (the simulator).

Why: dashboards, autoscalers and gateways read vLLM's names (``vllm:*``, labels
``model_name`` and ``engine``, vLLM 0.32's histogram buckets). The real vLLM
engine exports its own (``VllmEngine.vllm_metrics``); the simulated engine
records the same histograms and counters here, at the same moments of a
request's life vLLM uses (arrival, first scheduling, each token, finish), in
its own clock, so a dashboard cannot tell the two apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.registry import Collector

# vLLM 0.32's default buckets (vllm/v1/metrics/buckets.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)


class VllmRequestMetrics(Collector):
    """The request-level ``vllm:*`` families of one engine (a collector the worker registers)."""

    def __init__(self, model_name: str, engine_index: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        lbl = ["model_name", "engine"]
        self._v = (model_name, str(engine_index))
        r = self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              lbl, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             lbl, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             lbl, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", lbl,
                               buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", lbl,
                                 buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.decode = Histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", lbl,
                                buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", lbl, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", lbl,
                                         registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               [*lbl, "finished_reason"], registry=r)

    def first_token(self, ttft_s: float) -> None:
        self.ttft.labels(*self._v).observe(max(ttft_s, 0.0))

    def token_gap(self, itl_s: float) -> None:
        self.itl.labels(*self._v).observe(max(itl_s, 0.0))

    def finished(self, reason: str, *, arrival: float, scheduled: float | None, first_token: float | None,
                 now: float, prompt_tokens: int, output_tokens: int) -> None:
        """One request ended: phase times as vLLM splits them (queued, prefill, decode, e2e)."""
        v = self._v
        self.e2e.labels(*v).observe(max(now - arrival, 0.0))
        self.prompt_tokens.labels(*v).inc(prompt_tokens)
        self.generation_tokens.labels(*v).inc(output_tokens)
        if scheduled is not None:
            self.queue.labels(*v).observe(max(scheduled - arrival, 0.0))
            if first_token is not None:
                self.prefill.labels(*v).observe(max(first_token - scheduled, 0.0))
                self.decode.labels(*v).observe(max(now - first_token, 0.0))
        if reason in ("stop", "length", "abort", "tool_calls"):
            # vLLM counts finished requests by its reasons; a tool call ends as "stop" there.
            self.success.labels(*v, "stop" if reason == "tool_calls" else reason).inc()

    def collect(self) -> Iterator[object]:
        yield from self.registry.collect()


class PrefixedRegistryCollector(Collector):
    """The ``prefix`` families of another registry (vLLM's, holding the whole process's metrics).

    ``registry`` may be a function returning it, resolved at each scrape: vLLM picks
    a multiprocess registry only once its engine runs.
    """

    def __init__(self, registry: CollectorRegistry | Callable[[], CollectorRegistry], prefix: str = "vllm:") -> None:
        self.source = registry
        self.prefix = prefix

    def collect(self) -> Iterator[object]:
        source = self.source() if callable(self.source) else self.source
        for fam in source.collect():
            if fam.name.startswith(self.prefix):
                yield fam
