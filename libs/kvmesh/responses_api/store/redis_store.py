"""``redis``: responses kept in Redis, shared by every router replica.

A client may send its next turn to any replica behind the load balancer, so a
``previous_response_id`` answered by one must be found by all. Each record is one key
with the store's time to live; each item id of it is a small key naming its newest
record, with the same life. Keys are per tenant (the tenant is escaped, so no tenant can
name another's keys). Bound the memory on the Redis side (``maxmemory`` with
``volatile-ttl`` or ``allkeys-lru``) and do not share the indexer's Redis, whose policy is
``noeviction``: a full store must not refuse the index's writes. A record changed in place (a
conversation that grew) is written with WATCH/MULTI, so replicas adding to it at once retry rather
than overwrite each other. A streamed background response's events are a list key of their own
(``e``), so that a client resumes them on any replica.
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import quote

from redis.exceptions import RedisError, WatchError

from kvmesh.responses_api.store.base import Change, ResponseStore, StoredResponse, StoreError, TooLarge

T = TypeVar("T")
TIMEOUT_S = 2.0   # a request waits at most this for the store (each call), then is answered 503
UPDATE_TRIES = 64   # an update that loses this many races in a row is answered 503
UPDATE_BACKOFF_S = 0.002   # the first retry's mean pause; it doubles (jittered) up to 64x


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
        pipe = self.client.pipeline(transaction=False)
        self._write(pipe, tenant, record, raw)
        await pipe.execute()
        return True

    def _write(self, pipe: Any, tenant: str, record: StoredResponse, raw: bytes) -> None:
        rid = record.id
        pipe.set(self._key("r", tenant, rid), raw, px=self.ttl_ms)
        for item in record.item_ids():
            pipe.set(self._key("i", tenant, item), rid, px=self.ttl_ms)

    @_translated
    async def update(self, tenant: str, record_id: str, change: Change) -> StoredResponse | None:
        key = self._key("r", tenant, record_id)
        async with self.client.pipeline(transaction=True) as pipe:
            for attempt in range(UPDATE_TRIES):
                if attempt:   # losers spread out, so that many writers at once do not starve each other
                    await asyncio.sleep(random.uniform(0, 2 * UPDATE_BACKOFF_S * (1 << min(attempt - 1, 6))))
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    if raw is None:
                        return None
                    new = change(StoredResponse.decode(raw))
                    encoded = new.encode()
                    if len(encoded) > self.max_record_bytes:
                        raise TooLarge(record_id)
                    pipe.multi()
                    self._write(pipe, tenant, new, encoded)
                    await pipe.execute()
                    return new
                except WatchError:   # another writer changed it between our read and write: read again
                    continue
        raise StoreError(f"{record_id} changed by other writers {UPDATE_TRIES} times in a row")

    @_translated
    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        raw = await self.client.get(self._key("r", tenant, response_id))
        return StoredResponse.decode(raw) if raw is not None else None

    @_translated
    async def delete(self, tenant: str, response_id: str) -> bool:
        return bool(await self.client.delete(self._key("r", tenant, response_id)))

    shared = True

    @_translated
    async def add_events(self, tenant: str, response_id: str, events: list[bytes], ttl_s: float) -> None:
        key = self._key("e", tenant, response_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.rpush(key, *events)
        pipe.pexpire(key, max(1, int(ttl_s * 1000)))
        await pipe.execute()

    @_translated
    async def events(self, tenant: str, response_id: str, start: int) -> list[bytes] | None:
        key = self._key("e", tenant, response_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.exists(key)
        pipe.lrange(key, start, -1)
        there, got = await pipe.execute()
        return list(got) if there else None

    @_translated
    async def mark_cancelled(self, tenant: str, response_id: str, ttl_s: float) -> None:
        await self.client.set(self._key("x", tenant, response_id), b"1", px=max(1, int(ttl_s * 1000)))

    @_translated
    async def cancel_marked(self, tenant: str, response_id: str) -> bool:
        return bool(await self.client.exists(self._key("x", tenant, response_id)))

    @_translated
    async def item_owner(self, tenant: str, item_id: str) -> str | None:
        rid = await self.client.get(self._key("i", tenant, item_id))
        return rid.decode() if rid is not None else None

    async def close(self) -> None:
        await self.client.aclose()
