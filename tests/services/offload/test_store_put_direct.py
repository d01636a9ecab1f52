"""Zero-copy same-host puts (ReservePut/CommitPut) on a real store over loopback gRPC."""

from __future__ import annotations

import os
import time

import grpc
import pytest

from kvmesh.kvstore.client import OffloadClient, block_checksum
from kvmesh_api.offload.v1 import offload_pb2, offload_pb2_grpc

pytestmark = pytest.mark.timeout(60)
NS = "tiny-llama/L2-H2-D32-bf16-bs32"
BIG = 512 * 1024   # held in the store's shared slabs (>= the arena's min block)


def blocks(n: int, size: int, seed: int = 0) -> list[tuple[int, bytes]]:
    return [(1000 * seed + i + 1, os.urandom(size)) for i in range(n)]


def _calls(st, monkeypatch) -> dict[str, int]:  # noqa: ANN001
    """Counts the servicer's put RPCs (which path a client took)."""
    seen = {"ReservePut": 0, "CommitPut": 0, "PutShm": 0}
    for name, impl in (("ReservePut", "_reserve_put"), ("CommitPut", "_commit_put"), ("PutShm", "_put_shm")):
        orig = getattr(st.servicer, impl)

        def wrapped(*a, _orig=orig, _name=name):  # noqa: ANN002, ANN202
            seen[_name] += 1
            return _orig(*a)
        monkeypatch.setattr(st.servicer, impl, wrapped)
    return seen


async def test_big_blocks_go_straight_into_the_slabs(offload_factory, monkeypatch) -> None:
    st = await offload_factory(ram_capacity_bytes=64 << 20)
    seen = _calls(st, monkeypatch)
    async with OffloadClient(st.address, use_shm=True) as c:
        data = blocks(6, BIG)
        res = await c.put(NS, data, token_ids=[[1, 2]] * 6, parent=7, block_size=2)
        assert (res.stored, res.already_present, res.via_shm) == (6, 0, True)
        assert seen == {"ReservePut": 1, "CommitPut": 1, "PutShm": 0}
        keys = [k for k, _ in data]
        assert await c.get(NS, keys) == [d for _, d in data]
        again = await c.put(NS, data[:2])
        assert (again.stored, again.already_present) == (0, 2)
        # small blocks: the store says so once, then the client uses PutShm without asking
        small = blocks(3, 4096, seed=5)
        await c.put(NS, small)
        await c.put(NS, blocks(3, 4096, seed=6))
        assert seen["ReservePut"] == 3 and seen["PutShm"] == 2
        assert await c.get(NS, [k for k, _ in small]) == [d for _, d in small]
    # the store kept what the client checksummed: a gRPC reader verifies it
    async with OffloadClient(st.address, use_shm=False, use_bulk=False) as g:
        assert await g.get(NS, keys) == [d for _, d in data]
    assert len(st.servicer.reservations) == 0 and st.servicer.reservations.reserved_bytes == 0


async def test_a_put_of_most_of_the_ram_still_goes_straight_into_the_slabs(offload_factory, monkeypatch) -> None:
    # Reservations were capped at half the RAM: a bigger put silently took PutShm (two copies).
    st = await offload_factory(ram_capacity_bytes=16 << 20)
    seen = _calls(st, monkeypatch)
    async with OffloadClient(st.address, use_shm=True) as c:
        data = blocks(24, BIG)   # 12 MiB of a 16 MiB store
        assert (await c.put(NS, data)).stored == 24
        assert seen == {"ReservePut": 1, "CommitPut": 1, "PutShm": 0}
        counters = (await c.stats()).counters
        assert counters["puts_direct"] == 1 and counters.get("puts_shm_copied", 0) == 0
        assert await c.get(NS, [k for k, _ in data]) == [d for _, d in data]
    assert st.servicer.reservations.reserved_bytes == 0


