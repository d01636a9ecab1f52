"""A Responses request's conversation, with what the server kept put back in its place.

Why it exists: with ``previous_response_id`` a client sends only its new items and the
server adds the conversation so far; with ``item_reference`` it names an item the server
kept instead of sending it again. Both are resolved here, before the request is parsed,
into the plain ``input`` list a client keeping its own history would have sent: the
previous response's conversation, its output, then the new items (OpenAI's order; the
previous ``instructions`` do not carry over, as OpenAI documents and vLLM does). So one
parser renders both kinds of client, and a chained turn renders exactly the prefix the
previous turn cached.

``conversation_items`` gives every new item an id (the one it has, else a fresh one) so that
the stored conversation's items can be listed and referenced later.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from kvmesh.openai.errors import BadRequest, OpenAIError
from kvmesh.responses_api.store.base import (
    CONVERSATION,
    RESPONSE,
    ResponseStore,
    StoredResponse,
    StoreError,
    valid_id,
)

# Bounds a body's work on the store: each reference is a lookup.
MAX_REFERENCES = 1024


def not_found(what: str, ident: str, param: str) -> OpenAIError:
    return OpenAIError(f"{what} with id {ident[:128]!r} not found", param, status=404)


async def kept(store: ResponseStore, tenant: str, ident: Any, kind: str, what: str, param: str) -> StoredResponse:
    """The tenant's kept record ``ident`` of ``kind``: a 404 for an invalid or absent id, another
    tenant's, or a record of another kind (so one kind's id never reads as another's)."""
    rec = await store.get(tenant, ident) if valid_id(ident) else None
    if rec is None or rec.kind != kind:
        raise not_found(what, str(ident), param)
    return rec


def _with_id(item: Any) -> Any:
    """``item`` with an id, and a bare ``{"role", "content"}`` message typed as one (as OpenAI lists it)."""
    if not isinstance(item, dict):
        return item
    kind = item.get("type", "message")
    if valid_id(item.get("id")) and "type" in item:
        return item
    prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs",
              "custom_tool_call": "ctc", "custom_tool_call_output": "ctco"}.get(kind, "item")
    ident = item["id"] if valid_id(item.get("id")) else f"{prefix}_{uuid.uuid4().hex}"
    return {**item, "type": kind, "id": ident}


def conversation_items(inp: Any) -> list[Any]:
    """``input`` as a list of items with ids; a string is one user message (its content kept a
    string, so it renders as the string did)."""
    if isinstance(inp, str):
        inp = [{"type": "message", "role": "user", "content": inp}]
    return [_with_id(i) for i in inp] if isinstance(inp, list) else []


@dataclass
class Resolved:
    """The body to parse (stateless: its ``input`` is the whole conversation) and what was resolved."""

    body: dict[str, Any]
    previous: StoredResponse | None = None
    conversation: list[Any] | None = None    # the body's input, ids given (None: not yet, see ``stored_input``)
    thread: StoredResponse | None = None     # the Conversations API object it continues
    new_items: list[Any] = field(default_factory=list)   # the request's own input items, ids given

    def stored_input(self) -> list[Any]:
        """The conversation as it is kept. A stateless request's items get their ids only when it is kept:
        a client that stores nothing (Codex) does not pay for it on every turn."""
        if self.conversation is None:
            self.conversation = conversation_items(self.body.get("input"))
        return self.conversation


def wants_store(body: dict[str, Any]) -> bool:
    """Whether the request asks for its answer to be kept (``store``, default true, as OpenAI's)."""
    value = body.get("store", True)
    if value is not None and not isinstance(value, bool):
        raise BadRequest("'store' must be a boolean", "store")
    return value is not False


def unavailable(exc: StoreError) -> OpenAIError:
    return OpenAIError(f"the response store is unavailable ({exc}); retry, or send the whole conversation as "
                       "'input'", None, status=503)


