"""gRPC servicer of ``kvmesh.offload.v1.Offload`` over the synchronous store core.

Store calls run in a worker thread (``asyncio.to_thread``) so disk reads and
large copies never stall the event loop. A streamed Put is buffered in full and
committed only when the client half-closes the stream: a client that dies or
cancels mid-stream leaves nothing visible.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator

import grpc

from kvmesh.kvstore.block import buffer_of
from kvmesh.kvstore.checksum import block_checksum
from kvmesh.kvstore.limits import namespace_problem, session_problem
from kvmesh.kvstore.shm import SHM_DIR, AttachCache, Segment, ShmError, validate_name
from kvmesh.kvstore.wire import Chunk, decode_put_request, encode_get_response
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.offload.v1 import offload_pb2, offload_pb2_grpc
from kvmesh_offload.arena import SLAB_PREFIX, Arena, Slot
from kvmesh_offload.bulk import BulkServer
from kvmesh_offload.leases import Caller, LeaseTable, caller_of
from kvmesh_offload.metrics import RESTORE_LATENCY
from kvmesh_offload.pool_tier import POOL_NAME, PoolTier
from kvmesh_offload.reserve import ReservationTable, ReserveError
from kvmesh_offload.store import CPU, BadBlockError, BlockIn, Found, OffloadStore, StoreFullError

log = logging.getLogger(__name__)

MAX_CHUNK_BYTES = 4 * 1024 * 1024
MAX_KEYS = 65_536
MAX_U64 = (1 << 64) - 1
DEFAULT_CHUNK = 1024 * 1024
DEFAULT_LEASE_TTL_S = 120.0
_TIER = {CPU: common_pb2.TIER_CPU, "DISK": common_pb2.TIER_DISK}


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _check_ns(ns: str) -> None:
    problem = namespace_problem(ns)
    if problem is not None:
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, problem)


def _check_header(header: offload_pb2.PutHeader) -> None:
    _check_ns(header.namespace)
    problem = session_problem(header.session_id)
    if problem is not None:
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, problem)


POOLED = ("this store keeps its block bytes in a Mooncake pool: move them with a pool client "
          "(kvmesh.kvstore.mooncake.client, store_backend 'mooncake'); it serves Contains, GetBulk "
          "(sizes and checksums), Delete, Stats and PutShm with no segment")


def _check_keys(n: int) -> None:
    if n > MAX_KEYS:
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"chain of {n} keys exceeds the max of {MAX_KEYS}")


class OffloadServicer(offload_pb2_grpc.OffloadServicer):
    def __init__(self, store: OffloadStore, *, shm_enabled: bool = True,
                 max_block_bytes: int = 64 * 1024 * 1024, lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
                 bulk_host: str = "127.0.0.1", bulk_port: int | None = None, lease_bind_host: bool = True,
                 direct_put: bool = True, pool: PoolTier | None = None) -> None:
        self.store = store
        # Bytes in a Mooncake pool: this store answers for the index only (see pool_tier).
        self.pool = pool
        if pool is not None:
            bulk_port = None
        self.shm_enabled = shm_enabled
        self.direct_put = direct_put
        self.max_block_bytes = max_block_bytes
        self.draining = False
        self._segments = AttachCache()
        # Slabs for big blocks; a little headroom over RAM for blocks still held by readers.
        # Shared slabs let same-host clients read blocks in place (GetShm map_store).
        self.arena = Arena(int(store.ram.capacity * 1.25) + 64 * 1024 * 1024, shared=shm_enabled)
        # GetShm/GetBulk leases: token -> blocks kept alive while their caller reads them.
        self.leases = LeaseTable(lease_ttl_s, bind_host=lease_bind_host)
        # ReservePut: slab slots a same-host client writes into before CommitPut. All open
        # reservations together may pin up to the RAM budget, the most one put may store: at
        # half of it (as before) every put over half the RAM silently took the PutShm path
        # (two copies), the 1 GiB put of `kvmesh bench offload` included.
        self.reservations = ReservationTable(self.arena, max(store.ram.capacity, 1))
        # Bulk TCP data plane (GetBulk); None = off, 0 = any free port.
        self.bulk = BulkServer(bulk_host, bulk_port, self._take_lease) if bulk_port is not None else None
        # Bytes buffered by all in-flight Put streams: many concurrent streams must not
        # hold more than the RAM budget between them before anything is committed.
        self.inflight_put_bytes = 0

    async def _guard(self, context: grpc.aio.ServicerContext, coro):  # noqa: ANN001, ANN202
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "offload store is shutting down")
        try:
            return await coro
        except _Abort as exc:
            await context.abort(exc.code, exc.message)
        except StoreFullError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"store full: {exc}")
        except BadBlockError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    # -- Put ----------------------------------------------------------------------------------

    async def Put(self, request_iterator: AsyncIterator[offload_pb2.PutRequest],
                  context: grpc.aio.ServicerContext) -> offload_pb2.PutResponse:
        return await self._guard(context, self._put(request_iterator))

    def _not_pooled(self) -> None:
        if self.pool is not None:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, POOLED)

    async def _put(self, it: AsyncIterator[offload_pb2.PutRequest]) -> offload_pb2.PutResponse:
        self._not_pooled()
        held = [0]
        try:
            return await self._put_stream(it, held)
        finally:
            self.inflight_put_bytes -= held[0]

    async def _put_stream(self, it: AsyncIterator[offload_pb2.PutRequest], held: list[int]) -> offload_pb2.PutResponse:
        header: offload_pb2.PutHeader | None = None
        blocks: list[BlockIn] = []
        parts: list[bytes] = []
        cur_key: int | None = None
        cur_len = 0
        total = 0
        cap = self.store.ram.capacity
        async for req in it:
            if header is None:
                if not isinstance(req, offload_pb2.PutHeader):
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "the first Put message must be a header")
                header = req
                _check_header(header)
                continue
            if not isinstance(req, Chunk):
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "only one header per Put stream")
            ch = req
            if cur_key is not None and ch.key != cur_key:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"chunk out of order: block {ch.key} started before block {cur_key} ended")
            if len(ch.data) > MAX_CHUNK_BYTES:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"chunk of {len(ch.data)} bytes exceeds {MAX_CHUNK_BYTES}")
            cur_key = ch.key
            parts.append(ch.data)
            cur_len += len(ch.data)
            total += len(ch.data)
            if cur_len > self.max_block_bytes:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"block {ch.key} exceeds the max block size of {self.max_block_bytes}")
            if total > cap:
                raise StoreFullError(f"Put of at least {total} bytes exceeds the RAM capacity of {cap}")
            held[0] += len(ch.data)
            self.inflight_put_bytes += len(ch.data)
            if self.inflight_put_bytes > cap:
                raise StoreFullError(f"{self.inflight_put_bytes} bytes of Puts in flight exceed the RAM capacity {cap}")
            if not ch.last:
                continue
            joined = parts[0] if len(parts) == 1 else b"".join(parts)
            parts, cur_key, cur_len = [], None, 0
            if not len(joined):
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"block {ch.key}: empty data")
            data = self.arena.copy_in(joined)
            if not isinstance(data, Slot) and isinstance(data, memoryview):
                data = bytes(data)  # do not pin the whole received message
            csum = block_checksum(buffer_of(data))
            if ch.checksum and csum != ch.checksum:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"block {ch.key}: checksum mismatch on Put")
            blocks.append(BlockIn(ch.key, data, csum, tuple(ch.token_ids)))
            if len(blocks) > MAX_KEYS:
                _check_keys(len(blocks))
        if header is None:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "empty Put stream (no header)")
        if cur_key is not None:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"stream ended inside block {cur_key} (no last chunk)")
        return await self._commit(header, blocks)

    async def _commit(self, header: offload_pb2.PutHeader, blocks: list[BlockIn]) -> offload_pb2.PutResponse:
        self._sweep_leases()  # expired leases pin slab memory a Put may need
        out = await asyncio.to_thread(
            self.store.put, header.namespace, blocks, parent=header.parent_key if header.has_parent else None,
            session=header.session_id, block_size=header.block_size)
        return offload_pb2.PutResponse(stored=out.stored, already_present=out.already_present, bytes=out.bytes,
                                       evicted=out.evicted)

    # -- Get ----------------------------------------------------------------------------------

    async def Get(self, request: offload_pb2.GetRequest,
                  context: grpc.aio.ServicerContext) -> AsyncIterator[offload_pb2.GetResponse]:
        t0 = time.perf_counter()
        if self.pool is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, POOLED)
        found = await self._guard(context, self._lookup(request.namespace, request.keys))
        chunk = request.chunk_bytes or DEFAULT_CHUNK
        chunk = max(4096, min(chunk, MAX_CHUNK_BYTES))
        # `found` keeps every block (and its arena slot) alive until the stream is done.
        for f in found:
            mv = memoryview(buffer_of(f.block.data))
            tier = _TIER[f.medium]
            n = len(mv)
            for off in range(0, n, chunk):
                end = min(off + chunk, n)
                last = end == n
                # Pre-encoded bytes: the response serializer passes them through.
                yield encode_get_response(f.key, mv[off:end], last, f.block.checksum if last else 0, tier)
        if found:
            RESTORE_LATENCY.labels("grpc").observe(time.perf_counter() - t0)

    async def _lookup(self, namespace: str, keys) -> list[Found]:  # noqa: ANN001
        _check_ns(namespace)
        _check_keys(len(keys))
        return await asyncio.to_thread(self.store.get, namespace, list(keys))

    # -- small RPCs ---------------------------------------------------------------------------

    async def Contains(self, request: offload_pb2.ContainsRequest,
                       context: grpc.aio.ServicerContext) -> offload_pb2.ContainsResponse:
        async def run() -> offload_pb2.ContainsResponse:
            _check_ns(request.namespace)
            _check_keys(len(request.keys))
            present, in_ram = self.store.contains(request.namespace, list(request.keys))
            return offload_pb2.ContainsResponse(leading_present=present, leading_in_ram=in_ram)
        return await self._guard(context, run())

    async def Delete(self, request: offload_pb2.DeleteRequest,
                     context: grpc.aio.ServicerContext) -> offload_pb2.DeleteResponse:
        async def run() -> offload_pb2.DeleteResponse:
            _check_ns(request.namespace)
            _check_keys(len(request.keys))
            n = await asyncio.to_thread(self.store.delete, request.namespace, list(request.keys))
            return offload_pb2.DeleteResponse(deleted=n)
        return await self._guard(context, run())

    async def Stats(self, request: offload_pb2.StatsRequest,
                    context: grpc.aio.ServicerContext) -> offload_pb2.StatsResponse:
        s = self.store.stats()
        pool = {} if self.pool is None else {"pool": POOL_NAME, "pool_prefix": self.pool.prefix,
                                             "pool_master": self.pool.master}
        return offload_pb2.StatsResponse(**pool,
            ram_bytes=s["ram_bytes"], ram_capacity_bytes=s["ram_capacity_bytes"], disk_bytes=s["disk_bytes"],
            disk_capacity_bytes=s["disk_capacity_bytes"], ram_blocks=s["ram_blocks"], disk_blocks=s["disk_blocks"],
            counters={k: int(v) for k, v in s["counters"].items() if v >= 0}, eviction_policy=s["eviction_policy"])

    # -- shared memory ------------------------------------------------------------------------

    def _attach(self, name: str) -> Segment:
        """The client's segment, mapped (cached); the caller releases it (``_segments.release``)."""
        if not self.shm_enabled:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, "shared-memory path is disabled on this store")
        try:
            validate_name(name)
        except ShmError as exc:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if name.startswith(SLAB_PREFIX) or self._is_slab(name):
            # Writing (GetShm) or reading (PutShm) the store's own slabs would let a client
            # overwrite or re-label other clients' blocks.
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "a request may not name one of the store's segments")
        try:
            return self._segments.get(name)
        except ShmError as exc:
            # FAILED_PRECONDITION tells the client to fall back to gRPC (e.g. another host).
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None

    def _is_slab(self, name: str) -> bool:
        try:
            st = os.stat(SHM_DIR / name)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) in self.arena.slab_ids()

    async def PutShm(self, request: offload_pb2.ShmRequest,
                     context: grpc.aio.ServicerContext) -> offload_pb2.PutResponse:
        return await self._guard(context, self._put_shm(request))

    async def _put_shm(self, req: offload_pb2.ShmRequest) -> offload_pb2.PutResponse:
        _check_header(req.header)
        n = len(req.keys)
        _check_keys(n)
        if self.pool is not None:
            return await self._put_pool(req)
        if len(req.offsets) != n or len(req.sizes) != n:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "keys, offsets and sizes must have the same length")
        if req.checksums and len(req.checksums) != n:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "checksums must be empty or one per key")
        self._check_put_sizes(req, n, "RAM capacity")
        end = max((o + s for o, s in zip(req.offsets, req.sizes, strict=True)), default=0)
        seg = await asyncio.to_thread(self._attach, req.segment)
        try:
            if end > seg.size:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"blocks end at {end}, past the segment's {seg.size}")
            blocks = await asyncio.to_thread(self._copy_in, req, seg)
        finally:
            self._segments.release(seg)
        out = await self._commit(req.header, blocks)
        self.store.count("puts_shm_copied")
        return out

    def _check_put_sizes(self, req: offload_pb2.ShmRequest, n: int, budget: str) -> None:
        """Per-block size bounds and the whole put against the byte budget (shm and pool puts)."""
        if req.tokens and len(req.tokens) != n:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "tokens must be empty or one per key")
        for k, size in zip(req.keys, req.sizes, strict=True):
            if size == 0 or size > self.max_block_bytes:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"block {k}: size {size} outside (0, {self.max_block_bytes}]")
        if sum(req.sizes) > self.store.ram.capacity:
            raise StoreFullError(f"Put of {sum(req.sizes)} bytes exceeds the {budget} {self.store.ram.capacity}")

    async def _put_pool(self, req: offload_pb2.ShmRequest) -> offload_pb2.PutResponse:
        """Commit blocks a client already wrote to the pool (their objects must exist)."""
        assert self.pool is not None
        n = len(req.keys)
        if req.segment:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "a pooled store takes no segment: write the blocks "
                                                           "to the pool, then PutShm with an empty segment")
        if len(req.sizes) != n or len(req.checksums) != n:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "keys, sizes and checksums must have the same length")
        self._check_put_sizes(req, n, "pool budget")
        missing = await asyncio.to_thread(self.pool.missing, req.header.namespace, list(req.keys))
        if missing:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"{len(missing)} block(s) not in the pool (first: {missing[0]}): write them before PutShm")
        blocks = [BlockIn(k, None, csum, tuple(req.tokens[i].ids) if req.tokens else (), size)
                  for i, (k, size, csum) in enumerate(zip(req.keys, req.sizes, req.checksums, strict=True))]
        return await self._commit(req.header, blocks)

    def _copy_in(self, req: offload_pb2.ShmRequest, seg: Segment) -> list[BlockIn]:
        arena = self.arena
        blocks = []
        for i, (k, off, size) in enumerate(zip(req.keys, req.offsets, req.sizes, strict=True)):
            data = arena.copy_in(seg.buf[off:off + size])
            if isinstance(data, memoryview):
                data = bytes(data)
            csum = block_checksum(buffer_of(data))
            if req.checksums and req.checksums[i] and req.checksums[i] != csum:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"block {k}: checksum mismatch on PutShm")
            toks = tuple(req.tokens[i].ids) if req.tokens else ()
            blocks.append(BlockIn(k, data, csum, toks))
        return blocks

    async def ReservePut(self, request: offload_pb2.ShmRequest,
                         context: grpc.aio.ServicerContext) -> offload_pb2.PutReservation:
        return await self._guard(context, self._reserve_put(request, caller_of(context)))

    async def _reserve_put(self, req: offload_pb2.ShmRequest, caller: Caller) -> offload_pb2.PutReservation:
        self._not_pooled()
        if not (self.shm_enabled and self.direct_put):
            raise _Abort(grpc.StatusCode.UNIMPLEMENTED, "zero-copy puts are disabled on this store (--direct-put)")
        _check_ns(req.header.namespace)
        n = len(req.keys)
        _check_keys(n)
        if len(req.sizes) != n:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "keys and sizes must have the same length")
        for k, size in zip(req.keys, req.sizes, strict=True):
            if size == 0 or size > self.max_block_bytes:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"block {k}: size {size} outside (0, {self.max_block_bytes}]")
        if sum(req.sizes) > self.store.ram.capacity:
            raise StoreFullError(f"Put of {sum(req.sizes)} bytes exceeds the RAM capacity {self.store.ram.capacity}")
        if min(req.sizes, default=0) < self.arena.min_block:
            return offload_pb2.PutReservation(min_block_bytes=self.arena.min_block)
        self._sweep_leases()  # expired leases pin slab slots
        try:
            token, locs = await asyncio.to_thread(self.reservations.reserve, req.header, list(req.keys),
                                                  list(req.sizes), caller)
        except ReserveError as exc:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, f"no reservation: {exc}") from None
        return offload_pb2.PutReservation(reservation=token, segments=[seg for seg, _ in locs],
                                          offsets=[off for _, off in locs], ttl_s=self.reservations.ttl_s)

    async def CommitPut(self, request: offload_pb2.PutCommit,
                        context: grpc.aio.ServicerContext) -> offload_pb2.PutResponse:
        return await self._guard(context, self._commit_put(request, caller_of(context)))

    async def _commit_put(self, req: offload_pb2.PutCommit, caller: Caller) -> offload_pb2.PutResponse:
        res = self.reservations.take(req.reservation, caller)
        if res is None:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, "unknown or expired put reservation")
        if req.abort:
            return offload_pb2.PutResponse()
        n = len(res.keys)
        if len(req.checksums) != n:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"checksums must have one entry per block ({n})")
        if req.tokens and len(req.tokens) != n:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "tokens must be empty or one per block")
        blocks = [BlockIn(k, slot, csum, tuple(req.tokens[i].ids) if req.tokens else ())  # type: ignore[arg-type]
                  for i, (k, slot, csum) in enumerate(zip(res.keys, res.slots, req.checksums, strict=True))]
        out = await self._commit(res.header, blocks)
        self.store.count("puts_direct")   # which same-host path puts took (Stats counters)
        return out

    async def GetShm(self, request: offload_pb2.ShmRequest,
                     context: grpc.aio.ServicerContext) -> offload_pb2.ShmGetResponse:
        return await self._guard(context, self._get_shm(request, caller_of(context)))

    async def _get_shm(self, req: offload_pb2.ShmRequest, caller: Caller) -> offload_pb2.ShmGetResponse:
        t0 = time.perf_counter()
        self._not_pooled()
        _check_ns(req.header.namespace)
        _check_keys(len(req.keys))
        seg = await asyncio.to_thread(self._attach, req.segment)
        try:
            resp = await asyncio.to_thread(self._get_into, req, seg, caller)
        finally:
            self._segments.release(seg)
        if resp.leading_present:
            RESTORE_LATENCY.labels("shm").observe(time.perf_counter() - t0)
        return resp

    def _get_into(self, req: offload_pb2.ShmRequest, seg: Segment, caller: Caller) -> offload_pb2.ShmGetResponse:
        found = self.store.get(req.header.namespace, list(req.keys))
        if req.map_store and req.capacity:
            return self._map_out(req, seg, found, caller)
        return self._copy_out(req, seg, found)

    def _map_out(self, req: offload_pb2.ShmRequest, seg: Segment, found: list[Found],
                 caller: Caller) -> offload_pb2.ShmGetResponse:
        """Blocks in shared slabs are named, not copied, and leased until ReleaseShm;
        the others are packed into the client's segment as in ``_copy_out``."""
        limit = min(req.capacity, seg.size)
        resp = offload_pb2.ShmGetResponse()
        off = 0
        leased: list[Found] = []
        for f in found:
            data = f.block.data
            loc = data.location() if isinstance(data, Slot) else None
            if loc is not None:
                resp.segments.append(loc[0])
                resp.offsets.append(loc[1])
                resp.sizes.append(len(data))
                leased.append(f)
            else:
                buf = buffer_of(data)
                n = len(buf)
                if off + n > limit:
                    resp.truncated = True
                    resp.sizes.append(n)
                    break
                seg.buf[off:off + n] = buf
                resp.segments.append("")
                resp.offsets.append(off)
                resp.sizes.append(n)
                off += n
            resp.tiers.append(_TIER[f.medium])
            resp.checksums.append(f.block.checksum)
            resp.leading_present += 1
        if leased:
            resp.lease = self.leases.add(leased, caller)
        return resp

    def _sweep_leases(self) -> None:
        """Drop expired leases (a reader that died never releases); run on every lease and Put."""
        self.leases.sweep()

    def _take_lease(self, token: bytes, host: str) -> list[Found] | None:
        """The leased blocks for a bulk connection from ``host`` (ending the lease), or None."""
        return self.leases.take(token, host)

    async def GetBulk(self, request: offload_pb2.GetRequest,
                      context: grpc.aio.ServicerContext) -> offload_pb2.BulkGetResponse:
        if self.pool is not None:
            return await self._guard(context, self._get_pool(request))
        if self.bulk is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "bulk path is disabled on this store")
        found = await self._guard(context, self._lookup(request.namespace, request.keys))
        resp = offload_pb2.BulkGetResponse(leading_present=len(found), bulk_port=self.bulk.port)  # type: ignore[union-attr]
        for f in found:
            resp.sizes.append(len(buffer_of(f.block.data)))
            resp.tiers.append(_TIER[f.medium])
            resp.checksums.append(f.block.checksum)
        if found:
            resp.lease = self.leases.add(found, caller_of(context))
        return resp

    async def _get_pool(self, request: offload_pb2.GetRequest) -> offload_pb2.BulkGetResponse:
        """The leading blocks' sizes and checksums; the client reads the bytes from the pool (no lease:
        Mooncake's read lease covers the transfer, and a block evicted before it is a short read)."""
        found = await self._lookup(request.namespace, request.keys)
        return offload_pb2.BulkGetResponse(leading_present=len(found), sizes=[f.block.size for f in found],
                                           tiers=[_TIER[f.medium] for f in found],
                                           checksums=[f.block.checksum for f in found])

    async def ReleaseShm(self, request: offload_pb2.ShmRelease,
                         context: grpc.aio.ServicerContext) -> offload_pb2.ShmReleaseResponse:
        # Only the caller that took the lease can end it; anything else changes nothing.
        held = self.leases.release(request.lease, caller_of(context))
        return offload_pb2.ShmReleaseResponse(held=held)

    @property
    def lease_ttl_s(self) -> float:
        return self.leases.ttl_s

    @lease_ttl_s.setter
    def lease_ttl_s(self, value: float) -> None:
        self.leases.ttl_s = value

    @property
    def open_leases(self) -> int:
        return len(self.leases)

    def close(self) -> None:
        self._segments.close()
        if self.bulk is not None:
            self.bulk.close()
        self.leases.clear()
        self.arena.close()

    @staticmethod
    def _copy_out(req: offload_pb2.ShmRequest, seg: Segment, found: list[Found]) -> offload_pb2.ShmGetResponse:
        if req.capacity:
            limit = min(req.capacity, seg.size)
            slots = None
        else:
            # Explicit slots: block i goes at offsets[i] and may use sizes[i] bytes.
            if len(req.offsets) != len(req.sizes):
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "offsets and sizes must have the same length")
            limit = seg.size
            slots = list(zip(req.offsets, req.sizes, strict=True))
        resp = offload_pb2.ShmGetResponse()
        off = 0
        for i, f in enumerate(found):
            data = buffer_of(f.block.data)
            n = len(data)
            if slots is not None:
                if i >= len(slots):
                    resp.truncated = True
                    break
                off, room = slots[i]
                if n > room or off + n > limit:
                    resp.truncated = True
                    resp.sizes.append(n)  # tells the client how much room the next block needs
                    break
            elif off + n > limit:
                resp.truncated = True
                resp.sizes.append(n)
                break
            seg.buf[off:off + n] = data
            resp.offsets.append(off)
            resp.sizes.append(n)
            resp.tiers.append(_TIER[f.medium])
            resp.checksums.append(f.block.checksum)
            resp.leading_present += 1
            if slots is None:
                off += n
        return resp


