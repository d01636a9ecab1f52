"""Event-plane attacks of issue #20: index poisoning by forged sequence numbers and clears
(attack 6, event side), and memory exhaustion by an event flood (attack 7, indexer side).

The flood runs against a real indexer process fed by a ZMQ publisher this test controls,
as a hostile engine (or anyone who can reach a bound subscriber) would.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import grpc
import pytest
import zmq
import zmq.asyncio

from kvmesh.events.codec import AllBlocksCleared, BlockStored, KVEventBatch, encode_batch
from kvmesh.index.memory import MemoryIndex
from kvmesh_api.indexer.v1 import indexer_pb2, indexer_pb2_grpc
from kvmesh_indexer.ingest import Ingestor
from kvmesh_indexer.keys import ModelSpec
from kvmesh_tools.testing.procs import ServiceProcess

pytestmark = pytest.mark.timeout(180)

BS = 16
M = "m"
SPEC = ModelSpec(M, BS, "sha256_cbor")
KEYS = SPEC.hasher().block_keys(list(range(BS * 10)))


def store(i: int, j: int) -> BlockStored:
    return BlockStored(block_hashes=KEYS[i:j], parent_block_hash=KEYS[i - 1] if i else None,
                       token_ids=list(range(i * BS, j * BS)), block_size=BS, medium="GPU")


def batch(*events) -> KVEventBatch:  # noqa: ANN002
    return KVEventBatch(0.0, list(events))


def test_absurd_sequence_jump_changes_nothing() -> None:
    idx = MemoryIndex()
    ing = Ingestor(idx, {M: SPEC})
    ing.process("e", M, 0, batch(store(0, 4)))
    res = ing.process("e", M, 10**12, batch(AllBlocksCleared(), store(4, 5)))   # forged, no replay to ask
    assert not res.accepted and idx.endpoint_blocks("e") == 4 and ing.endpoints["e"].last_seq == 0
    ing.process("e", M, 1, batch(store(4, 6)))                                 # the engine goes on
    assert idx.endpoint_blocks("e") == 6 and ing.endpoints["e"].counters["rejected_implausible_seq"] == 2
    # A real jump (a long outage) continues: three batches in a row are believed.
    for s in (5_000_000, 5_000_001, 5_000_002):
        ing.process("e", M, s, batch(store(7, 8)))
    assert ing.endpoints["e"].last_seq == 5_000_002


def test_forged_reset_and_clear_are_checked_against_the_engines_replay_buffer() -> None:
    idx = MemoryIndex()
    ing = Ingestor(idx, {M: SPEC})
    engine = {0: batch(store(0, 4)), 1: batch(store(4, 6))}   # what the engine really published

    def replay(start: int) -> list[tuple[int, KVEventBatch]]:
        return [(s, b) for s, b in sorted(engine.items()) if s >= start]

    for s in (0, 1):
        ing.process("e", M, s, engine[s], replay=replay)
    # Forged: a "restart" at seq 0, an AllBlocksCleared in sequence, a jump to 10^12.
    for seq, forged in ((0, batch(AllBlocksCleared())), (2, batch(AllBlocksCleared())),
                        (10**12, batch(store(0, 1)))):
        res = ing.process("e", M, seq, forged, replay=replay)
        assert not res.accepted, seq
    assert idx.endpoint_blocks("e") == 6 and ing.endpoints["e"].last_seq == 1
    assert ing.endpoints["e"].counters["rejected_forged_seq"] == 3
    # The engine's own clear is in its buffer: applied.
    engine[2] = batch(AllBlocksCleared(), store(0, 1))
    assert ing.process("e", M, 2, engine[2], replay=replay).accepted
    assert idx.endpoint_blocks("e") == 1


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _tree_rss_kib(pid: int) -> int:
    """RSS of the process and its children (``kvmesh serve`` may exec through a wrapper)."""
    total = _rss_kib(pid)
    for child in Path(f"/proc/{pid}/task").glob("*/children"):
        for c in child.read_text().split():
            try:
                total += _tree_rss_kib(int(c))
            except (FileNotFoundError, AssertionError):
                pass
    return total


def test_event_flood_keeps_indexer_memory_bounded(tmp_path: Path) -> None:
    indexer = ServiceProcess.with_ports(
        "indexer", lambda port: ["--host", "127.0.0.1", "--port", str(port), "--models", f"{M}@{BS}@sha256_cbor",
                                 "--default-model", M], log_path=tmp_path / "indexer.log").start(timeout_s=60)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    pub.bind("tcp://127.0.0.1:0")
    addr = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        with grpc.insecure_channel(indexer.grpc_address) as ch:
            stub = indexer_pb2_grpc.IndexerStub(ch)
            stub.RegisterEndpoint(indexer_pb2.RegisterEndpointRequest(
                endpoint=indexer_pb2.Endpoint(endpoint_id="e0", model=M, grpc_address="127.0.0.1:1",
                                              kv_events_endpoint=addr), ttl_s=600), timeout=10)
            time.sleep(0.5)   # the SUB socket connects
            topic = b"kv@e0@" + M.encode()
            seq = 0

            def send(payload: bytes) -> None:
                nonlocal seq
                pub.send_multipart([topic, seq.to_bytes(8, "big"), payload], copy=False)
                seq += 1

            send(encode_batch(batch(store(0, 2))))
            deadline = time.monotonic() + 10
            while stub.Stats(indexer_pb2.StatsRequest(), timeout=5).entries < 2:
                assert time.monotonic() < deadline, "the first batch never arrived"
                time.sleep(0.05)
            idle = _tree_rss_kib(indexer.proc.pid)
            peak = [idle]
            stop = threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], _tree_rss_kib(indexer.proc.pid))
                    time.sleep(0.02)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            try:
                big = os.urandom(12 << 20)     # over the 8 MiB message limit: ZMQ disconnects the sender
                for _ in range(150):
                    send(big)
                # ZMQ dropped the connection (and what it had queued); wait until it is back.
                deadline = time.monotonic() + 30
                while stub.Stats(indexer_pb2.StatsRequest(), timeout=5).counters.get("batches", 0) < 2:
                    assert time.monotonic() < deadline, "the subscriber never reconnected"
                    send(encode_batch(batch(store(2, 3))))
                    time.sleep(0.2)
                mid = os.urandom(3 << 20)      # under it: the byte-bounded queue drops the excess
                for _ in range(150):
                    send(mid)
                time.sleep(3.0)
            finally:
                stop.set()
                sampler.join()
            print(f"indexer RSS idle {idle // 1024} MiB, peak during the flood {peak[0] // 1024} MiB")
            assert peak[0] < 2 * idle, f"indexer RSS {peak[0] // 1024} MiB vs idle {idle // 1024} MiB"
            # Still serving, and the endpoint still ingests in order afterwards.
            deadline = time.monotonic() + 20
            counters: dict = {}
            while time.monotonic() < deadline:
                counters = dict(stub.Stats(indexer_pb2.StatsRequest(), timeout=5).counters)
                if counters.get("dropped", 0) > 0:
                    break
                time.sleep(0.1)
            assert counters.get("dropped", 0) > 0, counters   # the excess was dropped and counted
            assert indexer.alive()
    finally:
        pub.close(linger=0)
        ctx.term()
        indexer.stop(grace_s=3)


async def test_largest_sequence_number_keeps_lookups_answering(start_indexer) -> None:
    """Found by the fuzzer: seq 2^64-1 made Lookup's applied-batch count overflow (UNKNOWN)."""
    from kvmesh.events.codec import encode_batch as enc

    ix = await start_indexer(models=f"{M}@{BS}@sha256_cbor", default_model=M)
    req = indexer_pb2.IngestEventsRequest(endpoint_id="e9", model=M, seq=(1 << 64) - 1,
                                          vllm_payload=enc(batch(store(0, 2))))
    resp = await ix.stub.IngestEvents(iter([req]), timeout=5)
    assert resp.batches_accepted == 1
    got = await ix.stub.Lookup(indexer_pb2.LookupRequest(model=M, chain=indexer_pb2.BlockChain(keys=KEYS[:2])),
                               timeout=5)
    assert [m.endpoint_id for m in got.matches] == ["e9"]


