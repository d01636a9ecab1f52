"""``redis``: responses kept in Redis, shared by every router replica.

A client may send its next turn to any replica behind the load balancer, so a
``previous_response_id`` answered by one must be found by all. Each record is one key
with the store's time to live; each item id of it is a small key naming its newest
record, with the same life. Keys are per tenant (the tenant is escaped, so no tenant can
name another's keys). Bound the memory on the Redis side (``maxmemory`` with
``volatile-ttl`` or ``allkeys-lru``) and do not share the indexer's Redis, whose policy is
``noeviction``: a full store must not refuse the index's writes.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import quote

from redis.exceptions import RedisError

from kvmesh.responses_api.store.base import ResponseStore, StoredResponse, StoreError

T = TypeVar("T")
TIMEOUT_S = 2.0   # a request waits at most this for the store (each call), then is answered 503


def _translated(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    @functools.wraps(fn)
    async def call(*args: Any, **kw: Any) -> T:
        try:
            return await fn(*args, **kw)
        except RedisError as exc:
            raise StoreError(f"{type(exc).__name__}: {exc}") from None
    return call


class RedisResponseStore(ResponseStore):
    name = "redis"

    def __init__(self, url: str, ttl_s: float, max_record_bytes: int, prefix: str = "kvmesh:responses",
                 client: Any = None) -> None:
        import redis.asyncio as aioredis

        self.client = client if client is not None else aioredis.Redis.from_url(
            url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.max_record_bytes = max_record_bytes
        self.prefix = prefix

    def _key(self, kind: str, tenant: str, ident: str) -> str:
        return f"{self.prefix}:{kind}:{quote(tenant, safe='')}:{ident}"

    @_translated
    async def put(self, tenant: str, record: StoredResponse) -> bool:
        raw = record.encode()
        if len(raw) > self.max_record_bytes:
            return False
        rid = record.id
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self._key("r", tenant, rid), raw, px=self.ttl_ms)
        for item in record.item_ids():
            pipe.set(self._key("i", tenant, item), rid, px=self.ttl_ms)
        await pipe.execute()
        return True

    @_translated
    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        raw = await self.client.get(self._key("r", tenant, response_id))
        return StoredResponse.decode(raw) if raw is not None else None

    @_translated
    async def delete(self, tenant: str, response_id: str) -> bool:
        return bool(await self.client.delete(self._key("r", tenant, response_id)))

    @_translated
    async def item_owner(self, tenant: str, item_id: str) -> str | None:
        rid = await self.client.get(self._key("i", tenant, item_id))
        return rid.decode() if rid is not None else None

    async def close(self) -> None:
        await self.client.aclose()
