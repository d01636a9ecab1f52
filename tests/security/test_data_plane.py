"""Attack 5 of issue #20 (the offload data plane) and attack 8 (hostile keys and namespaces).

Each attack is replayed against a real store on loopback gRPC and refused with the
right status, with no state change and the store still serving other clients.
"""

from __future__ import annotations

import asyncio
import os
import socket

import grpc
import pytest

from kvmesh.kvstore.bulk import ANSWER, MAGIC, NO_LEASE, REQUEST
from kvmesh.kvstore.client import InvalidOffloadRequest, OffloadClient, OffloadError
from kvmesh.kvstore.shm import SHM_DIR
from kvmesh.kvstore.wire import encode_put_chunk
from kvmesh_api.offload.v1 import offload_pb2, offload_pb2_grpc

pytestmark = pytest.mark.timeout(60)
NS = "tiny-llama/L2-H2-D32-bf16-bs32"
BIG = 512 * 1024   # big enough to live in the store's shared slabs


def _blocks(n: int = 3, start: int = 1) -> list[tuple[int, bytes]]:
    return [(start + i, os.urandom(BIG)) for i in range(n)]


def _bulk_probe(port: int, token: bytes) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(REQUEST.pack(MAGIC, token))
        (answer,) = ANSWER.unpack(s.recv(ANSWER.size, socket.MSG_WAITALL))
        return answer


async def test_lease_tokens_are_random_and_unguessable(offload_factory) -> None:
    st = await offload_factory(ram_capacity_bytes=64 << 20)
    data = _blocks()
    async with OffloadClient(st.address, use_shm=False) as c, grpc.aio.insecure_channel(st.address) as ch:
        await c.put(NS, data)
        stub = offload_pb2_grpc.OffloadStub(ch)
        keys = [k for k, _ in data]
        a = await stub.GetBulk(offload_pb2.GetRequest(namespace=NS, keys=keys))
        b = await stub.GetBulk(offload_pb2.GetRequest(namespace=NS, keys=keys))
        assert len(a.lease) == len(b.lease) == 16 and a.lease != b.lease
        # Guesses near a real token, and a release with a wrong token, change nothing.
        near = (int.from_bytes(a.lease, "big") ^ 1).to_bytes(16, "big")
        for guess in (bytes(16), near, b.lease[:8] + a.lease[8:]):
            assert await asyncio.to_thread(_bulk_probe, st.servicer.bulk.port, guess) == NO_LEASE
            assert not (await stub.ReleaseShm(offload_pb2.ShmRelease(lease=guess))).held
        assert st.servicer.open_leases == 2
        # The real holder still gets its bytes, once.
        assert await asyncio.to_thread(_bulk_probe, st.servicer.bulk.port, a.lease) == BIG * len(data)
        assert (await stub.ReleaseShm(offload_pb2.ShmRelease(lease=b.lease))).held
        assert st.servicer.open_leases == 0


def test_a_lease_is_bound_to_its_caller() -> None:
    from kvmesh.rpc.peers import peer_host
    from kvmesh_offload.leases import Caller, LeaseTable

    table = LeaseTable(ttl_s=60)
    owner = Caller("spiffe://kvmesh/worker/w0", "10.0.0.5")
    tok = table.add(["blocks"], owner)
    assert not table.release(tok, Caller("spiffe://kvmesh/worker/w1", "10.0.0.5"))   # another identity
    assert not table.release(tok, Caller(owner.principal, "10.0.0.6"))             # another host
    assert table.take(tok, "10.0.0.6") is None                                     # bulk from another host
    assert len(table) == 1 and table.refused == 3
    assert table.take(tok, "::ffff:10.0.0.5") == ["blocks"]                        # same host, v4-mapped
    assert peer_host("ipv6:[::1]:4000") == peer_host("ipv4:127.0.0.1:5") == "loopback"


