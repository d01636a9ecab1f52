"""The response stores by name, and the one function that opens the configured one.

``--responses-store`` is ``off``, ``memory`` or a ``redis://`` / ``rediss://`` URL (the
``redis`` backend). Adding a backend: its module in this package, one line in the table.
"""

from __future__ import annotations

from kvmesh.registry import LazyRegistry
from kvmesh.responses_api.store.base import ResponseStore

RESPONSE_STORES: LazyRegistry[type[ResponseStore]] = LazyRegistry("response store", {
    "memory": ("kvmesh.responses_api.store.memory", "MemoryResponseStore"),
    "redis": ("kvmesh.responses_api.store.redis_store", "RedisResponseStore"),
})
OFF = "off"


def store_name(spec: str) -> str:
    """The backend ``spec`` names (``off`` for none); ``ValueError`` for anything else."""
    if spec in ("", OFF):
        return OFF
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return "redis"
    if spec == "redis":
        raise ValueError("the redis response store is named by its URL: redis://HOST:PORT/DB")
    RESPONSE_STORES.location(spec)   # raises, naming the choices
    return spec


def open_store(spec: str, ttl_s: float, max_bytes: int, tenant_max_bytes: int) -> ResponseStore | None:
    """The store ``spec`` configures, or None when storing is off."""
    name = store_name(spec)
    if name == OFF:
        return None
    if name == "redis":
        return RESPONSE_STORES.create(name, spec, ttl_s, max_record_bytes=tenant_max_bytes)
    return RESPONSE_STORES.create(name, ttl_s, max_bytes, tenant_max_bytes)
