"""``get_into``: blocks copied straight into caller buffers; same-host reads from the store's shared slabs under a lease."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from kvmesh.kvstore.client import InvalidOffloadRequest, OffloadClient, OffloadError, SyncOffloadClient

pytestmark = pytest.mark.timeout(60)
NS = "tiny-llama/L2-H2-D32-bf16-bs32"
BIG = 512 * 1024    # held in shared slabs (arena blocks are >= 256 KiB)
SMALL = 64 * 1024   # held as plain bytes: copied into the client's segment


def _blocks() -> list[tuple[int, bytes]]:
    sizes = [BIG, BIG, SMALL, BIG]
    return [(i + 1, os.urandom(n)) for i, n in enumerate(sizes)]


@pytest.fixture(params=["grpc", "bulk", "shm"])
def path(request: pytest.FixtureRequest) -> str:
    return request.param


async def test_get_into_fills_caller_buffers(offload_factory, path: str) -> None:
    st = await offload_factory(ram_capacity_bytes=64 << 20)
    data = _blocks()
    keys = [k for k, _ in data]
    async with OffloadClient(st.address, use_shm=path == "shm", use_bulk=path == "bulk") as c:
        await c.put(NS, data)
        dst = np.zeros(BIG * len(data), dtype=np.uint8)  # e.g. a KV cache, one slot per block
        views = [dst[i * BIG:(i + 1) * BIG] for i in range(len(data))]
        # a miss after the second block: only the leading two are copied
        assert await c.get_into(NS, [keys[0], keys[1], 999], views) == 2
        assert await c.get_into(NS, keys, views) == len(data)
        for i, (_, d) in enumerate(data):
            assert views[i][:len(d)].tobytes() == d
        if path == "shm":
            # big blocks were read in place from the store's slabs, and the lease is over
            assert c._store_maps._maps, "expected mapped store slabs"
        assert st.servicer.open_leases == 0


async def test_async_get_into_copies_off_the_event_loop(offload_factory, monkeypatch, path: str) -> None:
    """A GiB takes ~90 ms to copy: on the loop it would stall every other call of a service."""
    import threading

    import kvmesh.kvstore.client_core as core

    copied_on: list[int] = []
    real = core.copy_into

    def spy(*args, **kwargs):
        copied_on.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(core, "copy_into", spy)
    st = await offload_factory(ram_capacity_bytes=64 << 20)
    data = _blocks()
    async with OffloadClient(st.address, use_shm=path == "shm", use_bulk=path == "bulk") as c:
        await c.put(NS, data)
        views = [np.zeros(BIG, dtype=np.uint8) for _ in data]
        assert await c.get_into(NS, [k for k, _ in data], views) == len(data)
        assert [v[:len(d)].tobytes() for v, (_, d) in zip(views, data, strict=True)] == [d for _, d in data]
    assert threading.get_ident() not in copied_on


async def test_cancelled_get_into_ends_its_lease_after_the_copy(offload_factory, monkeypatch) -> None:
    """A cancelled caller's copy thread still reads the store's slabs: the lease ends after it."""
    import threading

    import kvmesh.kvstore.client_core as core

    started, leases_during_copy = threading.Event(), []
    release = threading.Event()
    real = core.copy_into
    st = await offload_factory(ram_capacity_bytes=64 << 20)

    def slow(*args, **kwargs):
        started.set()
        release.wait(5)
        leases_during_copy.append(st.servicer.open_leases)
        return real(*args, **kwargs)

    monkeypatch.setattr(core, "copy_into", slow)
    data = [(i + 1, os.urandom(BIG)) for i in range(4)]
    async with OffloadClient(st.address, use_shm=True) as c:
        await c.put(NS, data)
        task = asyncio.create_task(c.get_into(NS, [k for k, _ in data], [bytearray(BIG) for _ in data]))
        await asyncio.to_thread(started.wait, 5)
        task.cancel()
        await asyncio.sleep(0.2)
        assert not task.done() and st.servicer.open_leases == 1   # waits for the copy, lease held
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert leases_during_copy == [1] and st.servicer.open_leases == 0


async def test_sync_client_get_into(offload_factory) -> None:
    st = await offload_factory(ram_capacity_bytes=64 << 20)
    data = _blocks()

    def run() -> list[bytes]:
        with SyncOffloadClient(st.address, use_shm=True) as c:
            c.put(NS, data)
            bufs = [bytearray(BIG) for _ in data]
            assert c.get_into(NS, [k for k, _ in data], bufs) == len(data)
            return [bytes(b[:len(d)]) for b, (_, d) in zip(bufs, data, strict=True)]

    assert await asyncio.to_thread(run) == [d for _, d in data]
    assert st.servicer.open_leases == 0


async def test_leased_blocks_survive_delete_and_reuse_until_released(offload_factory) -> None:
    st = await offload_factory(ram_capacity_bytes=64 << 20)
    first = [(i + 1, os.urandom(BIG)) for i in range(4)]
    async with OffloadClient(st.address, use_shm=True) as c:
        await c.put(NS, first)
        lease = await c.fetch(NS, [k for k, _ in first])
        assert st.servicer.open_leases == 1
        # the store drops the blocks and stores others of the same size: freed slots would be reused
        assert await c.delete(NS, [k for k, _ in first]) == 4
        await c.put(NS, [(100 + i, os.urandom(BIG)) for i in range(8)])
        assert [bytes(v) for v in lease.views] == [d for _, d in first]
        with pytest.raises(TypeError):
            lease.views[0][0] = 0  # store memory is mapped read-only
        await lease.arelease()
        assert lease.valid and st.servicer.open_leases == 0


async def test_expired_lease_is_reported_not_trusted(offload_factory) -> None:
    st = await offload_factory(ram_capacity_bytes=64 << 20)
    st.servicer.lease_ttl_s = 0.0  # every lease has expired by the time it is released
    data = _blocks()
    async with OffloadClient(st.address, use_shm=True) as c:
        await c.put(NS, data)
        with pytest.raises(OffloadError, match="lease expired"):
            await c.get(NS, [k for k, _ in data])
        with pytest.raises(OffloadError, match="lease expired"):
            await c.get_into(NS, [k for k, _ in data], [bytearray(BIG) for _ in data])


async def test_get_into_rejects_unusable_buffers(offload_factory, path: str) -> None:
    st = await offload_factory(ram_capacity_bytes=64 << 20)
    data = _blocks()
    keys = [k for k, _ in data]
    async with OffloadClient(st.address, use_shm=path == "shm", use_bulk=path == "bulk") as c:
        await c.put(NS, data)
        with pytest.raises(InvalidOffloadRequest, match="has 10 bytes"):
            await c.get_into(NS, keys, [bytearray(10)] * len(data))
        with pytest.raises(InvalidOffloadRequest, match="read-only"):
            await c.get_into(NS, keys, [bytes(BIG)] * len(data))
        with pytest.raises(InvalidOffloadRequest, match="destination buffers"):
            await c.get_into(NS, keys, [bytearray(BIG)])
        assert st.servicer.open_leases == 0  # released on errors too


async def test_bulk_path_falls_back_to_grpc_streams(offload_factory) -> None:
    data = _blocks()
    keys = [k for k, _ in data]
    off = await offload_factory(ram_capacity_bytes=64 << 20, bulk_port=-1)  # store without a bulk port
    async with OffloadClient(off.address, use_shm=False) as c:
        await c.put(NS, data)
        assert await c.get(NS, keys) == [d for _, d in data]
        assert not c._bulk  # FAILED_PRECONDITION: gRPC streams from now on
    st = await offload_factory(ram_capacity_bytes=64 << 20)
    async with OffloadClient(st.address, use_shm=False) as c:
        await c.put(NS, data)
        st.servicer.bulk.close()  # port unreachable (e.g. firewalled)
        assert await c.get(NS, keys) == [d for _, d in data]
        assert not c._bulk and st.servicer.open_leases == 0  # the unused lease was ended


async def test_bulk_port_serves_only_live_leases(offload_factory) -> None:
    import socket

    from kvmesh.kvstore.bulk import ANSWER, MAGIC, NO_LEASE, REQUEST

    st = await offload_factory(ram_capacity_bytes=64 << 20)
    data = _blocks()
    async with OffloadClient(st.address, use_shm=False) as c:
        await c.put(NS, data)

    def probe() -> tuple[int, bytes]:
        with socket.create_connection(("127.0.0.1", st.servicer.bulk.port), timeout=5) as s:
            s.sendall(REQUEST.pack(MAGIC, bytes(range(16))))  # never handed out
            (answer,) = ANSWER.unpack(s.recv(ANSWER.size, socket.MSG_WAITALL))
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")   # not the protocol: the store hangs up
            try:
                return answer, s.recv(1)
            except ConnectionResetError:
                return answer, b""

    answer, rest = await asyncio.to_thread(probe)
    assert answer == NO_LEASE and rest == b""
    st.servicer.lease_ttl_s = 0.0
    async with OffloadClient(st.address, use_shm=False) as c:
        with pytest.raises(OffloadError, match="unknown or expired"):
            await c.get_into(NS, [k for k, _ in data], [bytearray(BIG) for _ in data])


async def test_sync_client_bulk_get_into(offload_factory) -> None:
    st = await offload_factory(ram_capacity_bytes=64 << 20)
    data = _blocks()

    def run() -> list[bytes]:
        with SyncOffloadClient(st.address, use_shm=False) as c:
            c.put(NS, data)
            bufs = [bytearray(BIG) for _ in data]
            assert c.get_into(NS, [k for k, _ in data], bufs) == len(data)
            assert c._bulk
            return [bytes(b[:len(d)]) for b, (_, d) in zip(bufs, data, strict=True)]

    assert await asyncio.to_thread(run) == [d for _, d in data]
    assert st.servicer.open_leases == 0


async def test_truncated_shm_answer_ends_its_lease_and_retries(offload_factory) -> None:
    st = await offload_factory(ram_capacity_bytes=64 << 20)
    async with OffloadClient(st.address, use_shm=True) as c:
        await c.put(NS, [(1, b"x" * 1024)])
        assert await c.get(NS, [1]) == [b"x" * 1024]  # the client now guesses 1 KiB per block
        chain = [(10, os.urandom(BIG))] + [(11 + i, os.urandom(200 * 1024)) for i in range(8)]
        await c.put(NS, chain)
        # BIG is leased in place; the small blocks overflow the 1 MiB segment: truncated, retried
        assert await c.get(NS, [k for k, _ in chain]) == [d for _, d in chain]
        assert st.servicer.open_leases == 0