async def resolve(body: dict[str, Any], store: ResponseStore | None, tenant: str,
                  why_none: str = "the router runs with --responses-store off") -> Resolved:
    """``body`` with ``previous_response_id`` and ``item_reference`` items replaced by what ``store``
    kept for ``tenant``. Without a store both are refused (400), naming the field and ``why_none``;
    an unknown id (or another tenant's) is a 404, a store that cannot answer a 503."""
    try:
        return await _resolve(body, store, tenant, why_none)
    except StoreError as exc:
        raise unavailable(exc) from None


def _conversation_id(ref: Any) -> str:
    cid = ref.get("id") if isinstance(ref, dict) else ref
    if not valid_id(cid):
        raise BadRequest("'conversation' must be a conversation id or {\"id\": ...}", "conversation")
    return str(cid)


async def _resolve(body: dict[str, Any], store: ResponseStore | None, tenant: str, why_none: str) -> Resolved:
    prev_id = body.get("previous_response_id")
    conv_ref = body.get("conversation")
    inp = body.get("input")
    refs = [i for i, it in enumerate(inp) if isinstance(it, dict) and it.get("type") == "item_reference"] \
        if isinstance(inp, list) else []
    if prev_id is None and conv_ref is None and not refs:
        return Resolved(body)
    if store is None:
        if prev_id is not None:
            raise BadRequest(f"'previous_response_id' is not supported here: responses are not stored ({why_none});"
                             " send the whole conversation as 'input'", "previous_response_id")
        if conv_ref is not None:
            raise BadRequest(f"'conversation' is not supported here: conversations are not stored ({why_none}); "
                             "send the whole conversation as 'input'", "conversation")
        raise BadRequest(f"input[{refs[0]}]: items are not stored ({why_none}); send the item itself",
                         f"input[{refs[0]}]")
    if prev_id is not None and conv_ref is not None:
        raise BadRequest("Mutually exclusive parameters: give only one of 'previous_response_id' and "
                         "'conversation'", "conversation")
    if len(refs) > MAX_REFERENCES:
        raise BadRequest(f"'input' has {len(refs)} item references; at most {MAX_REFERENCES} are resolved",
                         "input")
    previous = None
    history: list[Any] = []
    if prev_id is not None:
        if not valid_id(prev_id):
            raise BadRequest("'previous_response_id' must be a response id (letters, digits, '_', '-', '.', ':'; "
                             "at most 128)", "previous_response_id")
        previous = await kept(store, tenant, prev_id, RESPONSE, "Previous response", "previous_response_id")
        if previous.response.get("status") in ("queued", "in_progress"):   # a background one, not done
            raise BadRequest(f"Previous response {prev_id!r} has not finished (status "
                             f"{previous.response['status']}): poll it until it has", "previous_response_id")
        history = previous.input + list(previous.response.get("output") or [])
    thread = None
    if conv_ref is not None:
        cid = _conversation_id(conv_ref)
        thread = await kept(store, tenant, cid, CONVERSATION, "Conversation", "conversation")
        history = thread.input
    new = await _dereference(inp, refs, store, tenant) if refs else inp
    out = {k: v for k, v in body.items() if k not in ("previous_response_id", "conversation")}
    if not new or not isinstance(new, (str, list)):
        return Resolved(out)   # the parser names what is wrong with 'input'
    items = conversation_items(new)
    conv = history + items
    out["input"] = conv
    return Resolved(out, previous, conv, thread, items)


async def _dereference(items: list[Any], refs: list[int], store: ResponseStore, tenant: str) -> list[Any]:
    records: dict[str, StoredResponse | None] = {}
    items = list(items)
    for i in refs:
        ident = items[i].get("id")
        where = f"input[{i}]"
        if not valid_id(ident):
            raise BadRequest(f"{where}: an item_reference needs the 'id' of a stored item", where)
        owner = await store.item_owner(tenant, ident)
        if owner is not None and owner not in records:
            records[owner] = await store.get(tenant, owner)
        rec = records.get(owner) if owner is not None else None
        found = rec.find(ident) if rec is not None else None
        if found is None:
            raise not_found("Item", ident, where)
        items[i] = found
    return items
