"""Prometheus metrics of a worker, under vLLM's names plus kvmesh's own.

Why it exists: gateways, autoscalers and dashboards already read vLLM's metric
names (``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``, ...), so a
kvmesh worker exposes the same names with the same labels
(``model_name``, ``engine``) whichever engine runs behind it. Engine-state
metrics are read from ``Engine.load()`` at scrape time (a custom collector), so
there is no polling loop and the numbers are never stale. Each worker owns its
own ``CollectorRegistry`` so several workers can live in one test process.

An engine that records vLLM's metrics itself (``Engine.vllm_metrics``: the real
vLLM engine exports vLLM's own, the simulator records the same names) wins: a
``vllm:*`` family it provides replaces the worker's copy, so every name appears
once. The page is served on ``metrics_port`` and at ``/metrics`` of the HTTP API
(the serving port, where vLLM serves it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvmesh.metrics_http import MetricsAuthConfig, serve_metrics
from kvmesh.rpc.tls import TlsConfig
from kvmesh.worker.engine.base import Engine

log = logging.getLogger(__name__)

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0)


class _EngineCollector(Collector):
    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[object]:
        labels = ["model_name", "engine"]
        values = [self.model_name, "0"]
        try:
            load = self.engine.load()
            info = self.engine.info()
        except Exception as exc:  # noqa: BLE001 - a scrape must never fail because the engine did
            log.debug("engine load unavailable for metrics", extra={"error": str(exc)})
            return
        for name, doc, v in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", load.running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", load.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", load.kv_usage),
            ("kvmesh_worker_free_blocks", "KV blocks free or evictable.", load.free_blocks),
            ("kvmesh_worker_waiting_prefill_tokens", "Uncached prompt tokens queued.",
             load.waiting_prefill_tokens),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, float(v))
            yield g
        for name, doc, v in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             load.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             load.prefix_cache_hits),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, float(v))
            yield c
        fallbacks = getattr(self.engine, "offload_fallbacks", None)
        if fallbacks is not None:
            c = CounterMetricFamily("kvmesh_worker_offload_fallbacks", "Offload restores that failed (store down "
                                    "or slow), so the prompt was recomputed locally.", labels=labels)
            c.add_metric(values, float(fallbacks))
            yield c
        late = getattr(self.engine, "offload_late_restores", None)
        if late is not None:
            c = CounterMetricFamily("kvmesh_worker_offload_late_restores", "Restores from the offload store when "
                                    "the scheduler took a request, of blocks on the GPU at its arrival and evicted "
                                    "while it queued (sim engine).", labels=labels)
            c.add_metric(values, float(late))
            yield c
        timeouts = getattr(self.engine, "offload_timeouts", None)
        if timeouts is not None:
            c = CounterMetricFamily("kvmesh_worker_offload_timeouts", "Offload store calls past their deadline "
                                    "(--offload-timeout-s, --offload-lookup-timeout-s), by operation: a restore "
                                    "then recomputes, a save is skipped.", labels=[*labels, "op"])
            for op in ("restore", "save"):
                c.add_metric([*values, op], float(timeouts.get(op, 0)))
            yield c
        cfg_labels = ["block_size", "num_gpu_blocks", "enable_prefix_caching", "prefix_caching_hash_algo",
                      "engine"]
        g = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                              labels=cfg_labels)
        g.add_metric([str(info.block_size), str(load.num_blocks), "True", str(info.hash_algo), "0"], 1.0)
        yield g


class _Merged(Collector):
    """The engine's ``vllm:*`` families first, then the worker's families of other names."""

    def __init__(self, engine_metrics: Collector | None, own: CollectorRegistry) -> None:
        self.engine_metrics = engine_metrics
        self.own = own

    def collect(self) -> Iterator[object]:
        seen: set[str] = set()
        if self.engine_metrics is not None:
            try:
                fams = list(self.engine_metrics.collect())
            except Exception as exc:  # noqa: BLE001 - a scrape must never fail because the engine did
                log.debug("engine metrics unavailable", extra={"error": str(exc)})
                fams = []
            for fam in fams:
                seen.add(fam.name)
                yield fam
        for fam in self.own.collect():
            if fam.name not in seen:
                yield fam


class WorkerMetrics:
    """Request-level counters/histograms plus the engine collector, in one registry."""

    def __init__(self, engine: Engine, model_name: str, role: str, endpoint_id: str) -> None:
        self._own = CollectorRegistry(auto_describe=False)
        self._own.register(_EngineCollector(engine, model_name))
        vllm_metrics = getattr(engine, "vllm_metrics", None)
        self.engine_metrics: Collector | None = vllm_metrics(model_name) if vllm_metrics is not None else None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Merged(self.engine_metrics, self._own))
        self.model_name = model_name
        self.role = role
        lbl = ["model_name", "engine"]
        self._vl = (model_name, "0")
        r = self._own
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", lbl, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", lbl,
                                         registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              lbl, buckets=_TTFT_BUCKETS, registry=r)
        self.requests = Counter("kvmesh_worker_requests", "Requests by RPC and outcome.",
                                ["role", "endpoint", "rpc", "outcome"], registry=r)
        self.cached_tokens = Counter("kvmesh_worker_cached_tokens", "Prompt tokens not recomputed, by source.",
                                     ["role", "endpoint", "source"], registry=r)
        self.kv_from_prefill = Counter("kvmesh_worker_kv_from_prefill", "Requests whose KV came from a prefill "
                                       "worker's handle.", ["role", "endpoint"], registry=r)
        self.request_seconds = Histogram("kvmesh_worker_request_seconds", "End-to-end request time at the worker.",
                                         ["role", "endpoint", "rpc"], buckets=_TTFT_BUCKETS, registry=r)
        self.endpoint = endpoint_id
        self._port = 0

    def observe(self, rpc: str, outcome: str, *, prompt: int = 0, output: int = 0, cached_gpu: int = 0,
                cached_offload: int = 0, ttft_s: float | None = None, kv_from_prefill: bool = False,
                duration_s: float | None = None) -> None:
        self.requests.labels(self.role, self.endpoint, rpc, outcome).inc()
        if prompt:
            self.prompt_tokens.labels(*self._vl).inc(prompt)
        if output:
            self.generation_tokens.labels(*self._vl).inc(output)
        if ttft_s is not None:
            self.ttft.labels(*self._vl).observe(ttft_s)
        if cached_gpu:
            self.cached_tokens.labels(self.role, self.endpoint, "gpu").inc(cached_gpu)
        if cached_offload:
            self.cached_tokens.labels(self.role, self.endpoint, "offload").inc(cached_offload)
        if kv_from_prefill:
            self.kv_from_prefill.labels(self.role, self.endpoint).inc()
        if duration_s is not None:
            self.request_seconds.labels(self.role, self.endpoint, rpc).observe(duration_s)

    def render(self) -> str:
        return generate_latest(self.registry).decode()

    def serve(self, port: int, host: str = "127.0.0.1", auth: MetricsAuthConfig | None = None,
              tls: TlsConfig | None = None) -> int:
        """Serve ``/metrics`` on ``port`` (0 = off) with ``auth``'s scrape credentials. Returns the port."""
        if port <= 0:
            return 0
        self._port = serve_metrics(port, host, self.registry, auth=auth, tls=tls)
        return self._port
