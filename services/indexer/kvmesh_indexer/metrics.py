"""Prometheus metrics and OpenTelemetry spans around the index and ingest.

Why a wrapper: backends stay free of telemetry code (llm-d style); the
``InstrumentedIndex`` decorates any ``BlockIndex`` with a lookup-latency
histogram and spans, and ``MetricsObserver`` turns ingest callbacks into
counters. Per-endpoint "seconds since last event" is computed at scrape time,
so an engine that publishes nothing shows a growing number at a glance.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvmesh.index.base import TIERS, BlockIndex, IndexStats, LookupResult, Tier
from kvmesh_indexer.index_wrapper import IndexWrapper

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("kvmesh.indexer.index")

LOOKUP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class IndexMetrics:
    """All indexer metric families, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.events = Counter("kvmesh_indexer_events", "KV events applied, by type (rate() = events/s)",
                              ["type"], registry=registry)
        self.rejected = Counter("kvmesh_indexer_rejected", "Inputs rejected and skipped, by reason",
                                ["endpoint", "reason"], registry=registry)
        self.gaps = Counter("kvmesh_indexer_seq_gaps", "Sequence gaps detected", ["endpoint"], registry=registry)
        self.missing = Counter("kvmesh_indexer_seq_missing_batches", "Batches missing in gaps", ["endpoint"],
                               registry=registry)
        self.replays = Counter("kvmesh_indexer_replays", "Replay requests, by outcome", ["endpoint", "outcome"],
                               registry=registry)
        self.tail_probes = Counter(
            "kvmesh_indexer_tail_probes", "Replay-buffer checks of quiet endpoints, by outcome "
            "(in_sync, caught_up = lost messages applied, restarted = engine restart found, unreachable)",
            ["endpoint", "outcome"], registry=registry)
        self.clears = Counter("kvmesh_indexer_endpoint_clears", "Endpoint clears, by reason",
                              ["endpoint", "reason"], registry=registry)
        self.dropped = Counter("kvmesh_indexer_dropped_messages", "Messages dropped on a full endpoint queue",
                               ["endpoint"], registry=registry)
        self.lookup_seconds = Histogram("kvmesh_indexer_lookup_seconds", "Index lookup latency",
                                        ["backend"], buckets=LOOKUP_BUCKETS, registry=registry)
        self.lookup_shards = Counter("kvmesh_indexer_lookup_shards",
                                     "Lookups by how many cluster shards they read (redis-cluster; target <= 2)",
                                     ["shards"], registry=registry)
        self.lookup_errors = Counter("kvmesh_indexer_lookup_errors", "Lookups that failed (backend down)",
                                     ["backend"], registry=registry)


class MetricsObserver:
    """IngestObserver that feeds ``IndexMetrics``."""

    def __init__(self, m: IndexMetrics) -> None:
        self.m = m

    def on_events(self, endpoint: str, kind: str, n: int) -> None:
        self.m.events.labels(kind).inc(n)

    def on_rejected(self, endpoint: str, reason: str, n: int) -> None:
        self.m.rejected.labels(endpoint, reason).inc(n)

    def on_gap(self, endpoint: str, missing: int) -> None:
        self.m.gaps.labels(endpoint).inc()
        self.m.missing.labels(endpoint).inc(missing)

    def on_replay(self, endpoint: str, outcome: str) -> None:
        self.m.replays.labels(endpoint, outcome).inc()

    def on_probe(self, endpoint: str, outcome: str) -> None:
        self.m.tail_probes.labels(endpoint, outcome).inc()

    def on_clear(self, endpoint: str, reason: str, blocks: int) -> None:
        self.m.clears.labels(endpoint, reason).inc()


