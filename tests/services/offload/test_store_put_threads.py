"""Same-host puts copy and checksum on the get's copy threads (``copy_blocks``), on a real store.

Big puts (>= ``PARALLEL_MIN_BYTES``) split their blocks over the copy threads on both shm paths
(ReservePut/CommitPut into the store's slabs, PutShm through the client's segment); what the
store keeps must be byte-equal and carry checksums every reader verifies. Small puts stay on
the calling thread.
"""

from __future__ import annotations

import os
import threading

import pytest

import kvmesh.kvstore.client_messages as cm
from kvmesh.kvstore.client import OffloadClient, block_checksum

pytestmark = pytest.mark.timeout(120)
NS = "tiny-llama/L2-H2-D32-bf16-bs32"
# Bigger than the copy piece (not a multiple of it) and >= the store's slab minimum.
SIZE = cm.VERIFY_CHUNK_BYTES + 4099


def _blocks(total: int, seed: int) -> list[tuple[int, bytes]]:
    n = max(2, -(-total // SIZE))
    return [(seed * 10_000 + i + 1, os.urandom(SIZE)) for i in range(n)]


def _record_shares(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """(thread name, lo, hi) of every non-empty share ``copy_blocks`` ran."""
    shares: list[tuple[str, int, int]] = []
    real = cm._copy_share

    def spy(dsts, srcs, summed, sums, lo, hi):  # noqa: ANN001, ANN202
        if hi > lo:
            shares.append((threading.current_thread().name, lo, hi))
        return real(dsts, srcs, summed, sums, lo, hi)

    monkeypatch.setattr(cm, "_copy_share", spy)
    return shares


@pytest.mark.parametrize("direct_put", [True, False], ids=["reserve-commit", "put-shm"])
async def test_a_big_put_is_split_over_the_copy_threads(offload_factory, monkeypatch, direct_put: bool) -> None:
    st = await offload_factory(ram_capacity_bytes=64 << 20, direct_put=direct_put)
    data = _blocks(cm.PARALLEL_MIN_BYTES + SIZE, seed=1)
    keys = [k for k, _ in data]
    shares = _record_shares(monkeypatch)
    async with OffloadClient(st.address, use_shm=True) as c:
        c.copy_threads = 2
        res = await c.put(NS, data, token_ids=[[7, 8]] * len(data), parent=99, block_size=2, session_id="s")
        assert (res.stored, res.via_shm) == (len(data), True)
        # Two threads, one of them a copy thread, whose shares cover every block once.
        assert len(shares) == 2 and any(name.startswith("kvmesh-offload-copy") for name, _, _ in shares)
        assert sorted((lo, hi) for _, lo, hi in shares) == [(0, len(data) // 2), (len(data) // 2, len(data))]
        assert await c.contains(NS, keys) == len(data)
        # A verifying same-host read checks every block against the checksums the put stored.
        dests = [bytearray(SIZE) for _ in data]
        assert await c.get_into(NS, keys, dests) == len(data)
        assert [bytes(d) for d in dests] == [d for _, d in data]
    # So does a reader over gRPC, which gets the store's checksums on the wire.
    async with OffloadClient(st.address, use_shm=False, use_bulk=False) as g:
        assert await g.get(NS, keys) == [d for _, d in data]
        assert (await g.stats()).ram_blocks == len(data)


@pytest.mark.parametrize("direct_put", [True, False], ids=["reserve-commit", "put-shm"])
async def test_a_small_put_stays_on_the_calling_thread(offload_factory, monkeypatch, direct_put: bool) -> None:
    st = await offload_factory(ram_capacity_bytes=64 << 20, direct_put=direct_put)
    data = _blocks(cm.PARALLEL_MIN_BYTES // 2, seed=2)

    def no_pool(helpers: int) -> None:
        raise AssertionError("a put under PARALLEL_MIN_BYTES used the copy threads")

    monkeypatch.setattr(cm, "_copy_pool", no_pool)
    shares = _record_shares(monkeypatch)
    async with OffloadClient(st.address, use_shm=True) as c:
        c.copy_threads = 2
        res = await c.put(NS, data)
        assert (res.stored, res.via_shm) == (len(data), True)
        assert len(shares) == 1 and shares[0][1:] == (0, len(data))
        assert await c.get(NS, [k for k, _ in data]) == [d for _, d in data]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_copy_blocks_returns_the_checksums_of_what_it_wrote(threads: int) -> None:
    n = cm.PARALLEL_MIN_BYTES // SIZE + 2
    srcs = [os.urandom(SIZE) for _ in range(n)]
    dsts = [bytearray(SIZE) for _ in range(n)]
    summed = [i % 3 != 0 for i in range(n)]   # unsummed blocks are copied, their sum is 0
    sums = cm.copy_blocks([memoryview(d) for d in dsts], [memoryview(s) for s in srcs], summed, threads)
    assert [bytes(d) for d in dsts] == srcs
    assert sums == [block_checksum(s) if want else 0 for s, want in zip(srcs, summed, strict=True)]