def _passthrough(msg: object) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()  # type: ignore[attr-defined]


def add_offload_servicer(servicer: OffloadServicer, server: grpc.aio.Server) -> None:
    """Like the generated ``add_OffloadServicer_to_server``, with zero-copy codecs for Put and Get."""
    pb = offload_pb2
    handlers = {
        "Put": grpc.stream_unary_rpc_method_handler(servicer.Put, request_deserializer=decode_put_request,
                                                    response_serializer=pb.PutResponse.SerializeToString),
        "Get": grpc.unary_stream_rpc_method_handler(servicer.Get, request_deserializer=pb.GetRequest.FromString,
                                                    response_serializer=_passthrough),
        "Contains": grpc.unary_unary_rpc_method_handler(servicer.Contains,
                                                        request_deserializer=pb.ContainsRequest.FromString,
                                                        response_serializer=pb.ContainsResponse.SerializeToString),
        "Delete": grpc.unary_unary_rpc_method_handler(servicer.Delete, request_deserializer=pb.DeleteRequest.FromString,
                                                      response_serializer=pb.DeleteResponse.SerializeToString),
        "Stats": grpc.unary_unary_rpc_method_handler(servicer.Stats, request_deserializer=pb.StatsRequest.FromString,
                                                     response_serializer=pb.StatsResponse.SerializeToString),
        "PutShm": grpc.unary_unary_rpc_method_handler(servicer.PutShm, request_deserializer=pb.ShmRequest.FromString,
                                                      response_serializer=pb.PutResponse.SerializeToString),
        "ReservePut": grpc.unary_unary_rpc_method_handler(
            servicer.ReservePut, request_deserializer=pb.ShmRequest.FromString,
            response_serializer=pb.PutReservation.SerializeToString),
        "CommitPut": grpc.unary_unary_rpc_method_handler(
            servicer.CommitPut, request_deserializer=pb.PutCommit.FromString,
            response_serializer=pb.PutResponse.SerializeToString),
        "GetShm": grpc.unary_unary_rpc_method_handler(servicer.GetShm, request_deserializer=pb.ShmRequest.FromString,
                                                      response_serializer=pb.ShmGetResponse.SerializeToString),
        "GetBulk": grpc.unary_unary_rpc_method_handler(
            servicer.GetBulk, request_deserializer=pb.GetRequest.FromString,
            response_serializer=pb.BulkGetResponse.SerializeToString),
        "ReleaseShm": grpc.unary_unary_rpc_method_handler(
            servicer.ReleaseShm, request_deserializer=pb.ShmRelease.FromString,
            response_serializer=pb.ShmReleaseResponse.SerializeToString),
    }
    name = pb.DESCRIPTOR.services_by_name["Offload"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)
