"""``MooncakeStoreClient``: a worker's client of a pooled offload store (``--byte-pool mooncake``).

Why: with the bytes in a Mooncake pool, a worker on any host moves them straight
between its own memory and the pool (Mooncake's transfer engine: TCP, or RDMA where
there is some); the offload store only answers for the index. So a Put writes the
blocks to the pool, then commits them (``PutShm`` with no segment: keys, sizes,
checksums, tokens, parent) and the store records the chain, runs its eviction policy and
publishes the KV events; a Get asks the store for the leading present blocks' sizes
and checksums (``GetBulk``), reads them from the pool and verifies every checksum. A
block the pool lost (Mooncake evicted it on its own) ends the read there, and the
store is told to forget it and what follows, so routing stops counting on it.

Same methods as ``SyncOffloadClient`` (``contains``, ``put``, ``fetch``, ``get``,
``get_into``, ``delete``, ``stats``), blocking and thread-safe. The pool is joined on
the first byte operation (a scheduler that only asks ``contains`` never joins); its
master comes from the store (``Stats``). Transfers go straight from and into memory
registered with ``register``; other memory is staged through a registered buffer
of this client's (one memcpy). Pool members are trusted: Mooncake has no access
control, so any member can overwrite an object; the checksums catch damage, not intent.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import grpc
import numpy as np

from kvmesh.kvstore.checksum import block_checksum
from kvmesh.kvstore.client_messages import (
    check_dests,
    check_keys,
    check_ns,
    plan_put,
    put_result,
    store_stats,
)
from kvmesh.kvstore.client_types import (
    DEFAULT_TIMEOUT_S,
    BlockLease,
    BytesLike,
    InvalidOffloadRequest,
    OffloadError,
    PutResult,
    StoreStats,
    StoreUnavailable,
    map_error,
)
from kvmesh.kvstore.mooncake.pool import (
    OBJECT_NOT_FOUND,
    Pool,
    PoolConfig,
    PoolError,
    buffer_address,
    describe,
)
from kvmesh.kvstore.mooncake.pool import object_key as _object_key
from kvmesh.rpc.channel import channel_options
from kvmesh.rpc.tls import sync_channel
from kvmesh_api.offload.v1 import offload_pb2, offload_pb2_grpc

log = logging.getLogger(__name__)
OBJECT_EXISTS = -705   # a concurrent writer put the same block first: the bytes are there


class _Stage:
    """A registered buffer of this client's, grown on demand; one user at a time."""

    def __init__(self, pool: Pool, nbytes: int) -> None:
        self.pool = pool
        self.lock = threading.Lock()
        self.buf = np.empty(0, dtype=np.uint8)
        self.addr = 0
        self._grow(nbytes)

    def _grow(self, nbytes: int) -> None:
        if self.addr:
            self.pool.unregister(self.addr)
        self.buf = np.empty(nbytes, dtype=np.uint8)
        self.buf.fill(0)  # fault the pages in now, not inside a timed transfer
        self.addr, _ = self.pool.register(self.buf)

    def ensure(self, nbytes: int) -> None:
        if nbytes > len(self.buf):
            self._grow(max(nbytes, 2 * len(self.buf)))


