"""``memory``: responses kept in the router's own process.

Bounded three ways: a time to live from when a response was stored, a total byte budget,
and a per-tenant share of it, so that one tenant's traffic evicts its own oldest responses
and never another tenant's. Eviction is oldest first: a record written again (a conversation
that grew) is taken out and put back, so insertion order is the order of last writes, and
the expired ones are always at the front.
A router replica keeps its own: behind several replicas use ``redis``. No call suspends
between reading and writing, so an ``update`` is one step on the event loop.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.responses_api.store.base import Change, ResponseStore, StoredResponse, TooLarge


@dataclass
class _Entry:
    raw: bytes
    expires: float
    items: list[str]


class MemoryResponseStore(ResponseStore):
    name = "memory"

    def __init__(self, ttl_s: float, max_bytes: int, tenant_max_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.max_bytes = ttl_s, max_bytes
        self.tenant_max_bytes = min(tenant_max_bytes, max_bytes) if tenant_max_bytes > 0 else max_bytes
        self.clock = clock
        self._records: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._by_tenant: dict[str, OrderedDict[str, None]] = {}   # each tenant's response ids, oldest first
        self._items: dict[tuple[str, str], str] = {}
        self._used: dict[str, int] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._records)

    def _drop(self, key: tuple[str, str]) -> None:
        e = self._records.pop(key)
        tenant, rid = key
        self.bytes -= len(e.raw)
        left = self._used[tenant] - len(e.raw)
        mine = self._by_tenant[tenant]
        del mine[rid]
        if mine:
            self._used[tenant] = left
        else:
            del self._used[tenant], self._by_tenant[tenant]
        for item in e.items:
            if self._items.get((tenant, item)) == rid:
                del self._items[(tenant, item)]

    def _expire(self, now: float) -> None:
        while self._records:
            key, e = next(iter(self._records.items()))
            if e.expires > now:
                return
            self._drop(key)

    def _live(self, tenant: str, response_id: str) -> _Entry | None:
        self._expire(self.clock())
        return self._records.get((tenant, response_id))

    async def put(self, tenant: str, record: StoredResponse) -> bool:
        return self._put(tenant, record)

    def _put(self, tenant: str, record: StoredResponse) -> bool:
        raw = record.encode()
        size = len(raw)
        if size > self.tenant_max_bytes:
            return False
        now = self.clock()
        self._expire(now)
        key = (tenant, record.id)
        if key in self._records:
            self._drop(key)
        # The tenant's own oldest first, then anyone's oldest.
        while self._used.get(tenant, 0) + size > self.tenant_max_bytes:
            self._drop((tenant, next(iter(self._by_tenant[tenant]))))
        while self.bytes + size > self.max_bytes and self._records:
            self._drop(next(iter(self._records)))
        items = record.item_ids()
        self._records[key] = _Entry(raw, now + self.ttl_s, items)
        self._by_tenant.setdefault(tenant, OrderedDict())[record.id] = None
        self._used[tenant] = self._used.get(tenant, 0) + size
        self.bytes += size
        for item in items:
            self._items[(tenant, item)] = record.id
        return True

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        e = self._live(tenant, response_id)
        return StoredResponse.decode(e.raw) if e is not None else None

    async def update(self, tenant: str, record_id: str, change: Change) -> StoredResponse | None:
        e = self._live(tenant, record_id)
        if e is None:
            return None
        new = change(StoredResponse.decode(e.raw))
        if not self._put(tenant, new):
            raise TooLarge(record_id)
        return new

    async def delete(self, tenant: str, response_id: str) -> bool:
        if self._live(tenant, response_id) is None:
            return False
        self._drop((tenant, response_id))
        return True

    async def item_owner(self, tenant: str, item_id: str) -> str | None:
        self._expire(self.clock())
        return self._items.get((tenant, item_id))
