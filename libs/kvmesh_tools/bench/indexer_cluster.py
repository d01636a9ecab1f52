"""``kvmesh bench indexer --backend redis-cluster``: the index on a Redis Cluster next to one Redis.

Why a run of its own: the cluster's targets (#23: lookup p99 <= 5 ms over 6k-block
chains, ingest >= 100k blocks/s, no lookup reading more than 2 shards) only mean
something next to the single-Redis backend measured in the same run on the same
machine load, so both are built here from the same chains and events, ingested
one after the other, and then looked up alternately (same chain, cluster then
single), so a load spike hits both. It starts a real 3-master cluster and one
redis-server on loopback unless ``--redis-url`` / ``--redis-cluster-url`` name
running ones.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from typing import Any

from kvmesh.index.base import BlockIndex
from kvmesh_indexer.ingest import Ingestor
from kvmesh_indexer.keys import ModelSpec
from kvmesh_tools.bench.common import percentile

MODEL = "bench"
TARGETS = {"ingest_blocks_per_s_min": 100_000, "lookup_p99_ms_max": 5.0, "lookup_shards_max": 2}


def _ingest(index: BlockIndex, work: list) -> tuple[float, int]:
    ingestor = Ingestor(index, {MODEL: ModelSpec(MODEL, 16)})
    seqs: dict[str, int] = {}
    blocks = 0
    t0 = time.perf_counter()
    for ep, batches in work:
        for b in batches:
            seq = seqs.get(ep, -1) + 1
            seqs[ep] = seq
            ingestor.process(ep, MODEL, seq, b)
            blocks += len(b.events[0].block_hashes)
    return time.perf_counter() - t0, blocks


def _used_memory(index: Any) -> int:
    from redis.cluster import RedisCluster

    if index.name == "redis-cluster":
        info = index.r.info("memory", target_nodes=RedisCluster.PRIMARIES)
        return sum(int(v["used_memory"]) for v in info.values())
    return int(index.r.info("memory")["used_memory"])


def run(args: argparse.Namespace, chains: list[list[int]], work: list, present: int) -> dict[str, Any]:
    from kvmesh_indexer.redis_backend import RedisIndex
    from kvmesh_indexer.redis_cluster_backend import RedisClusterIndex
    from kvmesh_tools.testing.redis_cluster import RedisClusterProcess
    from kvmesh_tools.testing.redis_server import RedisProcess

    procs: list[Any] = []
    idx: dict[str, Any] = {}
    try:
        curl = args.redis_cluster_url
        if not curl:
            procs.append(RedisClusterProcess().start())
            curl = procs[-1].url
        surl = args.redis_url
        if not surl:
            procs.append(RedisProcess().start())
            surl = procs[-1].url
        ns = f"bench{random.randrange(1 << 30)}"
        idx["redis-cluster"] = RedisClusterIndex(curl, namespace=ns, timeout_s=10.0, anchor_depth=args.anchor_depth,
                                                 probe_stride=args.probe_stride)
        idx["redis"] = RedisIndex(surl, namespace=ns, timeout_s=10.0, probe_stride=args.probe_stride)
        out: dict[str, dict[str, Any]] = {}
        for name, index in idx.items():
            mem0 = _used_memory(index)
            secs, blocks = _ingest(index, work)
            entries = index.stats().entries
            out[name] = {"ingest_blocks_per_s": round(blocks / secs), "ingested_blocks": blocks, "entries": entries,
                         # used_memory delta over every master: what one entry costs in each layout
                         "bytes_per_entry": round((_used_memory(index) - mem0) / max(1, entries), 1)}
        rng = random.Random(args.seed + 1)
        lat: dict[str, list[float]] = {k: [] for k in idx}
        load_before = os.getloadavg()[0]
        for _ in range(args.lookups):
            c = chains[rng.randrange(len(chains))]
            for name, index in idx.items():
                t = time.perf_counter()
                res = index.lookup(MODEL, c)
                lat[name].append(time.perf_counter() - t)
                if res.best_combined() != present:
                    raise RuntimeError(f"{name}: lookup found {res.best_combined()} leading blocks, want {present}")
        for name in idx:
            out[name]["lookup_p50_ms"] = round(percentile(lat[name], 50) * 1e3, 4)
            out[name]["lookup_p99_ms"] = round(percentile(lat[name], 99) * 1e3, 4)
        shards = idx["redis-cluster"].lookup_shards
        c = out["redis-cluster"]
        c["lookup_shards_max"] = max(shards, default=0)
        c["lookups_by_shards"] = {str(k): v for k, v in sorted(shards.items())}
        c["anchor_depth"] = args.anchor_depth
        single = out["redis"]
        result = {
            "bench": "indexer",
            "backend": "redis-cluster",
            **{k: c[k] for k in ("ingest_blocks_per_s", "lookup_p50_ms", "lookup_p99_ms", "lookup_shards_max")},
            "cluster": c,
            "single_redis_same_run": single,
            "ingest_vs_single": round(c["ingest_blocks_per_s"] / max(1, single["ingest_blocks_per_s"]), 3),
            "lookup_p99_vs_single": round(c["lookup_p99_ms"] / max(1e-9, single["lookup_p99_ms"]), 3),
            "loadavg_1m": round(max(load_before, os.getloadavg()[0]), 2),
            "cpus": os.cpu_count(),
            "masters": 3 if not args.redis_cluster_url else None,
            "lookup_blocks_matched": present,
            "targets": TARGETS,
        }
        result["meets_targets"] = bool(c["ingest_blocks_per_s"] >= TARGETS["ingest_blocks_per_s_min"]
                                       and c["lookup_p99_ms"] <= TARGETS["lookup_p99_ms_max"]
                                       and c["lookup_shards_max"] <= TARGETS["lookup_shards_max"])
        return result
    finally:
        for index in idx.values():
            index.close()
        for p in procs:
            p.stop()
