"""Clients of the offload store: async for services and the sim engine, sync for vLLM connector threads.

Both speak the ``kvmesh.offload.v1.Offload`` contract. On the same host they use
the shared-memory fast path (``PutShm``/``GetShm``) and fall back to chunked gRPC
streams when the store cannot open the client's segment (another host, no
``/dev/shm``) — callers never need to know which path carried the bytes.

Errors are mapped to a small family so workers can decide what to do:
``StoreUnavailable`` (store down or slow: recompute), ``StoreFull`` (Put refused:
skip offloading), ``InvalidOffloadRequest`` (a bug in the caller).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import crc32c as _crc32c
import grpc
from opentelemetry import propagate, trace

from kvmesh.kvstore.bulk import BulkConnections, BulkLeaseExpired, host_of
from kvmesh.kvstore.shm import SHM_DIR, Segment, SegmentPool, ShmError, shm_available
from kvmesh.kvstore.wire import Chunk, decode_get_response, encode_put_chunk
from kvmesh.rpc.channel import aio_channel, channel_options
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.offload.v1 import offload_pb2, offload_pb2_grpc

log = logging.getLogger(__name__)
_tracer = trace.get_tracer(__name__)


def _trace_md() -> tuple[tuple[str, str], ...]:
    """W3C trace context of the current span as call metadata (the channel is not
    instrumented, to keep the bulk path lean), so the store's spans join the request trace."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())

CHUNK_BYTES = 4 * 1024 * 1024       # the contract's max chunk size
MAX_KEYS = 65_536
MAX_U64 = (1 << 64) - 1
DEFAULT_TIMEOUT_S = 60.0
# Codes meaning "shm is not usable against this store": fall back to gRPC for good.
_SHM_FALLBACK_CODES = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED)

BytesLike = bytes | bytearray | memoryview
GET_METHOD = "/kvmesh.offload.v1.Offload/Get"
PUT_METHOD = "/kvmesh.offload.v1.Offload/Put"


def _identity(b: bytes) -> bytes:
    return b


def _ser(msg: offload_pb2.GetRequest) -> bytes:
    return msg.SerializeToString()


class OffloadError(Exception):
    """An offload store call failed."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class StoreUnavailable(OffloadError):
    """The store is down, draining or did not answer in time: recompute instead."""


class StoreFull(OffloadError):
    """The store refused a Put because it cannot make room (RESOURCE_EXHAUSTED)."""


class InvalidOffloadRequest(OffloadError):
    """The request is malformed (INVALID_ARGUMENT)."""


def crc32c(data: BytesLike) -> int:
    return _crc32c.crc32c(data)


def _map_error(exc: grpc.RpcError, what: str) -> OffloadError:
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    msg = f"offload {what}: {code.name if code else 'error'}: {detail}"
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return StoreUnavailable(msg, code)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return StoreFull(msg, code)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidOffloadRequest(msg, code)
    return OffloadError(msg, code)


@dataclass
class PutResult:
    stored: int = 0
    already_present: int = 0
    bytes: int = 0
    evicted: int = 0
    via_shm: bool = False


@dataclass
class StoreStats:
    ram_bytes: int
    ram_capacity_bytes: int
    disk_bytes: int
    disk_capacity_bytes: int
    ram_blocks: int
    disk_blocks: int
    eviction_policy: str
    counters: dict[str, int] = field(default_factory=dict)


@dataclass
class BlockLease:
    """Fetched blocks as zero-copy views; valid until ``release()`` (or the ``with`` block ends).

    On the shm path the views point into the client's segment, which is reused by
    later calls once released, or straight into the store's shared memory, which
    the store keeps for this lease until it is released; copy what you keep.
    ``valid`` turns False if the store reports that the lease had expired before
    the release (the bytes read may then have been reused: discard them).
    """

    views: list[memoryview]
    tiers: list[int]
    via_shm: bool = False
    _release: object = None     # frees the client's segment
    _end: object = None         # ends the store's lease (blocking, or in the background)
    _aend: object = None        # ends the store's lease, awaitable (async client)
    valid: bool = True

    def _drop(self) -> tuple[object, object]:
        rel, end, aend = self._release, self._end, self._aend
        self._release = self._end = self._aend = None
        for v in self.views:
            v.release()
        if callable(rel):
            rel()
        return end, aend

    def release(self) -> None:
        end, _ = self._drop()
        if callable(end) and end() is False:
            self.valid = False

    async def arelease(self) -> None:
        """Like ``release``, awaiting the store's answer (async client)."""
        end, aend = self._drop()
        if callable(aend):
            held = await aend()
        else:
            held = end() if callable(end) else None
        if held is False:
            self.valid = False

    def __enter__(self) -> BlockLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    async def __aenter__(self) -> BlockLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.arelease()


