"""Blocking offload client for threads (the vLLM connector): runs the core's plans with plain calls.

Everything but the I/O is in ``client_core``; this module only performs each op a plan
asks for and hands the result (or the error) back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvmesh.kvstore import client_core as core
from kvmesh.kvstore.client_types import DEFAULT_TIMEOUT_S
from kvmesh.rpc.channel import channel_options
from kvmesh.rpc.tls import sync_channel


class SyncOffloadClient(core.ClientCore):
    """Blocking client with the async client's methods, safe to share between threads.

    Methods (from ``ClientCore.OPERATIONS``): ``contains``, ``put``, ``fetch``, ``get``,
    ``get_into``, ``delete``, ``stats``; see the ``plan_*`` methods for their arguments.
    """

    def __init__(self, address: str, use_shm: bool | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 verify_checksums: bool | None = None, use_bulk: bool | None = None,
                 trust_local_store: bool = False) -> None:
        super().__init__(address, use_shm, timeout_s, verify_checksums,
                         sync_channel(address, None, channel_options()), use_bulk, trust_local_store)

    @staticmethod
    def _driver_method(plan: Callable[..., core.Plan[Any]]) -> Callable[..., Any]:
        def method(self: SyncOffloadClient, *args: Any, **kwargs: Any) -> Any:
            return self._run(plan(self, *args, **kwargs))
        return method

    def _run(self, plan: core.Plan[Any]) -> Any:
        done, step = core.advance(plan, None, None)
        while not done:
            try:
                sent, error = self._do(step), None
            except BaseException as exc:  # the plan decides: fall back, map, or let it through
                sent, error = None, exc
            done, step = core.advance(plan, sent, error)
        return step

    def _do(self, op: core.Op) -> Any:
        if isinstance(op, core.Blocking):
            return op.fn(*op.args)
        md = core.trace_metadata()
        if isinstance(op, core.Unary):
            return op.call(op.request, timeout=self.timeout_s, metadata=md)
        if isinstance(op, core.ClientStream):
            return op.call(op.messages, timeout=self.timeout_s, metadata=md)
        assert isinstance(op, core.ServerStream)
        for msg in op.call(op.request, timeout=self.timeout_s, metadata=md):
            op.feed(msg)
        return None

    def end_store_lease(self, lease_id: bytes) -> bool | None:
        return self._run(self.plan_release(lease_id))

    async def aend_store_lease(self, lease_id: bytes) -> bool | None:
        return self.end_store_lease(lease_id)

    def close(self) -> None:
        self._close_local()
        self._channel.close()

    def __enter__(self) -> SyncOffloadClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

