"""The offload store over real loopback gRPC and over shared memory."""

from __future__ import annotations

import os

import grpc
import pytest

from kvmesh.kvstore.client import (
    CHUNK_BYTES,
    InvalidOffloadRequest,
    OffloadClient,
    StoreFull,
    StoreUnavailable,
    SyncOffloadClient,
    block_checksum,
)
from kvmesh.kvstore.limits import session_hint
from kvmesh_api.offload.v1 import offload_pb2, offload_pb2_grpc
from kvmesh_tools.testing.ports import free_port

pytestmark = pytest.mark.timeout(60)
NS = "tiny-llama/L2-H2-D32-bf16-bs32"


def blocks(n: int, size: int, seed: int = 0) -> list[tuple[int, bytes]]:
    return [(1000 * seed + i + 1, os.urandom(size)) for i in range(n)]


@pytest.fixture(params=["grpc", "bulk", "shm"])
def path(request: pytest.FixtureRequest) -> str:
    return request.param


async def test_roundtrip_contains_get_delete_stats(offload_factory, path: str) -> None:
    st = await offload_factory(ram_capacity_bytes=64 << 20)
    async with OffloadClient(st.address, use_shm=path == "shm", use_bulk=path == "bulk") as c:
        data = blocks(3, 64 * 1024) + [(99, os.urandom(CHUNK_BYTES * 2 + 123))]  # one multi-chunk block
        res = await c.put(NS, data, token_ids=[[1, 2]] * 4, parent=7, block_size=2, session_id="s1")
        assert (res.stored, res.already_present, res.via_shm) == (4, 0, path == "shm")
        assert res.bytes == sum(len(d) for _, d in data)
        keys = [k for k, _ in data]
        assert await c.contains(NS, keys) == 4
        assert await c.get(NS, keys) == [d for _, d in data]
        # leading blocks only: a miss in the middle stops the chain
        assert await c.get(NS, [keys[0], 424242, keys[1]]) == [data[0][1]]
        assert await c.contains(NS, [keys[0], 424242, keys[1]]) == 1
        again = await c.put(NS, data[:2])
        assert (again.stored, again.already_present) == (0, 2)
        assert await c.delete(NS, keys[:1]) == 1
        assert await c.contains(NS, keys) == 0
        assert await c.get(NS, keys) == []
        stats = await c.stats()
        assert stats.ram_blocks == 3 and stats.eviction_policy == "agent"
        assert stats.counters["hits_ram"] >= 5 and stats.counters["misses"] >= 1


async def test_wrong_namespace_is_a_miss(offload_factory, path: str) -> None:
    st = await offload_factory(ram_capacity_bytes=8 << 20)
    async with OffloadClient(st.address, use_shm=path == "shm", use_bulk=path == "bulk") as c:
        data = blocks(2, 4096)
        await c.put(NS, data)
        other = NS.replace("bf16", "fp16")
        assert await c.contains(other, [k for k, _ in data]) == 0
        assert await c.get(other, [k for k, _ in data]) == []


async def test_eviction_keeps_budget_and_reports(offload_factory, path: str) -> None:
    st = await offload_factory(ram_capacity_bytes=10 * 4096, eviction_policy="lru")
    async with OffloadClient(st.address, use_shm=path == "shm", use_bulk=path == "bulk") as c:
        first = blocks(6, 4096, seed=1)
        second = blocks(6, 4096, seed=2)
        await c.put(NS, first)
        res = await c.put(NS, second)
        assert res.stored == 6 and res.evicted == 2
        stats = await c.stats()
        assert stats.ram_bytes <= stats.ram_capacity_bytes and stats.ram_blocks == 10
        # the tail of the older chain went first, so its head is still a hit
        assert await c.contains(NS, [k for k, _ in first]) == 4
        assert await c.get(NS, [k for k, _ in second]) == [d for _, d in second]


