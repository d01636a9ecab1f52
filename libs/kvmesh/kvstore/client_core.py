"""The offload client's logic, written once for the blocking and the asyncio driver.

Each operation is a *plan*: a generator that yields the I/O it needs (an ``Op``), gets
the result sent back (or the error thrown in) and returns the operation's answer. The
plans hold every decision: which path carries the bytes (same-host shm, else the bulk
TCP path, else gRPC streams), giving up a path for good when the store cannot do it,
the shm Get's retry with a bigger segment, the store's leases, error mapping and the
client spans. ``client_sync`` runs plans with blocking calls (the vLLM connector's
threads), ``client_async`` with ``await`` and worker threads for blocking steps. The plans
never touch a socket or wait on anything: every call, and every local step that can block
(a large memcpy, creating a segment, the bulk socket read), is an op the driver performs.
So the two clients cannot drift: they share every line but the I/O.

Plans run inside their span, so the trace context is current while a driver makes the
call and ``trace_metadata`` carries it to the store (the channels are not instrumented,
to keep the bulk path lean).
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import grpc
from opentelemetry import propagate, trace

from kvmesh.kvstore.bulk import (
    BulkChecksumMismatch,
    BulkConnections,
    BulkLeaseExpired,
    BulkUnreachable,
    host_of,
)
from kvmesh.kvstore.client_messages import (
    GetAssembler,
    PutPlan,
    StoreMaps,
    check_dests,
    check_keys,
    check_ns,
    copy_into,
    first_shm_size,
    grown_shm_size,
    plan_put,
    put_result,
    put_stream,
    reserve_request,
    shm_get_request,
    shm_put_request,
    store_stats,
    stream_get_request,
    views_from_shm,
    write_reserved,
)
from kvmesh.kvstore.client_types import (
    BlockLease,
    BytesLike,
    OffloadError,
    PutResult,
    StoreStats,
    StoreUnavailable,
    map_error,
)
from kvmesh.kvstore.shm import Segment, SegmentPool, ShmError, shm_available
from kvmesh.kvstore.wire import decode_get_response
from kvmesh_api.offload.v1 import offload_pb2, offload_pb2_grpc

log = logging.getLogger("kvmesh.kvstore.client")
_tracer = trace.get_tracer("kvmesh.kvstore.client")
T = TypeVar("T")

GET_METHOD = "/kvmesh.offload.v1.Offload/Get"
PUT_METHOD = "/kvmesh.offload.v1.Offload/Put"
# Codes meaning "this path is not usable against this store": use the next one for good.
FALLBACK_CODES = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED)
PATH_ATTR = "kvmesh.offload.path"   # "shm", "bulk" or "stream": which path carried the blocks


# --- the I/O a plan asks its driver for ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Unary:
    """A unary call on the driver's channel; its answer is sent back."""

    call: Callable[..., Any]
    request: Any


@dataclass(frozen=True, slots=True)
class ClientStream:
    """A client-streaming call sending ``messages`` (already-encoded bytes); its answer is sent back."""

    call: Callable[..., Any]
    messages: Iterator[bytes]


@dataclass(frozen=True, slots=True)
class ServerStream:
    """A server-streaming call; every message is handed to ``feed`` (None is sent back)."""

    call: Callable[..., Any]
    request: Any
    feed: Callable[[Any], None]


@dataclass(frozen=True, slots=True)
class Blocking:
    """Local work that can take a while (a large memcpy, creating a segment, reading the bulk
    socket): run inline by the sync driver, on a worker thread by the async one."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]


Op = Unary | ClientStream | ServerStream | Blocking
Plan = Generator[Op, Any, T]


def advance(plan: Plan[T], sent: Any, error: BaseException | None) -> tuple[bool, Any]:
    """Resume ``plan`` with an op's result (or its error): (True, answer) once it returns,
    else (False, the next op). The plan's own errors propagate."""
    try:
        return False, (plan.throw(error) if error is not None else plan.send(sent))
    except StopIteration as done:
        return True, done.value


def trace_metadata() -> tuple[tuple[str, str], ...]:
    """W3C trace context of the current span as call metadata, so the store's spans join the trace."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


# --- path choice -------------------------------------------------------------------------------


def is_local(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
    if address.startswith("unix:"):
        return True
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def want_shm(address: str, use_shm: bool | None) -> bool:
    """True forces shm, False disables it, None = on when the store's address is this host."""
    if use_shm is False or not shm_available():
        return False
    return True if use_shm else is_local(address)


# --- spans -------------------------------------------------------------------------------------