class MooncakeStoreClient:
    """Blocking client of a pooled offload store (see module docstring)."""

    def __init__(self, address: str, *, pool: PoolConfig | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 verify_checksums: bool = True, stage_bytes: int = 64 << 20) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.verify = verify_checksums
        self._pool_cfg = pool or PoolConfig()
        self._stage_bytes = stage_bytes
        self._channel = sync_channel(address, None, channel_options())
        self._stub = offload_pb2_grpc.OffloadStub(self._channel)
        self._join_lock = threading.Lock()
        self._pool: Pool | None = None
        self._prefix = ""
        self._put_stage: _Stage | None = None
        self._get_stage: _Stage | None = None

    # -- control plane (the store) --------------------------------------------------------------

    def _call(self, method: Any, request: Any, what: str) -> Any:
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise map_error(exc, what) from None

    def contains(self, namespace: str, keys: Sequence[int]) -> int:
        req = offload_pb2.ContainsRequest(namespace=check_ns(namespace), keys=check_keys(keys))
        return self._call(self._stub.Contains, req, "contains").leading_present

    def delete(self, namespace: str, keys: Sequence[int]) -> int:
        req = offload_pb2.DeleteRequest(namespace=check_ns(namespace), keys=check_keys(keys))
        return self._call(self._stub.Delete, req, "delete").deleted

    def stats(self) -> StoreStats:
        return store_stats(self._call(self._stub.Stats, offload_pb2.StatsRequest(), "stats"))

    # -- the pool -------------------------------------------------------------------------------

    def pool(self) -> Pool:
        """This client's pool membership (joined on first use)."""
        if self._pool is not None:
            return self._pool
        with self._join_lock:
            if self._pool is None:
                info = self._call(self._stub.Stats, offload_pb2.StatsRequest(), "stats")
                if info.pool != "mooncake":
                    raise OffloadError(f"the offload store at {self.address} keeps its bytes itself "
                                       f"(pool {info.pool!r}); use the kvmesh client (store_backend 'kvmesh')")
                cfg = self._pool_cfg if self._pool_cfg.master else replace(self._pool_cfg, master=info.pool_master)
                try:
                    pool = Pool(cfg)
                except PoolError as exc:
                    raise StoreUnavailable(f"offload pool: {exc}") from None
                self._prefix = info.pool_prefix
                self._put_stage = _Stage(pool, self._stage_bytes)
                self._get_stage = _Stage(pool, self._stage_bytes)
                self._pool = pool
        return self._pool

    def register(self, buf: object) -> None:
        """Register ``buf`` (numpy array, bytearray, torch tensor...) so transfers use it in place."""
        try:
            self.pool().register(buf)
        except PoolError as exc:
            raise OffloadError(str(exc)) from None

    def object_key(self, namespace: str, key: int) -> str:
        self.pool()
        return _object_key(self._prefix, namespace, key)

    # -- put ------------------------------------------------------------------------------------

    def put(self, namespace: str, blocks: Sequence[tuple[int, BytesLike]], *,
            token_ids: Sequence[Sequence[int]] | None = None, parent: int | None = None,
            block_size: int = 0, session_id: str = "") -> PutResult:
        """Write ``blocks`` (key, bytes) to the pool and commit them as a chain after ``parent``."""
        plan = plan_put(namespace, blocks, token_ids, parent, block_size, session_id)
        if not plan.keys:
            return PutResult()
        pool = self.pool()
        objs = [_object_key(self._prefix, namespace, k) for k in plan.keys]
        sizes = [len(memoryview(d).cast("B")) for d in plan.datas]
        sums = plan.checksums
        written: list[str] = []
        req = offload_pb2.ShmRequest(header=plan.header, segment="", keys=plan.keys, sizes=sizes, checksums=sums,
                                     tokens=[offload_pb2.TokenBlock(ids=t) for t in plan.tokens or []])
        try:
            self._write(pool, objs, plan.datas, sizes, written)
            try:
                resp = self._call(self._stub.PutShm, req, "put")
            except InvalidOffloadRequest as exc:
                if "not in the pool" not in str(exc):
                    raise
                # The store was removing an evicted copy of one of these blocks as we wrote it
                # (Mooncake kept the old object, then the removal took it): write again, once.
                self._write(pool, objs, plan.datas, sizes, written)
                resp = self._call(self._stub.PutShm, req, "put")
        except BaseException:
            # Nothing committed: do not leave the objects to Mooncake's own LRU.
            if written:
                try:
                    pool.remove(written)
                except Exception:  # noqa: BLE001 - best effort; the error below is the caller's
                    log.debug("could not remove uncommitted pool objects", exc_info=True)
            raise
        return put_result(resp, False)

    def _write(self, pool: Pool, objs: list[str], datas: list[BytesLike], sizes: list[int],
               written: list[str]) -> None:
        direct: list[int] = []
        staged: list[int] = []
        for i, d in enumerate(datas):
            try:
                addr, n = buffer_address(d)
            except (ValueError, TypeError):
                staged.append(i)
                continue
            (direct if pool.is_registered(addr, n) else staged).append(i)
        if direct:
            self._put_batch(pool, [objs[i] for i in direct], [buffer_address(datas[i])[0] for i in direct],
                            [sizes[i] for i in direct], written)
        stage = self._put_stage
        assert stage is not None
        with stage.lock:
            stage.ensure(max((sizes[i] for i in staged), default=0))
            while staged:
                batch: list[int] = []
                used = 0
                for i in staged:
                    if used + sizes[i] > len(stage.buf):
                        break
                    stage.buf[used:used + sizes[i]] = np.frombuffer(memoryview(datas[i]).cast("B"), dtype=np.uint8)
                    batch.append(i)
                    used += sizes[i]
                staged = staged[len(batch):]
                offs = np.cumsum([0] + [sizes[i] for i in batch[:-1]])
                self._put_batch(pool, [objs[i] for i in batch], [stage.addr + int(o) for o in offs],
                                [sizes[i] for i in batch], written)

    @staticmethod
    def _put_batch(pool: Pool, objs: list[str], addrs: list[int], sizes: list[int], written: list[str]) -> None:
        codes = pool.put_from(objs, addrs, sizes)
        written.extend(o for o, c in zip(objs, codes, strict=True) if c == 0)
        bad = next(((o, c) for o, c in zip(objs, codes, strict=True) if c not in (0, OBJECT_EXISTS)), None)
        if bad is not None:
            raise StoreUnavailable(f"offload put: writing {bad[0]} to the pool failed: {describe(bad[1])}")

    # -- get ------------------------------------------------------------------------------------

    def _lookup(self, namespace: str, keys: Sequence[int]) -> offload_pb2.BulkGetResponse:
        req = offload_pb2.GetRequest(namespace=check_ns(namespace), keys=check_keys(keys))
        return self._call(self._stub.GetBulk, req, "get")

    def get_into(self, namespace: str, keys: Sequence[int], dests: Sequence[object]) -> int:
        """Read the leading present blocks into ``dests`` (one buffer per key); return how many."""
        resp = self._lookup(namespace, keys)
        n = resp.leading_present
        if not n:
            return 0
        sizes = list(resp.sizes[:n])
        views = check_dests(sizes, dests)
        pool = self.pool()
        objs = [_object_key(self._prefix, namespace, k) for k in keys[:n]]
        addrs = []
        for v in views:
            addr, size = buffer_address(v)
            if not pool.is_registered(addr, size):
                break
            addrs.append(addr)
        if len(addrs) == n:
            got = self._read(pool, namespace, list(keys[:n]), objs, addrs, sizes)
        else:
            stage = self._get_stage
            assert stage is not None
            with stage.lock:
                stage.ensure(sum(sizes))
                offs = np.cumsum([0] + sizes[:-1])
                got = self._read(pool, namespace, list(keys[:n]), objs, [stage.addr + int(o) for o in offs], sizes)
                for i in range(got):
                    views[i][:] = stage.buf[int(offs[i]):int(offs[i]) + sizes[i]]
        self._verify(list(keys[:got]), views[:got], list(resp.checksums[:got]))
        return got

    def _read(self, pool: Pool, namespace: str, keys: list[int], objs: list[str], addrs: list[int],
              sizes: list[int]) -> int:
        """Transfer; the count of leading blocks read. A lost object ends the read and is reported."""
        codes = pool.get_into(objs, addrs, sizes)
        for i, (c, size) in enumerate(zip(codes, sizes, strict=True)):
            if c == size:
                continue
            if c == OBJECT_NOT_FOUND:
                self._forget(namespace, keys[i:])
                return i
            if c >= 0:
                raise OffloadError(f"block {keys[i]}: the pool holds {c} bytes, the store recorded {size}")
            raise StoreUnavailable(f"offload get: reading block {keys[i]} from the pool failed: {describe(c)}")
        return len(sizes)

    def _forget(self, namespace: str, keys: list[int]) -> None:
        log.warning("blocks lost from the pool; telling the store", extra={"namespace": namespace,
                                                                          "first": keys[0], "blocks": len(keys)})
        try:
            self.delete(namespace, keys)
        except OffloadError:
            log.debug("could not report lost blocks", exc_info=True)

    def _verify(self, keys: list[int], views: list[memoryview], sums: list[int]) -> None:
        if not self.verify:
            return
        for k, v, c in zip(keys, views, sums, strict=True):
            if block_checksum(v) != c:
                raise OffloadError(f"block {k}: checksum mismatch on the pool path")

    def fetch(self, namespace: str, keys: Sequence[int]) -> BlockLease:
        """The leading present blocks as views of this client's buffer, valid until ``release()``."""
        resp = self._lookup(namespace, keys)
        n = resp.leading_present
        if not n:
            return BlockLease([], [], False)
        pool = self.pool()
        stage = self._get_stage
        assert stage is not None
        sizes = list(resp.sizes[:n])
        stage.lock.acquire()
        try:
            stage.ensure(sum(sizes))
            offs = [int(o) for o in np.cumsum([0] + sizes[:-1])]
            objs = [_object_key(self._prefix, namespace, k) for k in keys[:n]]
            got = self._read(pool, namespace, list(keys[:n]), objs, [stage.addr + o for o in offs], sizes)
            mv = memoryview(stage.buf)
            views = [mv[o:o + s] for o, s in zip(offs[:got], sizes[:got], strict=True)]
            self._verify(list(keys[:got]), views, list(resp.checksums[:got]))
        except BaseException:
            stage.lock.release()
            raise
        return BlockLease(views, list(resp.tiers[:got]), False, stage.lock.release)

    def get(self, namespace: str, keys: Sequence[int]) -> list[bytes]:
        with self.fetch(namespace, keys) as lease:
            return [bytes(v) for v in lease.views]

    def close(self) -> None:
        with self._join_lock:
            pool, self._pool = self._pool, None
            self._put_stage = self._get_stage = None
        if pool is not None:
            pool.close()
        self._channel.close()

    def __enter__(self) -> MooncakeStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
