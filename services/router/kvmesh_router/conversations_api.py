"""The router's OpenAI Conversations API: ``/v1/conversations`` and its items.

Why it exists: Responses clients may keep their history as a server-side conversation (the
``conversation`` field of ``/v1/responses``; the Agents SDK's ``OpenAIConversationsSession``)
rather than chain ``previous_response_id``. Conversations live in the Responses store
(``--responses-store``), per tenant and bounded like responses
(``kvmesh.responses_api.conversations``); another tenant's conversation is not found. A response
created in a conversation adds its input and output items to it (``responses_api``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvmesh.openai.errors import BadRequest, OpenAIError
from kvmesh.responses_api import conversations as conv
from kvmesh.responses_api.history import kept, not_found
from kvmesh.responses_api.store.base import (
    CONVERSATION,
    Change,
    ResponseStore,
    StoredResponse,
    TooLarge,
    valid_id,
)
from kvmesh_router.http_guard import request_scope_of
from kvmesh_router.http_outcome import store_route

API = "conversations"
PATH = "/v1/conversations"


def _too_large() -> OpenAIError:
    return OpenAIError("the conversation is larger than this server keeps for a tenant "
                       "(--responses-store-tenant-max-bytes)", "items", status=413)


class ConversationsApi:
    def __init__(self, store: ResponseStore | None, body: Callable[[Request], Awaitable[dict[str, Any]]],
                 page_params: Callable[[Request], tuple[int, str, str | None, str | None]]) -> None:
        self.store = store
        self.body = body
        self.page_params = page_params

    def mount(self, app: FastAPI) -> None:
        off = None if self.store is not None else lambda **_: OpenAIError(
            "conversations are not stored by this server (--responses-store off); send the whole conversation "
            "as 'input'", "conversation_id", status=404)
        for path, methods, fn in (
                (PATH, ["POST"], self.create),
                (PATH + "/{conversation_id}", ["GET"], self.retrieve),
                (PATH + "/{conversation_id}", ["POST"], self.update),
                (PATH + "/{conversation_id}", ["DELETE"], self.delete),
                (PATH + "/{conversation_id}/items", ["GET"], self.list_items),
                (PATH + "/{conversation_id}/items", ["POST"], self.add_items),
                (PATH + "/{conversation_id}/items/{item_id}", ["GET"], self.item),
                (PATH + "/{conversation_id}/items/{item_id}", ["DELETE"], self.delete_item)):
            app.add_api_route(path, store_route(API, fn, off), methods=methods)

    # Handlers (``store_route`` answers what they raise).
    async def _thread(self, request: Request, conversation_id: str) -> StoredResponse:
        assert self.store is not None
        return await kept(self.store, request_scope_of(request).tenant, conversation_id, CONVERSATION,
                          "Conversation", "conversation_id")

    async def _put(self, request: Request, thread: StoredResponse) -> None:
        assert self.store is not None
        if not await self.store.put(request_scope_of(request).tenant, thread):
            raise _too_large()

    async def _change(self, request: Request, conversation_id: str, change: Change) -> StoredResponse:
        """The conversation changed in one store step (another replica adding to it at once is not lost)."""
        assert self.store is not None
        try:
            thread = await self.store.update(request_scope_of(request).tenant, conversation_id, change) \
                if valid_id(conversation_id) else None
        except TooLarge:
            raise _too_large() from None
        if thread is None:
            raise not_found("Conversation", conversation_id, "conversation_id")
        return thread

    async def create(self, request: Request) -> Response:
        thread = conv.new_conversation(await self.body(request))
        await self._put(request, thread)
        return JSONResponse(thread.response)

    async def retrieve(self, request: Request, conversation_id: str) -> Response:
        return JSONResponse((await self._thread(request, conversation_id)).response)

    async def update(self, request: Request, conversation_id: str) -> Response:
        body = await self.body(request)
        return JSONResponse((await self._change(request, conversation_id, conv.with_metadata(body.get("metadata")))
                             ).response)

    async def delete(self, request: Request, conversation_id: str) -> Response:
        await self._thread(request, conversation_id)
        assert self.store is not None
        await self.store.delete(request_scope_of(request).tenant, conversation_id)
        return JSONResponse({"id": conversation_id, "object": "conversation.deleted", "deleted": True})

    async def list_items(self, request: Request, conversation_id: str) -> Response:
        limit, order, after, before = self.page_params(request)
        thread = await self._thread(request, conversation_id)
        return JSONResponse(conv.page(thread.input, limit, order, after, before))

    async def add_items(self, request: Request, conversation_id: str) -> Response:
        body = await self.body(request)
        if "items" not in body:
            raise BadRequest("'items' is required", "items")
        items = conv.checked_items(body["items"])
        await self._change(request, conversation_id, conv.with_items(items))
        return JSONResponse(conv.page(items, len(items) or 1, "asc", None, None))

    async def item(self, request: Request, conversation_id: str, item_id: str) -> Response:
        found = (await self._thread(request, conversation_id)).find(item_id)
        if found is None:
            raise not_found("Item", item_id, "item_id")
        return JSONResponse(conv.listed(found))

    async def delete_item(self, request: Request, conversation_id: str, item_id: str) -> Response:
        thread = await self._change(request, conversation_id, conv.without_item(item_id))
        return JSONResponse(thread.response)
