"""Clients of the offload store: ``OffloadClient`` (asyncio) for services and the sim engine,
``SyncOffloadClient`` (blocking) for the vLLM connector's threads.

Both speak the ``kvmesh.offload.v1.Offload`` contract. On the same host they use the
shared-memory fast path (``PutShm``/``GetShm``), between hosts the bulk TCP path for
Gets, and gRPC streams when the store cannot do either (another host, no ``/dev/shm``,
no bulk port): callers never need to know which path carried the bytes.

This module is the public face; the code is split by job:
``client_types`` (errors, results, leases), ``client_messages`` (requests and answers,
no I/O), ``client_core`` (every decision, as plans without I/O, and the spans),
``client_sync`` and ``client_async`` (the two drivers, which only do the I/O).
"""

from __future__ import annotations

from kvmesh.kvstore.checksum import block_checksum
from kvmesh.kvstore.client_async import OffloadClient
from kvmesh.kvstore.client_sync import SyncOffloadClient
from kvmesh.kvstore.client_types import (
    CHUNK_BYTES,
    DEFAULT_TIMEOUT_S,
    MAX_KEYS,
    MAX_U64,
    TIER_NAMES,
    BlockLease,
    BytesLike,
    InvalidOffloadRequest,
    OffloadError,
    PutResult,
    StoreFull,
    StoreStats,
    StoreUnavailable,
)

__all__ = [
    "CHUNK_BYTES", "DEFAULT_TIMEOUT_S", "MAX_KEYS", "MAX_U64", "TIER_NAMES", "BlockLease", "BytesLike",
    "InvalidOffloadRequest", "OffloadClient", "OffloadError", "PutResult", "StoreFull", "StoreStats",
    "StoreUnavailable", "SyncOffloadClient", "block_checksum",
]
