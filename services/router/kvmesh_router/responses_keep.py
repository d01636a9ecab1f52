"""Keeping an answered response: in the store, and in the conversation it was created in.

Why it exists: three paths answer ``/v1/responses`` (the router's own workers, an external
engine behind the router's front door, and an external engine behind the Envoy gateway with
the router as its endpoint picker), and all three keep what they answered the same way, before
the answer's last event goes out so that a client chaining at once finds it. A store that fails
or refuses a response loses the stored copy, never the answer.
"""

from __future__ import annotations

import logging
from typing import Any

from kvmesh.responses_api.conversations import with_items
from kvmesh.responses_api.history import Resolved
from kvmesh.responses_api.output import ResponseHead
from kvmesh.responses_api.store.base import ResponseStore, StoredResponse, TooLarge
from kvmesh_router import metrics
from kvmesh_router.responses_tap import StoreTap

log = logging.getLogger(__name__)
FINISHED = ("completed", "incomplete")   # answered: kept, and added to a conversation


class _Cancelled(Exception):
    """The background response was cancelled while it ran: its record stays cancelled."""


class ResponseKeeper:
    """Keeps answers in one store (None: the store is off, and nothing is kept)."""

    def __init__(self, store: ResponseStore | None) -> None:
        self.store = store

    async def keep(self, tenant: str, head: ResponseHead, response: dict[str, Any], res: Resolved) -> None:
        """Keep a finished ``response`` (``head.store``) and add it to its conversation (``res.thread``)."""
        if self.store is None or response.get("status") not in FINISHED:
            return
        if res.thread is not None:
            await self._add_to_conversation(tenant, head, response, res)
        if not head.store:
            return
        try:
            kept = await self.store.put(tenant, StoredResponse(response, res.stored_input()))
        except Exception as exc:   # a store outage must not fail an answered request
            self._lost(head, exc)
            return
        metrics.RESPONSES_STORED.labels(outcome="stored" if kept else "too_large").inc()
        if not kept:
            log.warning("response not stored: larger than the store keeps", extra={"response_id": head.id})

    async def settle(self, tenant: str, head: ResponseHead, response: dict[str, Any], res: Resolved) -> None:
        """A background response's end (finished, or failed): its kept record, which clients poll, becomes
        ``response`` unless it was cancelled meanwhile; a finished one joins its conversation first, so a
        client that sees it completed finds it there."""
        assert self.store is not None

        def change(rec: StoredResponse) -> StoredResponse:
            if rec.response.get("status") == "cancelled":
                raise _Cancelled
            return StoredResponse(response, rec.input)

        try:
            now = await self.store.get(tenant, head.id)
            if now is None or now.response.get("status") == "cancelled":
                return
            if res.thread is not None and response.get("status") in FINISHED:
                await self._add_to_conversation(tenant, head, response, res)
            if await self.store.update(tenant, head.id, change) is None:   # deleted meanwhile
                return
        except _Cancelled:
            return
        except TooLarge:   # the poller learns why there is no answer
            metrics.RESPONSES_STORED.labels(outcome="too_large").inc()
            failed = {**response, "status": "failed", "output": [], "error": {
                "code": "server_error", "message": "the answer is larger than this server keeps for a tenant "
                                                   "(--responses-store-tenant-max-bytes)"}}
            try:
                await self.store.update(tenant, head.id, lambda rec: StoredResponse(failed, rec.input))
            except Exception as exc:
                self._lost(head, exc)
            return
        except Exception as exc:   # the store is down: the poller sees the response as it was
            self._lost(head, exc)
            return
        metrics.RESPONSES_STORED.labels(outcome="stored").inc()

    @staticmethod
    def _lost(head: ResponseHead, exc: Exception) -> None:
        log.warning("response not stored", extra={"response_id": head.id, "error": f"{type(exc).__name__}: {exc}"})
        metrics.RESPONSES_STORED.labels(outcome="error").inc()

    async def _add_to_conversation(self, tenant: str, head: ResponseHead, response: dict[str, Any],
                                   res: Resolved) -> None:
        """The request's input items and the answer's output join its conversation, as it is when written
        (another turn may have added to it meanwhile)."""
        assert self.store is not None and res.thread is not None
        items = res.new_items + list(response.get("output") or [])
        try:
            thread = await self.store.update(tenant, res.thread.id, with_items(items))
        except TooLarge:
            log.warning("answer not added: the conversation is larger than the store keeps",
                        extra={"conversation": res.thread.id})
            metrics.RESPONSES_STORED.labels(outcome="too_large").inc()
            return
        except Exception as exc:   # a store outage must not fail an answered request
            log.warning("answer not added to its conversation", extra={
                "response_id": head.id, "conversation": res.thread.id, "error": f"{type(exc).__name__}: {exc}"})
            metrics.RESPONSES_STORED.labels(outcome="error").inc()
            return
        if thread is None:
            log.warning("conversation gone before its answer was added", extra={"conversation": res.thread.id})

    def engine_tap(self, tenant: str, head: ResponseHead, res: Resolved, body: dict[str, Any]) -> StoreTap | None:
        """For an answer an external engine gives: None when nothing is to be kept. Otherwise ``body`` (what
        the engine gets) says ``store: false``, because the next turn may go to another engine, and the tap
        keeps the engine's answer as it passes, echoing what the router did."""
        if self.store is None or not (head.store or head.conversation):
            return None
        body["store"] = False

        async def keep(response: dict[str, Any]) -> None:
            await self.keep(tenant, head, response, res)

        return StoreTap({"store": head.store, "previous_response_id": head.previous_response_id,
                         "conversation": {"id": head.conversation} if head.conversation else None}, keep)
