"""``kvmesh bench offload --json PATH``: offload store throughput over loopback gRPC and shared memory.

A real ``kvmesh serve offload`` child process holds the blocks; this process is
the client. Each repeat deletes the blocks, puts ``--total-mib`` of them and
reads them back, once over gRPC and once over the shm fast path. The baseline is
a single-thread memcpy of the same size between warm buffers, in the same run.
Targets: ``get_gbps_grpc >= 25%`` and ``get_gbps_shm >= 70%`` of ``memcpy_gbps``.

How each figure is measured (GB = 1e9 bytes; every figure is the median of
``--repeats`` timed rounds after one unrecorded warm-up round):

- ``memcpy_gbps``: one ``np.copyto`` of ``--total-mib`` between two buffers whose
  pages were all touched beforehand, sampled between the store rounds and right
  before and after each recorded verified shm get.
- ``get_shm_vs_memcpy`` (the target): the median over repeats of each verified shm
  get's GB/s over the mean of the two memcpy copies timed right before and after it
  (``get_shm_vs_memcpy_paired`` per repeat in ``samples``). On this shared VM one
  1 GiB memcpy ranges 4.6-16 GB/s within a run, so the ratio of the two medians
  (still reported, ``get_shm_vs_memcpy_medians``) swings with when the baseline
  happened to be sampled; the paired ratio compares the two at the same moment.
- ``get_gbps_shm``: ``OffloadClient.get_into`` of every block into a caller
  buffer of the same size whose pages were touched beforehand (what a KV
  connector does: it writes into its already-allocated cache). The store names
  where each block sits in its shared slabs; the client copies it from there
  into the buffer: one copy per block, plus one GetShm and one ReleaseShm call.
  Each block's XXH3-64 is verified while it is copied (2 MiB pieces under the
  bench's glibc tunables, checksummed right after copying: ``client_messages.copy_piece_bytes``), the blocks split over ``copy_threads``
  threads (``$KVMESH_OFFLOAD_COPY_THREADS``, default 2); ``get_gbps_shm_trusted`` is
  the same get by a client with ``trust_local_store`` (no verification),
  ``get_shm_verified_vs_trusted`` their same-run ratio; ``get_gbps_shm_1thread`` the
  verified get copied by the calling thread alone.
- ``get_gbps_shm_views``: ``fetch`` only (views of the store's memory, no copy);
  ``get_gbps_shm_bytes``: ``get`` (a fresh ``bytes`` per block).
- ``get_gbps_grpc``: ``fetch`` over the gRPC stream (the received messages,
  viewed without a copy); ``get_into_gbps_grpc`` adds the copy into the
  caller buffer.
- ``get_gbps_bulk``: ``get_into`` over the bulk path a client on another host
  uses (``GetBulk`` over gRPC, then the bytes over a plain TCP connection,
  received straight into the caller buffer), on loopback here;
  ``get_gbps_bulk_fetch`` receives into a pooled client buffer instead.
- ``put_gbps_*``: ``put`` of the same blocks after deleting them. ``put_gbps_shm`` copies
  each block into its reserved slab slot and checksums it there, piece by piece as the get does,
  the blocks split over ``copy_threads`` threads as the get's are; ``put_gbps_shm_1thread``
  is the same put copied by the calling thread alone (same run), ``put_vs_get_shm`` the
  target ratio (>= 0.8) and ``put_vs_get_shm_1thread`` both on one thread.
  ``put_shm_direct_calls`` / ``put_shm_copied_calls``: the store's count of shm puts that
  went into reserved slots / fell back to PutShm (two copies); the latter should be 0.

Bulk copies and glibc: ``memcpy`` switches to non-temporal stores only above
``glibc.cpu.x86_non_temporal_threshold`` (99 MiB on this host), so one 1 GiB
copy (the baseline) runs ~1.6x faster than the same bytes copied 2 MiB at a time
(which is how blocks move). By default the bench therefore runs itself in a child
process with ``GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x100000``
(1 MiB), the setting we recommend for the store and the workers' environment;
the baseline copy is not slowed by it (it was already non-temporal). The same
child also gets ``glibc.cpu.x86_rep_movsb_threshold=0x200000``: on AMD glibc copies
pieces from 8 KiB up to the L2 size (1 MiB here) with ``rep movsb``, and the
512 KiB pieces of a verified get ran ~2x slower that way than through glibc's
vector loop (docs/bench-history.md); the 1 GiB baseline copy does not use
``rep movsb`` either way. ``--no-nt-copies`` measures with neither tunable; the
JSON records which.

``grpc_raw_stream_gbps`` is a pass-through gRPC stream of
pre-built messages between two processes (no protobuf, no store): the ceiling
of the gRPC path on this host, measured in the same run. ``memcpy_to_shm_gbps``
is the baseline copy into a warm ``/dev/shm`` segment (4 KiB pages where tmpfs
has no huge pages): the ceiling of any shared-memory path here.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvmesh.kvstore.client import OffloadClient
from kvmesh.kvstore.client_messages import copy_threads
from kvmesh.kvstore.layout import kv_bytes_per_block, namespace_for
from kvmesh.kvstore.shm import Segment
from kvmesh_offload.arena import tune_malloc
from kvmesh_tools.bench.common import median, percentile, write_json
from kvmesh_tools.testing.procs import ServiceProcess

log = logging.getLogger(__name__)
MiB = 1024 * 1024


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("offload", help="offload store put/get GB/s over gRPC and shm vs memcpy")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--total-mib", type=int, default=1024, help="bytes moved per put/get (default 1 GiB)")
    p.add_argument("--repeats", type=int, default=5)
    # Llama-3-8B-like layout: 32 layers, 8 KV heads, head dim 128, bf16, 16-token blocks = 2 MiB/block.
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--address", default="", help="use a running store instead of starting one")
    p.add_argument("--nt-copies", action=argparse.BooleanOptionalAction, default=True,
                   help="run with glibc's non-temporal copy threshold at 1 MiB and no rep movsb below 2 MiB "
                        "(see module doc)")
    p.add_argument("--backend", choices=["kvmesh", "mooncake"], default="kvmesh",
                   help="kvmesh: the store's own paths (shm, bulk, gRPC); mooncake: the Mooncake byte pool "
                        "against the bulk path in the same run (see kvmesh_tools.bench.offload_pool)")
    p.add_argument("--tls", choices=["off", "on", "compare"], default="off",
                   help="gRPC to the store in plaintext, over mutual TLS (a throwaway CA), or both in the "
                        "same run (compare: tls_compare gives each mode's figures and their ratios)")
    p.set_defaults(func=run)


class Memcpy:
    """Single-thread memcpy between warm buffers; sampled between the store runs so that
    the baseline sees the same machine load (this host is shared)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.src = np.ones(nbytes, dtype=np.uint8)
        self.dst = np.empty(nbytes, dtype=np.uint8)
        self.dst.fill(0)  # touch every page now: no page faults in the timed copies
        self.rates: list[float] = []

        # The same copy into a warm POSIX shm segment: tmpfs has no huge pages here,
        # so this is the physical limit of any shared-memory path on this host.
        self.seg = Segment.create(nbytes)
        self.shm_dst = np.frombuffer(self.seg.mm, dtype=np.uint8, count=nbytes)
        self.shm_dst.fill(0)
        self.shm_rates: list[float] = []

    def copy(self) -> float:
        """One timed baseline copy, GB/s (also kept in ``rates``)."""
        t0 = time.perf_counter()
        np.copyto(self.dst, self.src)
        rate = self.nbytes / (time.perf_counter() - t0) / 1e9
        self.rates.append(rate)
        return rate

    def sample(self) -> None:
        self.copy()
        t0 = time.perf_counter()
        np.copyto(self.shm_dst, self.src)
        self.shm_rates.append(self.nbytes / (time.perf_counter() - t0) / 1e9)

    def close(self) -> None:
        del self.shm_dst
        self.seg.close()