def _check_dests(sizes: list[int], dests: Sequence[object]) -> list[memoryview]:
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


def _copy_into(views: list[memoryview], dests: Sequence[object]) -> int:
    """Copy each view into the matching caller buffer (one memcpy per block)."""
    for d, v in zip(_check_dests([len(v) for v in views], dests), views, strict=True):
        d[:] = v
    return len(views)


# ---------------------------------------------------------------------------------------------
# request building / validation shared by both clients


def _check_ns(namespace: str) -> str:
    if not isinstance(namespace, str) or not namespace:
        raise InvalidOffloadRequest("namespace must be a non-empty string")
    return namespace


def _check_keys(keys: Sequence[int]) -> list[int]:
    out = list(keys)
    if len(out) > MAX_KEYS:
        raise InvalidOffloadRequest(f"chain of {len(out)} keys exceeds the max of {MAX_KEYS}")
    for k in out:
        if not isinstance(k, int) or isinstance(k, bool) or k < 0 or k > MAX_U64:
            raise InvalidOffloadRequest(f"block key {k!r} is not a uint64")
    return out


@dataclass
class _PutPlan:
    header: offload_pb2.PutHeader
    keys: list[int]
    datas: list[BytesLike]
    crcs: list[int]
    tokens: list[list[int]] | None
    total: int


def _plan_put(namespace: str, blocks: Sequence[tuple[int, BytesLike]], token_ids: Sequence[Sequence[int]] | None,
              parent: int | None, block_size: int, session_id: str) -> _PutPlan:
    _check_ns(namespace)
    keys = _check_keys([k for k, _ in blocks])
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
        _check_keys([parent])
    if block_size < 0:
        raise InvalidOffloadRequest("block_size must be >= 0")
    header = offload_pb2.PutHeader(namespace=namespace, session_id=session_id or "",
                                   parent_key=parent or 0, has_parent=parent is not None, block_size=block_size)
    return _PutPlan(header, keys, datas, [crc32c(d) for d in datas], tokens,
                    sum(len(d) for d in datas))


def _put_stream(plan: _PutPlan) -> Iterator[bytes]:
    """Wire-encoded PutRequests (see ``kvstore.wire``): one copy of each payload."""
    yield offload_pb2.PutRequest(header=plan.header).SerializeToString()
    for i, (key, data) in enumerate(zip(plan.keys, plan.datas, strict=True)):
        mv = memoryview(data).cast("B")
        n = len(mv)
        for off in range(0, n, CHUNK_BYTES):
            end = min(off + CHUNK_BYTES, n)
            last = end == n
            yield encode_put_chunk(key, mv[off:end], last, plan.crcs[i] if last else 0,
                                   plan.tokens[i] if last and plan.tokens is not None else ())


def _shm_put_request(plan: _PutPlan, seg: Segment) -> offload_pb2.ShmRequest:
    offsets: list[int] = []
    sizes: list[int] = []
    off = 0
    for data in plan.datas:
        mv = memoryview(data).cast("B")
        n = len(mv)
        seg.buf[off:off + n] = mv
        offsets.append(off)
        sizes.append(n)
        off += n
    req = offload_pb2.ShmRequest(header=plan.header, segment=seg.name, keys=plan.keys, offsets=offsets,
                                 sizes=sizes, crc32c=plan.crcs)
    if plan.tokens is not None:
        req.tokens.extend(offload_pb2.TokenBlock(ids=t) for t in plan.tokens)
    return req


def _put_result(resp: offload_pb2.PutResponse, via_shm: bool) -> PutResult:
    return PutResult(resp.stored, resp.already_present, resp.bytes, resp.evicted, via_shm)


