"""Disk tier: spill under RAM, checksums on every read, survival across a store restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvmesh.kvstore.client import OffloadClient, SyncOffloadClient
from kvmesh_api.common.v1 import common_pb2

pytestmark = pytest.mark.timeout(90)
NS = "tiny-llama/L2-H2-D32-bf16-bs32"
BS = 32 * 1024


def chain(n: int, seed: int) -> list[tuple[int, bytes]]:
    return [(seed * 1000 + i, os.urandom(BS)) for i in range(n)]


async def test_spill_to_disk_and_promote_back(offload_factory, tmp_path: Path) -> None:
    st = await offload_factory(ram_capacity_bytes=4 * BS, disk_path=str(tmp_path / "d"),
                               disk_capacity_bytes=64 * BS, eviction_policy="lru")
    async with OffloadClient(st.address, use_shm=False) as c:
        a, b = chain(4, 1), chain(4, 2)
        await c.put(NS, a)
        await c.put(NS, b)                        # pushes all of a down to disk
        stats = await c.stats()
        assert stats.ram_blocks == 4 and stats.disk_blocks == 4 and stats.counters["blocks_spilled"] == 4
        assert await c.contains(NS, [k for k, _ in a]) == 4
        lease = await c.fetch(NS, [k for k, _ in a])
        assert lease.tiers == [common_pb2.TIER_DISK] * 4
        assert [bytes(v) for v in lease.views] == [d for _, d in a]
        lease.release()
        # promoted: the next read is served from RAM
        lease = await c.fetch(NS, [k for k, _ in a])
        assert lease.tiers == [common_pb2.TIER_CPU] * 4
        lease.release()
        assert (await c.stats()).counters["hits_disk"] == 4


def test_disk_survives_restart_and_corrupt_block_is_a_miss(offload_process, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    flags = ["--ram-capacity-bytes", str(2 * BS), "--disk-path", str(disk), "--disk-capacity-bytes", str(64 * BS)]
    proc = offload_process(*flags)
    a, b = chain(6, 1), chain(2, 2)
    with SyncOffloadClient(proc.grpc_address, use_shm=False) as c:
        for i in range(0, 6, 2):
            c.put(NS, a[i:i + 2], parent=a[i - 1][0] if i else None)
        c.put(NS, b)                              # a is entirely on disk now
        assert c.stats().disk_blocks == 6
    proc.stop()
    proc = offload_process(*flags)
    with SyncOffloadClient(proc.grpc_address, use_shm=True) as c:
        stats = c.stats()
        assert stats.disk_blocks == 6 and stats.ram_blocks == 0      # b was only in RAM
        assert c.contains(NS, [k for k, _ in a]) == 6
        assert c.contains(NS, [k for k, _ in b]) == 0
        # flip one byte in the data of block 3 of a (files are tail-data; the header has its own checksum)
        victim = next(p for p in disk.rglob("*.kvb") if p.stem == f"{a[3][0]:016x}")
        raw = bytearray(victim.read_bytes())
        raw[-10] ^= 0xFF
        victim.write_bytes(bytes(raw))
        got = c.get(NS, [k for k, _ in a])
        assert got == [d for _, d in a[:3]]                            # never bad data
        assert c.contains(NS, [k for k, _ in a]) == 3                  # and it is gone
        assert c.stats().counters["disk_corrupt_blocks"] == 1


def test_torn_header_and_leftover_temp_files_are_dropped_at_start(offload_process, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    flags = ["--ram-capacity-bytes", str(2 * BS), "--disk-path", str(disk), "--disk-capacity-bytes", str(64 * BS)]
    proc = offload_process(*flags)
    a = chain(4, 5)
    with SyncOffloadClient(proc.grpc_address, use_shm=False) as c:
        c.put(NS, a[:2])
        c.put(NS, a[2:])
        c.put(NS, chain(2, 6))                                          # a[2:] spills to disk too
    proc.stop()
    first = next(p for p in disk.rglob("*.kvb") if p.stem == f"{a[1][0]:016x}")
    first.write_bytes(first.read_bytes()[:20])                          # torn write of an older format
    # A file of format version 1 (CRC32C checksums): its checksums cannot be checked, so it is dropped.
    old = next(p for p in disk.rglob("*.kvb") if p.stem == f"{a[3][0]:016x}")
    raw = bytearray(old.read_bytes())
    raw[4] = 1
    old.write_bytes(bytes(raw))
    (disk / "tmp" / "dead.part").write_bytes(b"half a block")
    proc = offload_process(*flags)
    with SyncOffloadClient(proc.grpc_address, use_shm=False) as c:
        assert c.contains(NS, [a[0][0]]) == 1
        assert c.contains(NS, [a[1][0]]) == 0
        assert c.contains(NS, [a[2][0]]) == 1
        assert c.contains(NS, [a[3][0]]) == 0
        assert c.stats().counters["disk_corrupt_blocks"] == 2
    assert not (disk / "tmp" / "dead.part").exists()


def test_client_process_dying_mid_put_leaves_nothing(offload_process, tmp_path: Path) -> None:
    proc = offload_process("--ram-capacity-bytes", str(64 << 20))
    marker = tmp_path / "sent"
    script = textwrap.dedent(f"""
        import time, grpc
        from kvmesh_api.offload.v1 import offload_pb2 as pb, offload_pb2_grpc as rpc
        def stream():
            yield pb.PutRequest(header=pb.PutHeader(namespace={NS!r}))
            yield pb.PutRequest(chunk=pb.BlockChunk(key=1, data=b"a" * 100000, last=True))
            yield pb.PutRequest(chunk=pb.BlockChunk(key=2, data=b"b" * 100000))
            open({str(marker)!r}, "w").close()
            time.sleep(60)
        ch = grpc.insecure_channel({proc.grpc_address!r})
        rpc.OffloadStub(ch).Put(stream())
    """)
    child = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        for _ in range(200):
            if marker.exists():
                break
            import time
            time.sleep(0.05)
        assert marker.exists(), "client never started streaming"
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(5)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
    with SyncOffloadClient(proc.grpc_address, use_shm=False) as c:
        assert c.contains(NS, [1, 2]) == 0
        assert c.stats().ram_blocks == 0
    assert proc.alive()


def test_prometheus_metrics(offload_process, tmp_path: Path) -> None:
    import urllib.request

    proc = offload_process("--ram-capacity-bytes", str(2 * BS), "--disk-path", str(tmp_path / "m"),
                           port_flags=("--metrics-port",))
    mport = proc.flag_port("--metrics-port")
    a, b = chain(2, 7), chain(2, 8)
    with SyncOffloadClient(proc.grpc_address, use_shm=True) as c:
        c.put(NS, a)
        c.put(NS, b)
        assert len(c.get(NS, [k for k, _ in a] + [424242])) == 2      # from disk, then a miss
    text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()

    def value(prefix: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(prefix))
        return float(line.rsplit(" ", 1)[1])

    assert value('kvmesh_offload_bytes_stored_total{tier="cpu"}') == 4 * BS
    assert value('kvmesh_offload_bytes_stored_total{tier="disk"}') >= 2 * BS
    assert value('kvmesh_offload_hits_total{tier="disk"}') == 2
    assert value("kvmesh_offload_misses_total") == 1
    assert value('kvmesh_offload_evictions_total{tier="cpu"}') >= 2
    assert value('kvmesh_offload_restore_latency_seconds_count{path="shm"}') == 1
    assert value('kvmesh_offload_tier_capacity_bytes{tier="cpu"}') == 2 * BS
