"""The offload store over a real Mooncake Store pool (``--byte-pool mooncake``).

A real ``mooncake_master`` on loopback (no etcd), the offload service in this process
(real gRPC on port 0, joined to the pool, lending it the store's budget) and two
"hosts": child processes, each its own Mooncake client moving bytes straight to and
from the pool. The store keeps kvmesh's semantics on top: namespaces, chains and
leading hits, block checksums, its eviction (mirrored into the pool) and its KV events.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mooncake.store", reason="needs kvmesh[mooncake] (make install-mooncake)")

from kvmesh.kvstore.client import InvalidOffloadRequest, OffloadError, SyncOffloadClient  # noqa: E402
from kvmesh.kvstore.mooncake.client import MooncakeStoreClient  # noqa: E402
from kvmesh.kvstore.mooncake.pool import PoolConfig  # noqa: E402
from kvmesh_api.offload.v1 import offload_pb2, offload_pb2_grpc  # noqa: E402
from kvmesh_tools.testing.mooncake import MooncakeMaster, master_binary  # noqa: E402

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120),
              pytest.mark.skipif(master_binary() is None, reason="mooncake_master not installed")]

NS = "model-x/L2-H1-D64-bf16-B16"
BLOCK = 256 * 1024

# One "host": its own process and Mooncake client. Commands in, JSON answers out, one line each.
HOST = r'''
import hashlib, json, sys
import numpy as np
from kvmesh.kvstore.mooncake.client import MooncakeStoreClient

def payload(key, size):
    return np.random.default_rng(key).integers(0, 256, size, dtype=np.uint8)

c = MooncakeStoreClient(sys.argv[1], timeout_s=30)
dst = np.zeros(64 << 20, dtype=np.uint8)
registered = False
print("READY", flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    op = cmd["op"]
    try:
        if op == "put":
            blocks = [(k, payload(k, cmd["size"]).tobytes()) for k in cmd["keys"]]
            r = c.put(cmd["ns"], blocks, parent=cmd.get("parent"), token_ids=[[k % 1000] * 4 for k in cmd["keys"]],
                      block_size=4)
            out = {"stored": r.stored, "already": r.already_present}
        elif op == "contains":
            out = {"n": c.contains(cmd["ns"], cmd["keys"])}
        elif op == "get_into":
            if cmd.get("register") and not registered:
                c.register(dst)
                registered = True
            size = cmd["size"]
            dests = [dst[i * size:(i + 1) * size] for i in range(len(cmd["keys"]))]
            n = c.get_into(cmd["ns"], cmd["keys"], dests)
            out = {"n": n, "sha": [hashlib.sha256(d).hexdigest() for d in dests[:n]]}
        elif op == "fetch":
            with c.fetch(cmd["ns"], cmd["keys"]) as lease:
                out = {"n": len(lease.views), "sha": [hashlib.sha256(v).hexdigest() for v in lease.views]}
        else:
            break
    except Exception as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    print("ANS " + json.dumps(out), flush=True)
c.close()
'''


def sha(key: int, size: int = BLOCK) -> str:
    return hashlib.sha256(np.random.default_rng(key).integers(0, 256, size, dtype=np.uint8)).hexdigest()


class Host:
    def __init__(self, address: str, log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-c", HOST, address], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=open(log, "ab"), text=True)  # noqa: SIM115
        assert self.proc.stdout.readline().strip() == "READY", log.read_text()[-2000:]

    async def __call__(self, op: str, **kw: object) -> dict:
        # Off the event loop: the store under test serves on it.
        return await asyncio.to_thread(self.call, op, **kw)

    def call(self, op: str, **kw: object) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            assert line, "host exited: " + self.log.read_text(errors="replace")[-3000:]
            if line.startswith("ANS "):
                return json.loads(line[4:])

    def close(self) -> None:
        """Ask it to leave the pool (Mooncake's close takes a second or two); ``wait`` for it."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def wait(self) -> None:
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture
def master():
    # Short read leases: the store's removals of blocks just read wait for them to end.
    m = MooncakeMaster(extra_args=["--default_kv_lease_ttl=2000"]).start()
    yield m
    m.stop()


@pytest.fixture
async def pooled(master, offload_factory):
    """``await start(blocks=N, **overrides)``: a pooled store with a budget of N blocks, and its events."""
    async def start(blocks: int = 64, **overrides: object):
        events: list = []
        st = await offload_factory(event_sink=events.extend, byte_pool="mooncake", ram_capacity_bytes=blocks * BLOCK,
                                   mooncake=PoolConfig(master=master.address, segment_bytes=-1,
                                                       buffer_bytes=16 << 20), **overrides)
        return st, events
    return start


@pytest.fixture
def hosts(tmp_path):
    started: list[Host] = []

    def start(address: str, n: int = 2) -> list[Host]:
        for i in range(n):
            started.append(Host(address, tmp_path / f"host{i}.log"))
        return started[-n:]
    yield start
    for h in started:   # all leave at once
        h.close()
    for h in started:
        h.wait()


def wait_for(cond, timeout_s: float = 20.0, what: str = "condition") -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


async def test_two_hosts_share_a_chain_through_the_pool(pooled, hosts) -> None:
    st, events = await pooled()
    a, b = hosts(st.address)
    keys = [101, 102, 103, 104, 105, 106]
    assert await a("put", ns=NS, keys=keys[:4], size=BLOCK) == {"stored": 4, "already": 0}
    # The chain continues on the other host: the store links it to its parent.
    assert await b("put", ns=NS, keys=keys[4:], size=BLOCK, parent=104) == {"stored": 2, "already": 0}
    assert await b("put", ns=NS, keys=keys[:2], size=BLOCK) == {"stored": 0, "already": 2}
    for host in (a, b):
        assert (await host("contains", ns=NS, keys=keys))["n"] == 6
        assert (await host("contains", ns=NS, keys=[*keys[:3], 999, *keys[3:]]))["n"] == 3   # leading hits only
        assert (await host("contains", ns=NS + "-other", keys=keys))["n"] == 0               # namespaces apart
    want = [sha(k) for k in keys]
    assert await b("get_into", ns=NS, keys=keys, size=BLOCK, register=True) == {"n": 6, "sha": want}
    assert await a("get_into", ns=NS, keys=keys, size=BLOCK) == {"n": 6, "sha": want}      # staged copy
    assert await a("fetch", ns=NS, keys=[*keys[:2], 999, keys[2]]) == {"n": 2, "sha": want[:2]}
    # The indexer sees the tier: stored events, chained to their parents, medium CPU.
    stored = [e for e in events if e.kind == "stored"]
    assert [k for e in stored for k in e.keys] == keys
    assert stored[0].parent is None and stored[-1].parent == 104 and {e.medium for e in stored} == {"CPU"}
    assert stored[0].token_ids[:4] == [101] * 4


async def test_the_store_evicts_and_the_pool_follows(pooled, hosts) -> None:
    st, events = await pooled(blocks=6, eviction_policy="agent")
    (a,) = hosts(st.address, 1)
    pool = st.servicer.pool
    first, second = [201, 202, 203, 204], [301, 302, 303, 304]
    await a("put", ns=NS, keys=first, size=BLOCK)
    await a("put", ns=NS, keys=second, size=BLOCK)
    removed = [k for e in events if e.kind == "removed" for k in e.keys]
    assert len(removed) == 2 and set(removed) <= set(first)
    # Chain-aware: the store drops a chain's tail first, so the survivors are still a leading run.
    kept = (await a("contains", ns=NS, keys=first))["n"]
    assert kept == 2 and set(removed) == set(first[kept:])
    objs = [pool.key(NS, k) for k in first + second]
    wait_for(lambda: pool.pending() == 0, what="the janitor's removals")
    present = dict(zip(first + second, pool.pool.exists(objs), strict=True))
    assert all(present[k] == (0 if k in removed else 1) for k in first + second), present
    assert (await a("get_into", ns=NS, keys=first, size=BLOCK))["n"] == 2


async def test_a_block_lost_by_the_pool_is_a_short_read_and_leaves_the_index(pooled, hosts) -> None:
    st, events = await pooled()
    (a,) = hosts(st.address, 1)
    keys = [401, 402, 403, 404]
    await a("put", ns=NS, keys=keys, size=BLOCK)
    pool = st.servicer.pool
    assert pool.pool.remove([pool.key(NS, 403)], force=True) == [0]       # Mooncake dropped it behind the store's back
    got = await a("get_into", ns=NS, keys=keys, size=BLOCK, register=True)
    assert got == {"n": 2, "sha": [sha(401), sha(402)]}
    assert (await a("contains", ns=NS, keys=keys))["n"] == 2
    assert {k for e in events if e.kind == "removed" for k in e.keys} == {403, 404}


async def test_damaged_bytes_fail_the_checksum(pooled, hosts) -> None:
    st, _ = await pooled()
    (a,) = hosts(st.address, 1)
    await a("put", ns=NS, keys=[501, 502], size=BLOCK)
    pool = st.servicer.pool
    obj = pool.key(NS, 502)
    assert pool.pool.remove([obj], force=True) == [0]
    assert pool.pool.put_bytes(obj, b"\0" * BLOCK) == 0          # same size, other bytes
    for op in ("get_into", "fetch"):
        got = await a(op, ns=NS, keys=[501, 502], size=BLOCK)
        assert got["error"] == "OffloadError" and "checksum mismatch" in got["message"]


async def test_bad_requests_get_clear_errors(pooled, offload_factory) -> None:
    st, events = await pooled()
    local = await offload_factory()
    # Blocking clients: off the event loop the stores serve on.
    await asyncio.to_thread(_bad_requests, st.address, local.address)
    assert not [e for e in events if e.kind == "stored"]


def _bad_requests(address: str, local_address: str) -> None:
    c = MooncakeStoreClient(address, timeout_s=10)
    plain = SyncOffloadClient(address, use_shm=False, use_bulk=False, timeout_s=10)
    try:
        stub = offload_pb2_grpc.OffloadStub(c._channel)
        hdr = offload_pb2.PutHeader(namespace=NS)
        # A commit of blocks nobody wrote to the pool changes nothing.
        with pytest.raises(InvalidOffloadRequest, match="not in the pool"):
            c._call(stub.PutShm, offload_pb2.ShmRequest(header=hdr, keys=[7], sizes=[BLOCK], checksums=[1]), "put")
        for bad, msg in ((offload_pb2.ShmRequest(header=hdr, segment="x", keys=[7], sizes=[BLOCK], checksums=[1]),
                          "takes no segment"),
                         (offload_pb2.ShmRequest(header=hdr, keys=[7, 8], sizes=[BLOCK], checksums=[1]), "same length"),
                         (offload_pb2.ShmRequest(header=hdr, keys=[7], sizes=[0], checksums=[1]), "outside")):
            with pytest.raises(InvalidOffloadRequest, match=msg):
                c._call(stub.PutShm, bad, "put")
        assert c.contains(NS, [7]) == 0
        # The kvmesh byte paths say where the bytes are instead of failing obscurely.
        with pytest.raises(OffloadError, match="Mooncake pool"):
            plain.put(NS, [(7, b"x" * 100)])
        with pytest.raises(OffloadError, match="Mooncake pool"):
            plain.get(NS, [7])
        with pytest.raises(InvalidOffloadRequest):
            c.put(NS, [(7, b"")])
        with pytest.raises(InvalidOffloadRequest):
            c.get_into(NS, [1 << 64], [bytearray(8)])
        # A pool client against a store that keeps its own bytes.
        with MooncakeStoreClient(local_address, timeout_s=10) as lc, pytest.raises(OffloadError, match="keeps its"):
            lc.put(NS, [(7, b"x" * 100)])
    finally:
        c.close()
        plain.close()


def test_pool_config_is_validated() -> None:
    from kvmesh.config import ConfigError
    from kvmesh_offload.config import OffloadConfig

    for cfg, msg in ((OffloadConfig(byte_pool="mooncake"), "mooncake-master"),
                     (OffloadConfig(byte_pool="mooncake", mooncake=PoolConfig(master="h:1"), disk_path="/tmp/x"),
                      "no disk tier"),
                     (OffloadConfig(byte_pool="nope"), "unknown")):
        with pytest.raises(ConfigError, match=msg):
            cfg.validate()


def test_pooled_replay_keeps_the_store_hit_rate(master) -> None:
    """The pool loses no block the store still indexes: the same hits, eviction for eviction."""
    from kvmesh_tools.bench.offload_policy_pool import replay_pooled, replay_store
    from kvmesh_tools.policysim import TraceRequest

    rng = np.random.default_rng(7)
    reqs = []
    for i in range(60):   # 6 sessions whose chains grow turn by turn, plus shared system prompts
        s = i % 6
        turn = i // 6
        reqs.append(TraceRequest(float(i), "ns", f"s{s}", [1000 + j for j in range(8)] +
                                 [s * 100_000 + j for j in range(10 * (turn + 1))] +
                                 [int(x) for x in rng.integers(10**9, 2 * 10**9, 3)]))
    store = replay_store(reqs, "agent", 120)
    pool = replay_pooled(reqs, "agent", 120, master.address, "test")
    assert store.evictions > 0 and pool.holes == 0
    assert (pool.hits, pool.total, pool.evictions) == (store.hits, store.total, store.evictions)
