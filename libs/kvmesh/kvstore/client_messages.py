"""The offload client's requests and how it reads the answers, with no I/O.

Validation of what callers pass, the messages of each path (gRPC stream, shm, bulk)
and the assembly of blocks from the store's answers: pure functions over protobuf
messages and buffers, shared by the client core (``client_core``) and testable alone.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvmesh.kvstore.checksum import PieceHasher, block_checksum
from kvmesh.kvstore.client_types import (
    CHUNK_BYTES,
    MAX_KEYS,
    BytesLike,
    InvalidOffloadRequest,
    OffloadError,
    PutResult,
    StoreStats,
)
from kvmesh.kvstore.limits import MAX_U32, key_problem, namespace_problem, session_hint
from kvmesh.kvstore.shm import SHM_DIR, Segment
from kvmesh.kvstore.wire import Chunk, encode_put_chunk
from kvmesh_api.offload.v1 import offload_pb2


def check_ns(namespace: str) -> str:
    problem = namespace_problem(namespace)
    if problem is not None:
        raise InvalidOffloadRequest(problem)
    return namespace


def check_keys(keys: Sequence[int]) -> list[int]:
    out = list(keys)
    if len(out) > MAX_KEYS:
        raise InvalidOffloadRequest(f"chain of {len(out)} keys exceeds the max of {MAX_KEYS}")
    for k in out:
        problem = key_problem(k)
        if problem is not None:
            raise InvalidOffloadRequest(problem)
    return out


def check_dests(sizes: list[int], dests: Sequence[object]) -> list[memoryview]:
    """Writable byte views of the caller's buffers, cut to the block sizes."""
    if len(dests) < len(sizes):
        raise InvalidOffloadRequest(f"{len(dests)} destination buffers for {len(sizes)} blocks")
    out = []
    for i, n in enumerate(sizes):
        d = memoryview(dests[i]).cast("B")  # type: ignore[arg-type]
        if d.readonly:
            raise InvalidOffloadRequest(f"destination buffer {i} is read-only")
        if len(d) < n:
            raise InvalidOffloadRequest(f"destination buffer {i} has {len(d)} bytes, block has {n}")
        out.append(d[:n])
    return out


# Blocks are copied in pieces, each checksummed in the destination right after its copy. Which
# size is fastest depends on how glibc copies it (docs/bench-history.md, #20):
# - With glibc's non-temporal threshold at or below 2 MiB (GLIBC_TUNABLES, docs/offload.md),
#   2 MiB pieces are copied with non-temporal stores: two memory transfers per byte where a
#   cached copy makes three (the destination lines are read before being written). An
#   unverified copy then runs at about the one-big-memcpy baseline, and a verified one reads the
#   piece back from memory to checksum it, which XXH3 does fast enough to come out even or ahead.
# - Otherwise 512 KiB pieces, copied with cached stores and checksummed while in cache: 2 MiB
#   pieces copied that way are slower.
# Either way glibc must not copy pieces with `rep movsb` (on AMD it does for 8 KiB .. L2 size,
# about half as fast here): glibc.cpu.x86_rep_movsb_threshold=0x200000.
NT_PIECE_BYTES = 2 * 1024 * 1024
CACHED_PIECE_BYTES = 512 * 1024
_NT_TUNABLE = "glibc.cpu.x86_non_temporal_threshold="


def copy_piece_bytes(glibc_tunables: str) -> int:
    """The copy loop's piece size for a process started with ``GLIBC_TUNABLES=glibc_tunables``
    (glibc reads it once, at start)."""
    for item in glibc_tunables.split(":"):
        if item.startswith(_NT_TUNABLE):
            try:
                if int(item[len(_NT_TUNABLE):], 0) <= NT_PIECE_BYTES:
                    return NT_PIECE_BYTES
            except ValueError:
                pass
    return CACHED_PIECE_BYTES


VERIFY_CHUNK_BYTES = copy_piece_bytes(os.environ.get("GLIBC_TUNABLES", ""))