async def _bench(address: str, args: argparse.Namespace, memcpy: Memcpy) -> dict[str, Any]:
    bsize = kv_bytes_per_block(args.layers, args.kv_heads, args.head_dim, args.dtype, args.block_tokens)
    ns = namespace_for("bench-model", args.layers, args.kv_heads, args.head_dim, args.dtype, args.block_tokens)
    nblocks = max(1, args.total_mib * MiB // bsize)
    total = nblocks * bsize
    # Distinct content per block: one shared payload would stay in the CPU cache and make
    # puts (which read the source) look faster than a real KV cache's blocks allow.
    src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    blocks = [(i + 1, memoryview(src[i * bsize:(i + 1) * bsize])) for i in range(nblocks)]
    keys = [k for k, _ in blocks]
    res: dict[str, list[float]] = {k: [] for k in (
        "put_gbps_grpc", "get_gbps_grpc", "get_into_gbps_grpc", "put_gbps_shm", "get_gbps_shm",
        "get_gbps_shm_views", "get_gbps_shm_bytes", "restore_ms_grpc", "restore_ms_shm",
        "get_shm_client_page_faults", "get_gbps_bulk", "get_gbps_bulk_fetch", "restore_ms_bulk",
        "get_gbps_shm_trusted", "get_gbps_shm_1thread", "put_gbps_shm_1thread", "get_shm_vs_memcpy_paired")}
    # The caller's destination (a KV cache stand-in): allocated and touched once, reused.
    dst = np.empty(total, dtype=np.uint8)
    dst.fill(1)
    dests = [dst[i * bsize:(i + 1) * bsize] for i in range(nblocks)]
    grpc_c = OffloadClient(address, use_shm=False, use_bulk=False, timeout_s=600)
    bulk_c = OffloadClient(address, use_shm=False, use_bulk=True, timeout_s=600)
    shm_c = OffloadClient(address, use_shm=True, timeout_s=600)
    # The same shm get without the client's checksum pass (trust_local_store): what verifying costs.
    trusting_c = OffloadClient(address, use_shm=True, timeout_s=600, trust_local_store=True)
    # The same verified get, and the same put, by the calling thread alone: what the copy threads bring.
    single_c = OffloadClient(address, use_shm=True, timeout_s=600)
    single_c.copy_threads = 1
    try:
        # Repeat 0 is a warm-up, not recorded: it grows the store's slabs, creates the
        # client's 1 GiB segment and the store's mapping of it. The figures are steady state.
        for rep in range(args.repeats + 1):
            keep = rep > 0
            if keep:
                memcpy.sample()
            for path, c in (("grpc", grpc_c), ("bulk", bulk_c), ("shm", shm_c)):
                await c.delete(ns, keys)
                t0 = time.perf_counter()
                pr = await c.put(ns, blocks)
                dt_put = time.perf_counter() - t0
                assert pr.stored == nblocks, pr
                t0 = time.perf_counter()
                lease = await c.fetch(ns, keys)
                dt_views = time.perf_counter() - t0
                assert len(lease.views) == nblocks and lease.via_shm == (path == "shm")
                await lease.arelease()
                if keep and path == "shm":
                    before = memcpy.copy()
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                n = await c.get_into(ns, keys, dests)
                dt_into = time.perf_counter() - t0
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
                if keep and path == "shm":
                    # The target's ratio: this get against the baseline copied right before and
                    # right after it, so both see the same moment of this shared host.
                    res["get_shm_vs_memcpy_paired"].append(total / dt_into / 1e9 * 2 / (before + memcpy.copy()))
                assert n == nblocks
                if keep:
                    if path != "bulk":  # the bulk client puts over the same gRPC stream
                        res[f"put_gbps_{path}"].append(total / dt_put / 1e9)
                    if path == "bulk":
                        res["get_gbps_bulk"].append(total / dt_into / 1e9)
                        res["get_gbps_bulk_fetch"].append(total / dt_views / 1e9)
                        res["restore_ms_bulk"].append(dt_into * 1e3)
                    elif path == "shm":
                        res["get_gbps_shm"].append(total / dt_into / 1e9)
                        res["get_gbps_shm_views"].append(total / dt_views / 1e9)
                        res["restore_ms_shm"].append(dt_into * 1e3)
                        res["get_shm_client_page_faults"].append(faults)
                    else:
                        res["get_gbps_grpc"].append(total / dt_views / 1e9)
                        res["get_into_gbps_grpc"].append(total / dt_into / 1e9)
                        res["restore_ms_grpc"].append(dt_into * 1e3)
                if path == "shm":
                    t0 = time.perf_counter()
                    await trusting_c.get_into(ns, keys, dests)
                    if keep:
                        res["get_gbps_shm_trusted"].append(total / (time.perf_counter() - t0) / 1e9)
                    t0 = time.perf_counter()
                    await single_c.get_into(ns, keys, dests)
                    if keep:
                        res["get_gbps_shm_1thread"].append(total / (time.perf_counter() - t0) / 1e9)
                    await single_c.delete(ns, keys)
                    t0 = time.perf_counter()
                    pr = await single_c.put(ns, blocks)
                    if keep:
                        res["put_gbps_shm_1thread"].append(total / (time.perf_counter() - t0) / 1e9)
                    assert pr.stored == nblocks and pr.via_shm, pr
                    t0 = time.perf_counter()
                    got = await c.get(ns, keys)
                    if keep:
                        res["get_gbps_shm_bytes"].append(total / (time.perf_counter() - t0) / 1e9)
                    del got
                log.info("offload bench repeat", extra={"repeat": rep, "path": path, "warmup": not keep})
        stats = await grpc_c.stats()
    finally:
        await grpc_c.close()
        await bulk_c.close()
        await shm_c.close()
        await trusting_c.close()
        await single_c.close()
    out: dict[str, Any] = {k: median(v) for k, v in res.items() if not k.startswith("restore_ms")}
    out["restore_p50_ms_1gib"] = percentile(res["restore_ms_shm"], 50) * (1024 * MiB / total)
    out["restore_p50_ms_1gib_grpc"] = percentile(res["restore_ms_grpc"], 50) * (1024 * MiB / total)
    out["restore_p50_ms_1gib_bulk"] = percentile(res["restore_ms_bulk"], 50) * (1024 * MiB / total)
    out["samples"] = res
    out["bytes_per_op"] = total
    out["block_bytes"] = bsize
    out["blocks"] = nblocks
    out["store_counters"] = stats.counters
    # Which same-host put path ran (CommitPut into reserved slots, or PutShm's two copies):
    # a put the store would not reserve falls back to PutShm with no error, so say it here.
    out["put_shm_direct_calls"] = stats.counters.get("puts_direct", 0)
    out["put_shm_copied_calls"] = stats.counters.get("puts_shm_copied", 0)
    return out


_RAW_METHOD = "/kvmesh.bench.Raw/Stream"


def _raw_server(port: Any, nmsgs: int, msg_bytes: int, ready: Any) -> None:
    """A pass-through gRPC stream of pre-built messages: the transport's own ceiling. Binds
    port 0 and hands the port it got back in ``port`` (a shared int) before ``ready``."""
    import grpc

    tune_malloc()
    msgs = [os.urandom(msg_bytes) for _ in range(nmsgs)]

    async def handler(_req: bytes, _ctx: Any) -> Any:
        for m in msgs:
            yield m

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 * MiB)])
        h = grpc.unary_stream_rpc_method_handler(handler, request_deserializer=bytes, response_serializer=bytes)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kvmesh.bench.Raw", {"Stream": h}),))
        port.value = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(main())