async def test_store_full_is_resource_exhausted_and_changes_nothing(offload_factory, path: str) -> None:
    st = await offload_factory(ram_capacity_bytes=8 * 4096, evict_on_full=False)
    async with OffloadClient(st.address, use_shm=path == "shm", use_bulk=path == "bulk") as c:
        kept = blocks(6, 4096, seed=1)
        await c.put(NS, kept)
        refused = blocks(3, 4096, seed=2)
        with pytest.raises(StoreFull):
            await c.put(NS, refused)
        assert await c.contains(NS, [k for k, _ in refused]) == 0
        assert await c.get(NS, [k for k, _ in kept]) == [d for _, d in kept]
        # bigger than the whole store: refused even when eviction is allowed
    st2 = await offload_factory(ram_capacity_bytes=4 * 4096)
    async with OffloadClient(st2.address, use_shm=path == "shm", use_bulk=path == "bulk") as c:
        with pytest.raises(StoreFull):
            await c.put(NS, blocks(5, 4096))
        assert (await c.stats()).ram_blocks == 0


async def test_bad_input_gets_clear_errors(offload_factory) -> None:
    st = await offload_factory(ram_capacity_bytes=8 << 20)
    async with OffloadClient(st.address, use_shm=False) as c:
        with pytest.raises(InvalidOffloadRequest, match="namespace"):
            await c.get("", [1])
        with pytest.raises(InvalidOffloadRequest, match="uint64"):
            await c.contains(NS, [-1])
        with pytest.raises(InvalidOffloadRequest, match="max"):
            await c.contains(NS, list(range(70_000)))
        with pytest.raises(InvalidOffloadRequest, match="empty"):
            await c.put(NS, [(1, b"")])
    async with grpc.aio.insecure_channel(st.address) as ch:
        stub = offload_pb2_grpc.OffloadStub(ch)

        async def put(*msgs: offload_pb2.PutRequest) -> grpc.StatusCode:
            try:
                await stub.Put(iter(msgs))
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details()
            return grpc.StatusCode.OK, ""

        hdr = offload_pb2.PutRequest(header=offload_pb2.PutHeader(namespace=NS))
        chunk = offload_pb2.BlockChunk
        code, msg = await put(offload_pb2.PutRequest(chunk=chunk(key=1, data=b"x", last=True)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "header" in msg
        code, msg = await put(hdr, offload_pb2.PutRequest(chunk=chunk(key=1, data=b"abc", last=True, checksum=5)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "checksum" in msg
        code, msg = await put(hdr, offload_pb2.PutRequest(chunk=chunk(key=1, data=b"a")),
                              offload_pb2.PutRequest(chunk=chunk(key=2, data=b"b", last=True)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "out of order" in msg
        code, msg = await put(hdr, offload_pb2.PutRequest(chunk=chunk(key=1, data=b"a")))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "ended inside block" in msg
        code, msg = await put(offload_pb2.PutRequest(header=offload_pb2.PutHeader()))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "namespace" in msg
        # shm: a name outside the kvmesh- prefix is refused as a bad argument (never a file the store opens)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.PutShm(offload_pb2.ShmRequest(header=offload_pb2.PutHeader(namespace=NS),
                                                     segment="../../etc/passwd", keys=[1], offsets=[0], sizes=[4]))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.PutShm(offload_pb2.ShmRequest(header=offload_pb2.PutHeader(namespace=NS),
                                                     segment="kvmesh-x", keys=[1, 2], offsets=[0], sizes=[4]))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # nothing of the refused puts is visible
    assert (await OffloadClient(st.address, use_shm=False).stats()).ram_blocks == 0


async def test_any_session_id_is_a_hint_the_store_takes(offload_factory, path: str) -> None:
    """A session id is the client's choice: one the store's rule refuses (not printable ASCII,
    over 256 characters, a trailing newline) goes as its digest, so the save is not lost; the
    store itself still refuses such an id sent raw."""
    st = await offload_factory(ram_capacity_bytes=8 << 20)
    async with OffloadClient(st.address, use_shm=path == "shm", use_bulk=path == "bulk") as c:
        for i, sid in enumerate(["会话-1", "x" * 300, "s1\n", "plain id"]):
            data = blocks(2, 4096, seed=i + 1)
            res = await c.put(NS, data, session_id=sid)
            assert res.stored == 2, sid
            assert await c.contains(NS, [k for k, _ in data]) == 2
        with pytest.raises(InvalidOffloadRequest, match="namespace"):
            await c.contains(NS + "\n", [1])
    assert session_hint("plain id") == "plain id"
    assert session_hint("会话-1") == session_hint("会话-1") != session_hint("会话-2")
    async with grpc.aio.insecure_channel(st.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await offload_pb2_grpc.OffloadStub(ch).Put(iter([offload_pb2.PutRequest(
                header=offload_pb2.PutHeader(namespace=NS, session_id="s1\n"))]))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in ei.value.details()


async def test_shm_segment_bounds_are_checked(offload_factory) -> None:
    from kvmesh.kvstore.shm import Segment

    st = await offload_factory(ram_capacity_bytes=8 << 20)
    with Segment.create(4096) as seg:
        async with grpc.aio.insecure_channel(st.address) as ch:
            stub = offload_pb2_grpc.OffloadStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.PutShm(offload_pb2.ShmRequest(header=offload_pb2.PutHeader(namespace=NS),
                                                         segment=seg.name, keys=[1], offsets=[seg.size - 10],
                                                         sizes=[100]))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "past the segment" in ei.value.details()
            seg.buf[0:4] = b"abcd"
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.PutShm(offload_pb2.ShmRequest(header=offload_pb2.PutHeader(namespace=NS),
                                                         segment=seg.name, keys=[1], offsets=[0], sizes=[4],
                                                         checksums=[block_checksum(b"abcX")]))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "checksum" in ei.value.details()


async def test_shm_falls_back_to_grpc_when_store_cannot_map(offload_factory) -> None:
    st = await offload_factory(ram_capacity_bytes=8 << 20, shm_enabled=False)
    async with OffloadClient(st.address, use_shm=True) as c:
        data = blocks(2, 10_000)
        res = await c.put(NS, data)
        assert res.stored == 2 and not res.via_shm and not c.shm_enabled
        lease = await c.fetch(NS, [k for k, _ in data])
        assert not lease.via_shm and [bytes(v) for v in lease.views] == [d for _, d in data]
        lease.release()


async def test_shm_get_grows_segment_for_large_chains(offload_factory) -> None:
    st = await offload_factory(ram_capacity_bytes=64 << 20)
    async with OffloadClient(st.address, use_shm=True) as c:
        data = blocks(5, 3 << 20)  # 15 MiB > the first 1 MiB-per-block guess
        await c.put(NS, data)
        async with await c.fetch(NS, [k for k, _ in data]) as lease:
            assert lease.via_shm and [bytes(v) for v in lease.views] == [d for _, d in data]


def test_a_cached_mapping_is_never_closed_under_its_user() -> None:
    """The store maps each client's segment once (``AttachCache``); evicting or replacing a
    mapping that a call is still copying through must wait for that call. Closing it at once
    failed the call: 76 restores and puts of a 30-minute soak ("released memoryview")."""
    from kvmesh.kvstore.shm import AttachCache, Segment

    cache = AttachCache(max_entries=1)
    with Segment.create(4096) as a, Segment.create(4096) as b:
        ma = cache.get(a.name)
        mb = cache.get(b.name)                  # evicts a's mapping: its user still holds it
        assert len(cache) == 1
        ma.buf[0:4] = b"live"                   # raised ValueError when eviction closed it
        assert bytes(a.buf[0:4]) == b"live"
        cache.release(ma)                       # the last user closes it
        with pytest.raises(ValueError):
            ma.buf[0:1] = b"x"
        cache.release(mb)                       # still cached: stays mapped for the next call
        again = cache.get(b.name)
        assert again is mb
        again.buf[0:2] = b"ok"
        cache.release(again)
    cache.close()


async def test_many_clients_share_the_stores_mapping_cache(offload_factory) -> None:
    """More clients' segments than the store's mapping cache holds, all calling at once:
    every shm put and get succeeds (evicted mappings are closed by their last user)."""
    import asyncio

    st = await offload_factory(ram_capacity_bytes=64 << 20)
    clients = [OffloadClient(st.address, use_shm=True) for _ in range(12)]
    try:
        async def run(i: int, c: OffloadClient) -> None:
            for r in range(4):
                data = blocks(3, 64 << 10, seed=100 * i + r)
                res = await c.put(NS, data)
                assert res.stored == 3 and res.via_shm
                async with await c.fetch(NS, [k for k, _ in data]) as lease:
                    assert lease.via_shm and [bytes(v) for v in lease.views] == [d for _, d in data]

        await asyncio.gather(*(run(i, c) for i, c in enumerate(clients)))
    finally:
        for c in clients:
            await c.close()
    assert len(st.servicer._segments) <= 8


async def test_mid_stream_cancel_leaves_nothing_visible(offload_factory) -> None:
    import asyncio

    st = await offload_factory(ram_capacity_bytes=64 << 20)
    sent = asyncio.Event()

    async def stream():
        yield offload_pb2.PutRequest(header=offload_pb2.PutHeader(namespace=NS))
        yield offload_pb2.PutRequest(chunk=offload_pb2.BlockChunk(key=1, data=b"a" * 1000, last=True))
        yield offload_pb2.PutRequest(chunk=offload_pb2.BlockChunk(key=2, data=b"b" * 1000))
        sent.set()
        await asyncio.sleep(30)  # the client "hangs" and is then cancelled

    async with grpc.aio.insecure_channel(st.address) as ch:
        call = offload_pb2_grpc.OffloadStub(ch).Put(stream())
        await sent.wait()
        await asyncio.sleep(0.2)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    async with OffloadClient(st.address, use_shm=False) as c:
        assert await c.contains(NS, [1]) == 0
        assert (await c.stats()).ram_blocks == 0


def test_sync_client_parity(offload_process) -> None:
    proc = offload_process("--ram-capacity-bytes", str(32 << 20))
    for use_shm in (False, True):
        with SyncOffloadClient(proc.grpc_address, use_shm=use_shm) as c:
            data = blocks(3, 50_000, seed=3 + use_shm)
            res = c.put(NS, data, token_ids=[[1]] * 3, block_size=1)
            assert res.stored == 3 and res.via_shm == use_shm
            keys = [k for k, _ in data]
            assert c.contains(NS, keys) == 3
            assert c.get(NS, keys) == [d for _, d in data]
            assert c.delete(NS, keys) == 3
            assert c.stats().ram_blocks == 0


async def test_store_down_is_unavailable_quickly() -> None:
    async with OffloadClient(f"127.0.0.1:{free_port()}", use_shm=False, timeout_s=2) as c:
        with pytest.raises(StoreUnavailable):
            await c.contains(NS, [1])
        with pytest.raises(StoreUnavailable):
            await c.get(NS, [1])


async def test_concurrent_puts_share_one_in_flight_budget(offload_factory) -> None:
    import asyncio

    st = await offload_factory(ram_capacity_bytes=1 << 20)
    sent = asyncio.Event()

    async def slow():
        yield offload_pb2.PutRequest(header=offload_pb2.PutHeader(namespace=NS))
        yield offload_pb2.PutRequest(chunk=offload_pb2.BlockChunk(key=1, data=b"a" * 600_000, last=True))
        sent.set()
        await asyncio.sleep(30)

    async with grpc.aio.insecure_channel(st.address) as ch:
        stub = offload_pb2_grpc.OffloadStub(ch)
        first = stub.Put(slow())
        await sent.wait()
        await asyncio.sleep(0.2)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Put(iter([offload_pb2.PutRequest(header=offload_pb2.PutHeader(namespace=NS)),
                                 offload_pb2.PutRequest(chunk=offload_pb2.BlockChunk(key=2, data=b"b" * 600_000,
                                                                                     last=True))]))
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "in flight" in ei.value.details()
        first.cancel()
        await asyncio.sleep(0.2)
    assert st.servicer.inflight_put_bytes == 0
    async with OffloadClient(st.address, use_shm=False) as c:
        assert (await c.put(NS, [(3, b"c" * 600_000)])).stored == 1
