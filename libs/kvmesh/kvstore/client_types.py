"""What callers of the offload client handle: its errors, results, leases and limits.

Both drivers (``client_sync``, ``client_async``) return these, so a worker can switch
between them without touching its error handling. Errors are a small family so workers
can decide what to do: ``StoreUnavailable`` (store down or slow: recompute),
``StoreFull`` (Put refused: skip offloading), ``InvalidOffloadRequest`` (a bug in the caller).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from kvmesh_api.common.v1 import common_pb2

CHUNK_BYTES = 4 * 1024 * 1024       # the contract's max chunk size
MAX_KEYS = 65_536
MAX_U64 = (1 << 64) - 1
DEFAULT_TIMEOUT_S = 60.0
TIER_NAMES = {common_pb2.TIER_CPU: "cpu", common_pb2.TIER_DISK: "disk"}

BytesLike = bytes | bytearray | memoryview


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


def map_error(exc: grpc.RpcError, what: str) -> OffloadError:
    """The client's error for a failed call (``what``: the operation, for the message)."""
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


class LeaseEnder(Protocol):
    """How a client ends the store's lease on a ``BlockLease`` (each driver does its own I/O)."""

    def end_store_lease(self, lease_id: bytes) -> bool | None: ...

    def aend_store_lease(self, lease_id: bytes) -> Awaitable[bool | None]: ...


@dataclass
class BlockLease:
    """Fetched blocks as zero-copy views; valid until ``release()`` (or the ``with`` block ends).

    On the shm path the views point into the client's segment, which is reused by
    later calls once released, or straight into the store's shared memory, which
    the store keeps for this lease until it is released; copy what you keep.
    ``valid`` turns False if the store reports that the lease had expired before
    the release (the bytes read may then have been reused: discard them).
    An async client's lease ended by ``release()`` is ended in the background;
    ``arelease()`` (or ``async with``) waits for the store's answer.
    """

    views: list[memoryview]
    tiers: list[int]
    via_shm: bool = False
    _free: Callable[[], None] | None = None     # gives back the client's memory (segment, receive buffer)
    _lease_id: bytes = b""                      # the store's lease token on its memory (b"": none)
    _ender: LeaseEnder | None = None            # the client that ends it
    valid: bool = True
    # Checksums still to verify (shm blocks fetched to be copied: verified while copying); None = done.
    unverified_checksums: list[int] | None = None

    def take(self) -> bytes:
        """Drop the views and the client's memory; the store's lease token still to end (b"": none)."""
        free, lid = self._free, self._lease_id
        self._free, self._lease_id = None, b""
        for v in self.views:
            v.release()
        if free is not None:
            free()
        return lid if self._ender is not None else b""

    def release(self) -> None:
        lid = self.take()
        if lid and self._ender is not None and self._ender.end_store_lease(lid) is False:
            self.valid = False

    async def arelease(self) -> None:
        """Like ``release``, awaiting the store's answer."""
        lid = self.take()
        if lid and self._ender is not None and await self._ender.aend_store_lease(lid) is False:
            self.valid = False

    def __enter__(self) -> BlockLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    async def __aenter__(self) -> BlockLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.arelease()