def _stats(resp: offload_pb2.StatsResponse) -> StoreStats:
    return StoreStats(resp.ram_bytes, resp.ram_capacity_bytes, resp.disk_bytes, resp.disk_capacity_bytes,
                      resp.ram_blocks, resp.disk_blocks, resp.eviction_policy, dict(resp.counters))


class _GetAssembler:
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
        if self.verify and ch.crc32c and crc32c(data) != ch.crc32c:
            raise OffloadError(f"block {ch.key}: checksum mismatch on the wire")
        self.blocks.append(data)
        self.tiers.append(ch.tier)


def _is_local(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
    if address.startswith("unix:"):
        return True
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _want_shm(address: str, use_shm: bool | None) -> bool:
    if use_shm is False or not shm_available():
        return False
    return True if use_shm else _is_local(address)


def _first_guess(hint: int | None, n: int) -> int:
    """Segment size for a shm Get: the known block size x chain, else a bounded guess
    (a chain is often only partly present; the store says when more would fit)."""
    if hint:
        return hint * n
    return min(n, 64) * (1 << 20)


def _shm_get_request(namespace: str, keys: list[int], seg: Segment) -> offload_pb2.ShmRequest:
    return offload_pb2.ShmRequest(header=offload_pb2.PutHeader(namespace=namespace), segment=seg.name,
                                  keys=keys, capacity=seg.size, map_store=True)


class _StoreMaps:
    """Read-only mappings of the store's shared slabs, by segment name.

    Slabs live as long as the store, so a mapping is kept; when an unknown name
    shows up (new slab, or a restarted store) mappings of unlinked slabs are dropped.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[str, Segment] = {}

    def get(self, name: str) -> Segment:
        with self._lock:
            seg = self._maps.get(name)
        if seg is not None:
            return seg
        self._prune()
        seg = Segment.attach(name, readonly=True)
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


def _views_from_shm(resp: offload_pb2.ShmGetResponse, seg: Segment, verify: bool,
                    keys: list[int], store_maps: _StoreMaps | None = None) -> list[memoryview]:
    views = []
    names = resp.segments
    for i in range(resp.leading_present):
        off, size = resp.offsets[i], resp.sizes[i]
        name = names[i] if i < len(names) else ""
        src = store_maps.get(name) if name and store_maps is not None else seg
        if off + size > src.size:
            raise OffloadError(f"block {keys[i]}: shm answer points past segment {src.name}")
        v = src.buf[off:off + size]
        if verify and i < len(resp.crc32c) and resp.crc32c[i] and crc32c(v) != resp.crc32c[i]:
            raise OffloadError(f"block {keys[i]}: checksum mismatch in shared memory")
        views.append(v)
    return views


def _grown_size(resp: offload_pb2.ShmGetResponse, n_keys: int, seg: Segment) -> int:
    """After a truncated GetShm: room for the whole chain at the largest block size seen, at least double."""
    return max(max(resp.sizes, default=0) * n_keys, seg.size * 2)


class _ClientCore:
    """State and I/O-free steps shared by the async and the sync client (the calls differ only by ``await``)."""

    def __init__(self, address: str, use_shm: bool | None, timeout_s: float, verify_checksums: bool | None,
                 channel: grpc.Channel | grpc.aio.Channel, use_bulk: bool | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.verify = verify_checksums is not False
        self.verify_shm = bool(verify_checksums)
        self._channel = channel
        self._stub = offload_pb2_grpc.OffloadStub(channel)
        self._get = channel.unary_stream(GET_METHOD, request_serializer=_ser,
                                         response_deserializer=decode_get_response)
        self._put = channel.stream_unary(PUT_METHOD, request_serializer=_identity,
                                         response_deserializer=offload_pb2.PutResponse.FromString)
        self._shm = _want_shm(address, use_shm)
        self._pool = SegmentPool()
        self._store_maps = _StoreMaps()
        # Bulk TCP path for Gets that do not use shm (None = use it when the store offers it).
        self._bulk_host = host_of(address)
        self._bulk = use_bulk is not False and self._bulk_host is not None
        self._conns = BulkConnections()
        self._recv_lock = threading.Lock()
        self._recv_idle: bytearray | None = None
        self._hint_lock = threading.Lock()
        self._block_size_hint: dict[str, int] = {}

    @property
    def shm_enabled(self) -> bool:
        return self._shm

    def _shm_failed(self, exc: grpc.RpcError, what: str) -> None:
        """A shm call failed: raise the mapped error, unless the store cannot do shm (then use gRPC for good)."""
        if exc.code() not in _SHM_FALLBACK_CODES:
            raise _map_error(exc, what) from exc
        log.info("offload shm path unavailable, using gRPC", extra={"address": self.address,
                                                                   "reason": exc.details()})
        self._shm = False

    def _bulk_failed(self, exc: grpc.RpcError) -> None:
        if exc.code() not in _SHM_FALLBACK_CODES:
            raise _map_error(exc, "get") from exc
        log.info("offload bulk path unavailable, using gRPC streams", extra={"address": self.address,
                                                                            "reason": exc.details()})
        self._bulk = False

    def _bulk_receive(self, resp: offload_pb2.BulkGetResponse, dests: list[memoryview], keys: list[int]) -> bool:
        """Blocking: read the leased blocks into ``dests``. False = the bulk port cannot be
        reached (bulk turned off for good; the caller ends the lease and uses gRPC)."""
        assert self._bulk_host is not None
        try:
            sock = self._conns.connect(self._bulk_host, resp.bulk_port, self.timeout_s)
        except OSError as exc:
            log.warning("offload bulk port unreachable, using gRPC streams",
                        extra={"address": self.address, "port": resp.bulk_port, "reason": str(exc)})
            self._bulk = False
            return False
        try:
            self._conns.transfer(sock, self._bulk_host, resp.bulk_port, resp.lease, dests, self.timeout_s)
        except BulkLeaseExpired as exc:
            raise OffloadError(f"offload get: {exc}") from None
        except OSError as exc:
            raise StoreUnavailable(f"offload get: bulk transfer failed: {exc}") from exc
        if self.verify:
            for i, d in enumerate(dests):
                if resp.crc32c[i] and crc32c(d) != resp.crc32c[i]:
                    raise OffloadError(f"block {keys[i]}: checksum mismatch on the bulk path")
        return True

    def _recv_buffer(self, n: int) -> bytearray:
        with self._recv_lock:
            buf, self._recv_idle = self._recv_idle, None
        if buf is None or len(buf) < n:
            buf = bytearray(n)
        return buf

    def _recv_done(self, buf: bytearray) -> None:
        with self._recv_lock:
            if self._recv_idle is None or len(self._recv_idle) < len(buf):
                self._recv_idle = buf

    def _bulk_plan(self, resp: offload_pb2.BulkGetResponse,
                   dests: Sequence[object] | None) -> tuple[list[memoryview], bytearray | None]:
        """Receive buffers: the caller's (checked) or views of one pooled buffer."""
        sizes = list(resp.sizes[:resp.leading_present])
        if dests is not None:
            return _check_dests(sizes, dests), None
        buf = self._recv_buffer(sum(sizes))
        mv = memoryview(buf)
        out, off = [], 0
        for n in sizes:
            out.append(mv[off:off + n])
            off += n
        return out, buf

    def _first_shm_size(self, namespace: str, n_keys: int) -> int:
        with self._hint_lock:
            return _first_guess(self._block_size_hint.get(namespace), n_keys)

    def _grpc_get_request(self, namespace: str, keys: list[int]) -> tuple[offload_pb2.GetRequest, _GetAssembler]:
        return (offload_pb2.GetRequest(namespace=namespace, keys=keys, chunk_bytes=CHUNK_BYTES),
                _GetAssembler(keys, self.verify))

    def _shm_lease(self, namespace: str, keys: list[int], resp: offload_pb2.ShmGetResponse,
                   seg: Segment) -> BlockLease:
        """A complete GetShm answer as a lease holding ``seg`` and the store's lease
        (both released here on error or when empty)."""
        try:
            if resp.sizes:
                with self._hint_lock:
                    self._block_size_hint[namespace] = max(resp.sizes)
            views = _views_from_shm(resp, seg, self.verify_shm, keys, self._store_maps)
        except BaseException:
            self._pool.release(seg)
            if resp.lease:
                self._end_store_lease(resp.lease)
            raise
        if not views:
            self._pool.release(seg)
            return BlockLease([], [], True)
        lid = resp.lease
        lease = BlockLease(views, list(resp.tiers), True, lambda: self._pool.release(seg))
        if lid:
            lease._end = lambda: self._end_store_lease(lid)
            lease._aend = self._aend_store_lease(lid)
        return lease

    def _end_store_lease(self, lease_id: int) -> bool | None:
        raise NotImplementedError

    def _aend_store_lease(self, lease_id: int) -> object:
        return None


# ---------------------------------------------------------------------------------------------


class OffloadClient(_ClientCore):
    """Async client. ``use_shm``: True forces the shm path, False disables it, None = auto (loopback).

    ``verify_checksums``: check each block's CRC32C on the client. None (default)
    checks blocks that crossed the network (gRPC) and trusts same-host shm copies,
    whose source the store verified on Put and on every disk read.
    """

    def __init__(self, address: str, use_shm: bool | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 verify_checksums: bool | None = None, channel: grpc.aio.Channel | None = None,
                 use_bulk: bool | None = None) -> None:
        super().__init__(address, use_shm, timeout_s, verify_checksums,
                         channel or aio_channel(address, traced=False), use_bulk)
        self._bg: set[asyncio.Task] = set()

    async def contains(self, namespace: str, keys: Sequence[int]) -> int:
        req = offload_pb2.ContainsRequest(namespace=_check_ns(namespace), keys=_check_keys(keys))
        try:
            resp = await self._stub.Contains(req, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise _map_error(exc, "contains") from exc
        return resp.leading_present

    async def put(self, namespace: str, blocks: Sequence[tuple[int, BytesLike]], *,
                  token_ids: Sequence[Sequence[int]] | None = None, parent: int | None = None,
                  block_size: int = 0, session_id: str = "") -> PutResult:
        plan = _plan_put(namespace, blocks, token_ids, parent, block_size, session_id)
        if not plan.keys:
            return PutResult()
        with _tracer.start_as_current_span("offload.put", kind=trace.SpanKind.CLIENT, attributes={
                "kvmesh.offload.namespace": namespace, "kvmesh.offload.blocks": len(plan.keys),
                "kvmesh.offload.bytes": plan.total, "server.address": self.address}) as span:
            res = await self._put_plan(plan)
            span.set_attribute("kvmesh.offload.via_shm", res.via_shm)
            span.set_attribute("kvmesh.offload.stored", res.stored)
            return res

    async def _put_plan(self, plan: _PutPlan) -> PutResult:
        seg = None
        if self._shm:
            try:
                seg = await asyncio.to_thread(self._pool.acquire, plan.total)
            except ShmError as exc:  # e.g. /dev/shm full: this call goes over gRPC
                log.warning("no shared memory for this put; using gRPC", extra={"reason": str(exc)})
        if seg is not None:
            try:
                req = await asyncio.to_thread(_shm_put_request, plan, seg)
                resp = await self._stub.PutShm(req, timeout=self.timeout_s, metadata=_trace_md())
                return _put_result(resp, True)
            except grpc.RpcError as exc:
                self._shm_failed(exc, "put")
            finally:
                self._pool.release(seg)
        try:
            resp = await self._put(_aiter(_put_stream(plan)), timeout=self.timeout_s, metadata=_trace_md())
        except grpc.RpcError as exc:
            raise _map_error(exc, "put") from exc
        return _put_result(resp, False)

    async def fetch(self, namespace: str, keys: Sequence[int]) -> BlockLease:
        """The leading present blocks as zero-copy views (see ``BlockLease``)."""
        _check_ns(namespace)
        keys = _check_keys(keys)
        if not keys:
            return BlockLease([], [])
        with _tracer.start_as_current_span("offload.get", kind=trace.SpanKind.CLIENT, attributes={
                "kvmesh.offload.namespace": namespace, "kvmesh.offload.blocks_requested": len(keys),
                "server.address": self.address}) as span:
            lease = await self._fetch_keys(namespace, keys)
            span.set_attribute("kvmesh.offload.blocks", len(lease.views))
            span.set_attribute("kvmesh.offload.bytes", sum(len(v) for v in lease.views))
            return lease

    async def _fetch_keys(self, namespace: str, keys: list[int]) -> BlockLease:
        if self._shm:
            lease = await self._fetch_shm(namespace, keys)
            if lease is not None:
                return lease
        if self._bulk:
            got = await self._bulk_get(namespace, keys, None)
            if got is not None:
                views, tiers, buf = got
                return BlockLease(views, tiers, False, (lambda: self._recv_done(buf)) if buf is not None else None)
        req, asm = self._grpc_get_request(namespace, keys)
        try:
            async for resp in self._get(req, timeout=self.timeout_s, metadata=_trace_md()):
                asm.feed(resp)
        except grpc.RpcError as exc:
            raise _map_error(exc, "get") from exc
        return BlockLease(asm.blocks, asm.tiers)

    async def _bulk_get(self, namespace: str, keys: list[int], dests: Sequence[object] | None,
                        ) -> tuple[list[memoryview], list[int], bytearray | None] | None:
        """Blocks over the bulk path; None = use a gRPC stream for this call."""
        req = offload_pb2.GetRequest(namespace=namespace, keys=keys)
        try:
            resp = await self._stub.GetBulk(req, timeout=self.timeout_s, metadata=_trace_md())
        except grpc.RpcError as exc:
            self._bulk_failed(exc)
            return None
        if not resp.leading_present:
            return [], [], None
        try:
            views, buf = self._bulk_plan(resp, dests)
        except BaseException:
            await self._release_rpc(resp.lease)
            raise
        try:
            ok = await asyncio.to_thread(self._bulk_receive, resp, views, keys)
        except BaseException:
            if buf is not None:
                self._recv_done(buf)
            raise
        if not ok:
            await self._release_rpc(resp.lease)
            if buf is not None:
                self._recv_done(buf)
            return None
        return views, list(resp.tiers), buf

    async def _fetch_shm(self, namespace: str, keys: list[int]) -> BlockLease | None:
        """None means: use gRPC for this call (shm unusable now or for good)."""
        size = self._first_shm_size(namespace, len(keys))
        while True:
            try:
                seg = await asyncio.to_thread(self._pool.acquire, size)
            except ShmError as exc:
                log.warning("no shared memory for this get; using gRPC", extra={"reason": str(exc)})
                return None
            try:
                resp = await self._stub.GetShm(_shm_get_request(namespace, keys, seg), timeout=self.timeout_s,
                                               metadata=_trace_md())
            except BaseException as exc:
                self._pool.release(seg)
                if isinstance(exc, grpc.RpcError):
                    self._shm_failed(exc, "get")
                    return None
                raise
            if not resp.truncated:
                return self._shm_lease(namespace, keys, resp, seg)
            size = _grown_size(resp, len(keys), seg)
            self._pool.release(seg)
            if resp.lease:
                await self._release_rpc(resp.lease)  # retried below with a bigger segment

    async def get(self, namespace: str, keys: Sequence[int]) -> list[bytes]:
        """The leading present blocks of ``keys`` (stops at the first miss), as bytes."""
        lease = await self.fetch(namespace, keys)
        try:
            out = [bytes(v) for v in lease.views]
        finally:
            await lease.arelease()
        if not lease.valid:
            raise OffloadError("offload get: the store's lease expired while reading")
        return out

    async def get_into(self, namespace: str, keys: Sequence[int], dests: Sequence[object]) -> int:
        """Copy the leading present blocks straight into ``dests[i]`` (writable, pre-allocated
        buffers, e.g. slices of a KV cache); returns how many blocks were copied.

        Same host: one copy per block, from the store's shared memory into the buffer.
        Other hosts (bulk path): received straight into the buffers.
        """
        _check_ns(namespace)
        keys = _check_keys(keys)
        if not keys:
            return 0
        if not self._shm and self._bulk:
            got = await self._bulk_get(namespace, keys, dests)
            if got is not None:
                return len(got[0])
        lease = await self.fetch(namespace, keys)
        try:
            n = _copy_into(lease.views, dests)
        finally:
            await lease.arelease()
        if not lease.valid:
            raise OffloadError("offload get: the store's lease expired while copying")
        return n

    def _end_store_lease(self, lease_id: int) -> bool | None:
        # Sync release() of an async lease: end it in the background (use arelease() to wait).
        try:
            task = asyncio.get_running_loop().create_task(self._release_rpc(lease_id))
        except RuntimeError:
            return None  # no loop any more: the store expires the lease
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
        return None

    def _aend_store_lease(self, lease_id: int) -> object:
        return lambda: self._release_rpc(lease_id)

    async def _release_rpc(self, lease_id: int) -> bool | None:
        try:
            resp = await self._stub.ReleaseShm(offload_pb2.ShmRelease(lease=lease_id), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            log.warning("offload lease release failed", extra={"lease": lease_id, "error": str(exc)})
            return None
        return resp.held

    async def delete(self, namespace: str, keys: Sequence[int]) -> int:
        req = offload_pb2.DeleteRequest(namespace=_check_ns(namespace), keys=_check_keys(keys))
        try:
            return (await self._stub.Delete(req, timeout=self.timeout_s)).deleted
        except grpc.RpcError as exc:
            raise _map_error(exc, "delete") from exc

    async def stats(self) -> StoreStats:
        try:
            return _stats(await self._stub.Stats(offload_pb2.StatsRequest(), timeout=self.timeout_s))
        except grpc.RpcError as exc:
            raise _map_error(exc, "stats") from exc

    async def close(self) -> None:
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)
        self._conns.close()
        self._pool.close()
        self._store_maps.close()
        await self._channel.close()

    async def __aenter__(self) -> OffloadClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _aiter(it: Iterator[bytes]) -> AsyncIterator[bytes]:
    for item in it:
        yield item


class SyncOffloadClient(_ClientCore):
    """Blocking client with the same methods, safe to share between threads (vLLM connector)."""

    def __init__(self, address: str, use_shm: bool | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 verify_checksums: bool | None = None, use_bulk: bool | None = None) -> None:
        super().__init__(address, use_shm, timeout_s, verify_checksums,
                         grpc.insecure_channel(address, options=channel_options()), use_bulk)

    def contains(self, namespace: str, keys: Sequence[int]) -> int:
        req = offload_pb2.ContainsRequest(namespace=_check_ns(namespace), keys=_check_keys(keys))
        try:
            return self._stub.Contains(req, timeout=self.timeout_s).leading_present
        except grpc.RpcError as exc:
            raise _map_error(exc, "contains") from exc

    def put(self, namespace: str, blocks: Sequence[tuple[int, BytesLike]], *,
            token_ids: Sequence[Sequence[int]] | None = None, parent: int | None = None,
            block_size: int = 0, session_id: str = "") -> PutResult:
        plan = _plan_put(namespace, blocks, token_ids, parent, block_size, session_id)
        if not plan.keys:
            return PutResult()
        seg = None
        if self._shm:
            try:
                seg = self._pool.acquire(plan.total)
            except ShmError as exc:  # e.g. /dev/shm full: this call goes over gRPC
                log.warning("no shared memory for this put; using gRPC", extra={"reason": str(exc)})
        if seg is not None:
            try:
                resp = self._stub.PutShm(_shm_put_request(plan, seg), timeout=self.timeout_s)
                return _put_result(resp, True)
            except grpc.RpcError as exc:
                self._shm_failed(exc, "put")
            finally:
                self._pool.release(seg)
        try:
            resp = self._put(_put_stream(plan), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise _map_error(exc, "put") from exc
        return _put_result(resp, False)

    def fetch(self, namespace: str, keys: Sequence[int]) -> BlockLease:
        _check_ns(namespace)
        keys = _check_keys(keys)
        if not keys:
            return BlockLease([], [])
        if self._shm:
            lease = self._fetch_shm(namespace, keys)
            if lease is not None:
                return lease
        if self._bulk:
            got = self._bulk_get(namespace, keys, None)
            if got is not None:
                views, tiers, buf = got
                return BlockLease(views, tiers, False, (lambda: self._recv_done(buf)) if buf is not None else None)
        req, asm = self._grpc_get_request(namespace, keys)
        try:
            for resp in self._get(req, timeout=self.timeout_s):
                asm.feed(resp)
        except grpc.RpcError as exc:
            raise _map_error(exc, "get") from exc
        return BlockLease(asm.blocks, asm.tiers)

    def _bulk_get(self, namespace: str, keys: list[int], dests: Sequence[object] | None,
                  ) -> tuple[list[memoryview], list[int], bytearray | None] | None:
        """See ``OffloadClient._bulk_get``."""
        req = offload_pb2.GetRequest(namespace=namespace, keys=keys)
        try:
            resp = self._stub.GetBulk(req, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            self._bulk_failed(exc)
            return None
        if not resp.leading_present:
            return [], [], None
        try:
            views, buf = self._bulk_plan(resp, dests)
        except BaseException:
            self._end_store_lease(resp.lease)
            raise
        try:
            ok = self._bulk_receive(resp, views, keys)
        except BaseException:
            if buf is not None:
                self._recv_done(buf)
            raise
        if not ok:
            self._end_store_lease(resp.lease)
            if buf is not None:
                self._recv_done(buf)
            return None
        return views, list(resp.tiers), buf

    def _fetch_shm(self, namespace: str, keys: list[int]) -> BlockLease | None:
        """None means: use gRPC for this call (shm unusable now or for good)."""
        size = self._first_shm_size(namespace, len(keys))
        while True:
            try:
                seg = self._pool.acquire(size)
            except ShmError as exc:
                log.warning("no shared memory for this get; using gRPC", extra={"reason": str(exc)})
                return None
            try:
                resp = self._stub.GetShm(_shm_get_request(namespace, keys, seg), timeout=self.timeout_s)
            except BaseException as exc:
                self._pool.release(seg)
                if isinstance(exc, grpc.RpcError):
                    self._shm_failed(exc, "get")
                    return None
                raise
            if not resp.truncated:
                return self._shm_lease(namespace, keys, resp, seg)
            size = _grown_size(resp, len(keys), seg)
            self._pool.release(seg)
            if resp.lease:
                self._end_store_lease(resp.lease)  # retried below with a bigger segment

    def get(self, namespace: str, keys: Sequence[int]) -> list[bytes]:
        with self.fetch(namespace, keys) as lease:
            out = [bytes(v) for v in lease.views]
        if not lease.valid:
            raise OffloadError("offload get: the store's lease expired while reading")
        return out

    def get_into(self, namespace: str, keys: Sequence[int], dests: Sequence[object]) -> int:
        """See ``OffloadClient.get_into``."""
        _check_ns(namespace)
        keys = _check_keys(keys)
        if not keys:
            return 0
        if not self._shm and self._bulk:
            got = self._bulk_get(namespace, keys, dests)
            if got is not None:
                return len(got[0])
        with self.fetch(namespace, keys) as lease:
            n = _copy_into(lease.views, dests)
        if not lease.valid:
            raise OffloadError("offload get: the store's lease expired while copying")
        return n

    def _end_store_lease(self, lease_id: int) -> bool | None:
        try:
            return self._stub.ReleaseShm(offload_pb2.ShmRelease(lease=lease_id), timeout=self.timeout_s).held
        except grpc.RpcError as exc:
            log.warning("offload lease release failed", extra={"lease": lease_id, "error": str(exc)})
            return None

    def delete(self, namespace: str, keys: Sequence[int]) -> int:
        req = offload_pb2.DeleteRequest(namespace=_check_ns(namespace), keys=_check_keys(keys))
        try:
            return self._stub.Delete(req, timeout=self.timeout_s).deleted
        except grpc.RpcError as exc:
            raise _map_error(exc, "delete") from exc

    def stats(self) -> StoreStats:
        try:
            return _stats(self._stub.Stats(offload_pb2.StatsRequest(), timeout=self.timeout_s))
        except grpc.RpcError as exc:
            raise _map_error(exc, "stats") from exc

    def close(self) -> None:
        self._conns.close()
        self._pool.close()
        self._store_maps.close()
        self._channel.close()

    def __enter__(self) -> SyncOffloadClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


TIER_NAMES = {common_pb2.TIER_CPU: "cpu", common_pb2.TIER_DISK: "disk"}