# Threads that copy (and checksum) one get's or one put's blocks, each its own share of them. One
# core's copy plus checksum is bound by that core's memory-level parallelism, not by the memory
# bus, so a second core nearly doubles a big transfer; both the copy (ctypes.memmove) and the
# checksum (XXH3 through ctypes, kvstore.checksum) release the GIL. 1 = the calling thread alone.
COPY_THREADS_ENV = "KVMESH_OFFLOAD_COPY_THREADS"
DEFAULT_COPY_THREADS = 2
# Transfers smaller than this are copied by the calling thread: a hand-off costs ~50 us.
PARALLEL_MIN_BYTES = 8 * 1024 * 1024


def copy_threads() -> int:
    """Copy threads per transfer: ``$KVMESH_OFFLOAD_COPY_THREADS``, else 2 (1 on a single-CPU process)."""
    try:
        return max(1, int(os.environ[COPY_THREADS_ENV]))
    except (KeyError, ValueError):
        return min(DEFAULT_COPY_THREADS, len(os.sched_getaffinity(0)))


_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_pid = 0


def _copy_pool(helpers: int) -> ThreadPoolExecutor:
    global _pool, _pool_size, _pool_pid
    with _pool_lock:
        # A forked child inherits the pool object but not its threads: work submitted there
        # would never run, so a child makes its own.
        if _pool is None or _pool_size < helpers or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(helpers, thread_name_prefix="kvmesh-offload-copy")
            _pool_size, _pool_pid = helpers, os.getpid()
        return _pool


def _address(buf: memoryview) -> int:
    # np.frombuffer accepts read-only buffers (the store's slabs are mapped read-only).
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def _copy_share(dsts: list[memoryview], srcs: list[memoryview], summed: Sequence[bool], sums: list[int],
                lo: int, hi: int) -> None:
    """Copy blocks ``lo:hi`` piece by piece; ``sums[i]`` = XXH3-64 of ``dsts[i]`` where ``summed[i]``."""
    hasher = PieceHasher() if any(summed[lo:hi]) else None
    for i in range(lo, hi):
        d, v, want = dsts[i], srcs[i], summed[i]
        n = len(v)
        da, sa = _address(d), _address(v)
        if want and hasher is not None:
            hasher.reset()
        for off in range(0, n, VERIFY_CHUNK_BYTES):
            size = min(VERIFY_CHUNK_BYTES, n - off)
            ctypes.memmove(da + off, sa + off, size)
            if want and hasher is not None:
                hasher.update(d[off:off + size], da + off)
        sums[i] = hasher.digest() if want and hasher is not None else 0


def share_threads(nbytes: int, nblocks: int, threads: int | None = None) -> int:
    """How many threads copy a transfer of ``nblocks`` blocks, ``nbytes`` in all: ``threads``
    (default ``copy_threads()``), at most one per block, and 1 below ``PARALLEL_MIN_BYTES``."""
    n = min(threads or copy_threads(), nblocks)
    return 1 if n > 1 and nbytes < PARALLEL_MIN_BYTES else max(1, n)