async def test_getshm_cannot_name_a_store_slab(offload_factory) -> None:
    st = await offload_factory(ram_capacity_bytes=64 << 20)
    data = _blocks()
    async with OffloadClient(st.address, use_shm=True) as c, grpc.aio.insecure_channel(st.address) as ch:
        await c.put(NS, data)
        other = _blocks(1, start=100)
        await c.put(NS, other)
        slabs = sorted(p.name for p in SHM_DIR.glob(f"kvmesh-slab-{os.getpid()}-*"))
        assert slabs, "the store keeps big blocks in shared slabs"
        stub = offload_pb2_grpc.OffloadStub(ch)
        # Under its own name and under a hard link with an innocent name.
        alias = f"kvmesh-{os.getpid()}-alias{os.urandom(3).hex()}"
        os.link(SHM_DIR / slabs[0], SHM_DIR / alias)
        try:
            for name in (slabs[0], alias):
                for rpc, req in (
                    (stub.GetShm, offload_pb2.ShmRequest(header=offload_pb2.PutHeader(namespace=NS), segment=name,
                                                         keys=[other[0][0]], capacity=1 << 20)),
                    (stub.PutShm, offload_pb2.ShmRequest(header=offload_pb2.PutHeader(namespace=NS), segment=name,
                                                         keys=[555], offsets=[0], sizes=[BIG])),
                ):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await rpc(req)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            (SHM_DIR / alias).unlink()
        assert await c.get(NS, [k for k, _ in data]) == [d for _, d in data]   # nothing was overwritten
        assert await c.contains(NS, [555]) == 0


async def test_shm_readers_verify_checksums_unless_trusted(offload_factory) -> None:
    st = await offload_factory(ram_capacity_bytes=64 << 20)
    data = _blocks(1)
    key = data[0][0]
    async with OffloadClient(st.address, use_shm=True) as c:
        await c.put(NS, data)
        lease = await c.fetch(NS, [key])
        slot_seg, slot_off = None, None
        async with lease:
            assert lease.via_shm
        # Find where the store keeps the block and damage it in place (another process on the host could).
        found = st.store.get(NS, [key])[0]
        slot_seg, slot_off = found.block.data.location()
        del found
        with open(SHM_DIR / slot_seg, "r+b") as f:
            f.seek(slot_off)
            f.write(b"\xff" * 64)
        with pytest.raises(OffloadError, match="checksum mismatch"):
            await c.get(NS, [key])
        # get_into verifies while it copies (the copied bytes, piece by piece): same refusal.
        dest = bytearray(len(data[0][1]))
        with pytest.raises(OffloadError, match="checksum mismatch"):
            await c.get_into(NS, [key], [dest])
    async with OffloadClient(st.address, use_shm=True, trust_local_store=True) as trusting:
        got = await trusting.get(NS, [key])
        assert got and got[0][:64] == b"\xff" * 64   # trusted: no second pass over the bytes