class StateCollector(Collector):
    """Scrape-time gauges: index size, blocks by tier, per-endpoint freshness."""

    def __init__(self, stats: Callable[[], IndexStats | None],
                 freshness: Callable[[], Iterable[tuple[str, float, bool]]]) -> None:
        self._stats = stats
        self._freshness = freshness

    def collect(self):  # type: ignore[no-untyped-def]
        st = None
        try:
            st = self._stats()
        except Exception as exc:  # noqa: BLE001 - a scrape must never fail because Redis is down
            log.debug("stats unavailable for scrape", extra={"error": str(exc)})
        up = GaugeMetricFamily("kvmesh_indexer_backend_up", "1 when the index backend answers")
        up.add_metric([], 0.0 if st is None else 1.0)
        yield up
        if st is not None:
            blocks = GaugeMetricFamily("kvmesh_indexer_blocks", "Block-endpoint entries by tier", labels=["tier"])
            for t in TIERS:
                blocks.add_metric([t.name], float(st.entries_by_tier.get(t, 0)))
            yield blocks
            size = GaugeMetricFamily("kvmesh_indexer_index_entries", "Block-endpoint-tier entries in the index")
            size.add_metric([], float(st.entries))
            yield size
            keys = GaugeMetricFamily("kvmesh_indexer_index_keys", "Distinct block keys in the index")
            keys.add_metric([], float(st.keys))
            yield keys
            if "evicted" in st.counters:
                ev = GaugeMetricFamily("kvmesh_indexer_evicted_entries", "Entries evicted by the LRU budget")
                ev.add_metric([], float(st.counters["evicted"]))
                yield ev
        since = GaugeMetricFamily(
            "kvmesh_indexer_seconds_since_last_event",
            "Per endpoint: seconds since its last KV event (since it was added if it never published)",
            labels=["endpoint"])
        published = GaugeMetricFamily("kvmesh_indexer_endpoint_published",
                                      "1 once the endpoint published any KV event, else 0", labels=["endpoint"])
        for ep, secs, pub in self._freshness():
            since.add_metric([ep], secs)
            published.add_metric([ep], 1.0 if pub else 0.0)
        yield since
        yield published


class InstrumentedIndex(IndexWrapper):
    """Adds latency metrics and spans to any backend without touching it."""

    def __init__(self, inner: BlockIndex, metrics: IndexMetrics | None = None) -> None:
        super().__init__(inner)
        self.metrics = metrics

    def clear_endpoint(self, endpoint: str, tier: Tier | None = None) -> int:
        with _tracer.start_as_current_span("index.clear_endpoint", attributes={"kvmesh.endpoint": endpoint}):
            return self.inner.clear_endpoint(endpoint, tier)

    def lookup(self, model: str, keys: Sequence[int], endpoint_filter: Iterable[str] | None = None,
               include_speculative: bool = False, exclude: Iterable[str] | None = None,
               extra_models: Sequence[str] = ()) -> LookupResult:
        t0 = time.perf_counter()
        with self._lookup_span(model, keys) as span:
            try:
                res = self.inner.lookup(model, keys, endpoint_filter, include_speculative, exclude, extra_models)
            except Exception:
                self._lookup_failed()
                raise
            return self._looked_up(span, res, t0)

    @property
    def native_async(self) -> bool:
        """The backend answers ``lookup_async`` on the event loop (no thread)."""
        return bool(getattr(self.inner, "native_async", False))

    async def lookup_async(self, model: str, keys: Sequence[int], endpoint_filter: Iterable[str] | None = None,
                           include_speculative: bool = False, exclude: Iterable[str] | None = None,
                           extra_models: Sequence[str] = ()) -> LookupResult:
        t0 = time.perf_counter()
        with self._lookup_span(model, keys) as span:
            try:
                res = await self.inner.lookup_async(  # type: ignore[attr-defined]
                    model, keys, endpoint_filter, include_speculative, exclude, extra_models)
            except Exception:
                self._lookup_failed()
                raise
            return self._looked_up(span, res, t0)

    def _lookup_span(self, model: str, keys: Sequence[int]) -> Any:
        return _tracer.start_as_current_span("index.lookup", attributes={
            "kvmesh.backend": self.name, "kvmesh.model": model, "kvmesh.chain_length": len(keys)})

    def _lookup_failed(self) -> None:
        if self.metrics:
            self.metrics.lookup_errors.labels(self.name).inc()

    def _looked_up(self, span: Any, res: LookupResult, t0: float) -> LookupResult:
        span.set_attribute("kvmesh.best_combined", res.best_combined())
        span.set_attribute("kvmesh.endpoints_matched", len(res.matches))
        if self.metrics:
            self.metrics.lookup_seconds.labels(self.name).observe(time.perf_counter() - t0)
            shards = getattr(self.inner, "last_lookup_shards", 0)
            if shards:
                self.metrics.lookup_shards.labels(str(shards)).inc()
        return res

    def run_id(self) -> str | None:
        fn = getattr(self.inner, "run_id", None)
        return fn() if fn else "in-process"
