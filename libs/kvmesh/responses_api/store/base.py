"""What a response store keeps and the few calls the router makes of it.

A record is the ``response`` object as it was answered and the conversation items it
answered (``input``: the whole conversation before its output, earlier turns included, as
vLLM keeps its ``msg_store``), serialized once as JSON. Keys are per tenant: a response or
item id of another tenant is not found, exactly as an id that never existed.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec

# OpenAI's ids are a prefix and hex or base62 (``resp_…``, ``msg_…``, ``fc_…``); a client's own item
# ids are free text in principle, so only what could harm a key or a log is refused.
ID_PATTERN = re.compile(r"[A-Za-z0-9_.:-]{1,128}")

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def valid_id(value: Any) -> bool:
    return isinstance(value, str) and ID_PATTERN.fullmatch(value) is not None


RESPONSE, CONVERSATION = "response", "conversation"


@dataclass
class StoredResponse:
    """One answered response and the conversation items it answered; or a Conversations API object
    (``response`` is then the ``conversation`` object, ``input`` its items)."""

    response: dict[str, Any]
    input: list[dict[str, Any]]

    @property
    def id(self) -> str:
        return str(self.response["id"])

    @property
    def kind(self) -> str:
        """``response`` or ``conversation`` (the object's own ``object`` field)."""
        return str(self.response.get("object"))

    def _items(self) -> list[Any]:
        return [*self.input, *(self.response.get("output") or ())]

    def item_ids(self) -> list[str]:
        """Ids of every item a later ``item_reference`` may name: the conversation's and the output's."""
        return [i["id"] for i in self._items() if isinstance(i, dict) and valid_id(i.get("id"))]

    def find(self, item_id: str) -> dict[str, Any] | None:
        for item in self._items():
            if isinstance(item, dict) and item.get("id") == item_id:
                return item
        return None

    def encode(self) -> bytes:
        return _encode({"response": self.response, "input": self.input})

    @classmethod
    def decode(cls, raw: bytes) -> StoredResponse:
        doc = _decode(raw)
        return cls(doc["response"], doc["input"])


class StoreError(Exception):
    """The store could not answer (its server is down or too slow): the caller answers 503."""


class TooLarge(Exception):
    """The changed record is larger than the store keeps for a tenant; nothing was written."""


Change = Callable[[StoredResponse], StoredResponse]


class ResponseStore(ABC):
    """A tenant-scoped, bounded store of answered responses."""

    name: ClassVar[str]

    @abstractmethod
    async def put(self, tenant: str, record: StoredResponse) -> bool:
        """Keep ``record``; False when it is not kept (larger than the store allows)."""

    @abstractmethod
    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The record of ``response_id`` for ``tenant``; None if absent, expired or another tenant's."""

    @abstractmethod
    async def delete(self, tenant: str, response_id: str) -> bool:
        """Forget ``response_id``; False if ``tenant`` had no such response."""

    @abstractmethod
    async def update(self, tenant: str, record_id: str, change: Change) -> StoredResponse | None:
        """Replace a record by ``change(record)`` as one step, so that two writers at once (two turns of
        one conversation, on two router replicas) cannot lose each other's items. ``change`` sees the
        record as it is now and may be called again if another writer got there first; what it raises
        comes out of ``update`` and writes nothing. Returns the new record, or None when there is none
        (absent, expired or another tenant's). Raises ``TooLarge`` when the new record is not kept."""

    @abstractmethod
    async def item_owner(self, tenant: str, item_id: str) -> str | None:
        """The id of the newest kept response whose conversation or output holds ``item_id``."""

    # A streamed background response's events, for a client that resumes them on another replica. Only
    # a store every replica shares keeps them; the replica that runs a response keeps its own copy.
    shared: ClassVar[bool] = False

    async def add_events(self, tenant: str, response_id: str, events: list[bytes], ttl_s: float) -> None:  # noqa: B027
        """Append ``events`` to the response's, kept ``ttl_s`` from the last append (a shared store)."""

    async def events(self, tenant: str, response_id: str, start: int) -> list[bytes] | None:
        """The response's events from index ``start`` on; None when none are kept."""
        return None

    async def mark_cancelled(self, tenant: str, response_id: str, ttl_s: float) -> None:  # noqa: B027
        """Note, in a small key of its own, that a background response was cancelled (a shared store), so
        that the replica running it learns without reading the whole record."""

    async def cancel_marked(self, tenant: str, response_id: str) -> bool:
        return False

    async def close(self) -> None:  # noqa: B027 - an in-process store has nothing to release
        """Release connections."""
