"""``kvmesh bench offload --backend mooncake``: the Mooncake byte pool against kvmesh's own bulk path.

One run starts a real ``mooncake_master`` and two ``kvmesh serve offload`` children on
loopback: one keeping its bytes (the bulk TCP data plane other hosts use) and one with
``--byte-pool mooncake`` (lending the pool its budget). This process is the client of
both, with the same blocks and the same caller buffer (warm, and registered with the
pool): every repeat puts the blocks into each store and reads them back into the
buffer, alternating, so both see the same machine state. Both reads verify every
block's checksum (XXH3-64). Target: ``get_pool_vs_bulk`` (median GB/s of the pool's ``get_into``
over the bulk ``get_into``) >= 0.8.

- ``get_gbps_bulk``: ``OffloadClient.get_into`` over ``GetBulk`` + the bulk TCP port.
- ``get_gbps_pool``: ``MooncakeStoreClient.get_into`` (``GetBulk`` for sizes and
  checksums, then Mooncake ``batch_get_into`` straight into the registered buffer).
- ``get_gbps_pool_staged``: the same into an unregistered buffer (through the client's
  registered staging buffer: one more memcpy).
- ``put_gbps_grpc`` / ``put_gbps_pool``: puts of the same blocks (gRPC stream to the
  kvmesh store; ``batch_put_from`` of the registered source + one commit to the pool).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvmesh.kvstore.client import OffloadClient
from kvmesh.kvstore.layout import kv_bytes_per_block, namespace_for
from kvmesh_tools.bench.common import median
from kvmesh_tools.testing.mooncake import MooncakeMaster
from kvmesh_tools.testing.ports import free_port
from kvmesh_tools.testing.procs import ServiceProcess

log = logging.getLogger(__name__)
MiB = 1024 * 1024
TARGET = 0.8


def _store(name: str, tmp: Path, capacity: int, *flags: str) -> ServiceProcess:
    def ports() -> tuple[list[str], str]:
        port = free_port()
        return (["--host", "127.0.0.1", "--port", str(port), "--ram-capacity-bytes", str(capacity),
                 "--eviction-policy", "lru", "--endpoint-id", name, *flags], f"127.0.0.1:{port}")
    return ServiceProcess.on_fresh_ports("offload", ports, log_path=tmp / f"{name}.log").start(timeout_s=120)


def run_pool_bench(args: argparse.Namespace) -> dict[str, Any]:
    from kvmesh.kvstore.mooncake.client import MooncakeStoreClient

    bsize = kv_bytes_per_block(args.layers, args.kv_heads, args.head_dim, args.dtype, args.block_tokens)
    ns = namespace_for("bench-model", args.layers, args.kv_heads, args.head_dim, args.dtype, args.block_tokens)
    nblocks = max(1, args.total_mib * MiB // bsize)
    total = nblocks * bsize
    capacity = int(total * 1.5) + 64 * MiB
    src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    blocks = [(i + 1, memoryview(src[i * bsize:(i + 1) * bsize])) for i in range(nblocks)]
    keys = [k for k, _ in blocks]
    dst = np.empty(total, dtype=np.uint8)
    dst.fill(1)
    dests = [dst[i * bsize:(i + 1) * bsize] for i in range(nblocks)]
    plain = np.empty(total, dtype=np.uint8)     # not registered: the staged path
    plain.fill(1)
    plain_dests = [plain[i * bsize:(i + 1) * bsize] for i in range(nblocks)]
    res: dict[str, list[float]] = {k: [] for k in ("get_gbps_bulk", "get_gbps_pool", "get_gbps_pool_staged",
                                                   "put_gbps_grpc", "put_gbps_pool", "get_pool_vs_bulk")}
    tmp = tempfile.TemporaryDirectory(prefix="kvmesh-pool-bench-")
    master = MooncakeMaster().start()
    local = pooled = None
    try:
        local = _store("offload-local", Path(tmp.name), capacity)
        pooled = _store("offload-pool", Path(tmp.name), capacity, "--byte-pool", "mooncake",
                        "--mooncake-master", master.address)
        pc = MooncakeStoreClient(pooled.grpc_address, timeout_s=600, stage_bytes=max(64 * MiB, total))
        pc.register(src)
        pc.register(dst)

        async def bulk_round(keep: bool) -> float:
            c = OffloadClient(local.grpc_address, use_shm=False, use_bulk=True, timeout_s=600)
            try:
                await c.delete(ns, keys)
                t0 = time.perf_counter()
                pr = await c.put(ns, blocks)
                dt_put = time.perf_counter() - t0
                assert pr.stored == nblocks, pr
                t0 = time.perf_counter()
                n = await c.get_into(ns, keys, dests)
                dt = time.perf_counter() - t0
                assert n == nblocks
            finally:
                await c.close()
            if keep:
                res["put_gbps_grpc"].append(total / dt_put / 1e9)
            return total / dt / 1e9

        for rep in range(args.repeats + 1):     # repeat 0 warms both paths up, unrecorded
            keep = rep > 0
            bulk = asyncio.run(bulk_round(keep))
            pc.delete(ns, keys)
            t0 = time.perf_counter()
            pr = pc.put(ns, blocks)
            dt_put = time.perf_counter() - t0
            assert pr.stored == nblocks, pr
            t0 = time.perf_counter()
            n = pc.get_into(ns, keys, dests)
            dt = time.perf_counter() - t0
            assert n == nblocks
            t0 = time.perf_counter()
            n = pc.get_into(ns, keys, plain_dests)
            dt_staged = time.perf_counter() - t0
            assert n == nblocks and bytes(plain[:64]) == bytes(src[:64])
            if keep:
                res["get_gbps_bulk"].append(bulk)
                res["get_gbps_pool"].append(total / dt / 1e9)
                res["get_gbps_pool_staged"].append(total / dt_staged / 1e9)
                res["put_gbps_pool"].append(total / dt_put / 1e9)
                res["get_pool_vs_bulk"].append(res["get_gbps_pool"][-1] / bulk)
            log.info("pool bench repeat", extra={"repeat": rep, "bulk_gbps": round(bulk, 3),
                                                 "pool_gbps": round(total / dt / 1e9, 3)})
        pc.close()
    finally:
        for p in (pooled, local):
            if p is not None:
                p.stop()
        master.stop()
        tmp.cleanup()
    out: dict[str, Any] = {k: median(v) for k, v in res.items()}
    # The ratio of medians (the target) and the median of same-repeat ratios.
    out["get_pool_vs_bulk"] = out["get_gbps_pool"] / out["get_gbps_bulk"]
    out["get_pool_vs_bulk_paired_median"] = median(res["get_pool_vs_bulk"])
    out["samples"] = res
    out["bytes_per_op"] = total
    out["block_bytes"] = bsize
    out["blocks"] = nblocks
    out["targets"] = {"get_pool_vs_bulk_min": TARGET, "get_pool_vs_bulk_met": out["get_pool_vs_bulk"] >= TARGET}
    out["repeats"] = args.repeats
    out["glibc_tunables"] = os.environ.get("GLIBC_TUNABLES", "")
    out["load_avg_1m"] = os.getloadavg()[0]
    return out
