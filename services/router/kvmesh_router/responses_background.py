"""Background responses (``background: true``): answered at once as ``queued``, run on, polled.

Why it exists: OpenAI's Responses API lets a client start a long answer and come back for it
(``responses.create(background=True)``, then ``responses.retrieve`` until its status is final,
or ``responses.cancel``), as vLLM's own ``/v1/responses`` does. The router keeps the record in
its Responses store from the start (``queued``, then ``in_progress``, then ``completed``,
``incomplete``, ``failed`` or ``cancelled``), so any replica answers the poll. The generation
runs on the replica that took the request, routed like any other (same prefix, same policy),
detached from the client's connection but not from the request's deadline
(``--http-deadline-s``).

A cancel may reach another replica: it writes ``cancelled`` in the store, and the replica that
runs the response reads its record every ``CANCEL_POLL_S`` and stops the generation when it
sees it (at once when the cancel reaches the same replica). A record left ``queued`` or
``in_progress`` past the deadline (its replica stopped) reads as ``failed``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvmesh.openai.errors import BadRequest, OpenAIError
from kvmesh.responses_api.history import Resolved, not_found
from kvmesh.responses_api.output import ResponseHead
from kvmesh.responses_api.store.base import ResponseStore, StoredResponse, StoreError
from kvmesh_router.errors import RouterError
from kvmesh_router.responses_keep import ResponseKeeper

log = logging.getLogger(__name__)

CANCEL_POLL_S = 1.0
RUNNING = ("queued", "in_progress")
STALE_GRACE_S = 30.0   # past the deadline, and this: the replica that ran it is gone


class _NotQueued(Exception):
    """Cancelled (or deleted) before its turn to run came."""


class BackgroundResponses:
    """The background responses this replica runs, and the calls that start, cancel and read them."""

    def __init__(self, store: ResponseStore, keeper: ResponseKeeper, deadline_s: float, max_running: int = 256,
                 tenant_max_running: int = 64) -> None:
        self.store = store
        self.keeper = keeper
        self.deadline_s = deadline_s
        self.max_running = max_running
        self.tenant_max_running = tenant_max_running
        self._running: dict[str, asyncio.Task[None]] = {}
        self._per_tenant: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._running)

    async def start(self, tenant: str, head: ResponseHead, res: Resolved,
                    answer: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """Keep ``head``'s response as ``queued`` and run ``answer`` (the finished response) behind it. They
        outlive their connections, so their number is bounded here: past it, a 429."""
        if len(self._running) >= self.max_running:
            raise OpenAIError(f"too many background responses running on this server ({self.max_running}); "
                              "retry later", "background", status=429)
        if self._per_tenant.get(tenant, 0) >= self.tenant_max_running:
            raise OpenAIError(f"too many background responses of this tenant running ({self.tenant_max_running});"
                              " retry when one has finished", "background", status=429)
        queued = head.response("queued", [])
        if not await self.store.put(tenant, StoredResponse(queued, res.stored_input())):
            raise OpenAIError("the request is larger than this server keeps for a tenant "
                              "(--responses-store-tenant-max-bytes)", "input", status=413)
        task = asyncio.create_task(self._run(tenant, head, res, answer), name=f"background {head.id}")
        self._running[head.id] = task
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1

        def ended(_task: asyncio.Task[None]) -> None:
            self._running.pop(head.id, None)
            left = self._per_tenant.pop(tenant) - 1
            if left:
                self._per_tenant[tenant] = left

        task.add_done_callback(ended)
        return queued

    async def _status(self, tenant: str, response_id: str) -> str | None:
        rec = await self.store.get(tenant, response_id)
        return None if rec is None else str(rec.response.get("status"))

    async def _set_running(self, tenant: str, head: ResponseHead) -> bool:
        """``queued`` becomes ``in_progress``; False when it was cancelled (or deleted) before it started."""
        def change(rec: StoredResponse) -> StoredResponse:
            if rec.response.get("status") != "queued":
                raise _NotQueued
            return StoredResponse({**rec.response, "status": "in_progress"}, rec.input)

        try:
            return await self.store.update(tenant, head.id, change) is not None
        except _NotQueued:
            return False
        except StoreError:   # a store that does not answer leaves it queued; it runs all the same
            return True

    async def _run(self, tenant: str, head: ResponseHead, res: Resolved,
                   answer: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        work: asyncio.Task[dict[str, Any]] | None = None
        try:
            if not await self._set_running(tenant, head):
                return
            work = asyncio.create_task(answer())
            while not (await asyncio.wait({work}, timeout=CANCEL_POLL_S))[0]:
                try:
                    status = await self._status(tenant, head.id)
                except StoreError:   # not known now: the generation goes on, and the next poll asks again
                    continue
                if status not in RUNNING:   # cancelled, or deleted, elsewhere
                    return
            response = work.result()
        except RouterError as exc:
            response = head.response("failed", [], error={"code": exc.error_type, "message": exc.message})
        except Exception as exc:   # noqa: BLE001 - the poller must learn that it failed
            log.exception("background response failed", extra={"response_id": head.id})
            response = head.response("failed", [], error={"code": "server_error",
                                                           "message": f"internal error: {type(exc).__name__}"})
        finally:   # cancelled here or elsewhere, or failed: the generation stops with it
            if work is not None and not work.done():
                work.cancel()
        await self.keeper.settle(tenant, head, response, res)

    async def cancel(self, tenant: str, response_id: str) -> dict[str, Any]:
        """``POST /v1/responses/{id}/cancel``: a queued or running background response becomes ``cancelled``."""
        def change(rec: StoredResponse) -> StoredResponse:
            status = rec.response.get("status")
            if status not in RUNNING:
                raise BadRequest("Cannot cancel a synchronous response." if not rec.response.get("background")
                                 else f"Cannot cancel a response that is already {status}.", "response_id")
            return StoredResponse({**rec.response, "status": "cancelled"}, rec.input)

        rec = await self.store.update(tenant, response_id, change)
        if rec is None:
            raise not_found("Response", response_id, "response_id")
        task = self._running.get(response_id)
        if task is not None:
            task.cancel()
        return rec.response

    def as_read(self, response: dict[str, Any]) -> dict[str, Any]:
        """A kept response as a poll reads it: one still running past its deadline lost its replica."""
        if response.get("status") not in RUNNING or not self.deadline_s:
            return response
        if time.time() - float(response.get("created_at") or 0) <= self.deadline_s + STALE_GRACE_S:
            return response
        return {**response, "status": "failed", "error": {
            "code": "server_error", "message": "the router replica running this response stopped before it ended"}}
