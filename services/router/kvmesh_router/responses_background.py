"""Background responses (``background: true``): answered at once as ``queued``, run on, polled.

Why it exists: OpenAI's Responses API lets a client start a long answer and come back for it
(``responses.create(background=True)``, then ``responses.retrieve`` until its status is final,
or ``responses.cancel``), as vLLM's own ``/v1/responses`` does. The router keeps the record in
its Responses store from the start (``queued``, then ``in_progress``, then ``completed``,
``incomplete``, ``failed`` or ``cancelled``), so any replica answers the poll. The generation
runs on the replica that took the request, routed like any other (same prefix, same policy),
detached from the client's connection but not from the request's deadline
(``--http-deadline-s``).

A streamed one (``stream: true`` too) sends its events as they come, and keeps them on the
replica that runs it (``EventLog``) for ``LOG_KEEP_S`` after its end, and in a shared (Redis) store
as well: a client whose connection broke resumes with ``GET
/v1/responses/{id}?stream=true&starting_after=N`` on any replica (the events after sequence number
N, then the rest as they come), as OpenAI's and vLLM's servers resume them.

A cancel may reach another replica: it writes ``cancelled`` in the store and, in a shared store,
a small marker key that the replica running the response reads every ``CANCEL_POLL_S``; it stops
the generation when it sees it (at once when the cancel reaches the same replica). Deleting a
running background response cancels it first. A record left ``queued`` or
``in_progress`` past the deadline (its replica stopped) reads as ``failed``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
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
LOG_KEEP_S = 300.0   # a streamed background response's events stay this long after its end
LOGS_MAX_BYTES = 64 << 20   # and at most this many bytes of ended ones stay (the oldest go first)
SHARED_POLL_S = 0.1   # a resumption on another replica reads the shared store this often
SHARED_POLLS_PER_STATUS = 10   # and, while nothing comes, looks for a cancel every this many reads
SHARED_CANCEL_LOOKS_PER_RECORD = 30   # and reads the record (has its replica stopped?) every this many looks
LAST_EVENTS = (b"event: response.completed", b"event: response.failed")


class EventLog:
    """The events of one streamed background response (one ``event:``/``data:`` frame each, so an
    event's place in the list is its ``sequence_number``), and the readers that follow it."""

    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.shared = 0   # how many of them the shared store has
        self.size = 0
        self.done = False
        self._changed = asyncio.Event()

    def add(self, frames: bytes) -> None:
        for f in frames.split(b"\n\n"):
            if f:
                self.events.append(f + b"\n\n")
                self.size += len(f) + 2
        self._wake()

    def close(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: int) -> AsyncIterator[bytes]:
        """The events after sequence number ``after`` (-1: all), then each as it comes, to the end."""
        i = max(after + 1, 0)
        while True:
            changed = self._changed
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.done:
                return
            await changed.wait()


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
        self._per_tenant: dict[str, int] = {}   # places taken, per tenant
        self._active = 0   # places taken in all (admitted, running)
        self._logs: dict[tuple[str, str], EventLog] = {}
        self._ended: OrderedDict[tuple[str, str], int] = OrderedDict()   # ended logs' sizes, oldest first
        self._ended_bytes = 0

    async def _admit(self, tenant: str, head: ResponseHead, res: Resolved) -> None:
        """Within the bounds (they outlive their connections, so their number is bounded here: past it, a
        429), kept as ``queued``. The place is taken before the store is awaited, so that requests arriving
        meanwhile count it; ``_launch`` hands it to the task, a failure gives it back."""
        if self._active >= self.max_running:
            raise OpenAIError(f"too many background responses running on this server ({self.max_running}); "
                              "retry later", "background", status=429)
        if self._per_tenant.get(tenant, 0) >= self.tenant_max_running:
            raise OpenAIError(f"too many background responses of this tenant running ({self.tenant_max_running});"
                              " retry when one has finished", "background", status=429)
        self._take(tenant, 1)
        try:
            kept = await self.store.put(tenant, StoredResponse(head.response("queued", []), res.stored_input()))
        except BaseException:
            self._take(tenant, -1)
            raise
        if not kept:
            self._take(tenant, -1)
            raise OpenAIError("the request is larger than this server keeps for a tenant "
                              "(--responses-store-tenant-max-bytes)", "input", status=413)

    def _take(self, tenant: str, n: int) -> None:
        self._active += n
        left = self._per_tenant.pop(tenant, 0) + n
        if left:
            self._per_tenant[tenant] = left

    def _launch(self, tenant: str, head: ResponseHead, run: Awaitable[None]) -> None:
        """Run ``run`` in the place ``_admit`` took; the place is free when it ends."""
        task = asyncio.create_task(run, name=f"background {head.id}")   # type: ignore[arg-type]
        self._running[head.id] = task

        def ended(_task: asyncio.Task[None]) -> None:
            self._running.pop(head.id, None)
            self._take(tenant, -1)

        task.add_done_callback(ended)

    async def start(self, tenant: str, head: ResponseHead, res: Resolved,
                    answer: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """Keep ``head``'s response as ``queued`` and run ``answer`` (the finished response) behind it."""
        await self._admit(tenant, head, res)
        self._launch(tenant, head, self._run(tenant, head, res, answer))
        return head.response("queued", [])

    async def start_stream(self, tenant: str, head: ResponseHead, res: Resolved,
                           events: Callable[[], AsyncIterator[bytes]]) -> EventLog:
        """Keep ``head``'s response as ``queued`` and run ``events`` (which keep the response themselves)
        into a log that the caller, and later resumptions, follow."""
        await self._admit(tenant, head, res)
        events_log = EventLog()
        key = (tenant, head.id)
        self._logs[key] = events_log

        async def pump() -> None:
            async for frames in events():
                events_log.add(frames)
                if self.store.shared:   # for a client that resumes on another replica
                    await self._share(tenant, head.id, events_log)

        async def run() -> None:
            try:
                await self._run(tenant, head, res, pump)
            finally:   # however it ended (cancelled before it ran too), its readers see the end
                events_log.close()
                self._retire(key, events_log.size)

        self._launch(tenant, head, run())
        return events_log

    def _retire(self, key: tuple[str, str], size: int) -> None:
        """An ended log stays ``LOG_KEEP_S``, within ``LOGS_MAX_BYTES`` of ended logs in all."""
        self._ended[key] = size
        self._ended_bytes += size
        asyncio.get_running_loop().call_later(LOG_KEEP_S, self._forget, key)
        while self._ended_bytes > LOGS_MAX_BYTES:
            self._forget(next(iter(self._ended)))

    def _forget(self, key: tuple[str, str]) -> None:
        size = self._ended.pop(key, None)
        if size is not None:
            self._ended_bytes -= size
            self._logs.pop(key, None)

    async def _share(self, tenant: str, response_id: str, events_log: EventLog) -> None:
        new = events_log.events[events_log.shared:]
        if not new:
            return
        try:
            await self.store.add_events(tenant, response_id, new, LOG_KEEP_S)
        except StoreError as exc:   # resumption elsewhere loses these; the answer goes on
            log.warning("background events not shared", extra={"response_id": response_id, "error": str(exc)})
            return
        events_log.shared += len(new)

    def events_of(self, tenant: str, response_id: str) -> EventLog | None:
        return self._logs.get((tenant, response_id))

    async def follow(self, tenant: str, response_id: str, after: int) -> AsyncIterator[bytes] | None:
        """The events of a streamed background response after ``after``: this replica's log, else (a shared
        store) the store's copy, read until its last event; None when neither is kept."""
        here = self.events_of(tenant, response_id)
        if here is not None:
            return here.follow(after)
        first = await self.store.events(tenant, response_id, max(after + 1, 0)) if self.store.shared else None
        return None if first is None else self._follow_shared(tenant, response_id, max(after + 1, 0), first)

    async def _follow_shared(self, tenant: str, response_id: str, i: int, got: list[bytes]
                             ) -> AsyncIterator[bytes]:
        """The shared store's events from index ``i`` on (``got``: the first read), until the last one.

        No last event yet: it still runs, or it ended without one. While nothing comes, a cancel is looked
        for every second (its marker: one key) and the record itself, which can be a whole conversation,
        is read only every 30 s (``SHARED_CANCEL_LOOKS_PER_RECORD`` looks): one whose replica stopped reads
        as failed once past its deadline (``as_read``), so a reader of it ends then."""
        idle = 0
        while True:
            for event in got:
                yield event
            i += len(got)
            if got and got[-1].startswith(LAST_EVENTS):
                return
            idle = 0 if got else idle + 1
            looks, due = divmod(idle, SHARED_POLLS_PER_STATUS)   # due 0: a cancel look is due
            try:
                if idle and not due and await self._ended_elsewhere(
                        tenant, response_id, record=looks % SHARED_CANCEL_LOOKS_PER_RECORD == 0):
                    return
                if idle:
                    await asyncio.sleep(SHARED_POLL_S)
                more = await self.store.events(tenant, response_id, i)
            except StoreError:   # the stream ends here; the client resumes again from its last event
                return
            if more is None:   # its log is no longer kept
                return
            got = more

    async def _ended_elsewhere(self, tenant: str, response_id: str, record: bool) -> bool:
        if await self.store.cancel_marked(tenant, response_id):
            return True
        if not record:
            return False
        rec = await self.store.get(tenant, response_id)
        return rec is None or self.as_read(rec.response).get("status") not in RUNNING

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
                   answer: Callable[[], Awaitable[dict[str, Any] | None]]) -> None:
        """Run ``answer`` while the record says it runs; its response (None: it kept its own) settles it."""
        work: asyncio.Task[dict[str, Any] | None] | None = None
        try:
            if not await self._set_running(tenant, head):
                return
            work = asyncio.create_task(answer())
            # A cancel on this replica cancels this task; one on another (a shared store) leaves a marker.
            poll = CANCEL_POLL_S if self.store.shared else None
            while not (await asyncio.wait({work}, timeout=poll))[0]:
                try:
                    if await self.store.cancel_marked(tenant, head.id):
                        return
                except StoreError:   # not known now: the generation goes on, and the next poll asks again
                    continue
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
        if response is not None:
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
        if self.store.shared:   # the replica running it may be another
            await self.store.mark_cancelled(tenant, response_id, self.deadline_s + STALE_GRACE_S)
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