async def test_plaintext_takeover_of_a_live_endpoint_is_refused(start_indexer) -> None:
    """Attack 1 without mTLS: a live endpoint moves only from the host that registered it."""
    ix = await start_indexer(models=f"{M}@{BS}@sha256_cbor", default_model=M)

    def reg(addr: str) -> indexer_pb2.RegisterEndpointRequest:
        return indexer_pb2.RegisterEndpointRequest(
            endpoint=indexer_pb2.Endpoint(endpoint_id="w0", model=M, grpc_address=addr), ttl_s=60)

    await ix.stub.RegisterEndpoint(reg("10.9.9.9:50051"), timeout=5)
    ix.app.servicer.registrars["w0"] = "10.9.9.9"   # as if it had registered from its own host
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ix.stub.RegisterEndpoint(reg("127.0.0.1:6666"), timeout=5)   # the attacker's address
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    eps = await ix.stub.ListEndpoints(indexer_pb2.ListEndpointsRequest(), timeout=5)
    assert [e.endpoint.grpc_address for e in eps.endpoints if e.endpoint.endpoint_id == "w0"] == ["10.9.9.9:50051"]
    await ix.stub.RegisterEndpoint(reg("10.9.9.9:50051"), timeout=5)       # same addresses: a refresh
    await ix.stub.DeregisterEndpoint(indexer_pb2.DeregisterEndpointRequest(endpoint_id="w0"), timeout=5)
    await ix.stub.RegisterEndpoint(reg("127.0.0.1:6666"), timeout=5)       # free again once gone


