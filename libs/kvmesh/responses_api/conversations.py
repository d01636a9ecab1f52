"""OpenAI's Conversations API objects, kept in the response store.

Why it exists: a conversation is the other way OpenAI's Responses clients leave their history
with the server (``conversation`` on ``/v1/responses``; the Agents SDK's
``OpenAIConversationsSession``): a list of items that each response answered in it adds its
input and output to. It lives in the same tenant-scoped, bounded store as responses, as a
record whose object is the ``conversation`` and whose items are its ``input``; ``history``
puts its items before a request's own. Also here: the pages that list a record's items, shared
with ``GET /v1/responses/{id}/input_items``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from kvmesh.openai.errors import BadRequest
from kvmesh.responses_api.history import conversation_items, not_found
from kvmesh.responses_api.requests import checked_metadata, input_messages
from kvmesh.responses_api.store.base import CONVERSATION, Change, StoredResponse

MAX_ITEMS_PER_ADD = 20   # OpenAI's bound on items given at creation or in one add


def _metadata(md: Any) -> dict[str, str]:
    return checked_metadata(md, max_chars=(64, 512))


def checked_items(items: Any) -> list[Any]:
    """Items to add, checked as ``input`` items are (an item the renderer refuses is refused now, not
    at the conversation's next response); ids given."""
    if items is None:
        return []
    if not isinstance(items, list) or len(items) > MAX_ITEMS_PER_ADD:
        raise BadRequest(f"'items' must be a list of at most {MAX_ITEMS_PER_ADD} items", "items")
    if any(isinstance(i, dict) and i.get("type") == "item_reference" for i in items):
        raise BadRequest("'items' cannot hold item references: add the items themselves", "items")
    if items:
        try:
            input_messages({"input": items})
        except BadRequest as exc:
            raise BadRequest(exc.message.replace("input[", "items["), "items") from None
    return conversation_items(items)


def new_conversation(body: dict[str, Any]) -> StoredResponse:
    obj = {"id": f"conv_{uuid.uuid4().hex}", "object": CONVERSATION, "created_at": int(time.time()),
           "metadata": _metadata(body.get("metadata"))}
    return StoredResponse(obj, checked_items(body.get("items")))


def _conversation(thread: StoredResponse) -> StoredResponse:
    if thread.kind != CONVERSATION:   # a response of that id is not a conversation
        raise not_found("Conversation", thread.id, "conversation_id")
    return thread


# Changes of a kept conversation, for ``ResponseStore.update`` (which applies each to the record as it is
# when written, so two writers at once keep both their items).
def with_metadata(md: Any) -> Change:
    metadata = _metadata(md)
    return lambda thread: StoredResponse({**_conversation(thread).response, "metadata": metadata}, thread.input)


def with_items(items: list[Any]) -> Change:
    return lambda thread: StoredResponse(_conversation(thread).response, thread.input + items)


def without_item(item_id: str) -> Change:
    def change(thread: StoredResponse) -> StoredResponse:
        kept = [i for i in _conversation(thread).input if not (isinstance(i, dict) and i.get("id") == item_id)]
        if len(kept) == len(thread.input):
            raise not_found("Item", item_id, "item_id")
        return StoredResponse(thread.response, kept)
    return change


def listed(item: Any) -> Any:
    """An item as OpenAI lists it: a message's string content as one text part (``input_text``, or
    ``output_text`` for the assistant). Kept items keep the string, which is what renders."""
    if isinstance(item, dict) and item.get("type") == "message" and isinstance(item.get("content"), str):
        kind = "output_text" if item.get("role") == "assistant" else "input_text"
        return {**item, "content": [{"type": kind, "text": item["content"]}]}
    return item


def page(items: list[Any], limit: int, order: str, after: str | None, before: str | None) -> dict[str, Any]:
    """A list page of ``items`` (oldest first): ``order`` desc (newest first) or asc, from after ``after``
    up to ``before`` (item ids), at most ``limit``."""
    seq = items if order == "asc" else items[::-1]
    ids = [i.get("id") if isinstance(i, dict) else None for i in seq]
    start = 0 if after is None else ids.index(after) + 1 if after in ids else len(seq)
    end = len(seq) if before is None else ids.index(before) if before in ids else 0
    window = seq[start:max(start, end)]
    data = [listed(i) for i in window[:limit]]
    return {"object": "list", "data": data, "first_id": data[0].get("id") if data else None,
            "last_id": data[-1].get("id") if data else None, "has_more": len(window) > limit}