def _span(name: str, address: str, namespace: str, **attrs: int) -> Any:
    """A client span of an offload call; both drivers' spans come from here."""
    attributes: dict[str, Any] = {"kvmesh.offload.namespace": namespace, "server.address": address}
    attributes.update({f"kvmesh.offload.{k}": v for k, v in attrs.items()})
    return _tracer.start_as_current_span(name, kind=trace.SpanKind.CLIENT, attributes=attributes)


def _record_get(span: trace.Span, views: Sequence[memoryview], path: str) -> None:
    span.set_attribute(PATH_ATTR, path)
    span.set_attribute("kvmesh.offload.blocks", len(views))
    span.set_attribute("kvmesh.offload.bytes", sum(len(v) for v in views))


# --- the core ----------------------------------------------------------------------------------


def _identity(b: bytes) -> bytes:
    return b


def _serialize(msg: offload_pb2.GetRequest) -> bytes:
    return msg.SerializeToString()


class ClientCore:
    """State and plans of an offload client; a driver subclass runs the plans.

    ``OPERATIONS`` are the public methods: for each, the plan ``plan_<name>`` becomes the
    driver's method ``<name>`` through the driver's ``_driver_method`` (blocking call or
    coroutine), so signatures and docstrings are written once, here.

    ``use_shm``: True forces the shm path, False disables it, None = auto (loopback).
    ``use_bulk``: False disables the bulk path, None = use it when the store offers it.
    ``verify_checksums``: check each block's checksum (XXH3-64) on the client. None (default) checks
    every block, same-host shm reads included (another process on the host could have
    written the shared memory), unless ``trust_local_store`` is set: then shm reads are
    trusted (the store verified them on Put and on every disk read). False checks none.
    """

    OPERATIONS: ClassVar[tuple[str, ...]] = ("contains", "put", "fetch", "get", "get_into", "delete", "stats")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in ClientCore.OPERATIONS:
            plan = getattr(ClientCore, f"plan_{name}")
            method = functools.wraps(plan)(cls._driver_method(plan))
            method.__name__, method.__qualname__ = name, f"{cls.__qualname__}.{name}"
            setattr(cls, name, method)

    @staticmethod
    def _driver_method(plan: Callable[..., Plan[Any]]) -> Callable[..., Any]:
        raise NotImplementedError

    def __init__(self, address: str, use_shm: bool | None, timeout_s: float, verify_checksums: bool | None,
                 channel: grpc.Channel | grpc.aio.Channel, use_bulk: bool | None = None,
                 trust_local_store: bool = False) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.verify = verify_checksums is not False
        self.verify_shm = bool(verify_checksums) or (verify_checksums is None and not trust_local_store)
        # Threads copying a same-host get_into or put (None: $KVMESH_OFFLOAD_COPY_THREADS, default 2).
        self.copy_threads: int | None = None
        self._channel = channel
        self._stub = offload_pb2_grpc.OffloadStub(channel)
        self._get = channel.unary_stream(GET_METHOD, request_serializer=_serialize,
                                         response_deserializer=decode_get_response)
        self._put = channel.stream_unary(PUT_METHOD, request_serializer=_identity,
                                         response_deserializer=offload_pb2.PutResponse.FromString)
        self._shm = want_shm(address, use_shm)
        self._pool = SegmentPool()
        self._store_maps = StoreMaps()
        # Zero-copy puts (ReservePut/CommitPut) write into the store's slabs; off for good
        # once the store does not offer them or a slab cannot be mapped writable.
        self._direct_put = True
        self._direct_min = 0   # the store keeps blocks smaller than this out of its slabs
        self._store_wmaps = StoreMaps(writable=True)
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

    def end_store_lease(self, lease_id: bytes) -> bool | None:
        """End the store's lease from ``BlockLease.release()`` (driver: blocking or in the background)."""
        raise NotImplementedError

    async def aend_store_lease(self, lease_id: bytes) -> bool | None:
        """End the store's lease from ``BlockLease.arelease()``."""
        raise NotImplementedError

    def _close_local(self) -> None:
        self._conns.close()
        self._pool.close()
        self._store_maps.close()
        self._store_wmaps.close()

    # --- operations (the public methods of both drivers) ---------------------------------

    def plan_contains(self, namespace: str, keys: Sequence[int]) -> Plan[int]:
        """How many leading blocks of ``keys`` the store holds."""
        req = offload_pb2.ContainsRequest(namespace=check_ns(namespace), keys=check_keys(keys))
        return (yield from self._unary(self._stub.Contains, req, "contains")).leading_present

    def plan_delete(self, namespace: str, keys: Sequence[int]) -> Plan[int]:
        """Delete ``keys``; returns how many the store held."""
        req = offload_pb2.DeleteRequest(namespace=check_ns(namespace), keys=check_keys(keys))
        return (yield from self._unary(self._stub.Delete, req, "delete")).deleted

    def plan_stats(self) -> Plan[StoreStats]:
        """The store's capacity, usage and counters."""
        return store_stats((yield from self._unary(self._stub.Stats, offload_pb2.StatsRequest(), "stats")))

    def plan_put(self, namespace: str, blocks: Sequence[tuple[int, BytesLike]], *,
                 token_ids: Sequence[Sequence[int]] | None = None, parent: int | None = None,
                 block_size: int = 0, session_id: str = "") -> Plan[PutResult]:
        """Store ``blocks`` (key, bytes) as a chain continuing ``parent``; all or nothing."""
        plan = plan_put(namespace, blocks, token_ids, parent, block_size, session_id)
        if not plan.keys:
            return PutResult()
        with _span("offload.put", self.address, namespace, blocks=len(plan.keys), bytes=plan.total) as span:
            res = yield from self._put_blocks(plan)
            span.set_attribute(PATH_ATTR, "shm" if res.via_shm else "stream")
            span.set_attribute("kvmesh.offload.via_shm", res.via_shm)
            span.set_attribute("kvmesh.offload.stored", res.stored)
            return res

    def plan_fetch(self, namespace: str, keys: Sequence[int]) -> Plan[BlockLease]:
        """The leading present blocks as zero-copy views (see ``BlockLease``)."""
        check_ns(namespace)
        keys = check_keys(keys)
        if not keys:
            return BlockLease([], [])
        with _span("offload.get", self.address, namespace, blocks_requested=len(keys)) as span:
            return (yield from self._fetch_keys(namespace, keys, span))

    def plan_get(self, namespace: str, keys: Sequence[int]) -> Plan[list[bytes]]:
        """The leading present blocks of ``keys`` (stops at the first miss), as bytes."""
        lease = yield from self.plan_fetch(namespace, keys)
        return (yield from self._consume(lease, lambda views: [bytes(v) for v in views], "reading"))

    def plan_get_into(self, namespace: str, keys: Sequence[int], dests: Sequence[object]) -> Plan[int]:
        """Copy the leading present blocks straight into ``dests[i]`` (writable, pre-allocated
        buffers, e.g. slices of a KV cache); returns how many blocks were copied.

        Same host: one copy per block, from the store's shared memory into the buffer.
        Other hosts (bulk path): received straight into the buffers.
        """
        check_ns(namespace)
        keys = check_keys(keys)
        if not keys:
            return 0
        with _span("offload.get", self.address, namespace, blocks_requested=len(keys)) as span:
            if not self._shm and self._bulk:
                got = yield from self._bulk_get(namespace, keys, dests)
                if got is not None:
                    _record_get(span, got[0], "bulk")
                    return len(got[0])
            lease = yield from self._fetch_keys(namespace, keys, span, verify_on_copy=True)
            return (yield from self._consume(
                lease, lambda views: copy_into(views, dests, lease.unverified_checksums, keys, self.copy_threads), "copying"))

    def plan_release(self, lease_id: bytes) -> Plan[bool | None]:
        """End the store's lease: False if it had expired, None if the store did not answer."""
        try:
            resp = yield Unary(self._stub.ReleaseShm, offload_pb2.ShmRelease(lease=lease_id))
        except grpc.RpcError as exc:
            log.warning("offload lease release failed", extra={"error": str(exc)})
            return None
        return resp.held

    # --- steps -------------------------------------------------------------------------------

    def _unary(self, call: Callable[..., Any], request: Any, what: str) -> Plan[Any]:
        try:
            return (yield Unary(call, request))
        except grpc.RpcError as exc:
            raise map_error(exc, what) from exc

    def _consume(self, lease: BlockLease, use: Callable[[list[memoryview]], T], doing: str) -> Plan[T]:
        """``use`` the lease's views, then end the lease; its bytes count only if it was still held.

        ``use`` copies the blocks (~90 ms a GiB here): a Blocking op, so the async driver runs it
        on a worker thread instead of stalling its event loop (and every other call on it)."""
        try:
            out = yield Blocking(use, (lease.views,))
        finally:
            lid = lease.take()
            if lid and (yield from self.plan_release(lid)) is False:
                lease.valid = False
        if not lease.valid:
            raise OffloadError(f"offload get: the store's lease expired while {doing}")
        return out

    def _path_failed(self, exc: grpc.RpcError, path: str, what: str) -> None:
        """A shm or bulk call failed: raise the mapped error, unless the store cannot do
        that path (then it is off for good and the caller takes the next one)."""
        if exc.code() not in FALLBACK_CODES:
            raise map_error(exc, what) from exc
        if path == "shm":
            log.info("offload shm path unavailable, using gRPC",
                     extra={"address": self.address, "reason": exc.details()})
            self._shm = False
        else:
            log.info("offload bulk path unavailable, using gRPC streams",
                     extra={"address": self.address, "reason": exc.details()})
            self._bulk = False

    def _put_blocks(self, plan: PutPlan) -> Plan[PutResult]:
        if self._shm and self._direct_put and plan.keys \
                and min(memoryview(d).nbytes for d in plan.datas) >= self._direct_min:
            res = yield from self._put_direct(plan)
            if res is not None:
                return res
        seg = None
        if self._shm:
            try:
                seg = yield Blocking(self._pool.acquire, (plan.total,))
            except ShmError as exc:  # e.g. /dev/shm full: this call goes over gRPC
                log.warning("no shared memory for this put; using gRPC", extra={"reason": str(exc)})
        if seg is not None:
            try:
                req = yield Blocking(shm_put_request, (plan, seg, self.copy_threads))
                return put_result((yield Unary(self._stub.PutShm, req)), True)
            except grpc.RpcError as exc:
                self._path_failed(exc, "shm", "put")
            finally:
                self._pool.release(seg)
        try:
            resp = yield ClientStream(self._put, put_stream(plan))
        except grpc.RpcError as exc:
            raise map_error(exc, "put") from exc
        return put_result(resp, False)

    def _put_direct(self, plan: PutPlan) -> Plan[PutResult | None]:
        """Zero-copy shm put; None means: use PutShm for this call."""
        try:
            resv = yield Unary(self._stub.ReservePut, reserve_request(plan))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:   # an older store
                self._direct_put = False
                return None
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:   # no shared slot now: copy path
                return None
            raise map_error(exc, "put") from exc
        if not resv.reservation:
            self._direct_min = resv.min_block_bytes
            return None
        try:
            req = yield Blocking(write_reserved, (plan, resv, self._store_wmaps, self.copy_threads))
        except (OffloadError, ShmError, OSError) as exc:
            log.info("zero-copy put unavailable, using PutShm", extra={"address": self.address, "reason": str(exc)})
            self._direct_put = False
            try:
                yield Unary(self._stub.CommitPut, offload_pb2.PutCommit(reservation=resv.reservation, abort=True))
            except grpc.RpcError:
                pass   # the reservation expires on its own
            return None
        try:
            return put_result((yield Unary(self._stub.CommitPut, req)), True)
        except grpc.RpcError as exc:
            raise map_error(exc, "put") from exc

    def _fetch_keys(self, namespace: str, keys: list[int], span: trace.Span,
                    verify_on_copy: bool = False) -> Plan[BlockLease]:
        """Path choice for a Get: shm, else bulk, else a gRPC stream.

        ``verify_on_copy``: the caller copies the blocks with ``copy_into``, which checks shm
        blocks while copying (``lease.unverified_checksums``) instead of in a pass of its own here."""
        if self._shm:
            lease = yield from self._fetch_shm(namespace, keys, verify_on_copy)
            if lease is not None:
                _record_get(span, lease.views, "shm")
                return lease
        if self._bulk:
            got = yield from self._bulk_get(namespace, keys, None)
            if got is not None:
                views, tiers, buf = got
                _record_get(span, views, "bulk")
                return BlockLease(views, tiers, False, (lambda: self._recv_done(buf)) if buf is not None else None)
        asm = GetAssembler(keys, self.verify)
        try:
            yield ServerStream(self._get, stream_get_request(namespace, keys), asm.feed)
        except grpc.RpcError as exc:
            raise map_error(exc, "get") from exc
        _record_get(span, asm.blocks, "stream")
        return BlockLease(asm.blocks, asm.tiers)

    def _fetch_shm(self, namespace: str, keys: list[int], verify_on_copy: bool = False) -> Plan[BlockLease | None]:
        """None means: use another path for this call (shm unusable now or for good)."""
        with self._hint_lock:
            size = first_shm_size(self._block_size_hint.get(namespace), len(keys))
        while True:
            try:
                seg = yield Blocking(self._pool.acquire, (size,))
            except ShmError as exc:
                log.warning("no shared memory for this get; using gRPC", extra={"reason": str(exc)})
                return None
            try:
                resp = yield Unary(self._stub.GetShm, shm_get_request(namespace, keys, seg))
            except BaseException as exc:
                self._pool.release(seg)
                if isinstance(exc, grpc.RpcError):
                    self._path_failed(exc, "shm", "get")
                    return None
                raise
            if not resp.truncated:
                return (yield from self._shm_lease(namespace, keys, resp, seg, verify_on_copy))
            # Retried with a segment big enough for the whole chain.
            size = grown_shm_size(resp, len(keys), seg)
            self._pool.release(seg)
            if resp.lease:
                yield from self.plan_release(resp.lease)

    def _shm_lease(self, namespace: str, keys: list[int], resp: offload_pb2.ShmGetResponse,
                   seg: Segment, verify_on_copy: bool = False) -> Plan[BlockLease]:
        """A complete GetShm answer as a lease holding ``seg`` and the store's lease
        (both released here on error or when empty)."""
        try:
            if resp.sizes:
                with self._hint_lock:
                    self._block_size_hint[namespace] = max(resp.sizes)
            views = views_from_shm(resp, seg, self.verify_shm and not verify_on_copy, keys, self._store_maps)
        except BaseException:
            self._pool.release(seg)
            if resp.lease:
                yield from self.plan_release(resp.lease)
            raise
        if not views:
            self._pool.release(seg)
            return BlockLease([], [], True)
        lease = BlockLease(views, list(resp.tiers), True, lambda: self._pool.release(seg), resp.lease, self)
        if self.verify_shm and verify_on_copy:
            lease.unverified_checksums = [resp.checksums[i] if i < len(resp.checksums) else 0
                                          for i in range(len(views))]
        return lease

    def _bulk_get(self, namespace: str, keys: list[int], dests: Sequence[object] | None,
                  ) -> Plan[tuple[list[memoryview], list[int], bytearray | None] | None]:
        """Blocks over the bulk path, into ``dests`` or a pooled buffer; None = use a gRPC stream."""
        try:
            resp = yield Unary(self._stub.GetBulk, offload_pb2.GetRequest(namespace=namespace, keys=keys))
        except grpc.RpcError as exc:
            self._path_failed(exc, "bulk", "get")
            return None
        if not resp.leading_present:
            return [], [], None
        try:
            views, buf = self._bulk_buffers(resp, dests)
        except BaseException:
            yield from self.plan_release(resp.lease)
            raise
        assert self._bulk_host is not None
        sums = resp.checksums if self.verify else None
        try:
            yield Blocking(self._conns.receive, (self._bulk_host, resp.bulk_port, resp.lease, views,
                                                 self.timeout_s, sums))
        except BulkUnreachable as exc:
            # Bulk off for good: end the unused lease and use gRPC streams.
            log.warning("offload bulk port unreachable, using gRPC streams",
                        extra={"address": self.address, "port": resp.bulk_port, "reason": str(exc)})
            self._bulk = False
            yield from self.plan_release(resp.lease)
            if buf is not None:
                self._recv_done(buf)
            return None
        except BaseException as exc:
            if buf is not None:
                self._recv_done(buf)
            if isinstance(exc, BulkLeaseExpired):
                raise OffloadError(f"offload get: {exc}") from None
            if isinstance(exc, BulkChecksumMismatch):
                raise OffloadError(f"block {keys[exc.index]}: checksum mismatch on the bulk path") from None
            if isinstance(exc, OSError):
                raise StoreUnavailable(f"offload get: bulk transfer failed: {exc}") from exc
            raise
        return views, list(resp.tiers), buf

    def _bulk_buffers(self, resp: offload_pb2.BulkGetResponse,
                      dests: Sequence[object] | None) -> tuple[list[memoryview], bytearray | None]:
        """Receive buffers: the caller's (checked) or views of one pooled buffer."""
        sizes = list(resp.sizes[:resp.leading_present])
        if dests is not None:
            return check_dests(sizes, dests), None
        with self._recv_lock:
            buf, self._recv_idle = self._recv_idle, None
        if buf is None or len(buf) < sum(sizes):
            buf = bytearray(sum(sizes))
        mv = memoryview(buf)
        out, off = [], 0
        for n in sizes:
            out.append(mv[off:off + n])
            off += n
        return out, buf

    def _recv_done(self, buf: bytearray) -> None:
        with self._recv_lock:
            if self._recv_idle is None or len(self._recv_idle) < len(buf):
                self._recv_idle = buf