def grpc_ceiling_gbps(total: int, msg_bytes: int, repeats: int) -> list[float]:
    """Loopback GB/s of a raw gRPC stream (no protobuf, no store) between two processes."""
    import multiprocessing as mp

    import grpc

    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    port = ctx.Value("i", 0)
    n = max(1, total // msg_bytes)
    proc = ctx.Process(target=_raw_server, args=(port, n, msg_bytes, ready), daemon=True)
    proc.start()
    rates: list[float] = []
    try:
        if not ready.wait(60):
            return rates
        with grpc.insecure_channel(f"127.0.0.1:{port.value}",
                                   options=[("grpc.max_receive_message_length", 64 * MiB)]) as ch:
            call = ch.unary_stream(_RAW_METHOD, request_serializer=bytes, response_deserializer=bytes)
            list(call(b""))  # warm-up
            for _ in range(repeats):
                t0 = time.perf_counter()
                got = list(call(b""))
                rates.append(len(got) * msg_bytes / (time.perf_counter() - t0) / 1e9)
                del got
    finally:
        proc.terminate()
        proc.join(10)
    return rates


NT_TUNABLE = "glibc.cpu.x86_non_temporal_threshold=0x100000"
# No `rep movsb` below 2 MiB: on AMD, glibc copies 8 KiB .. L2-sized pieces (the 512 KiB pieces
# of a verified get) with `rep movsb`, ~2x slower here than its vector loop (see module doc).
REP_MOVSB_TUNABLE = "glibc.cpu.x86_rep_movsb_threshold=0x200000"
COPY_TUNABLES = (NT_TUNABLE, REP_MOVSB_TUNABLE)


def _has_copy_tunables() -> bool:
    have = os.environ.get("GLIBC_TUNABLES", "").split(":")
    return all(t in have for t in COPY_TUNABLES)


def _rerun_with_nt_copies(args: argparse.Namespace) -> int:
    """The tunables are read at process start: run this bench in a child that has them."""
    env = dict(os.environ)
    env["GLIBC_TUNABLES"] = ":".join(t for t in (env.get("GLIBC_TUNABLES", ""), *COPY_TUNABLES) if t)
    argv = ["bench", "offload", "--total-mib", str(args.total_mib), "--repeats", str(args.repeats),
            "--layers", str(args.layers), "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim),
            "--dtype", args.dtype, "--block-tokens", str(args.block_tokens), "--nt-copies"]
    if args.json:
        argv += ["--json", args.json]
    if args.address:
        argv += ["--address", args.address]
    argv += ["--tls", args.tls, "--backend", args.backend]
    code = "import sys; from kvmesh_tools.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *argv], env=env, check=False).returncode


SUMMARY_KEYS = ("memcpy_gbps", "get_gbps_shm_trusted", "get_gbps_shm_1thread", "get_shm_1thread_vs_memcpy", "get_shm_verified_vs_trusted", "put_gbps_grpc", "get_gbps_grpc", "get_into_gbps_grpc", "put_gbps_shm",
                "get_gbps_shm", "get_gbps_shm_views", "get_gbps_shm_bytes", "restore_p50_ms_1gib",
                "grpc_raw_stream_gbps", "memcpy_to_shm_gbps", "get_gbps_bulk", "get_grpc_vs_memcpy",
                "get_bulk_vs_memcpy", "get_shm_vs_memcpy", "put_vs_get_shm", "put_gbps_shm_1thread",
                "put_vs_get_shm_1thread", "get_shm_vs_memcpy_medians")


def run(args: argparse.Namespace) -> int:
    if args.nt_copies and not _has_copy_tunables():
        return _rerun_with_nt_copies(args)
    tune_malloc()  # as the offload service does; workers moving big blocks should too
    if args.backend == "mooncake":
        from kvmesh_tools.bench.offload_pool import run_pool_bench

        out = write_json(args.json, {"bench": "offload", "backend": "mooncake", **run_pool_bench(args)})
        print({k: round(out[k], 3) for k in ("get_gbps_bulk", "get_gbps_pool", "get_gbps_pool_staged",
                                             "put_gbps_grpc", "put_gbps_pool", "get_pool_vs_bulk")})
        return 0
    if args.tls != "compare":
        res = _once(args, args.tls)
    else:
        # Both modes in one run, on the same machine state; the TLS-on figures are the result.
        plain = _once(args, "off")
        res = _once(args, "on")
        res["tls_compare"] = {
            "off": {k: plain[k] for k in SUMMARY_KEYS}, "on": {k: res[k] for k in SUMMARY_KEYS},
            "get_shm_vs_memcpy_off": plain["get_shm_vs_memcpy"], "get_shm_vs_memcpy_on": res["get_shm_vs_memcpy"],
            "get_grpc_on_over_off": res["get_gbps_grpc"] / plain["get_gbps_grpc"],
            "get_shm_on_over_off": res["get_gbps_shm"] / plain["get_gbps_shm"]}
    out = write_json(args.json, {"bench": "offload", **res})
    summary = {k: round(out[k], 3) for k in SUMMARY_KEYS}
    print(summary)
    if "tls_compare" in out:
        print({k: round(v, 3) for k, v in out["tls_compare"].items() if isinstance(v, float)})
    return 0


def _once(args: argparse.Namespace, tls_mode: str) -> dict[str, Any]:
    """One full measurement with the store and this client in plaintext (``off``) or mTLS (``on``)."""
    from kvmesh.rpc import tls
    from kvmesh_tools.stack.certs import CertAuthority

    total = args.total_mib * MiB
    memcpy = Memcpy(total)
    memcpy.sample()
    proc = None
    tmp = tempfile.TemporaryDirectory(prefix="kvmesh-offload-bench-")
    address = args.address
    client_tls, server_flags = tls.plaintext(), []
    if tls_mode == "on":
        ca = CertAuthority(Path(tmp.name) / "certs")
        client_tls = ca.issue("worker", "bench").tls_config()
        server_flags = ca.issue("store", "offload-0").flags()
    saved = tls.default()
    tls.set_default(client_tls, warn=False)   # the offload clients below take the process's identity
    if not address:
        # Started again on fresh ports if its port is taken before it binds (ServiceProcess).
        proc = ServiceProcess.with_ports(
            "offload", lambda port: ["--host", "127.0.0.1", "--port", str(port), "--ram-capacity-bytes",
                                     str(int(total * 1.5) + 64 * MiB), "--eviction-policy", "lru", *server_flags],
            log_path=Path(tmp.name) / "offload.log", tls=client_tls)
        proc.start(timeout_s=60)
        address = proc.grpc_address
    try:
        res = asyncio.run(_bench(address, args, memcpy))
    finally:
        tls.set_default(saved, warn=False)
        if proc is not None:
            proc.stop()
        tmp.cleanup()
    res["tls"] = tls_mode
    raw = grpc_ceiling_gbps(total, res["block_bytes"], args.repeats)
    res["grpc_raw_stream_gbps"] = median(raw)
    res["samples"]["grpc_raw_stream_gbps"] = raw
    memcpy.sample()
    memcpy.close()
    base = median(memcpy.rates)
    res["memcpy_gbps"] = base
    res["samples"]["memcpy_gbps"] = memcpy.rates
    res["memcpy_to_shm_gbps"] = median(memcpy.shm_rates)
    res["samples"]["memcpy_to_shm_gbps"] = memcpy.shm_rates
    res["get_shm_vs_memcpy_to_shm"] = res["get_gbps_shm"] / res["memcpy_to_shm_gbps"]
    res["get_grpc_vs_memcpy"] = res["get_gbps_grpc"] / base
    res["get_bulk_vs_memcpy"] = res["get_gbps_bulk"] / base
    # The target: median over repeats of the get against the memcpy copied right before and
    # after it. The ratio of the two medians (``_medians``) mixes moments: on this shared VM one
    # 1 GiB memcpy ranged 4.6-16 GB/s within a run, so it swung with when the baseline was sampled.
    res["get_shm_vs_memcpy"] = res["get_shm_vs_memcpy_paired"]
    res["get_shm_vs_memcpy_medians"] = res["get_gbps_shm"] / base
    res["get_shm_trusted_vs_memcpy"] = res["get_gbps_shm_trusted"] / base
    res["get_shm_verified_vs_trusted"] = res["get_gbps_shm"] / res["get_gbps_shm_trusted"]
    res["get_shm_1thread_vs_memcpy"] = res["get_gbps_shm_1thread"] / base
    res["copy_threads"] = copy_threads()
    res["grpc_raw_vs_memcpy"] = res["grpc_raw_stream_gbps"] / base
    # Same run: the shm put (zero-copy ReservePut/CommitPut) against the shm get, both on the
    # copy threads, and both on the calling thread alone.
    res["put_vs_get_shm"] = res["put_gbps_shm"] / res["get_gbps_shm"]
    res["put_vs_get_shm_1thread"] = res["put_gbps_shm_1thread"] / res["get_gbps_shm_1thread"]
    res["put_shm_threads_vs_1thread"] = res["put_gbps_shm"] / res["put_gbps_shm_1thread"]
    res["targets"] = {"get_grpc_vs_memcpy_min": 0.25, "get_shm_vs_memcpy_min": 0.70, "put_vs_get_shm_min": 0.8,
                      "get_grpc_met": res["get_grpc_vs_memcpy"] >= 0.25,
                      "get_shm_met": res["get_shm_vs_memcpy"] >= 0.70,
                      "put_vs_get_shm_met": res["put_vs_get_shm"] >= 0.8}
    res["repeats"] = args.repeats
    res["warmup_repeats"] = 1
    res["glibc_tunables"] = os.environ.get("GLIBC_TUNABLES", "")
    res["load_avg_1m"] = os.getloadavg()[0]
    return res