def copy_blocks(dsts: list[memoryview], srcs: list[memoryview], summed: Sequence[bool],
                threads: int | None = None) -> list[int]:
    """Copy ``srcs[i]`` into ``dsts[i]`` (same lengths, checked by the caller) in
    ``VERIFY_CHUNK_BYTES`` pieces; where ``summed[i]``, checksum each piece of the *destination*
    right after copying it. Returns each destination's XXH3-64 (0 where not summed).

    The one copy loop of the same-host paths: the get's copy into the caller's buffers and the
    put's copy into the store's slots (or the client's segment). The blocks are split over
    ``share_threads`` threads, each a contiguous share, the calling thread one of them; it
    returns only when every share is done (a share's error is raised after that).
    """
    n = len(srcs)
    sums = [0] * n
    nthreads = share_threads(sum(len(v) for v in srcs), n, threads)
    bounds = [n * t // nthreads for t in range(nthreads + 1)]
    futures = []
    if nthreads > 1:
        pool = _copy_pool(nthreads - 1)
        futures = [pool.submit(_copy_share, dsts, srcs, summed, sums, bounds[t], bounds[t + 1])
                   for t in range(1, nthreads)]
    try:
        _copy_share(dsts, srcs, summed, sums, bounds[0], bounds[1])
    finally:
        errors = [f.exception() for f in futures]   # waits for every share, even after an error
    for exc in errors:
        if exc is not None:
            raise exc
    return sums


def copy_into(views: list[memoryview], dests: Sequence[object], checksums: Sequence[int] | None = None,
              keys: Sequence[int] | None = None, threads: int | None = None) -> int:
    """Copy each view into the matching caller buffer.

    ``checksums`` (an XXH3-64 per block, 0 = unknown): verify each block as it is copied. The checksum
    is taken over the *destination* bytes, piece by piece right after copying them, so what the
    caller ends up with is what was verified even if the source (shared memory another process
    may write) changes meanwhile; a mismatch raises ``OffloadError``.
    ``threads``: copy threads (default ``copy_threads()``), see ``copy_blocks``.
    """
    dsts = check_dests([len(v) for v in views], dests)
    wants = [(checksums[i] if checksums is not None and i < len(checksums) else 0) for i in range(len(views))]
    sums = copy_blocks(dsts, views, [w != 0 for w in wants], threads)
    for i, (want, got) in enumerate(zip(wants, sums, strict=True)):
        if want and got != want:
            name = keys[i] if keys is not None and i < len(keys) else i
            raise OffloadError(f"block {name}: checksum mismatch in shared memory")
    return len(views)


# --- Put -----------------------------------------------------------------------------------


@dataclass
class PutPlan:
    header: offload_pb2.PutHeader
    keys: list[int]
    datas: list[BytesLike]
    tokens: list[list[int]] | None
    total: int

    @functools.cached_property
    def checksums(self) -> list[int]:
        """Checksums of the source blocks (the gRPC stream and the Mooncake pool; the shm puts
        checksum what they wrote instead)."""
        return [block_checksum(d) for d in self.datas]


def plan_put(namespace: str, blocks: Sequence[tuple[int, BytesLike]], token_ids: Sequence[Sequence[int]] | None,
             parent: int | None, block_size: int, session_id: str) -> PutPlan:
    check_ns(namespace)
    keys = check_keys([k for k, _ in blocks])
    datas = [d for _, d in blocks]
    for k, d in zip(keys, datas, strict=True):
        if not isinstance(d, bytes | bytearray | memoryview):
            raise InvalidOffloadRequest(f"block {k}: data must be bytes-like, got {type(d).__name__}")
        if len(d) == 0:
            raise InvalidOffloadRequest(f"block {k}: empty data")
    tokens = None
    if token_ids is not None:
        tokens = [list(t) for t in token_ids]
        if len(tokens) != len(keys):
            raise InvalidOffloadRequest(f"token_ids has {len(tokens)} entries for {len(keys)} blocks")
    if parent is not None:
        check_keys([parent])
    if block_size < 0:
        raise InvalidOffloadRequest("block_size must be >= 0")
    if not isinstance(session_id, str | None):
        raise InvalidOffloadRequest("session_id must be a string")
    session_id = session_hint(session_id or "")
    if tokens is not None and any(not 0 <= t <= MAX_U32 for ts in tokens for t in ts):
        raise InvalidOffloadRequest("token ids must be uint32")
    header = offload_pb2.PutHeader(namespace=namespace, session_id=session_id,
                                   parent_key=parent or 0, has_parent=parent is not None, block_size=block_size)
    return PutPlan(header, keys, datas, tokens,
                   sum(len(d) for d in datas))


def put_stream(plan: PutPlan) -> Iterator[bytes]:
    """Wire-encoded PutRequests (see ``kvstore.wire``): one copy of each payload."""
    yield offload_pb2.PutRequest(header=plan.header).SerializeToString()
    for i, (key, data) in enumerate(zip(plan.keys, plan.datas, strict=True)):
        mv = memoryview(data).cast("B")
        n = len(mv)
        for off in range(0, n, CHUNK_BYTES):
            end = min(off + CHUNK_BYTES, n)
            last = end == n
            yield encode_put_chunk(key, mv[off:end], last, plan.checksums[i] if last else 0,
                                   plan.tokens[i] if last and plan.tokens is not None else ())


def shm_put_request(plan: PutPlan, seg: Segment, threads: int | None = None) -> offload_pb2.ShmRequest:
    """Copies the blocks into ``seg`` back to back and checksums what it wrote (blocking: the
    put's memcpy, on ``threads`` copy threads, see ``copy_blocks``)."""
    srcs = [memoryview(d).cast("B") for d in plan.datas]
    sizes = [len(v) for v in srcs]
    offsets: list[int] = []
    off = 0
    for n in sizes:
        offsets.append(off)
        off += n
    dsts = [seg.buf[o:o + n] for o, n in zip(offsets, sizes, strict=True)]
    sums = copy_blocks(dsts, srcs, [True] * len(srcs), threads)
    req = offload_pb2.ShmRequest(header=plan.header, segment=seg.name, keys=plan.keys, offsets=offsets,
                                 sizes=sizes, checksums=sums)
    if plan.tokens is not None:
        req.tokens.extend(offload_pb2.TokenBlock(ids=t) for t in plan.tokens)
    return req


def reserve_request(plan: PutPlan) -> offload_pb2.ShmRequest:
    return offload_pb2.ShmRequest(header=plan.header, keys=plan.keys,
                                  sizes=[memoryview(d).nbytes for d in plan.datas])


def write_reserved(plan: PutPlan, resv: offload_pb2.PutReservation, maps: StoreMaps,
                   threads: int | None = None) -> offload_pb2.PutCommit:
    """Copies each block into its reserved slab slot and checksums the slot right after, piece
    by piece (blocking: the one copy of the put, on ``threads``
    copy threads like a get's, see ``copy_blocks``)."""
    n = len(plan.keys)
    if len(resv.segments) != n or len(resv.offsets) != n:
        raise OffloadError(f"ReservePut answered {len(resv.segments)} slots for {n} blocks")
    srcs: list[memoryview] = []
    dsts: list[memoryview] = []
    for name, off, data in zip(resv.segments, resv.offsets, plan.datas, strict=True):
        seg = maps.get(name)
        mv = memoryview(data).cast("B")
        size = len(mv)
        if off + size > seg.size:
            raise OffloadError(f"reserved slot at {off}+{size} is past slab {name}")
        srcs.append(mv)
        dsts.append(seg.buf[off:off + size])
    req = offload_pb2.PutCommit(reservation=resv.reservation, checksums=copy_blocks(dsts, srcs, [True] * n, threads))
    if plan.tokens is not None:
        req.tokens.extend(offload_pb2.TokenBlock(ids=t) for t in plan.tokens)
    return req


def put_result(resp: offload_pb2.PutResponse, via_shm: bool) -> PutResult:
    return PutResult(resp.stored, resp.already_present, resp.bytes, resp.evicted, via_shm)


def store_stats(resp: offload_pb2.StatsResponse) -> StoreStats:
    return StoreStats(resp.ram_bytes, resp.ram_capacity_bytes, resp.disk_bytes, resp.disk_capacity_bytes,
                      resp.ram_blocks, resp.disk_blocks, resp.eviction_policy, dict(resp.counters))


# --- Get -----------------------------------------------------------------------------------


def stream_get_request(namespace: str, keys: list[int]) -> offload_pb2.GetRequest:
    return offload_pb2.GetRequest(namespace=namespace, keys=keys, chunk_bytes=CHUNK_BYTES)


class GetAssembler:
    """Rebuilds blocks from a Get stream, verifying each block's checksum."""

    def __init__(self, keys: list[int], verify: bool) -> None:
        self.keys = keys
        self.verify = verify
        self.blocks: list[memoryview] = []
        self.tiers: list[int] = []
        self._parts: list[memoryview] = []

    def feed(self, ch: Chunk) -> None:
        idx = len(self.blocks)
        if idx >= len(self.keys) or ch.key != self.keys[idx]:
            raise OffloadError(f"store sent block {ch.key} out of order (expected index {idx})")
        self._parts.append(ch.data)
        if not ch.last:
            return
        data = self._parts[0] if len(self._parts) == 1 else memoryview(b"".join(self._parts))
        self._parts = []
        if self.verify and ch.checksum and block_checksum(data) != ch.checksum:
            raise OffloadError(f"block {ch.key}: checksum mismatch on the wire")
        self.blocks.append(data)
        self.tiers.append(ch.tier)


def first_shm_size(hint: int | None, n: int) -> int:
    """Segment size for a shm Get: the known block size x chain, else a bounded guess
    (a chain is often only partly present; the store says when more would fit)."""
    if hint:
        return hint * n
    return min(n, 64) * (1 << 20)


def grown_shm_size(resp: offload_pb2.ShmGetResponse, n_keys: int, seg: Segment) -> int:
    """After a truncated GetShm: room for the whole chain at the largest block size seen, at least double."""
    return max(max(resp.sizes, default=0) * n_keys, seg.size * 2)


def shm_get_request(namespace: str, keys: list[int], seg: Segment) -> offload_pb2.ShmRequest:
    return offload_pb2.ShmRequest(header=offload_pb2.PutHeader(namespace=namespace), segment=seg.name,
                                  keys=keys, capacity=seg.size, map_store=True)


class StoreMaps:
    """Mappings of the store's shared slabs, by segment name (read-only unless ``writable``:
    the zero-copy put writes into reserved slots).

    Slabs live as long as the store, so a mapping is kept; when an unknown name
    shows up (new slab, or a restarted store) mappings of unlinked slabs are dropped.
    """

    def __init__(self, writable: bool = False) -> None:
        self._lock = threading.Lock()
        self._maps: dict[str, Segment] = {}
        self._readonly = not writable

    def get(self, name: str) -> Segment:
        with self._lock:
            seg = self._maps.get(name)
        if seg is not None:
            return seg
        self._prune()
        # Slabs are fully allocated and every slot gets used: map all their pages now.
        seg = Segment.attach(name, readonly=self._readonly, populate=True)
        with self._lock:
            old = self._maps.setdefault(name, seg)
        if old is not seg:
            seg.close()
        return old

    def _prune(self) -> None:
        with self._lock:
            stale = [n for n in self._maps if not (SHM_DIR / n).exists()]
            segs = [self._maps.pop(n) for n in stale]
        for seg in segs:
            seg.close()

    def close(self) -> None:
        with self._lock:
            segs, self._maps = list(self._maps.values()), {}
        for seg in segs:
            seg.close()


def views_from_shm(resp: offload_pb2.ShmGetResponse, seg: Segment, verify: bool,
                   keys: list[int], store_maps: StoreMaps | None = None) -> list[memoryview]:
    """The blocks of a complete GetShm answer: in ``seg`` or in the store's slabs it names."""
    views = []
    names = resp.segments
    for i in range(resp.leading_present):
        off, size = resp.offsets[i], resp.sizes[i]
        name = names[i] if i < len(names) else ""
        src = store_maps.get(name) if name and store_maps is not None else seg
        if off + size > src.size:
            raise OffloadError(f"block {keys[i]}: shm answer points past segment {src.name}")
        v = src.buf[off:off + size]
        if verify and i < len(resp.checksums) and resp.checksums[i] and block_checksum(v) != resp.checksums[i]:
            raise OffloadError(f"block {keys[i]}: checksum mismatch in shared memory")
        views.append(v)
    return views