_FLOODER = """
import os, sys, time, zmq
ctx = zmq.Context()
pub = ctx.socket(zmq.XPUB)              # a PUB that sees the subscription arrive
pub.setsockopt(zmq.SNDHWM, 100_000)
pub.bind("tcp://127.0.0.1:0")
print(pub.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
assert pub.recv()[:1] == b"\x01"         # the indexer's SUB subscribed: the flood reaches it
print("subscribed", flush=True)
sys.stdin.readline()
mid = os.urandom(3 << 20)
for i in range(150):
    pub.send_multipart([b"kv@e0@m", i.to_bytes(8, "big"), mid], copy=False)
print("sent", flush=True)
sys.stdin.readline()
"""


async def test_a_stalled_subscriber_leaves_a_flood_with_the_publisher() -> None:
    """ZMQ's pipe in front of the byte-bounded queue is bounded in bytes too.

    The indexer's loop is blocked (as on a starved machine, where CI saw the flood test's peak
    reach 2.4x idle) while a publisher in another process sends 150 x 3 MiB: libzmq's I/O thread
    keeps reading only up to the receive mark derived from ``socket_buffer_bytes``, so this
    process grows by a few messages, not by the flood (~450 MiB at the old 100,000-message mark).
    """
    import subprocess
    import sys

    from kvmesh_indexer.pump import EndpointSource, IngestPump
    from kvmesh_indexer.zmq_subscriber import ZmqSubscriber

    pump = IngestPump(Ingestor(MemoryIndex(), {M: SPEC}), queue_bytes=16 << 20, max_payload_bytes=8 << 20)
    sub = ZmqSubscriber(pump, context=zmq.asyncio.Context(), max_message_bytes=8 << 20)
    assert sub.rcvhwm == 4
    flooder = subprocess.Popen([sys.executable, "-c", _FLOODER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    try:
        addr = flooder.stdout.readline().strip()
        await sub.add(EndpointSource("e0", M), addr)
        # Blocking read: libzmq's own thread connects and subscribes, not this loop.
        assert flooder.stdout.readline().strip() == "subscribed"
        before = _rss_kib(os.getpid())
        flooder.stdin.write("go\n")
        flooder.stdin.flush()
        assert flooder.stdout.readline().strip() == "sent"
        time.sleep(2.0)            # the loop is blocked: nothing reads the socket but libzmq
        grown = (_rss_kib(os.getpid()) - before) // 1024
        assert grown < 64, f"{grown} MiB held for a stalled reader"
    finally:
        flooder.kill()
        await sub.close()
        await pump.close()