async def test_a_store_without_direct_puts_is_asked_once(offload_factory, monkeypatch) -> None:
    st = await offload_factory(ram_capacity_bytes=16 << 20, direct_put=False)
    seen = _calls(st, monkeypatch)
    async with OffloadClient(st.address, use_shm=True) as c:
        for seed in range(3):
            data = blocks(2, BIG, seed=seed)
            res = await c.put(NS, data)
            assert (res.stored, res.via_shm) == (2, True)
            assert await c.get(NS, [k for k, _ in data]) == [d for _, d in data]
    assert seen == {"ReservePut": 1, "CommitPut": 0, "PutShm": 3}
    assert st.store.stats()["counters"]["puts_shm_copied"] == 3


async def test_reservation_errors_are_clear_and_change_nothing(offload_factory) -> None:
    st = await offload_factory(ram_capacity_bytes=16 << 20)
    async with grpc.aio.insecure_channel(st.address) as ch:
        stub = offload_pb2_grpc.OffloadStub(ch)
        hdr = offload_pb2.PutHeader(namespace=NS)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.CommitPut(offload_pb2.PutCommit(reservation=b"\x01" * 16, checksums=[1]))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.ReservePut(offload_pb2.ShmRequest(header=hdr, keys=[1, 2], sizes=[BIG]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as e:   # more than the RAM: never reserved
            await stub.ReservePut(offload_pb2.ShmRequest(header=hdr, keys=list(range(1, 40)), sizes=[BIG] * 39))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        held = await stub.ReservePut(offload_pb2.ShmRequest(header=hdr, keys=list(range(1, 20)), sizes=[BIG] * 19))
        with pytest.raises(grpc.aio.AioRpcError) as e:   # open reservations past the budget (the RAM)
            await stub.ReservePut(offload_pb2.ShmRequest(header=hdr, keys=list(range(20, 39)), sizes=[BIG] * 19))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        await stub.CommitPut(offload_pb2.PutCommit(reservation=held.reservation, abort=True))
        resv = await stub.ReservePut(offload_pb2.ShmRequest(header=hdr, keys=[1, 2], sizes=[BIG, BIG]))
        assert len(resv.segments) == 2 and resv.reservation
        with pytest.raises(grpc.aio.AioRpcError) as e:   # one checksum per block
            await stub.CommitPut(offload_pb2.PutCommit(reservation=resv.reservation, checksums=[1]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as e:   # the failed commit ended the reservation
            await stub.CommitPut(offload_pb2.PutCommit(reservation=resv.reservation, checksums=[1, 2]))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        resv = await stub.ReservePut(offload_pb2.ShmRequest(header=hdr, keys=[3], sizes=[BIG]))
        out = await stub.CommitPut(offload_pb2.PutCommit(reservation=resv.reservation, abort=True))
        assert out.stored == 0
    assert st.store.contains(NS, [1])[0] == 0 and st.store.contains(NS, [3])[0] == 0
    assert st.servicer.reservations.reserved_bytes == 0


async def test_uncommitted_reservations_expire(offload_factory) -> None:
    st = await offload_factory(ram_capacity_bytes=16 << 20)
    st.servicer.reservations.ttl_s = 0.1
    async with grpc.aio.insecure_channel(st.address) as ch:
        stub = offload_pb2_grpc.OffloadStub(ch)
        hdr = offload_pb2.PutHeader(namespace=NS)
        await stub.ReservePut(offload_pb2.ShmRequest(header=hdr, keys=[1, 2], sizes=[BIG, BIG]))
        assert st.servicer.reservations.reserved_bytes == 2 * BIG
        time.sleep(0.15)
        assert st.servicer.reservations.sweep() == 1 and st.servicer.reservations.reserved_bytes == 0
    # a client still stores through the copy path when the store refuses reservations
    st.servicer.reservations.max_bytes = 0
    async with OffloadClient(st.address, use_shm=True) as c:
        data = blocks(2, BIG, seed=3)
        assert (await c.put(NS, data)).stored == 2
        assert await c.get(NS, [k for k, _ in data]) == [d for _, d in data]
        assert block_checksum(data[0][1]) == st.store.get(NS, [data[0][0]])[0].block.checksum