async def test_key_over_64_bits_and_huge_namespace_are_refused(offload_factory) -> None:
    events: list = []
    st = await offload_factory(event_sink=events.extend, ram_capacity_bytes=64 << 20)
    async with grpc.aio.insecure_channel(st.address, options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
        put = ch.stream_unary("/kvmesh.offload.v1.Offload/Put", request_serializer=lambda b: b,
                              response_deserializer=offload_pb2.PutResponse.FromString)
        header = offload_pb2.PutRequest(header=offload_pb2.PutHeader(namespace=NS)).SerializeToString()
        chunk = bytearray(encode_put_chunk(1, b"x" * 64, True, 0))
        # Rewrite the key varint (field 1 of the chunk) as 2^64 + 5: 10 bytes, the last one 0x02.
        big_key = b"\x85\x80\x80\x80\x80\x80\x80\x80\x80\x02"
        inner = b"\x08" + big_key + bytes(chunk[2 + 1 + 1:])  # drop the 1-byte key 0x01 after tag 0x08
        bad_chunk = b"\x12" + bytes([len(inner)]) + inner
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await put(iter([header, bad_chunk]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stub = offload_pb2_grpc.OffloadStub(ch)
        for ns in ("n" * (1 << 20), "has space", "tab\tns", ""):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Contains(offload_pb2.ContainsRequest(namespace=ns, keys=[1]))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as err:
            raw = ch.unary_unary("/kvmesh.offload.v1.Offload/Stats", request_serializer=lambda b: b)
            await raw(b"\xff\xff\xff")  # does not parse: INVALID_ARGUMENT, not UNKNOWN
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    stored = [e for e in events if e.kind == "stored"]
    assert st.store.stats()["ram_blocks"] == 0 and not stored
    # Another client's Put and Get are unaffected.
    async with OffloadClient(st.address, use_shm=False) as c:
        data = [(2**64 - 1, os.urandom(4096))]
        assert (await c.put(NS, data, token_ids=[[1, 2, 3]])).stored == 1
        assert await c.get(NS, [2**64 - 1]) == [data[0][1]]
        with pytest.raises(InvalidOffloadRequest):
            await c.put("n" * 300, data)
    stored = [e for e in events if e.kind == "stored"]
    assert stored and all(k < 2**64 for e in stored for k in e.keys)


def test_copy_into_verifies_what_it_copied_piece_by_piece() -> None:
    """The fused copy+verify checks every piece of a multi-piece block, and the destination bytes."""
    from kvmesh.kvstore.checksum import block_checksum
    from kvmesh.kvstore.client_messages import VERIFY_CHUNK_BYTES, copy_into

    block = os.urandom(3 * VERIFY_CHUNK_BYTES + 123)
    good = block_checksum(block)
    dest = bytearray(len(block))
    assert copy_into([memoryview(block)], [dest], [good], [7]) == 1 and bytes(dest) == block
    for where in (0, VERIFY_CHUNK_BYTES + 5, len(block) - 1):   # first, a middle and the last piece
        bad = bytearray(block)
        bad[where] ^= 1
        with pytest.raises(OffloadError, match="block 7: checksum mismatch"):
            copy_into([memoryview(bad)], [bytearray(len(block))], [good], [7])
    # 0 = no checksum known: copied as is.
    assert copy_into([memoryview(bad)], [dest], [0]) == 1 and bytes(dest) == bytes(bad)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_copy_into_threads_verify_every_share(threads: int) -> None:
    """Blocks split over copy threads: every share is copied and verified, a bad block in any
    share is named, and the call returns only after every thread finished."""
    from kvmesh.kvstore.checksum import block_checksum
    from kvmesh.kvstore.client_messages import PARALLEL_MIN_BYTES, VERIFY_CHUNK_BYTES, copy_into

    size = VERIFY_CHUNK_BYTES + 4097
    n = PARALLEL_MIN_BYTES // size + 3
    blocks = [os.urandom(size) for _ in range(n)]
    sums = [block_checksum(b) for b in blocks]
    keys = list(range(100, 100 + n))
    dests = [bytearray(size) for _ in range(n)]
    assert copy_into([memoryview(b) for b in blocks], dests, sums, keys, threads=threads) == n
    assert [bytes(d) for d in dests] == blocks
    for bad_i in (0, n // 2, n - 1):   # in the caller's share, a middle one, the last thread's
        src = [bytearray(b) for b in blocks]
        src[bad_i][size // 2] ^= 0xFF
        with pytest.raises(OffloadError, match=f"block {keys[bad_i]}: checksum mismatch"):
            copy_into([memoryview(b) for b in src], [bytearray(size) for _ in range(n)], sums, keys,
                      threads=threads)
    # Read-only sources (the store's slabs are mapped read-only) copy the same way.
    ro = [memoryview(bytes(b)) for b in blocks]
    out = [bytearray(size) for _ in range(n)]
    assert copy_into(ro, out, None, keys, threads=threads) == n and [bytes(d) for d in out] == blocks


def test_copy_threads_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvmesh.kvstore.client_messages import COPY_THREADS_ENV, copy_threads

    monkeypatch.setenv(COPY_THREADS_ENV, "3")
    assert copy_threads() == 3
    monkeypatch.setenv(COPY_THREADS_ENV, "0")
    assert copy_threads() == 1
    monkeypatch.delenv(COPY_THREADS_ENV)
    assert copy_threads() == min(2, len(os.sched_getaffinity(0)))


def test_copy_threads_work_in_a_forked_child() -> None:
    """A child forked after a threaded copy copies with threads of its own (no hang)."""
    import multiprocessing as mp

    from kvmesh.kvstore.checksum import block_checksum
    from kvmesh.kvstore.client_messages import PARALLEL_MIN_BYTES, copy_into

    blocks = [os.urandom(PARALLEL_MIN_BYTES // 2) for _ in range(4)]
    sums = [block_checksum(b) for b in blocks]
    assert copy_into([memoryview(b) for b in blocks], [bytearray(len(b)) for b in blocks], sums, threads=2) == 4
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_copy_in_child, args=(blocks, sums, q))
    child.start()
    try:
        assert q.get(timeout=60) == 4
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


def _copy_in_child(blocks: list[bytes], sums: list[int], q: object) -> None:
    from kvmesh.kvstore.client_messages import copy_into

    dests = [bytearray(len(b)) for b in blocks]
    n = copy_into([memoryview(b) for b in blocks], dests, sums, threads=2)
    q.put(n if [bytes(d) for d in dests] == blocks else -1)  # type: ignore[attr-defined]


def test_piecewise_checksum_matches_whole_and_catches_any_flip() -> None:
    """The copy loop's piecewise XXH3-64 (through ctypes, GIL released) equals the one-shot
    checksum the store and the gRPC/bulk paths use, at any piece boundaries; its fallback
    (the xxhash package's streaming object) gives the same digest."""
    import numpy as np

    from kvmesh.kvstore import checksum
    from kvmesh.kvstore.checksum import PieceHasher, block_checksum

    data = np.frombuffer(bytearray(os.urandom(1 << 20 | 77)), dtype=np.uint8)
    view, addr = memoryview(data).cast("B"), int(data.ctypes.data)
    whole = block_checksum(view)
    assert whole == block_checksum(bytes(view))
    assert checksum._XXH3 is not None   # the fast path is the one in use on the supported wheels
    fallback = PieceHasher.__new__(PieceHasher)
    fallback._state, fallback._py = None, None
    fallback.reset()
    for h in (PieceHasher(), fallback):
        for piece in (512 * 1024, 4096, 1000):
            h.reset()
            for off in range(0, len(view), piece):
                h.update(view[off:off + piece], addr + off)
            assert h.digest() == whole
    flipped = bytearray(view)
    for where in (0, len(flipped) // 2, len(flipped) - 1):
        flipped[where] ^= 1
        assert block_checksum(flipped) != whole
        flipped[where] ^= 1


def test_copy_piece_size_follows_glibc_non_temporal_threshold() -> None:
    """2 MiB pieces only where glibc copies them with non-temporal stores; 512 KiB otherwise."""
    from kvmesh.kvstore.client_messages import CACHED_PIECE_BYTES, NT_PIECE_BYTES, copy_piece_bytes

    assert copy_piece_bytes("") == CACHED_PIECE_BYTES
    nt = "glibc.cpu.x86_non_temporal_threshold"
    assert copy_piece_bytes(f"{nt}=0x100000:glibc.cpu.x86_rep_movsb_threshold=0x200000") == NT_PIECE_BYTES
    assert copy_piece_bytes(f"glibc.malloc.trim_threshold=1:{nt}=2097152") == NT_PIECE_BYTES
    assert copy_piece_bytes(f"{nt}=0x4000000") == CACHED_PIECE_BYTES
    assert copy_piece_bytes(f"{nt}=junk") == CACHED_PIECE_BYTES
