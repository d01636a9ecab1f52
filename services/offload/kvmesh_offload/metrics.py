"""Prometheus metrics of the offload store.

Counters live in the synchronous store core (plain ints, so the cluster
simulator needs no Prometheus); a custom collector exposes them at scrape time.
The restore-latency histogram is observed by the servicer per Get.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvmesh_offload.store import OffloadStore

RESTORE_LATENCY = Histogram(
    "kvmesh_offload_restore_latency_seconds",
    "Time to serve a Get/GetShm that returned at least one block, by transport path",
    ["path"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)

# counter key in the store -> (metric, tier label or None)
_TIERED = {
    "bytes_stored_ram": ("bytes_stored", "cpu"), "bytes_stored_disk": ("bytes_stored", "disk"),
    "bytes_fetched_ram": ("bytes_fetched", "cpu"), "bytes_fetched_disk": ("bytes_fetched", "disk"),
    "hits_ram": ("hits", "cpu"), "hits_disk": ("hits", "disk"),
    "evictions_ram": ("evictions", "cpu"), "evictions_disk": ("evictions", "disk"),
}
_PLAIN = {
    "misses": "misses", "disk_corrupt_blocks": "corrupt_blocks", "put_refused_full": "put_refused",
    "blocks_dropped": "blocks_dropped", "blocks_promoted": "blocks_promoted", "blocks_spilled": "blocks_spilled",
}


class StoreCollector(Collector):
    def __init__(self) -> None:
        self.store: OffloadStore | None = None

    def collect(self) -> Iterator[object]:
        store = self.store
        if store is None:
            return
        stats = store.stats()
        counters: dict[str, int] = stats["counters"]  # type: ignore[assignment]
        tiered: dict[str, CounterMetricFamily] = {}
        for key, (name, tier) in _TIERED.items():
            fam = tiered.setdefault(name, CounterMetricFamily(f"kvmesh_offload_{name}", f"offload {name} by tier",
                                                              labels=["tier"]))
            fam.add_metric([tier], counters.get(key, 0))
        yield from tiered.values()
        for key, name in _PLAIN.items():
            yield CounterMetricFamily(f"kvmesh_offload_{name}", f"offload {name.replace('_', ' ')}",
                                      value=counters.get(key, 0))
        used = GaugeMetricFamily("kvmesh_offload_tier_bytes", "bytes held per tier", labels=["tier"])
        used.add_metric(["cpu"], stats["ram_bytes"])
        used.add_metric(["disk"], stats["disk_bytes"])
        yield used
        cap = GaugeMetricFamily("kvmesh_offload_tier_capacity_bytes", "capacity per tier", labels=["tier"])
        cap.add_metric(["cpu"], stats["ram_capacity_bytes"])
        cap.add_metric(["disk"], stats["disk_capacity_bytes"])
        yield cap


COLLECTOR = StoreCollector()
REGISTRY.register(COLLECTOR)


def bind_store(store: OffloadStore) -> None:
    """Point the process-wide collector at the store being served."""
    COLLECTOR.store = store
