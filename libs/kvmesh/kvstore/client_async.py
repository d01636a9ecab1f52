"""Asyncio offload client for services and the sim engine: runs the core's plans with ``await``.

Everything but the I/O is in ``client_core``; this module performs each op a plan asks
for (blocking steps on a worker thread, so the event loop keeps serving) and hands the
result (or the error) back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc

from kvmesh.kvstore import client_core as core
from kvmesh.kvstore.client_types import DEFAULT_TIMEOUT_S
from kvmesh.rpc.channel import aio_channel


async def _aiter(it: Iterator[bytes]) -> AsyncIterator[bytes]:
    for item in it:
        yield item


class OffloadClient(core.ClientCore):
    """Async client (see ``core.ClientCore`` for ``use_shm``, ``use_bulk`` and ``verify_checksums``).

    Methods (from ``ClientCore.OPERATIONS``, coroutines here): ``contains``, ``put``,
    ``fetch``, ``get``, ``get_into``, ``delete``, ``stats``; see the ``plan_*`` methods.
    """

    def __init__(self, address: str, use_shm: bool | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 verify_checksums: bool | None = None, channel: grpc.aio.Channel | None = None,
                 use_bulk: bool | None = None, trust_local_store: bool = False) -> None:
        super().__init__(address, use_shm, timeout_s, verify_checksums,
                         channel or aio_channel(address, traced=False), use_bulk, trust_local_store)
        self._bg: set[asyncio.Task] = set()

    @staticmethod
    def _driver_method(plan: Callable[..., core.Plan[Any]]) -> Callable[..., Any]:
        async def method(self: OffloadClient, *args: Any, **kwargs: Any) -> Any:
            return await self._run(plan(self, *args, **kwargs))
        return method

    async def _run(self, plan: core.Plan[Any]) -> Any:
        done, step = core.advance(plan, None, None)
        while not done:
            try:
                sent, error = await self._do(step), None
            except BaseException as exc:  # the plan decides: fall back, map, or let it through
                sent, error = None, exc
            done, step = core.advance(plan, sent, error)
        return step

    async def _do(self, op: core.Op) -> Any:
        if isinstance(op, core.Blocking):
            work = asyncio.ensure_future(asyncio.to_thread(op.fn, *op.args))
            try:
                return await asyncio.shield(work)
            except asyncio.CancelledError:
                # A thread cannot be stopped: it is still reading the lease's views and writing
                # the caller's buffers. The plan must not end the lease (and the caller must not
                # reuse the buffers) until it is done.
                await asyncio.wait({work})
                raise
        md = core.trace_metadata()
        if isinstance(op, core.Unary):
            return await op.call(op.request, timeout=self.timeout_s, metadata=md)
        if isinstance(op, core.ClientStream):
            return await op.call(_aiter(op.messages), timeout=self.timeout_s, metadata=md)
        assert isinstance(op, core.ServerStream)
        async for msg in op.call(op.request, timeout=self.timeout_s, metadata=md):
            op.feed(msg)
        return None

    def end_store_lease(self, lease_id: bytes) -> bool | None:
        """``release()`` of an async lease: ended in the background (``arelease()`` waits)."""
        try:
            task = asyncio.get_running_loop().create_task(self._run(self.plan_release(lease_id)))
        except RuntimeError:
            return None  # no loop any more: the store expires the lease
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
        return None

    async def aend_store_lease(self, lease_id: bytes) -> bool | None:
        return await self._run(self.plan_release(lease_id))

    async def close(self) -> None:
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)
        self._close_local()
        await self._channel.close()

    async def __aenter__(self) -> OffloadClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
